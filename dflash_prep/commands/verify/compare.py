"""The drawn samples: which ones (a seeded draw), read from their shards and compared layer by layer with their
reference run alone, and with their padded batch (the noise floor)."""

from __future__ import annotations

import random

import torch

from dflash_prep.commands.verify.judge import NoiseResult, compare
from dflash_prep.commands.verify.noise import PaddedBatches
from dflash_prep.commands.verify.reference import num_launched_processes, run_alone
from dflash_prep.commands.verify.report import CannotVerify, VerifyReport


def choose_samples(all_ids: list[str], num_samples: int, seed: int) -> list[str]:
    """`num_samples` ids drawn with random.Random(seed) from the sorted ids (all when N >= their number)."""
    ids = sorted(all_ids)
    if num_samples >= len(ids):
        return ids
    return sorted(random.Random(seed).sample(ids, num_samples))


def compare_chosen(model, shards, ids_by_shard: dict, wanted: set, layout, layer_ids: list[int],
                    dev: torch.device, tol: float, report: VerifyReport, log=print) -> None:
    """Each chosen sample's stored layers against its reference run alone; results appended to `report` (and,
    unless `report.noise_floor_measured` is off, each sample's padded-batch vs alone rounding noise)."""
    from dflash_prep.consume.shard_format import ShardFormatError

    drawn = [(shard, {j for j, sid in enumerate(ids_by_shard[shard.rel_path]) if sid in wanted}) for shard in shards]
    drawn = [(shard, positions) for shard, positions in drawn if positions]
    padded = None if not report.noise_floor_measured else PaddedBatches(
        model, _drawn_input_ids(model, drawn, wanted, layout), layer_ids, layout.capture_final, dev,
        skip_on_oom=num_launched_processes() == 1, log=log)
    unreadable: set[str] = set()
    for shard, positions in drawn:
        try:
            unreadable |= _compare_shard(model, shard, positions, wanted, layout, layer_ids, dev, tol, report, padded,
                                         log)
        except (ShardFormatError, OSError) as e:  # a damaged or missing shard is a failed check, named
            report.integrity_problems.append(f"{shard.rel_path}: its drawn samples cannot be read ({e})")
            log(f"FAIL {report.integrity_problems[-1]}")
            unreadable |= {ids_by_shard[shard.rel_path][j] for j in positions}
    missing = wanted - {r.sample_id for r in report.results} - unreadable
    if missing:
        report.integrity_problems.append(f"sample(s) not found in the shards: {sorted(missing)[:5]}")
        log(f"FAIL {report.integrity_problems[-1]}")


def _drawn_input_ids(model, drawn: list, wanted: set, layout) -> list[tuple[str, torch.Tensor]]:
    """(sample id, input_ids [T]) of the drawn samples in reading order (the order `_compare_shard` meets them);
    a shard that cannot be read or is missing gives none, nor does a sample that cannot run (`_unrunnable`): they
    get no noise floor; the compare pass names them."""
    from dflash_prep.consume.shard_format import ShardFormatError
    from dflash_prep.consume.shard_read import iter_shard

    out: list[tuple[str, torch.Tensor]] = []
    for shard, positions in drawn:
        try:
            found = [(sample["sample_id"], sample["input_ids"]) for sample in iter_shard(
                shard, layout, wanted=lambda j, p=positions: j in p, check_tokens=False, fp8="raw",
                verify_sha256=False)]
        except (ShardFormatError, OSError):  # damaged or missing: the compare pass names it
            continue
        out += [(sid, ids) for sid, ids in found if sid in wanted and not _unrunnable(ids, _vocab_size(model))]
    return out


def _vocab_size(model) -> int:
    return int(model.config.get_text_config().vocab_size)


def _unrunnable(input_ids_T: torch.Tensor, vocab_size: int) -> str | None:
    """Why a stored sample cannot run through the model (no token; a token id outside [0, vocab_size): the
    embedding would raise), None when it can."""
    if input_ids_T.shape[0] == 0:
        return "holds no token"
    low, high = int(input_ids_T.min()), int(input_ids_T.max())
    if low < 0 or high >= vocab_size:
        return f"holds token id {high if high >= vocab_size else low}, outside the model's vocabulary of {vocab_size}"
    return None


def _compare_shard(model, shard, positions: set, wanted: set, layout, layer_ids: list[int], dev: torch.device,
                   tol: float, report: VerifyReport, padded: PaddedBatches | None = None, log=print) -> set[str]:
    """The drawn samples of one shard against their reference run alone (results appended to `report`); returns
    the ids of those that cannot run (`_unrunnable`: an integrity problem, named)."""
    from dflash_prep.consume.shard_read import iter_shard

    H, final_name, empty = layout.hidden_size, f"final ({layout.capture_final})", set()
    for sample in iter_shard(shard, layout, wanted=lambda j, p=positions: j in p, check_tokens=False,
                             fp8="float32", verify_sha256=False):  # hashes: check_output
        sid = sample["sample_id"]
        if sid not in wanted:
            raise CannotVerify(f"{shard.path}: sample order differs from the index ({sid})")
        if problem := _unrunnable(sample["input_ids"], _vocab_size(model)):
            report.integrity_problems.append(f"{shard.rel_path}: sample {sid} {problem}")
            log(f"FAIL {report.integrity_problems[-1]}")
            empty.add(sid)
            continue
        ref = run_alone(model, sample["input_ids"], layer_ids, layout.capture_final, dev)
        stored = sample["hidden_states"].float()
        for slot, layer in enumerate(layer_ids):
            report.results.append(compare(sid, str(layer), stored[:, slot * H:(slot + 1) * H], ref[str(layer)], tol))
        if layout.has_final:
            report.results.append(compare(sid, final_name, sample["final_hidden_states"].float(), ref["final"], tol))
        batch = padded.states(sid) if padded is not None else None
        if batch is not None:
            names = [(str(layer), str(layer)) for layer in layer_ids] + ([("final", final_name)] if layout.has_final
                                                                           else [])
            for key, name in names:
                noise = compare(sid, name, batch[key].float(), ref[key], tol)
                report.noise.append(NoiseResult(sid, name, noise.relative_error, noise.relative_l2_error))
    return empty

