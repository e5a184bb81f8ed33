"""Rows in, token ids and assistant-only loss masks out.

Accepted rows (one of; chat.py turns the first three into messages for the template):
- OpenAI style: `messages: [{role, content}]`, roles system/user/assistant/tool; content a string, a list of text
  parts, or null beside `tool_calls`; `reasoning_content` / `reasoning` on assistant turns; a `tools` column;
- ShareGPT style: `conversations: [{from, value}]`, from system/human/user/gpt/assistant/tool;
- SpecForge / speculators style: `conversations: [{role, content}]`;
- pre-tokenized: `input_ids: [int]`, optional `loss_mask: [0/1]` (all ones when absent).

A JSON/JSONL file that does not load as one Arrow table (a line that is not JSON, a row that is not an object,
bytes that are not UTF-8), or whose table would change what a row says (ids typed as floats, tool arguments typed
as structs), is read line by line instead: each line is one row, and a line that does not parse becomes a skipped
row. A source with no row, or parquet files that cannot be read or disagree on columns, is a RecipeError naming
the file (exit code 2).

Guarantees:
- every row of the source (after `max_samples`) ends up either kept or skipped with exactly one reason; none
  is dropped silently and none raises inside the loop (a bad row becomes a skip reason);
- `sample_id` is a stable, dot-free key derived from the row's position in the source (`{row:010d}`), so the
  same recipe always gives the same ids; the row's own id (if any) is kept as `source_id`;
- `input_ids` of a conversation are exactly the tokenization of the chat template's rendering
  (`apply_chat_template` with `data.chat_template_kwargs`); `loss_mask` is 1 exactly on the tokens the assistant
  generates (chat.py; docs/FORMAT.md states the convention), for any template;
- kept rows have 2 <= num_tokens <= max_length and at least two consecutive supervised tokens (DFlash trains
  on anchors p with p and p+1 supervised: a row without one is useless to it);
- `check_data_verdict` stops a run (exit code 2, before any model loads) that would keep no row or skip more than
  `data.max_skipped_fraction` of them.
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

from dflash_prep.data import chat
from dflash_prep.recipe.schema import DataSection, RecipeError

log = logging.getLogger(__name__)

# Skip reasons (stable strings: they appear in summaries, the manifest and skipped.jsonl).
SKIP_NO_CONTENT_FIELD = chat.NO_CONTENT_FIELD
SKIP_BAD_STRUCTURE = chat.BAD_STRUCTURE
SKIP_EMPTY = chat.EMPTY
SKIP_UNKNOWN_ROLE = chat.UNKNOWN_ROLE
SKIP_BAD_CONTENT = chat.BAD_CONTENT
SKIP_MEDIA_CONTENT = chat.MEDIA_CONTENT
SKIP_BAD_TOOL_CALLS = chat.BAD_TOOL_CALLS
SKIP_BAD_TOOLS = chat.BAD_TOOLS
SKIP_NO_ASSISTANT = chat.NO_ASSISTANT
SKIP_TEMPLATE_ERROR = chat.TEMPLATE_ERROR
SKIP_SPAN_NOT_FOUND = chat.SPAN_NOT_FOUND
SKIP_BAD_TOKEN_IDS = "bad_input_ids"
SKIP_OUT_OF_VOCAB = "token_id_out_of_vocab"
SKIP_BAD_LOSS_MASK = "bad_loss_mask"
SKIP_TOO_LONG = "longer_than_max_length"
SKIP_TOO_SHORT = "fewer_than_2_tokens"
SKIP_NO_SUPERVISED_PAIR = "no_two_consecutive_supervised_tokens"
SKIP_INVALID_JSON = "invalid_json"
SKIP_NOT_AN_OBJECT = "row_not_an_object"
SKIP_INVALID_UTF8 = "invalid_utf8"  # a line whose bytes are not UTF-8, or a string with a lone surrogate
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


INVALID_UTF8_LINE = "\x00invalid utf-8\x00"  # stands for a line whose bytes are not UTF-8 (no JSON text is this)


def _load_json_lines(files: list[str]):
    """JSON/JSONL files as one string column, one row per line (per element of a top-level JSON array). A line whose
    bytes are not UTF-8 becomes `INVALID_UTF8_LINE` (a skipped row), never text with U+FFFD in it."""
    import datasets

    raw = []
    for name in files:
        data = Path(name).read_bytes()
        data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
        if Path(name).suffix == ".json":
            try:
                whole = json.loads(data.decode("utf-8"))
            except (ValueError, RecursionError):
                whole = None
            if isinstance(whole, list):
                raw += [json.dumps(row) for row in whole]
                continue
        for line in data.split(b"\n"):  # JSON Lines: only \n ends a line
            if line.strip():
                try:
                    raw.append(line.decode("utf-8"))
                except UnicodeDecodeError:
                    raw.append(INVALID_UTF8_LINE)
    return datasets.Dataset.from_dict({RAW_JSON_COLUMN: raw}, features=datasets.Features(
        {RAW_JSON_COLUMN: datasets.Value("string")}))


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


def _check_parquet_files(files: list[str]) -> None:
    """Fail (RecipeError naming the file) on a parquet file that cannot be read or whose columns differ from the
    first file's; reads the footers only."""
    import pyarrow.parquet as pq

    first = None
    for name in files:
        try:
            names = pq.read_schema(name).names
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: all mean "not readable"
            raise RecipeError(f"recipe key `data.path`: {name} is not a readable parquet file "
                              f"({type(e).__name__}: {str(e)[:120]})") from None
        if first is None:
            first = (name, names)
        elif sorted(names) != sorted(first[1]):
            raise RecipeError(f"recipe key `data.path`: {name} has columns {sorted(names)}, {first[0]} has "
                              f"{sorted(first[1])}; all files of one dataset need the same columns")


