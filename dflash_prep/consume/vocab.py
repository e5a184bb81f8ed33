"""Supervised-token frequencies of an output, and the draft-vocabulary mappings drafter trainers load.

EAGLE-3 and DFlash drafters often predict over a reduced vocabulary: the N target tokens most frequent among the
supervised (loss-mask 1) tokens of the training data. This module

- counts those frequencies when an extraction finishes (`count_supervised_tokens`, over exactly the samples
  the manifest lists, so the counts do not depend on the number of ranks, on resumes, or on failed samples) and
  stores them as `OUT/token_freq.safetensors` (tensor `token_freq`, int64 [vocab_size]: entry t = how many
  supervised tokens have id t; no pickle);
- builds the mapping (`draft_vocab`) and writes it in the layouts the trainers load (`write_mapping`), for
  `dflash-prep vocab OUT --size N`.

The mapping convention is the one both trainers share (speculators `speculators.train.vocab_mapping.
build_vocab_mappings_from_distribution`, SpecForge `specforge.data.preprocessing.process_token_dict_to_mappings`):
the selected target ids sorted ascending, `d2t[i] = selected[i] - i` (an OFFSET: target id = i + d2t[i]),
`t2d[t] = True` iff target id t is in the draft vocabulary. Selection: the N most frequent ids, ties broken by
the smaller id (speculators' rule; SpecForge's `Counter.most_common` breaks ties by insertion order), padded
with the smallest ids not yet selected when fewer than N ids occur.

Layouts (`write_mapping`):
- `speculators`: `d2t.npy` int64 [N] and `t2d.npy` bool [V] (`np.save`; its `scripts/train.py` reads them with
  `np.load` + `torch.from_numpy`), plus `token_freq.pt`, its frequency file (`torch.save` of a plain
  {token id: count} dict of ints, as its `save_token_frequency_distribution` writes; loadable with
  `torch.load(weights_only=True)`);
- `specforge`: `vocab_mapping.pt`, `torch.save({"d2t": int64 [N], "t2d": bool [V]})`, what its draft models'
  `load_vocab_mapping(path)` copies into their `d2t` / `t2d` buffers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from dflash_prep.recipe.location import one_line_store_errors

TOKEN_FREQ_NAME = "token_freq.safetensors"
LAYOUTS = ("speculators", "specforge")
_ROWS_PER_CHUNK = 4096  # bounds the memory of one counting step (token ids + masks of these rows)


def count_supervised_tokens(kept, vocab_size: int, sample_ids: set[str] | None = None) -> np.ndarray:
    """Frequencies of the supervised tokens of a tokenized dataset: int64 [vocab_size].

    `kept`: a `datasets.Dataset` with `sample_id`, `input_ids` and `loss_mask` columns (data.TOKENIZED_COLUMNS);
    `sample_ids`: count only these rows (the samples a manifest lists), or every row when None. Vectorised over
    Arrow chunks: about a second per 10M tokens on one core. Raises ValueError on a token id outside
    [0, vocab_size) (tokenization skips such rows, so this means the wrong vocabulary size).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    counts = np.zeros(vocab_size, dtype=np.int64)
    wanted = pa.array(sorted(sample_ids), type=pa.string()) if sample_ids is not None else None
    arrow = kept.select_columns(["sample_id", "input_ids", "loss_mask"]).with_format("arrow")
    for chunk in arrow.iter(batch_size=_ROWS_PER_CHUNK):
        if wanted is not None:
            chunk = chunk.filter(pc.is_in(chunk["sample_id"], value_set=wanted))
        if chunk.num_rows == 0:
            continue
        ids = pc.list_flatten(chunk["input_ids"]).to_numpy(zero_copy_only=False)
        mask = pc.list_flatten(chunk["loss_mask"]).to_numpy(zero_copy_only=False).astype(bool)
        supervised = ids[mask].astype(np.int64)
        if supervised.size and (supervised.min() < 0 or supervised.max() >= vocab_size):
            raise ValueError(f"a supervised token id lies outside [0, {vocab_size})")
        counts += np.bincount(supervised, minlength=vocab_size)
    return counts


def write_token_freq(out_dir: str | Path, counts: np.ndarray, num_samples: int) -> dict:
    """Write `OUT/token_freq.safetensors` atomically (tmp, fsync, rename); -> its manifest entry.

    The entry: {"path", "vocab_size", "num_samples", "num_supervised_tokens", "num_distinct_tokens"}.
    """
    from dflash_prep.io import atomic_save_safetensors

    atomic_save_safetensors(Path(out_dir) / TOKEN_FREQ_NAME,
                            {"token_freq": torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64))},
                            {"num_samples": str(num_samples), "counts": "supervised (loss_mask 1) tokens per token id"})
    return {"path": TOKEN_FREQ_NAME, "vocab_size": int(counts.shape[0]), "num_samples": num_samples,
            "num_supervised_tokens": int(counts.sum()), "num_distinct_tokens": int(np.count_nonzero(counts))}


