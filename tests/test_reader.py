"""Tests for dflash_prep.consume.reader: round trip against the tar bytes and a direct forward, rank/worker split,
shuffling, format errors, and the DFlash collator (padded and packed batches).

One small extraction (60 rows of the embedded demo, final layer before the norm, one shard per ~4-sample
batch) is shared by the whole module.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as safetensors_load
from torch.utils.data import DataLoader

from dflash_prep.consume.reader import (
    DFlashCollator,
    ShardDataset,
    ShardFormatError,
    has_supervised_pair,
    iter_tar_samples,
    plan_consumer,
    resolve_rank_world,
    shards_of,
)

NUM_ROWS = 60
OVERRIDES = [f"data.max_samples={NUM_ROWS}", "data.max_length=384", "batching.max_tokens_per_batch=1536",
             "batching.num_workers=0", "output.max_shard_bytes=1", "layers.capture_final=before_norm"]


def _extract(out_dir: Path, overrides: list[str]):
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    recipe = load_recipe(None, [f"output.dir={out_dir}", *overrides])
    summary = run_extraction(recipe)
    assert summary is not None and (out_dir / "manifest.json").is_file()
    return recipe


@pytest.fixture(scope="module")
def extraction(tmp_path_factory):
    out = tmp_path_factory.mktemp("reader") / "out"
    recipe = _extract(out, OVERRIDES)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == NUM_ROWS and manifest["num_skipped"] == 0
    assert len(manifest["shards"]) >= 8, "the split tests need more shards than 2 ranks x 2 workers"
    return out, recipe, manifest


def _bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (bit-level comparison, NaN-safe)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


def _fingerprint(sample: dict) -> str:
    h = hashlib.sha256()
    for name in ("input_ids", "loss_mask", "hidden_states", "final_hidden_states"):
        if name in sample:
            h.update(name.encode())
            h.update(_bits(sample[name]))
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- round trip
def test_reader_yields_exactly_the_tar_members(extraction):
    import webdataset as wds

    out, _, manifest = extraction
    urls = [str(out / s["path"]) for s in manifest["shards"]]
    expected = {}
    for rec in wds.WebDataset(urls, shardshuffle=False, empty_check=False):  # independent decoder: no handlers
        tensors = safetensors_load(rec["hidden_states.safetensors"])
        expected[rec["__key__"]] = {
            "input_ids": np.load(io.BytesIO(rec["input_ids.npy"]), allow_pickle=False),
            "loss_mask": np.load(io.BytesIO(rec["loss_mask.npy"]), allow_pickle=False),
            **tensors,
        }
    samples = list(ShardDataset(out))
    assert [s["sample_id"] for s in samples] == list(expected)  # manifest order, then file order
    assert len(samples) == NUM_ROWS
    H, k = manifest["hidden_size"], len(manifest["layer_ids"])
    for s in samples:
        e = expected[s["sample_id"]]
        T = e["input_ids"].shape[0]
        assert set(s) == {"sample_id", "input_ids", "loss_mask", "hidden_states", "final_hidden_states"}
        assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.int64
        assert s["hidden_states"].dtype == torch.bfloat16 and tuple(s["hidden_states"].shape) == (T, k * H)
        assert s["final_hidden_states"].dtype == torch.bfloat16 and tuple(s["final_hidden_states"].shape) == (T, H)
        assert np.array_equal(s["input_ids"].numpy(), e["input_ids"].astype(np.int64))
        assert np.array_equal(s["loss_mask"].numpy(), e["loss_mask"].astype(np.int64))
        assert _bits(s["hidden_states"]) == _bits(e["hidden_states"])
        assert _bits(s["final_hidden_states"]) == _bits(e["final_hidden_states"])


def test_reader_matches_a_direct_forward_through_the_model(extraction):
    """Rebuild the model from the recipe's seed, replay the frozen plan's batches through the decoder with
    `output_hidden_states=True` (no project hooks) and a hook of our own on the last layer: the stored states are
    those values rounded to bf16, bit for bit; an unpadded single-sample forward agrees within bf16 rounding."""
    from dflash_prep.data.rows import load_rows, tokenize_dataset
    from dflash_prep.plan.batches import collate, samples_from_rows
    from dflash_prep.target.layers import find_decoder
    from dflash_prep.target.model import load_config, load_model, load_tokenizer, vocab_size_of

    out, recipe, manifest = extraction
    layer_ids = manifest["layer_ids"]
    config = load_config(recipe.model)
    tokenizer = load_tokenizer(recipe.model)
    model = load_model(recipe.model, config, torch.device("cpu"))
    decoder = find_decoder(model)
    data = tokenize_dataset(load_rows(recipe.data), tokenizer, recipe.data, vocab_size_of(config))
    kept = data.kept
    by_id = {s["sample_id"]: s for s in ShardDataset(out)}
    plan = json.loads((out / "plan.json").read_text())["batches"]

    last_out = {}
    handle = decoder.layers[-1].register_forward_hook(
        lambda m, a, o: last_out.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    try:
        checked = 0
        for padded_length, indices in plan:
            rows = kept[list(indices)]
            batch = collate(samples_from_rows(rows), padded_length, tokenizer.pad_token_id or 0)
            with torch.inference_mode():
                hf = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids, use_cache=False, output_hidden_states=True)
            for b, info in enumerate(batch.samples):
                n = info.num_tokens
                stored = by_id[info.sample_id]
                assert np.array_equal(stored["input_ids"].numpy(), info.input_ids.astype(np.int64))
                want_TK = torch.cat([hf.hidden_states[i + 1][b, :n] for i in layer_ids], dim=-1).to(torch.bfloat16)
                assert _bits(stored["hidden_states"]) == _bits(want_TK), info.sample_id
                assert _bits(stored["final_hidden_states"]) == _bits(last_out["x"][b, :n].to(torch.bfloat16))
                checked += 1
        assert checked == NUM_ROWS

        # Padding-free cross-check on the longest sample: its own forward, no batch, no padding.
        sid = max(by_id, key=lambda s: by_id[s]["input_ids"].shape[0])
        ids = by_id[sid]["input_ids"].unsqueeze(0)
        with torch.inference_mode():
            alone = decoder(input_ids=ids, use_cache=False, output_hidden_states=True)
        alone_TK = torch.cat([alone.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(by_id[sid]["hidden_states"].float(), alone_TK, rtol=2 ** -7, atol=1e-5)
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------- work split
def _read_rank(out: Path, rank: int, world_size: int, num_workers: int, **kw) -> list[dict]:
    ds = ShardDataset(out, rank=rank, world_size=world_size, **kw)
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers)
    return list(loader)


@pytest.mark.parametrize("split", ["auto", "sample"])
def test_two_ranks_two_workers_read_every_sample_exactly_once(extraction, split):
    out, _, _ = extraction
    reference = {s["sample_id"]: _fingerprint(s) for s in ShardDataset(out)}
    seen: list[str] = []
    for rank in range(2):
        samples = _read_rank(out, rank, 2, num_workers=2, split=split)
        assert len(samples) == ShardDataset(out, split=split).num_samples_for(rank, 2, num_workers=2)
        for s in samples:
            assert _fingerprint(s) == reference[s["sample_id"]]  # content unchanged by the split
        seen += [s["sample_id"] for s in samples]
    assert len(seen) == len(set(seen)) == NUM_ROWS
    assert set(seen) == set(reference)


def test_split_rule_shards_when_enough_else_samples(extraction):
    out, _, manifest = extraction
    shards = shards_of(out, manifest)
    S = len(shards)
    plans = [plan_consumer(shards, c, 4) for c in range(4)]
    assert all(p.mode == "shard" for p in plans)
    assert sorted(s.rel_path for p in plans for s in p.shards) == sorted(s.rel_path for s in shards)
    counts = [p.num_samples for p in plans]  # dealt to the least-loaded consumer: within one shard's worth
    assert sum(counts) == NUM_ROWS and max(counts) - min(counts) <= max(s.num_samples for s in shards)
    # More consumers than shards: every consumer walks every shard and strides over samples.
    C = S + 3
    plans = [plan_consumer(shards, c, C) for c in range(C)]
    assert all(p.mode == "sample" and len(p.shards) == S for p in plans)
    counts = [p.num_samples for p in plans]
    assert sum(counts) == NUM_ROWS and max(counts) - min(counts) <= 1
    # ... and really reads that way (no DataLoader: explicit ranks as consumers).
    ids = [s["sample_id"] for r in range(C) for s in ShardDataset(out, rank=r, world_size=C)]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == NUM_ROWS


def test_rank_and_world_from_torch_distributed(tmp_path):
    import torch.distributed as dist

    assert resolve_rank_world() == (0, 1)
    assert resolve_rank_world(3, 4) == (3, 4)
    with pytest.raises(ValueError):
        resolve_rank_world(4, 4)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert resolve_rank_world() == (0, 1)
        assert resolve_rank_world(1, 2) == (1, 2)  # explicit arguments win
    finally:
        dist.destroy_process_group()


def test_shuffle_changes_order_not_content(extraction):
    out, _, _ = extraction
    plain = [s["sample_id"] for s in ShardDataset(out)]
    reference = {s["sample_id"]: _fingerprint(s) for s in ShardDataset(out)}

    def read(epoch, seed=7):
        ds = ShardDataset(out, shuffle=True, seed=seed, shuffle_buffer=16)
        ds.set_epoch(epoch)
        samples = list(ds)
        assert all(_fingerprint(s) == reference[s["sample_id"]] for s in samples)
        return [s["sample_id"] for s in samples]

    e0, e0_again, e1 = read(0), read(0), read(1)
    assert sorted(e0) == sorted(e1) == sorted(plain) and len(e0) == NUM_ROWS
    assert e0 == e0_again  # seeded: reproducible
    assert e0 != plain and e1 != e0  # and it does change the order, per epoch
    # With ranks and workers, shuffled: still exactly once.
    seen = [s["sample_id"] for r in range(2) for s in _read_rank(out, r, 2, 2, shuffle=True, seed=3)]
    assert sorted(seen) == sorted(plain)


def test_seeded_order_is_reproducible_with_dataloader_workers(extraction):
    """Shuffled, 2 workers: the same (seed, epoch) gives the same sequence in a fresh loader; another epoch another
    sequence of the same samples; every sample once."""
    out, _, _ = extraction

    def read(epoch):
        ds = ShardDataset(out, shuffle=True, seed=11, shuffle_buffer=8, rank=0, world_size=1)
        ds.set_epoch(epoch)
        return [s["sample_id"] for s in DataLoader(ds, batch_size=None, num_workers=2)]

    e0, e0_again, e1 = read(0), read(0), read(1)
    assert e0 == e0_again
    assert e0 != e1 and sorted(e0) == sorted(e1) and len(set(e0)) == NUM_ROWS


def test_reads_only_what_the_manifest_lists(extraction, tmp_path, monkeypatch):
    """Manifest-only start: a stray complete shard and a `.tmp` beside the listed ones are never read, no folder
    is listed (listing raises here), and a listed shard is opened only when reached: removing the last one in
    manifest order lets construction and the other shards' samples through, then fails naming it."""
    import os
    import shutil

    out, _, manifest = extraction
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    first, last = manifest["shards"][0]["path"], manifest["shards"][-1]["path"]
    shutil.copy(copy / first, (copy / first).with_name("shard-999999.tar"))
    shutil.copy(copy / first, (copy / first).with_name("shard-999998.tar.tmp"))
    (copy / last).unlink()

    def no_listing(*args, **kwargs):
        raise AssertionError(f"a folder was listed: {args}")

    monkeypatch.setattr(os, "scandir", no_listing)
    monkeypatch.setattr(os, "listdir", no_listing)
    ds = ShardDataset(copy)
    ids = []
    with pytest.raises(FileNotFoundError, match=last.replace(".", "[.]")):
        for s in ds:
            ids.append(s["sample_id"])
    assert len(ids) == len(set(ids)) == NUM_ROWS - manifest["shards"][-1]["num_samples"]


