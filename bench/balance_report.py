"""Issue 13's figures of a finished extraction: per rank, loop seconds against the predicted seconds of its share,
forwards, writer drain and start-up seconds per stage; and each rank's predicted finish under the split by
predicted time (what the run used) and under the former split by padded tokens, for the same plan.

    python3 bench/balance_report.py OUT [DEST.txt]
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the checkout on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_prep.commands.cost import batch_cost_model  # noqa: E402
from dflash_prep.data.rows import load_rows, tokenize_dataset  # noqa: E402
from dflash_prep.plan.planner import PlannedBatch, rank_finish_seconds, split_across_ranks  # noqa: E402
from dflash_prep.recipe.schema import load_recipe  # noqa: E402
from dflash_prep.target.layers import num_decoder_layers  # noqa: E402
from dflash_prep.target.model import load_config, load_tokenizer, vocab_size_of  # noqa: E402


def _stages(seconds: dict | None) -> str:
    return "n/a" if not seconds else ", ".join(
        f"{k} {v:.1f}s" if not isinstance(v, bool) else f"{k} {v}" for k, v in seconds.items())


def report(out: Path) -> list[str]:
    s = json.loads((out / "summary.json").read_text())
    lines = [f"wall {s['wall_seconds']:.1f}s, {s['tokens_per_second']:,.0f} tok/s; main start-up "
             f"{_stages(s.get('startup_seconds'))}"]
    for r in s["ranks"]:
        predicted = r.get("predicted_seconds") or 0.0
        lines.append(f"rank {r['rank']}: loop {r['loop_seconds']:.1f}s (predicted {predicted:.1f}s), "
                     f"forwards {r['forward_seconds']:.1f}s (GPU {r['gpu_forward_seconds']}), writer drain "
                     f"{r['writer_drain_seconds']:.1f}s, writer wait {r['writer_wait_seconds']:.1f}s, "
                     f"{r['num_real_tokens']:,} tokens, {r['bytes_written'] / 1e9:.2f} GB; start-up "
                     f"{_stages(r.get('startup_seconds'))}")
    ends = [r["loop_seconds"] for r in s["ranks"]]
    lines.append(f"loop end spread (max - min): {max(ends) - min(ends):.1f}s of {max(ends):.1f}s")
    recipe = load_recipe(out / "recipe.resolved.yaml", [])
    config = load_config(recipe.model)
    data = tokenize_dataset(load_rows(recipe.data), load_tokenizer(recipe.model), recipe.data, vocab_size_of(config))
    lengths = [int(n) for n in data.kept["num_tokens"]]
    stored = json.loads((out / "plan.json").read_text())
    plan = [PlannedBatch(i, tuple(idx), T, sum(lengths[j] for j in idx))
            for i, (T, idx) in enumerate(stored["batches"])]
    layer_ids = json.loads((out / "manifest.json").read_text())["layer_ids"]
    model = batch_cost_model(recipe, config, layer_ids, num_decoder_layers(config))
    cost = functools.partial(model.cost_of, lengths=lengths)
    for name, by in (("by predicted time (the run's)", cost), ("by padded tokens (before)", None)):
        shares = split_across_ranks(plan, len(s["ranks"]), by)
        finish = [rank_finish_seconds([cost(b) for b in share]) for share in shares]
        tokens = [sum(b.num_real_tokens for b in share) for share in shares]
        lines.append(f"split {name}: predicted finish {[round(f, 2) for f in finish]} s, real tokens {tokens}")
    return lines


if __name__ == "__main__":
    text = "\n".join(report(Path(sys.argv[1]))) + "\n"
    print(text, end="")
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(text)
