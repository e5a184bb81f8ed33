"""Rows in, token ids and assistant-only loss masks out.

Accepted rows (one of):
- OpenAI style: `messages: [{role, content}]`, roles system/user/assistant/tool;
- ShareGPT style: `conversations: [{from, value}]`, from system/human/user/gpt/assistant/tool;
- pre-tokenized: `input_ids: [int]`, optional `loss_mask: [0/1]` (all ones when absent).

A JSON/JSONL file that does not load as one Arrow table (a line that is not JSON, a row that is not an object)
is read line by line instead: each line is one row, and a line that does not parse becomes a skipped row.

Guarantees:
- every row of the source (after `max_samples`) ends up either kept or skipped with exactly one reason; none
  is dropped silently and none raises inside the loop (a bad row becomes a skip reason);
- `sample_id` is a stable, dot-free key derived from the row's position in the source (`{row:010d}`), so the
  same recipe always gives the same ids; the row's own id (if any) is kept as `source_id`;
- `loss_mask` is 1 exactly on the tokens the chat template marks with `{% generation %}` (assistant text);
- kept rows have 2 <= num_tokens <= max_length and at least two consecutive supervised tokens (DFlash trains
  on anchors p with p and p+1 supervised: a row without one is useless to it).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .recipe import DataSection, RecipeError

log = logging.getLogger(__name__)

ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "tool": "tool", "function": "tool"}

# Skip reasons (stable strings: they appear in summaries, the manifest and skipped.jsonl).
SKIP_NO_CONTENT_FIELD = "no_messages_conversations_or_input_ids"
SKIP_BAD_STRUCTURE = "malformed_conversation"
SKIP_EMPTY = "empty_conversation"
SKIP_UNKNOWN_ROLE = "unknown_role"
SKIP_BAD_CONTENT = "non_string_content"
SKIP_NO_ASSISTANT = "no_assistant_turn"
SKIP_TEMPLATE_ERROR = "chat_template_error"
SKIP_BAD_TOKEN_IDS = "bad_input_ids"
SKIP_OUT_OF_VOCAB = "token_id_out_of_vocab"
SKIP_BAD_LOSS_MASK = "bad_loss_mask"
SKIP_TOO_LONG = "longer_than_max_length"
SKIP_TOO_SHORT = "fewer_than_2_tokens"
SKIP_NO_SUPERVISED_PAIR = "no_two_consecutive_supervised_tokens"
SKIP_INVALID_JSON = "invalid_json"
SKIP_NOT_AN_OBJECT = "row_not_an_object"
SKIP_ROW_ERROR = "unreadable_row"  # anything else that goes wrong on one row (logged at debug level)

RAW_JSON_COLUMN = "__dflash_prep_raw_json__"  # the one column of a JSON file read line by line

TOKENIZED_COLUMNS = ("sample_id", "source_row", "source_id", "input_ids", "loss_mask", "num_tokens", "skip_reason")


def _tokenized_features():
    """Fixed output types of the tokenize map: inferred types would break on a first batch of skipped rows."""
    from datasets import Features, List, Value

    return Features({"sample_id": Value("string"), "source_row": Value("int64"), "source_id": Value("string"),
                     "input_ids": List(Value("int32")), "loss_mask": List(Value("int64")),
                     "num_tokens": Value("int64"), "skip_reason": Value("string")})


def _detect_format(path: str, fmt: str) -> tuple[str, Any]:
    """-> (kind, data_files or path) with kind in json/parquet/arrow/disk/hub."""
    if fmt == "hub":
        return "hub", path
    p = Path(path)
    if fmt == "disk" or (fmt == "auto" and p.is_dir() and (
            (p / "dataset_info.json").exists() or (p / "state.json").exists() or (p / "dataset_dict.json").exists())):
        if not p.is_dir():
            raise RecipeError(f"recipe key `data.path` = {path!r}: `data.format: disk` needs a save_to_disk folder")
        return "disk", path
    if p.is_dir():
        files = sorted(f for f in glob.glob(str(p / "**" / "*"), recursive=True) if os.path.isfile(f))
    elif any(c in path for c in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    elif p.is_file():
        files = [path]
    elif (fmt in ("auto",) and "/" in path and not path.startswith((".", "/", "~"))
          and Path(path).suffix not in (".jsonl", ".json", ".parquet", ".arrow")):
        return "hub", path
    else:
        raise RecipeError(f"recipe key `data.path` = {path!r}: no such file or folder (for a hub dataset set "
                          f"`data.format: hub`)")
    by_suffix = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
    kinds = {by_suffix.get(Path(f).suffix) for f in files} - {None}
    if fmt != "auto":
        kinds = {fmt}
    if not files or len(kinds) != 1:
        raise RecipeError(f"recipe key `data.path` = {path!r}: found {len(files)} files with formats "
                          f"{sorted(k for k in kinds if k)}; expected .jsonl/.json/.parquet/.arrow files of one "
                          f"kind (or set `data.format`)")
    files = [f for f in files if fmt != "auto" or Path(f).suffix in by_suffix]
    return kinds.pop(), files


def check_data_source(section: DataSection) -> None:
    """Fail (RecipeError naming the key) when `data.path`/`data.format` cannot be read; cheap, no loading."""
    _detect_format(section.path, section.format)


def _load_json_lines(files: list[str]):
    """JSON/JSONL files as one string column, one row per line (per element of a top-level JSON array)."""
    import datasets

    raw = []
    for name in files:
        text = Path(name).read_text(encoding="utf-8-sig", errors="replace")
        if Path(name).suffix == ".json":
            try:
                whole = json.loads(text)
            except (ValueError, RecursionError):
                whole = None
            if isinstance(whole, list):
                raw += [json.dumps(row) for row in whole]
                continue
        raw += [line for line in text.split("\n") if line.strip()]  # JSON Lines: only \n ends a line
    return datasets.Dataset.from_dict({RAW_JSON_COLUMN: raw})


_LINE_NOT_AN_OBJECT = re.compile(rb"^[ \t\r\f\v]*[^\s{]", re.MULTILINE)


def _lines_are_objects(files: list[str], chunk_bytes: int = 16 << 20) -> bool:
    """True when every non-blank line of the JSON Lines files starts with `{` (a file that is one JSON array is
    left to the loader). A byte scan at C speed, no parsing: pyarrow's JSON reader kills the process (segfault,
    pyarrow 26) on a `null` line, so a file holding one must never reach it."""
    for name in files:
        with open(name, "rb") as f:
            data = f.read(max(chunk_bytes, 1 << 16))
            if data.startswith(b"\xef\xbb\xbf"):
                data = data[3:]
            if data.lstrip()[:1] == b"[":
                continue
            if Path(name).suffix == ".json":  # JSON Lines only if its first line is a whole object by itself
                try:
                    json.loads(data.lstrip().split(b"\n", 1)[0])
                except (ValueError, RecursionError):
                    continue  # one (pretty-printed) JSON document: the loader reads it whole
            while data:
                more = f.read(chunk_bytes)
                end = len(data) if not more else data.rfind(b"\n") + 1  # whole lines only, the rest carries over
                # Fast path (GB/s): every line of the chunk starts with `{` right away; else the exact regex.
                newlines = data.count(b"\n", 0, end) - (end > 0 and data[end - 1:end] == b"\n")
                if not (end == 0 or (data[:1] == b"{" and data.count(b"\n{", 0, end) == newlines)):
                    if _LINE_NOT_AN_OBJECT.search(data, 0, end):
                        return False
                data = data[end:] + more
    return True


def load_rows(section: DataSection):
    """Load the raw rows as a `datasets.Dataset` (first `max_samples` rows only)."""
    import datasets

    kind, source = _detect_format(section.path, section.format)
    if kind == "disk":
        ds = datasets.load_from_disk(source)
        if isinstance(ds, datasets.DatasetDict):
            if section.split not in ds:
                raise RecipeError(f"recipe key `data.split` = {section.split!r}: the dataset has splits {list(ds)}")
            ds = ds[section.split]
    elif kind == "hub":
        ds = datasets.load_dataset(source, split=section.split)
    elif kind == "json":
        try:
            if not _lines_are_objects(source):
                raise ValueError("a line is not a JSON object")
            ds = datasets.load_dataset(kind, data_files=source, split="train")
        except (ValueError, TypeError, datasets.exceptions.DatasetGenerationError) as e:
            log.warning("data: %s does not load as one table (%s: %s); reading it line by line, bad lines are "
                        "skipped with a reason", section.path, type(e).__name__, str(e)[:200])
            ds = _load_json_lines(source)
    else:
        ds = datasets.load_dataset(kind, data_files=source, split="train")
    if section.max_samples is not None and section.max_samples < len(ds):
        ds = ds.select(range(section.max_samples))
    return ds


def _normalize_messages(row: dict) -> tuple[list[dict] | None, str]:
    """-> (messages, "") or (None, skip reason)."""
    if row.get("messages") is not None:
        raw, role_key, text_key = row["messages"], "role", "content"
    elif row.get("conversations") is not None:
        raw, role_key, text_key = row["conversations"], "from", "value"
    else:
        return None, SKIP_NO_CONTENT_FIELD
    if not isinstance(raw, list):
        return None, SKIP_BAD_STRUCTURE
    if not raw:
        return None, SKIP_EMPTY
    messages = []
    for turn in raw:
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            return None, SKIP_BAD_STRUCTURE
        role = ROLE_ALIASES.get(turn[role_key]) if isinstance(turn[role_key], str) else None
        if role is None:
            return None, SKIP_UNKNOWN_ROLE
        if not isinstance(turn[text_key], str):
            return None, SKIP_BAD_CONTENT
        messages.append({"role": role, "content": turn[text_key]})
    if not any(m["role"] == "assistant" for m in messages):
        return None, SKIP_NO_ASSISTANT
    return messages, ""


def has_supervised_pair(loss_mask) -> bool:
    """True when some p has loss_mask[p] == loss_mask[p+1] == 1."""
    return any(a and b for a, b in zip(loss_mask, loss_mask[1:]))


@dataclass
class Tokenizer:
    """Row -> tokenized record; a picklable callable for `datasets.map(batched=True, with_indices=True)`."""

    tokenizer: Any
    max_length: int
    overlong: str
    vocab_size: int
    id_column: str | None = None
    chat_template_kwargs: dict | None = None

    def tokenize_row(self, row: dict) -> tuple[list[int], list[int], str]:
        """-> (input_ids, loss_mask, skip_reason); skip_reason is "" for a kept row."""
        if row.get("input_ids") is not None and row.get("messages") is None and row.get("conversations") is None:
            ids = row["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                return [], [], SKIP_BAD_TOKEN_IDS
            mask = row.get("loss_mask")
            if mask is None:
                mask = [1] * len(ids)
            elif (not isinstance(mask, list) or len(mask) != len(ids)
                  or not all(m in (0, 1) and not isinstance(m, float) for m in mask)):
                return [], [], SKIP_BAD_LOSS_MASK
        else:
            messages, reason = _normalize_messages(row)
            if reason:
                return [], [], reason
            try:
                out = self.tokenizer.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                    **(self.chat_template_kwargs or {}))
            except Exception as e:  # a template may reject a role order etc.: skip that row, with its reason
                log.debug("chat template failed on a row: %s", e)
                return [], [], SKIP_TEMPLATE_ERROR
            ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        if any(t < 0 or t >= self.vocab_size for t in ids):
            return [], [], SKIP_OUT_OF_VOCAB
        if len(ids) > self.max_length:
            if self.overlong == "skip":
                return [], [], SKIP_TOO_LONG
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if len(ids) < 2:
            return [], [], SKIP_TOO_SHORT
        if not has_supervised_pair(mask):
            return [], [], SKIP_NO_SUPERVISED_PAIR
        return [int(t) for t in ids], [int(m) for m in mask], ""

    def _row_of(self, batch: dict, columns: list[str], j: int) -> tuple[dict, str]:
        """-> (row, "") or ({}, skip reason) for a line that is not a JSON object."""
        if columns == [RAW_JSON_COLUMN]:
            try:
                row = json.loads(batch[RAW_JSON_COLUMN][j])
            except (ValueError, RecursionError):
                return {}, SKIP_INVALID_JSON
            return (row, "") if isinstance(row, dict) else ({}, SKIP_NOT_AN_OBJECT)
        return {c: batch[c][j] for c in columns}, ""

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = {k: [] for k in TOKENIZED_COLUMNS}
        columns = list(batch)
        for j, row_index in enumerate(indices):
            row, reason = self._row_of(batch, columns, j)
            ids, mask = [], []
            if not reason:
                try:
                    ids, mask, reason = self.tokenize_row(row)
                except Exception as e:  # noqa: BLE001 - one bad row never ends the run: it is skipped, with a reason
                    log.debug("row %d: %s: %s", row_index, type(e).__name__, e)
                    ids, mask, reason = [], [], SKIP_ROW_ERROR
            source_id = row.get(self.id_column or "id")
            if isinstance(source_id, (dict, list)):
                source_id = json.dumps(source_id, sort_keys=True)
            out["sample_id"].append(f"{row_index:010d}")
            out["source_row"].append(int(row_index))
            out["source_id"].append(None if source_id is None else str(source_id))
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["num_tokens"].append(len(ids))
            out["skip_reason"].append(reason)
        return out


def check_chat_template(tokenizer) -> None:
    """Fail early when the tokenizer cannot produce an assistant mask (the mask would be silently all zero)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise RecipeError("recipe key `model.tokenizer`: the tokenizer has no chat template; conversations cannot "
                          "be tokenized (use pre-tokenized rows with `input_ids`/`loss_mask`, or a tokenizer with "
                          "a template)")
    if "generation" not in template:
        raise RecipeError("recipe key `model.tokenizer`: the chat template has no {% generation %} block, so the "
                          "assistant loss mask would be all zero; use a template that wraps assistant text in "
                          "{% generation %}...{% endgeneration %}")


