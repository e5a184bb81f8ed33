#!/usr/bin/env python
"""The regeneration's client against a bare load loop: does `engine: openai` keep a server as busy as it can be?

    python bench/client_bench.py OUT.json [--requests 96] [--concurrency 8] [--max-tokens 16] [--rounds 2]
        [--serve-args "--continuous-batching"] [--server-cpus 0]

One real `transformers serve` (CPU, float32) of the demo model's config with random weights (seeded) and the
demo tokenizer, on a free loopback port; the same requests (one user message each, greedy, `max_tokens` new tokens)
sent, `concurrency` in flight, by:

  bare_async    asyncio + `openai.AsyncOpenAI`, a semaphore of `concurrency` (the load loop a user would write)
  bare_threads  `concurrency` threads + `openai.OpenAI`
  engine        `OpenAIEngine.answer(all requests)` (regen/openai_engine.py, `max_concurrency` = concurrency)
  run           `dflash-prep regenerate` in this process on rows of those prompts (the loop, the conversation rules,
                the commits): its own requests/s over its loop time (summary.json `this_run`)

in alternating rounds (bare_async, bare_threads, engine, run, then again) so a drift of the machine's load hits all
alike. Reported: requests/s and generated tokens/s of each (median over the rounds), and the ratios of `engine` and
`run` to `bare_async` and to the faster of the two bare loops. Greedy decoding: every method gets the same answers, so the same work. Writes OUT.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "dflash_prep" / "demo" / "tiny-demo"


def save_model(dest: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(DEMO / "model_config.json")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dest)
    AutoTokenizer.from_pretrained(DEMO / "tokenizer").save_pretrained(dest)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, log: Path, serve_args: list[str],
                 cpus: set[int] | None = None) -> subprocess.Popen:
    """`transformers serve` of `model` on `port`, on the CPUs `cpus` only (its torch threads as many) when given."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cpus:
        env["OMP_NUM_THREADS"] = str(len(cpus))
    serve = Path(sys.executable).parent / "transformers"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(serve), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu", "--dtype", "float32", *serve_args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("transformers serve did not answer")


def _cpus(text: str) -> set[int]:
    """"0", "0-3" or "0,2" -> the CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def prompts(n: int) -> list[str]:
    return [f"Write one sentence about the number {i} and what it means to you." for i in range(n)]


def kwargs_of(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "seed": 0}


def bare_async(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> tuple[float, int]:
    import openai

    async def go():
        client = openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=600)
        gate = asyncio.Semaphore(concurrency)

        async def one(text):
            async with gate:
                reply = await client.chat.completions.create(**kwargs_of(model, text, max_tokens))
                return reply.usage.completion_tokens

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(t) for t in texts))
        seconds = time.perf_counter() - t0
        await client.close()
        return seconds, sum(tokens)

    return asyncio.run(go())


def bare_threads(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> tuple[float, int]:
    import openai

    client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = list(pool.map(lambda t: client.chat.completions.create(**kwargs_of(model, t, max_tokens))
                               .usage.completion_tokens, texts))
    return time.perf_counter() - t0, sum(tokens)


def engine(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> tuple[float, int]:
    from dflash_prep.recipe.schema import RegenerateSection
    from dflash_prep.regen.engine import Request
    from dflash_prep.regen.openai_engine import OpenAIEngine

    section = RegenerateSection(engine="openai", base_urls=[url], max_concurrency=concurrency)
    client = OpenAIEngine(section, model)
    requests = [Request(messages=[{"role": "user", "content": t}], tools=None, sampling={}, seed=0,
                        max_tokens=max_tokens) for t in texts]
    t0 = time.perf_counter()
    answers = client.answer(requests)
    seconds = time.perf_counter() - t0
    client.close()
    assert all(a.rejected is None for a in answers), [a.rejected for a in answers if a.rejected][:3]
    return seconds, sum(a.completion_tokens for a in answers)


def run(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int, work: Path) -> tuple[float, int]:
    from dflash_prep.commands.regenerate import main as regenerate_main

    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"b{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                            for i, t in enumerate(texts)))
    out = work / "regenerated"
    sets = {"model.config": "null", "model.tokenizer": "null", "model.name_or_path": model, "data.path": str(data),
            "output.dir": str(work / "states"), "regenerate.output_dir": str(out), "regenerate.engine": "openai",
            "regenerate.base_urls": f"[{url}]", "regenerate.max_concurrency": concurrency,
            "regenerate.max_tokens": max_tokens, "regenerate.overwrite": "true"}
    argv = ["--recipe", str(REPO / "dflash_prep" / "demo" / "tiny-demo.yaml")]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert regenerate_main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())["this_run"]
    return summary["loop_seconds"], summary["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve-args", default="")
    parser.add_argument("--server-cpus", type=_cpus, default=None,
                        help="CPUs the server runs on, e.g. 0 or 0-3 (default: all); the client then runs on the "
                             "others, so that neither takes the other's cores (a small machine's noise)")
    args = parser.parse_args()
    if args.server_cpus:
        client_cpus = os.sched_getaffinity(0) - args.server_cpus
        if not client_cpus:
            parser.error(f"--server-cpus {sorted(args.server_cpus)} leaves the client no CPU")
        os.sched_setaffinity(0, client_cpus)
    work = Path(tempfile.mkdtemp(prefix="client-bench-"))
    model = save_model(work / "model")
    port = free_port()
    server = start_server(model, port, work / "serve.log", args.serve_args.split(), args.server_cpus)
    url, name = f"http://127.0.0.1:{port}/v1", str(model)
    texts = prompts(args.requests)
    methods = {"bare_async": bare_async, "bare_threads": bare_threads, "engine": engine,
               "run": lambda *a: run(*a, work=work)}
    results: dict[str, list] = {m: [] for m in methods}
    try:
        bare_async(url, name, texts[: args.concurrency], args.concurrency, args.max_tokens)  # warm-up
        for r in range(args.rounds):
            for method, fn in methods.items():
                seconds, tokens = fn(url, name, texts, args.concurrency, args.max_tokens)
                results[method].append({"seconds": seconds, "completion_tokens": tokens,
                                        "requests_per_second": len(texts) / seconds,
                                        "generated_tokens_per_second": tokens / seconds})
                print(f"round {r} {method:13s} {len(texts) / seconds:7.2f} req/s {tokens / seconds:8.1f} tok/s "
                      f"({seconds:.1f}s, {tokens} tokens)", flush=True)
    finally:
        os.killpg(server.pid, 9)
        server.wait()
    median = {m: statistics.median(x["requests_per_second"] for x in v) for m, v in results.items()}
    report = {"server": f"transformers serve (CPU, float32) {args.serve_args}".strip(),
              "model": "tiny-demo config, random weights", "requests": args.requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "results": results,
              "server_cpus": sorted(args.server_cpus) if args.server_cpus else None,
              "client_cpus": sorted(os.sched_getaffinity(0)),
              "median_requests_per_second": median,
              "ratio_engine_to_bare_async": median["engine"] / median["bare_async"],
              "ratio_run_to_bare_async": median["run"] / median["bare_async"],
              "ratio_engine_to_best_bare": median["engine"] / max(median["bare_async"], median["bare_threads"]),
              "ratio_run_to_best_bare": median["run"] / max(median["bare_async"], median["bare_threads"])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("median", "ratio"))}, indent=2))


if __name__ == "__main__":
    main()
