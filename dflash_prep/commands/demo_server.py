"""`dflash-prep demo-server`: the demo's tiny model served by `transformers serve`, on the CPU, offline.

    dflash-prep demo-server [--dir out/tiny-demo-model] [--host 127.0.0.1] [--port 8000] [--save-only]

Saves the demo's model (its config with the random weights `init_seed` draws: the very weights the demo's
in-process runs build) and its tokenizer into `--dir` (once; a folder that holds them is reused), prints the
`--set` keys that point a run at it, then becomes `transformers serve DIR --device cpu --dtype float32` (Ctrl-C
stops it). Needs the server's extra: `pip install 'transformers[serving]'` (or this package's `[serving]`). With a
served folder the server examples of docs/SERVERS.md run as written, with no GPU and no download. Exit codes: 2
when `transformers serve` is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

DEFAULT_DIR = "out/tiny-demo-model"


def save_demo_model(dest: Path) -> Path:
    """The demo recipe's model (random weights from its config and `init_seed`, float32) and tokenizer saved as a
    model folder at `dest` (written to `dest.tmp`, then renamed); a folder already holding a config is kept."""
    dest = Path(dest)
    if (dest / "config.json").is_file() and (dest / "tokenizer_config.json").is_file():
        return dest
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from dflash_prep.recipe.schema import load_recipe
    from dflash_prep.target.model import load_model

    section = load_recipe(None).model
    config = AutoConfig.from_pretrained(section.config)
    model = load_model(section, config, torch.device("cpu"))
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(section.tokenizer).save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.replace(dest)
    return dest


# What `transformers serve` imports before it serves (transformers.utils.import_utils.is_serve_available, 5.x):
# checked here so that a missing one is one line, not the server's traceback after the model is saved.
SERVING_MODULES = ("fastapi", "uvicorn", "pydantic", "openai")


def missing_serving_modules() -> list[str]:
    import importlib.util

    return [m for m in SERVING_MODULES if importlib.util.find_spec(m) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-prep demo-server", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"the model folder (default {DEFAULT_DIR})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--save-only", action="store_true", help="save the folder, do not serve it")
    args = parser.parse_args(argv)
    serve = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    missing = [] if args.save_only else missing_serving_modules()
    if not args.save_only and (not Path(serve).is_file() or missing):
        what = f" (missing: {', '.join(missing)})" if missing else ""
        print(f"error: `transformers serve` is not installed{what}: pip install '.[serving]' in a checkout of "
              f"dflash-prep, or pip install 'transformers[serving]'", file=sys.stderr)
        return 2
    dest = save_demo_model(Path(args.dir)).resolve()
    print(f"demo model folder: {dest}\nrun against it with: --set model.config=null --set model.tokenizer=null "
          f"--set model.name_or_path={dest}", flush=True)
    if args.save_only:
        return 0
    print(f"serving it at http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.execv(serve, [serve, "serve", str(dest), "--host", args.host, "--port", str(args.port), "--device", "cpu",
                     "--dtype", "float32"])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