def _table_is_lossy(ds) -> str | None:
    """What a JSON file loaded as one Arrow table lost of what a row said, or None: token ids or masks typed as
    floats (one 5.5 or 2**64 in a file turns every id into a float), or tool schemas and call arguments typed as
    structs (Arrow unions the keys of all rows and fills the missing ones with null, which the template would
    render)."""
    import datasets

    def float_list(feature) -> bool:
        inner = getattr(feature, "feature", None)
        return inner is not None and not (isinstance(inner, datasets.Value) and "int" in inner.dtype)

    features = ds.features
    if any(c in features and float_list(features[c]) for c in ("input_ids", "loss_mask")):
        return "token ids or masks typed as floats"
    if "tools" in features and not isinstance(features["tools"], datasets.Value):
        return "tool schemas typed as a table column, not JSON strings"
    turns = repr(features.get("messages", features.get("conversations")))
    if "tool_calls" in turns and not re.search(r"'arguments': Value\('(large_)?string'\)", turns):
        return "tool-call arguments typed as a table column, not JSON strings"
    return None


def load_rows(section: DataSection):
    """Load the raw rows as a `datasets.Dataset` (first `max_samples` rows only).

    Raises RecipeError (one line, naming the file) for a source without any row and for parquet files that cannot
    be read or disagree on columns; a JSON file whose table would lose information is read line by line."""
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
        ds = _load_json(section, source)
    else:
        if kind == "parquet":
            _check_parquet_files(source)
        try:
            ds = datasets.load_dataset(kind, data_files=source, split="train")
        except Exception as e:  # noqa: BLE001 - a file datasets cannot read is a bad input, not a crash
            raise RecipeError(f"recipe key `data.path` = {section.path!r}: cannot read {kind} files {source[:3]}"
                              f"{' ...' if len(source) > 3 else ''} ({type(e).__name__}: {str(e)[:160]})") from None
    if kind != "json" and (lost := _table_is_lossy(ds)):
        log.warning("data: %s: %s (%s)", section.path, lost,
                    "rows are read as typed" if "floats" in lost else
                    "keys one row lacks are null in it and the template renders them; store them as JSON strings, "
                    "or use JSON Lines")
    if len(ds) == 0:
        where = source if isinstance(source, str) else ", ".join(source[:3]) + (" ..." if len(source) > 3 else "")
        raise RecipeError(f"recipe key `data.path` = {section.path!r}: no rows in {where} (empty or blank lines only)")
    if section.max_samples is not None and section.max_samples < len(ds):
        ds = ds.select(range(section.max_samples))
    return ds