def read_token_freq(out_dir: str | Path) -> np.ndarray:
    """`OUT/token_freq.safetensors` -> int64 [vocab_size]. Raises FileNotFoundError naming the file."""
    from safetensors.numpy import load

    from dflash_prep.recipe.location import as_location

    path = as_location(out_dir) / TOKEN_FREQ_NAME  # a local folder or an object-store URL
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {Path(out_dir)} is not a finished extraction output (the "
                                f"frequencies are written with the manifest), or one from a dflash-prep version "
                                f"before they were stored")
    return load(path.read_bytes())["token_freq"]


def draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (d2t int64 [N], t2d bool [V]) for the N = draft_vocab_size most frequent ids (module docstring).

    Raises ValueError when N is not in [1, V].
    """
    vocab_size = int(counts.shape[0])
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"--size {draft_vocab_size}: the draft vocabulary must hold 1 to {vocab_size} tokens "
                         f"(the target's vocabulary size)")
    # Stable sort of -count: equal counts keep ascending id order, so ties go to the smaller id; ids that never
    # occur (count 0) follow in ascending order, which is the padding rule.
    by_frequency = np.argsort(-counts, kind="stable")
    selected = np.sort(by_frequency[:draft_vocab_size]).astype(np.int64)
    d2t = selected - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[selected] = True
    return d2t, t2d


def token_freq_dict(counts: np.ndarray) -> dict[int, int]:
    """{token id: count} for the ids that occur: speculators' frequency-file content."""
    return {int(t): int(counts[t]) for t in np.flatnonzero(counts)}


def write_mapping(counts: np.ndarray, d2t: np.ndarray, t2d: np.ndarray, dest: str | Path, layout: str) -> list[Path]:
    """Write the mapping `draft_vocab` made from `counts` in `layout` (LAYOUTS) into the folder `dest`; -> the files
    written."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if layout == "speculators":
        files = [dest / "d2t.npy", dest / "t2d.npy", dest / "token_freq.pt"]
        np.save(files[0], d2t)
        np.save(files[1], t2d)
        torch.save(token_freq_dict(counts), files[2])
        return files
    if layout == "specforge":
        path = dest / "vocab_mapping.pt"
        torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, path)
        return [path]
    raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")


def _write_mappings(counts, d2t, t2d, dest: str, layouts) -> list:
    """`write_mapping` of each layout into `dest/LAYOUT`; a `dest` in an object store is written locally first and
    uploaded (fsspec `put`). -> the files (their URLs for a store)."""
    from dflash_prep.recipe.location import check_location, is_remote

    if not is_remote(dest):
        return [f for layout in layouts for f in write_mapping(counts, d2t, t2d, Path(dest) / layout, layout)]
    import tempfile

    import fsspec

    check_location(dest, writable=False, key="--dest")
    fs, root = fsspec.url_to_fs(dest)
    with tempfile.TemporaryDirectory(prefix="dflash-prep-vocab-") as tmp:
        local = [f for layout in layouts for f in write_mapping(counts, d2t, t2d, Path(tmp) / layout, layout)]
        for f in local:
            fs.put_file(str(f), f"{root}/{f.relative_to(tmp)}")
        return [f"{dest.rstrip('/')}/{f.relative_to(tmp)}" for f in local]


def build_parser(prog: str = "dflash-prep vocab") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Draft-vocabulary mapping (d2t / t2d) from the "
                                     "supervised-token frequencies of an extraction output.")
    parser.add_argument("out_dir", help="a finished extraction output (holds token_freq.safetensors): a folder or an "
                                        "object-store URL")
    parser.add_argument("--size", type=int, required=True, help="draft vocabulary size N (e.g. 32000)")
    parser.add_argument("--layout", choices=(*LAYOUTS, "all"), default="all", help="trainer layout (default: all)")
    parser.add_argument("--dest", help="folder to write (default: OUT/vocab-N)")
    return parser


@one_line_store_errors
def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 2 on a missing frequency file or a bad size (one line on stderr)."""
    import sys

    args = build_parser().parse_args(argv)
    try:
        from dflash_prep.store.manifest import read_manifest

        read_manifest(args.out_dir)  # a finished output, its manifest readable: the counts cover what it lists
        counts = read_token_freq(args.out_dir)
        dest = args.dest or f"{str(args.out_dir).rstrip('/')}/vocab-{args.size}"
        layouts = LAYOUTS if args.layout == "all" else (args.layout,)
        d2t, t2d = draft_vocab(counts, args.size)
        files = _write_mappings(counts, d2t, t2d, dest, layouts)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    selected = np.arange(args.size) + d2t
    share = counts[selected].sum() / max(int(counts.sum()), 1)
    print(f"draft vocabulary: {args.size} of {counts.shape[0]} target tokens, covering {share:.2%} of the "
          f"{int(counts.sum()):,} supervised tokens")
    for f in files:
        print(f"  {f}")
    return 0