# ------------------------------------------------------------------------------------------ format errors
def _copy_with_manifest(out: Path, dest: Path, edit) -> Path:
    dest.mkdir()
    (dest / "shards").symlink_to(out / "shards")
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def test_sample_count_mismatch_names_the_shard(extraction, tmp_path):
    out, _, _ = extraction

    def edit(m):  # the totals still add up (else the reader refuses the manifest at construction)
        m["shards"][2]["num_samples"] += 1
        m["num_samples"] += 1

    bad = _copy_with_manifest(out, tmp_path / "bad", edit)
    shard = json.loads((bad / "manifest.json").read_text())["shards"][2]["path"]
    with pytest.raises(ShardFormatError, match=shard.replace(".", r"\.")):
        list(ShardDataset(bad))


def test_wrong_layer_count_is_refused(extraction, tmp_path):
    out, _, _ = extraction

    def edit(m):
        m["layer_ids"] = m["layer_ids"][:-1]

    with pytest.raises(ShardFormatError, match="hidden_states is torch.bfloat16"):
        next(iter(ShardDataset(_copy_with_manifest(out, tmp_path / "bad", edit))))


def _flip_a_state_byte(shard: Path) -> str:
    """XOR one byte in the middle of the first sample's `hidden_states` tensor data (not a header: every decoder
    still accepts the sample); returns that sample's id."""
    import struct
    import tarfile

    with tarfile.open(shard) as tar:
        info = next(i for i in tar if i.name.endswith(".hidden_states.safetensors"))
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[info.offset_data:info.offset_data + 8])
    header = json.loads(data[info.offset_data + 8:info.offset_data + 8 + n])
    a, b = header["hidden_states"]["data_offsets"]
    data[info.offset_data + 8 + n + (a + b) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    return info.name.split(".", 1)[0]


@pytest.mark.slow
def test_no_consumer_gets_a_corrupted_state_silently(extraction, tmp_path):
    """One flipped byte inside a stored state: the reader (DataLoader workers on) stops with an error naming the
    shard; only `verify_sha256=False` reads it, and then the state really differs (the corruption is silent to
    every other check)."""
    import shutil

    out, _, manifest = extraction
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    victim = manifest["shards"][3]["path"]
    sample_id = _flip_a_state_byte(bad / victim)
    loader = DataLoader(ShardDataset(bad, rank=0, world_size=1), batch_size=None, num_workers=2)
    with pytest.raises(ShardFormatError, match=rf"{victim.replace('.', '[.]')}: sha256 .* differs from the manifest"):
        for _ in loader:
            pass
    read = {s["sample_id"]: s for s in ShardDataset(bad, verify_sha256=False)}
    clean = {s["sample_id"]: s for s in ShardDataset(out)}
    assert len(read) == NUM_ROWS
    assert [sid for sid in clean if _bits(clean[sid]["hidden_states"]) != _bits(read[sid]["hidden_states"])] \
        == [sample_id]


@pytest.mark.parametrize("edit", ["drop", "duplicate"])
def test_shard_counts_add_up_to_num_samples_and_paths_are_unique(extraction, tmp_path, edit):
    """A manifest entry dropped or duplicated (num_samples left as it was) is refused before any sample is read,
    instead of yielding fewer or more samples than `num_samples` says."""
    out, _, _ = extraction

    def change(m):
        if edit == "drop":
            del m["shards"][1]
        else:
            m["shards"].insert(2, dict(m["shards"][1]))

    bad = _copy_with_manifest(out, tmp_path / "bad", change)
    why = "num_samples is 60, its shards add up to" if edit == "drop" else "listed 2 times in the manifest"
    with pytest.raises(ShardFormatError, match=why):
        ShardDataset(bad)


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar holding `members` in this order, written with the standard library (independent of the reader)."""
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_tar_samples_and_their_errors(tmp_path):
    good = _tar(tmp_path / "good.tar", [("a.x.npy", b"1"), ("a.y", b"22"), ("b.x.npy", b"333")])
    assert [(p, k, m) for p, k, m in iter_tar_samples(good)] == [(0, "a", {"x.npy": b"1", "y": b"22"}),
                                                                 (1, "b", {"x.npy": b"333"})]
    assert [m for _, _, m in iter_tar_samples(good, wanted=lambda j: j == 1, member_names=["x.npy"])] \
        == [None, {"x.npy": b"333"}]
    digest = hashlib.sha256(good.read_bytes()).hexdigest()
    assert len(list(iter_tar_samples(good, expected_sha256=digest, expected_bytes=good.stat().st_size))) == 2
    with pytest.raises(ShardFormatError, match="good.tar: sha256 .* differs"):
        list(iter_tar_samples(good, expected_sha256="0" * 64))

    split = _tar(tmp_path / "split.tar", [("a.x.npy", b"1"), ("b.x.npy", b"2"), ("a.y", b"3")])
    with pytest.raises(ShardFormatError, match=r"split\.tar: sample key 'a' appears twice"):
        list(iter_tar_samples(split))
    twice = _tar(tmp_path / "twice.tar", [("a.x.npy", b"1"), ("a.x.npy", b"2")])
    with pytest.raises(ShardFormatError, match=r"twice\.tar: sample 'a' has two 'x\.npy' members"):
        list(iter_tar_samples(twice))
    empty = _tar(tmp_path / "empty.tar", [])  # a shard may hold zero samples (docs/FORMAT.md)
    assert list(iter_tar_samples(empty, expected_sha256=hashlib.sha256(empty.read_bytes()).hexdigest())) == []
    not_a_tar = tmp_path / "junk.tar"
    not_a_tar.write_bytes(b"this is not a tar archive" * 100)
    with pytest.raises(ShardFormatError, match=r"junk\.tar: not a readable tar"):
        list(iter_tar_samples(not_a_tar))


@pytest.mark.parametrize("verify_sha256", [True, False])
def test_truncated_shard_is_one_error_naming_it(extraction, tmp_path, verify_sha256):
    """A shard cut in the middle of a member (a copy that stopped early): one `ShardFormatError` naming the shard,
    its message one readable line, with or without the hash."""
    import shutil

    out, _, manifest = extraction
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    victim = manifest["shards"][2]["path"]
    data = (bad / victim).read_bytes()
    (bad / victim).write_bytes(data[:len(data) // 2 + 7])
    with pytest.raises(ShardFormatError) as caught:
        list(ShardDataset(bad, verify_sha256=verify_sha256))
    message = str(caught.value)
    assert message.startswith(str(bad / victim)) and "\n" not in message and "<" not in message, message


def test_missing_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest"):
        ShardDataset(tmp_path)


# ------------------------------------------------------------------------------------------ DFlash batches
def _sample(sid: str, mask: list[int], H: int = 4, k: int = 2) -> dict:
    T = len(mask)
    return {"sample_id": sid, "input_ids": torch.arange(100, 100 + T), "loss_mask": torch.tensor(mask),
            "hidden_states": torch.randn(T, k * H).to(torch.bfloat16)}


def test_has_supervised_pair():
    assert has_supervised_pair(torch.tensor([0, 1, 1, 0]))
    assert not has_supervised_pair(torch.tensor([1, 0, 1, 0, 1]))
    assert not has_supervised_pair(torch.tensor([1]))


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_collator_truncates_and_drops_samples_without_an_anchor(mode):
    keep = _sample("a", [0, 1, 1, 0, 0, 0])
    late_pair = _sample("b", [0, 0, 0, 0, 1, 1])  # its only pair lies beyond max_length=4
    no_pair = _sample("c", [1, 0, 1, 0])
    batch = DFlashCollator(max_length=4, mode=mode)([keep, late_pair, no_pair])
    assert batch["sample_ids"] == ["a"] and batch["num_dropped"] == 2
    assert batch["input_ids"].shape == (1, 4)
    assert torch.equal(batch["input_ids"][0], keep["input_ids"][:4])
    assert DFlashCollator(max_length=4, mode=mode)([late_pair, no_pair]) is None


def _real_samples(out: Path, n: int) -> list[dict]:
    return [s for _, s in zip(range(n), ShardDataset(out, split="sample", rank=0, world_size=1))]


def test_padded_batch_holds_the_samples(extraction):
    out, _, manifest = extraction
    samples = _real_samples(out, 5)
    max_length = 200
    batch = DFlashCollator(max_length, "padded", pad_token_id=-7, pad_to_multiple_of=64)(samples)
    kept = [s for s in samples if has_supervised_pair(s["loss_mask"][:max_length])]
    assert batch["sample_ids"] == [s["sample_id"] for s in kept]
    B, T = batch["input_ids"].shape
    lengths = [min(s["input_ids"].shape[0], max_length) for s in kept]
    assert B == len(kept) and T % 64 == 0 and T >= max(lengths)
    assert batch["lengths"].tolist() == lengths
    assert batch["hidden_states"].shape == (B, T, len(manifest["layer_ids"]) * manifest["hidden_size"])
    assert batch["final_hidden_states"].shape == (B, T, manifest["hidden_size"])
    for b, (s, n) in enumerate(zip(kept, lengths)):
        assert torch.equal(batch["input_ids"][b, :n], s["input_ids"][:n])
        assert torch.equal(batch["loss_mask"][b, :n], s["loss_mask"][:n])
        assert _bits(batch["hidden_states"][b, :n]) == _bits(s["hidden_states"][:n])
        assert _bits(batch["final_hidden_states"][b, :n]) == _bits(s["final_hidden_states"][:n])
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (T - n)
        assert batch["position_ids"][b, :n].tolist() == list(range(n))
        assert (batch["input_ids"][b, n:] == -7).all() and (batch["loss_mask"][b, n:] == 0).all()
        assert (batch["hidden_states"][b, n:] == 0).all()


def test_packed_batch_holds_the_samples(extraction):
    out, _, manifest = extraction
    samples = _real_samples(out, 5)
    max_length = 200
    batch = DFlashCollator(max_length, "packed", pad_to_multiple_of=128)(samples)
    kept = [s for s in samples if has_supervised_pair(s["loss_mask"][:max_length])]
    lengths = [min(s["input_ids"].shape[0], max_length) for s in kept]
    total = sum(lengths)
    N = batch["input_ids"].shape[1]
    assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["position_ids"].shape == (1, N)
    assert N % 128 == 0 and total <= N < total + 128
    assert batch["lengths"].tolist() == lengths
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == list(np.cumsum([0] + lengths))
    assert batch["hidden_states"].shape == (1, N, len(manifest["layer_ids"]) * manifest["hidden_size"])
    cu = batch["cu_seqlens"].tolist()
    for d, (s, n) in enumerate(zip(kept, lengths)):
        a, b = cu[d], cu[d + 1]
        assert torch.equal(batch["input_ids"][0, a:b], s["input_ids"][:n])
        assert torch.equal(batch["loss_mask"][0, a:b], s["loss_mask"][:n])
        assert _bits(batch["hidden_states"][0, a:b]) == _bits(s["hidden_states"][:n])
        assert _bits(batch["final_hidden_states"][0, a:b]) == _bits(s["final_hidden_states"][:n])
        assert batch["position_ids"][0, a:b].tolist() == list(range(n))
        assert (batch["document_ids"][0, a:b] == d).all()
    assert (batch["document_ids"][0, total:] == -1).all() and (batch["loss_mask"][0, total:] == 0).all()
    # Packed and padded views of the same samples hold the same tokens and states.
    padded = DFlashCollator(max_length, "padded")(samples)
    real = padded["attention_mask"].bool()
    assert torch.equal(padded["input_ids"][real], batch["input_ids"][0, :total])
    assert _bits(padded["hidden_states"][real]) == _bits(batch["hidden_states"][0, :total])


def test_dataloader_with_collator_end_to_end(extraction):
    out, _, _ = extraction
    loader = DataLoader(ShardDataset(out, shuffle=True, seed=1), batch_size=8, num_workers=0,
                        collate_fn=DFlashCollator(max_length=256, mode="packed"))
    ids = [sid for batch in loader if batch is not None for sid in batch["sample_ids"]]
    dropped = sum(batch["num_dropped"] for batch in DataLoader(
        ShardDataset(out), batch_size=8, collate_fn=DFlashCollator(max_length=256, mode="packed")) if batch)
    assert len(ids) == len(set(ids)) and len(ids) + dropped == NUM_ROWS