def _load_json(section: DataSection, files: list[str]):
    """JSON/JSONL files as one table when that is exact, else line by line (see `_table_is_lossy`)."""
    import datasets

    if all(os.path.getsize(f) == 0 for f in files):
        return _load_json_lines(files)
    try:
        if not _lines_are_objects(files):
            raise ValueError("a line is not a JSON object")
        ds = datasets.load_dataset("json", data_files=files, split="train")
    except (ValueError, TypeError, datasets.exceptions.DatasetGenerationError) as e:
        log.warning("data: %s does not load as one table (%s: %s); reading it line by line, bad lines are "
                    "skipped with a reason", section.path, type(e).__name__, str(e)[:200])
        return _load_json_lines(files)
    if lost := _table_is_lossy(ds):
        log.info("data: %s: as one table it would have %s; reading it line by line so each row keeps its own "
                 "values", section.path, lost)
        return _load_json_lines(files)
    return ds


def has_supervised_pair(loss_mask) -> bool:
    """True when some p has loss_mask[p] == loss_mask[p+1] == 1."""
    return any(a and b for a, b in zip(loss_mask, loss_mask[1:]))


def _is_int_list(values: Any, allowed: tuple[int, ...] | None = None) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and (allowed is None or v in allowed) for v in values)


def _has_lone_surrogate(row: dict) -> bool:
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@dataclass
class Tokenizer:
    """Row -> tokenized record; a picklable callable for `datasets.map(batched=True, with_indices=True)`.

    `chat_template`: the template text replacing the tokenizer's own (`data.chat_template`, already read)."""

    tokenizer: Any
    max_length: int
    overlong: str
    vocab_size: int
    id_column: str | None = None
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    rules_version: int = 2  # part of the `datasets.map` cache key: bump when tokenization or masking rules change

    def __post_init__(self):
        self.renderer = chat.ChatRenderer(self.tokenizer, self.chat_template, self.chat_template_kwargs)

    def tokenize_row(self, row: dict) -> tuple[list[int], list[int], str]:
        """-> (input_ids, loss_mask, skip_reason); skip_reason is "" for a kept row."""
        if row.get("input_ids") is not None and row.get("messages") is None and row.get("conversations") is None:
            ids = row["input_ids"]
            if not _is_int_list(ids):
                return [], [], SKIP_BAD_TOKEN_IDS
            mask = row.get("loss_mask")
            if mask is None:
                mask = [1] * len(ids)
            elif not _is_int_list(mask, (0, 1)) or len(mask) != len(ids):
                return [], [], SKIP_BAD_LOSS_MASK
        else:
            try:
                ids, mask = self.renderer.tokenize(*chat.row_to_chat(row))
            except chat.SkipRow as e:
                if e.__cause__ is not None:
                    log.debug("chat template failed on a row: %s", e.__cause__)
                return [], [], e.args[0]
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
        """-> (row, "") or ({}, skip reason) for a line that is not a JSON object, or not UTF-8."""
        if columns == [RAW_JSON_COLUMN]:
            line = batch[RAW_JSON_COLUMN][j]
            if line == INVALID_UTF8_LINE:
                return {}, SKIP_INVALID_UTF8
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                return {}, SKIP_INVALID_JSON
            if not isinstance(row, dict):
                return {}, SKIP_NOT_AN_OBJECT
            if ("\\ud" in line or "\\uD" in line) and _has_lone_surrogate(row):
                return {}, SKIP_INVALID_UTF8
            return row, ""
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