@dataclass
class TokenizedData:
    """The tokenized dataset split into what is kept and what was skipped."""

    kept: Any  # datasets.Dataset with TOKENIZED_COLUMNS
    num_rows: int
    skipped_counts: dict[str, int]
    skipped_rows: list[dict]  # [{sample_id, source_row, source_id, reason}]


def tokenize_dataset(rows, tokenizer, section: DataSection, vocab_size: int) -> TokenizedData:
    """Tokenize every row through `datasets.map` (cached on disk; call on the main process first)."""
    needs_template = "messages" in rows.column_names or "conversations" in rows.column_names or (
        rows.column_names == [RAW_JSON_COLUMN]
        and any('"messages"' in r or '"conversations"' in r for r in rows[RAW_JSON_COLUMN]))
    if needs_template:
        check_chat_template(tokenizer)
    fn = Tokenizer(tokenizer=tokenizer, max_length=section.max_length, overlong=section.overlong,
                   vocab_size=vocab_size, id_column=section.id_column,
                   chat_template_kwargs=dict(section.chat_template_kwargs))
    try:
        tokenized = rows.map(fn, batched=True, batch_size=256, with_indices=True, remove_columns=rows.column_names,
                             num_proc=section.num_proc, desc="tokenize", features=_tokenized_features())
    except Exception as e:  # noqa: BLE001 - datasets can load a JSON table it then fails to decode (odd keys)
        kind, files = _detect_format(section.path, section.format)
        if kind != "json" or rows.column_names == [RAW_JSON_COLUMN]:
            raise
        log.warning("data: %s loads as a table whose rows cannot be decoded (%s: %s); reading it line by line",
                    section.path, type(e).__name__, str(e)[:200])
        rows = _load_json_lines(files)
        if section.max_samples is not None and section.max_samples < len(rows):
            rows = rows.select(range(section.max_samples))
        return tokenize_dataset(rows, tokenizer, section, vocab_size)
    reasons = tokenized["skip_reason"]
    reasons = list(reasons)
    counts = Counter(r for r in reasons if r)
    skipped_idx = [i for i, r in enumerate(reasons) if r]
    skipped_rows = []
    if skipped_idx:
        sub = tokenized.select(skipped_idx).select_columns(["sample_id", "source_row", "source_id", "skip_reason"])
        skipped_rows = [{"sample_id": r["sample_id"], "source_row": r["source_row"], "source_id": r["source_id"],
                         "reason": r["skip_reason"]} for r in sub]
    kept_idx = [i for i, r in enumerate(reasons) if not r]
    kept = tokenized.select(kept_idx) if skipped_idx else tokenized
    return TokenizedData(kept=kept, num_rows=len(tokenized), skipped_counts=dict(sorted(counts.items())),
                         skipped_rows=skipped_rows)


def write_skipped(path: Path, skipped_rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in skipped_rows:
            f.write(json.dumps(row) + "\n")
