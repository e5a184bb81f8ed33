"""An object store that refuses or does not answer: every command and the reader say so in one line, with the
documented exit code (2 for a missing bucket or refused credentials, 1 for a store that does not answer, naming its
endpoint), never a traceback.

The store is a real moto_server on loopback, in its own process, with authentication on (moto's
`INITIAL_NO_AUTH_ACTION_COUNT`: the first requests, which create an IAM user with a policy, its key and a bucket,
pass unauthenticated; every later one must be signed by a key IAM knows and allowed by its policy). The stopped
endpoint is a loopback port nothing listens on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "present-bucket"
SETUP_REQUESTS = 5  # create_user, create_access_key, create_policy, attach_user_policy, create_bucket
BASE_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "AWS_DEFAULT_REGION": "us-east-1",
            "PYTHONPATH": str(REPO)}
BASE_ENV.pop("DFLASH_PREP_FAULTS", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_answering(endpoint: str, proc: subprocess.Popen, seconds: float = 60) -> None:
    """Until the moto_server `proc` at `endpoint` answers its API (or raise once it died or `seconds` passed)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=5)
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def auth_server():
    """(endpoint, access key id, secret) of a moto_server with authentication on, holding BUCKET."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_REQUESTS)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_answering(endpoint, proc)
        anonymous = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                         aws_secret_access_key="testing")
        iam = boto3.client("iam", **anonymous)
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        policy = iam.create_policy(PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        iam.attach_user_policy(UserName="reader", PolicyArn=policy["Policy"]["Arn"])
        boto3.client("s3", **anonymous).create_bucket(Bucket=BUCKET)
        # authentication is on from here: the unknown key is refused, the user's key works
        with pytest.raises(Exception, match="InvalidAccessKeyId"):
            boto3.client("s3", **anonymous).list_objects_v2(Bucket=BUCKET)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key["AccessKeyId"],
                     aws_secret_access_key=key["SecretAccessKey"]).list_objects_v2(Bucket=BUCKET)
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def case_env(auth_server, case: str) -> tuple[dict, str]:
    """(environment, output URL) of one fault: `refused` (a key the store does not know), `bad_secret` (a known
    key, a wrong secret), `missing` (good credentials, no such bucket), `stopped` (nothing at the endpoint)."""
    endpoint, key, secret = auth_server
    good = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": endpoint}
    if case == "refused":
        return {**BASE_ENV, **good, "AWS_ACCESS_KEY_ID": "AKIANOTKNOWNTOTHESTORE"}, f"s3://{BUCKET}/out"
    if case == "bad_secret":
        return {**BASE_ENV, **good, "AWS_SECRET_ACCESS_KEY": "x" * 40}, f"s3://{BUCKET}/out"
    if case == "missing":
        return {**BASE_ENV, **good}, "s3://no-such-bucket-here/out"
    return {**BASE_ENV, **good, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}, f"s3://{BUCKET}/out"


EXPECTED = {  # case -> (exit code, what the one line must say)
    "refused": (2, "refused the credentials"),
    "bad_secret": (2, "refused the credentials"),
    "missing": (2, "bucket 'no-such-bucket-here' does not exist"),
    "stopped": (1, "does not answer"),
}


def commands(url: str, tmp_path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "dflash_prep.commands.cli"]
    return {
        "extract": [sys.executable, "extract.py", "--set", f"output.dir={url}", "--set", "data.max_samples=8",
                    "--set", f"output.staging_dir={tmp_path / 'staging'}"],
        "inspect": [*cli, "inspect", url],
        "verify": [*cli, "verify", url],
        "export": [*cli, "export", url, "--to", "specforge", "--dest", str(tmp_path / "exported")],
        "vocab": [*cli, "vocab", url, "--size", "16", "--dest", str(tmp_path / "vocab")],
    }


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("[dflash-prep]")]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EXPECTED))
def test_every_command_says_a_refusing_or_silent_store_in_one_line(auth_server, case, tmp_path):
    env, url = case_env(auth_server, case)
    code, words = EXPECTED[case]
    for name, cmd in commands(url, tmp_path).items():
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        lines = error_lines(proc.stderr)
        assert proc.returncode == code, (name, proc.returncode, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (name, proc.stderr)
        if case == "stopped":
            assert env["AWS_ENDPOINT_URL"] in lines[0], (name, lines)  # names the endpoint
        assert not (tmp_path / "exported").exists() and not (tmp_path / "vocab").exists()


def test_the_reader_raises_one_clear_exception_per_fault(auth_server, tmp_path):
    """ShardDataset on each fault, in a fresh process (the store's credentials come from its environment)."""
    script = ("import sys\nfrom dflash_prep.consume.reader import ShardDataset\n"
              "from dflash_prep.recipe.location import StoreRefusedError, StoreUnreachableError\n"
              "try:\n    ShardDataset(sys.argv[1])\n"
              "except (StoreRefusedError, StoreUnreachableError) as e:\n"
              "    print(type(e).__name__, e.exit_code, str(e), sep='|')\n")
    expected_types = {"refused": "CredentialsRefusedError", "bad_secret": "CredentialsRefusedError",
                      "missing": "BucketMissingError", "stopped": "StoreUnreachableError"}
    for case, (code, words) in EXPECTED.items():
        env, url = case_env(auth_server, case)
        proc = subprocess.run([sys.executable, "-c", script, url], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        name, exit_code, message = proc.stdout.strip().split("|")
        assert (name, int(exit_code)) == (expected_types[case], code) and words in message and "\n" not in message


def test_a_store_that_answers_is_not_called_refused(auth_server, tmp_path):
    """The right credentials and an existing bucket with nothing under the prefix: the check passes and inspect says
    what is missing (no manifest), not a store error."""
    endpoint, key, secret = auth_server
    env = {**BASE_ENV, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_ENDPOINT_URL": endpoint}
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "inspect", f"s3://{BUCKET}/empty"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "refused" not in proc.stderr and "does not exist in the store" not in proc.stderr, proc.stderr
    assert "does not answer" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture
def frozen_server():
    """The endpoint of a real moto_server (no authentication, holding BUCKET) stopped with SIGSTOP: it accepts
    connections (the kernel does) and never answers, as a hung store or a frozen VM does."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_answering(endpoint, proc)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
        proc.send_signal(signal.SIGSTOP)
        yield endpoint
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_store_that_accepts_connections_and_never_answers_is_unreachable_within_the_deadline(frozen_server):
    """The bucket check ends at its deadline with the one-line error naming the endpoint (it waited for botocore's
    read timeouts and retries: minutes, with no line)."""
    import s3fs

    from dflash_prep.recipe.location import StoreUnreachableError, check_store

    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=frozen_server,
                           client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError) as e:
        check_store(fs, f"s3://{BUCKET}/out", timeout_seconds=3)
    assert time.monotonic() - t0 < 20
    assert frozen_server in str(e.value) and "does not answer" in str(e.value)


@pytest.mark.slow
def test_inspect_of_an_output_in_a_frozen_store_ends_in_one_line_with_exit_code_1(frozen_server):
    env = {**BASE_ENV, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_ENDPOINT_URL": frozen_server}
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "inspect", f"s3://{BUCKET}/out"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and "does not answer" in lines[0] and frozen_server in lines[0], proc.stderr