def check_chat_template(tokenizer, chat_template: str | None = None) -> None:
    """Fail early when conversations cannot be rendered: neither `data.chat_template` nor the tokenizer has a
    template. Any template works otherwise (chat.py locates the assistant text; `{% generation %}` optional)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise RecipeError("recipe key `model.tokenizer`: the tokenizer has no chat template; conversations cannot "
                          "be tokenized (set `data.chat_template` to a template file or string, or use "
                          "pre-tokenized rows with `input_ids`/`loss_mask`)")
    _check_template_syntax(template, "data.chat_template" if chat_template else "model.tokenizer")


def check_recipe_chat_template(section: DataSection) -> None:
    """A `data.chat_template` the recipe gives must compile, whatever the rows turn out to be (RecipeError naming
    the key and the template's line): checked before the run claims its output folder."""
    template = read_chat_template(section)
    if template:
        _check_template_syntax(template, "data.chat_template")


def _check_template_syntax(template: str, key: str) -> None:
    """A Jinja syntax error is one line naming the key and the template's line, before any row is rendered
    (else every row would be skipped as `chat_template_error` without the reason). Compiled as transformers
    compiles chat templates (its `{% generation %}` extension included)."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers layout: the rows' own rendering still reports errors
        return
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise RecipeError(f"recipe key `{key}`: the chat template is not valid Jinja (line {e.lineno}: "
                          f"{e.message})") from None


@dataclass
class TokenizedData:
    """The tokenized dataset split into what is kept and what was skipped."""

    kept: Any  # datasets.Dataset with TOKENIZED_COLUMNS
    num_rows: int
    skipped_counts: dict[str, int]
    skipped_rows: list[dict]  # [{sample_id, source_row, source_id, reason}]


def tokenize_dataset(rows, tokenizer, section: DataSection, vocab_size: int) -> TokenizedData:
    """Tokenize every row through `datasets.map` (cached on disk; call on the main process first)."""
    template = read_chat_template(section)
    needs_template = "messages" in rows.column_names or "conversations" in rows.column_names or (
        rows.column_names == [RAW_JSON_COLUMN]
        and any('"messages"' in r or '"conversations"' in r for r in rows[RAW_JSON_COLUMN]))
    if needs_template:
        check_chat_template(tokenizer, template)
    fn = Tokenizer(tokenizer=tokenizer, max_length=section.max_length, overlong=section.overlong,
                   vocab_size=vocab_size, id_column=section.id_column,
                   chat_template_kwargs=dict(section.chat_template_kwargs), chat_template=template)
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


def read_chat_template(section: DataSection) -> str | None:
    """`data.chat_template` as template text (the file read), or None. Raises RecipeError naming the key."""
    try:
        return chat.load_chat_template(section.chat_template)
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"recipe key `data.chat_template` = {section.chat_template!r}: cannot read it as a "
                          f"template file ({type(e).__name__}: {e})") from None


class NothingToExtractError(RecipeError):
    """The data would give an empty or mostly skipped run (exit code 2, before any model loads)."""


def check_data_verdict(data: TokenizedData, section: DataSection) -> str:
    """The one-line verdict on the tokenized data. Raises NothingToExtractError when no row is kept (a row whose
    mask is all zero is never kept: `no_two_consecutive_supervised_tokens`), or when more than
    `data.max_skipped_fraction` of the rows were skipped; the message names the top skip reasons, each with an
    example row (sample id and the row's own id)."""
    num_skipped = sum(data.skipped_counts.values())
    fraction = num_skipped / max(data.num_rows, 1)
    problem = None
    if len(data.kept) == 0:
        problem = f"no row kept: all {data.num_rows} skipped"
    elif fraction > section.max_skipped_fraction:
        problem = (f"{num_skipped} of {data.num_rows} rows skipped ({fraction:.0%}), more than "
                   f"data.max_skipped_fraction={section.max_skipped_fraction}")
    verdict = f"{data.num_rows} rows: {len(data.kept)} kept, {num_skipped} skipped"
    if problem is None:
        return verdict
    example = {}
    for r in data.skipped_rows:
        example.setdefault(r["reason"], r)
    top = sorted(data.skipped_counts.items(), key=lambda kv: -kv[1])[:3]
    reasons = "; ".join(f"{reason}: {n} (e.g. row {example[reason]['sample_id']}"
                        + (f", id {example[reason]['source_id']!r}" if example[reason]["source_id"] is not None else "")
                        + ")" for reason, n in top)
    raise NothingToExtractError(f"{problem}{' - ' + reasons if reasons else ''}. Nothing was extracted; see "
                                f"`dflash-prep plan --show-sample N` for how a row is tokenized and masked")

