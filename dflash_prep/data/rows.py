"""Rows in, token ids and assistant-only loss masks out.

Accepted rows (one of; chat.py turns the conversations into OpenAI messages for the template, docs/FORMAT.md lists
every shape):
- OpenAI style: `messages: [{role, content}]`, roles system/user/assistant/tool (and the legacy `function` role and
  `function_call`); content a string, a list of text parts or Anthropic blocks, or null beside `tool_calls`;
  `reasoning_content` / `reasoning` / `thinking` on assistant turns; a `tools` (or `functions`) column; `messages`
  may be a JSON string;
- ShareGPT style: `conversations: [{from, value}]`, from system/human/user/gpt/assistant/tool and LLaMA-Factory's
  function_call/observation;
- SpecForge / speculators style: `conversations: [{role, content}]`;
- any of these with a per-turn `weight` (0: the turn is not supervised) and a `system` column;
- pre-tokenized: `input_ids: [int]`, optional `loss_mask: [0/1]` (all ones when absent).

A JSON/JSONL file that does not load as one Arrow table (a line that is not JSON, a row that is not an object,
bytes that are not UTF-8), or whose table would change what a row says (ids typed as floats, tool arguments typed
as structs), is read line by line instead: each line is one row, and a line that does not parse becomes a skipped
row. A source with no row, or parquet files that cannot be read or disagree on columns, is a RecipeError naming
the file (exit code 2).

Guarantees:
- every row of the source (after `max_samples`) ends up either kept or skipped with exactly one reason and a
  detail (the turn and field at fault, or the template's error); none is dropped silently and none raises inside
  the loop (a bad row becomes a skip reason);
- `sample_id` is a stable, dot-free key derived from the row's position in the source (`{row:010d}`), so the
  same recipe always gives the same ids; the row's own id (if any) is kept as `source_id`;
- `input_ids` of a conversation are exactly the tokenization of the chat template's rendering
  (`apply_chat_template` with `data.chat_template_kwargs`); `loss_mask` is 1 exactly on the tokens the assistant
  generates (chat.py; docs/FORMAT.md states the convention), for any template;
- kept rows have 2 <= num_tokens <= max_length and at least two consecutive supervised tokens (DFlash trains
  on anchors p with p and p+1 supervised: a row without one is useless to it);
- `check_data_verdict` stops a run (exit code 2, before any model loads) that would keep no row or skip more than
  `data.max_skipped_fraction` of them, and warns (stops, with `data.strict`) when every row with tool calls, or
  every row with reasoning, is skipped or kept without them in its rendering;
- every row format goes through `datasets.map` with an on-disk cache, so a second plan or a resume reads the
  tokenized rows back instead of tokenizing again; the cache of local files is keyed on their content (the sha256
  of their bytes: `_content_cache_dir`; a JSON file read line by line is first written as an Arrow file under the
  same key), so a file edited in place, its modification time kept, is read again.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_prep.data import chat, conversation, samples
from dflash_prep.io import fsync_dir
from dflash_prep.recipe.fingerprints import files_sha256
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
SKIP_UNSUPPORTED_BLOCK = chat.UNSUPPORTED_BLOCK
SKIP_BAD_WEIGHT = chat.BAD_WEIGHT
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

TOKENIZED_COLUMNS = ("sample_id", "source_row", "source_id", "input_ids", "loss_mask", "num_tokens", "skip_reason",
                     "skip_detail", "has_tool_calls", "has_reasoning", "renders_tool_calls", "renders_reasoning",
                     "sample_kind", "turns_from_ids", "turns_from_text", "turns_ids_differ", "turns_cut",
                     "conversation_tokens")
SAMPLE_COUNTS = ("turns_from_ids", "turns_from_text", "turns_ids_differ", "turns_cut")  # per row, on its 1st sample
ROW_KINDS = {"tool_calls": "tool calls", "reasoning": "reasoning"}  # kinds whose wholesale loss is loud


def _tokenized_features():
    """Fixed output types of the tokenize map: inferred types would break on a first batch of skipped rows."""
    from datasets import Features, List, Value

    return Features({"sample_id": Value("string"), "source_row": Value("int64"), "source_id": Value("string"),
                     "input_ids": List(Value("int32")), "loss_mask": List(Value("int64")),
                     "num_tokens": Value("int64"), "skip_reason": Value("string"), "skip_detail": Value("string"),
                     **{f"{what}_{kind}": Value("bool") for what in ("has", "renders") for kind in ROW_KINDS},
                     "sample_kind": Value("string"), **{k: Value("int64") for k in SAMPLE_COUNTS},
                     "conversation_tokens": Value("int64")})


def _detect_format(path: str | list[str], fmt: str) -> tuple[str, Any]:
    """-> (kind, data_files or path) with kind in json/parquet/arrow/disk/hub. A list of paths (files, folders or
    globs) gives the files of all, in order, of one kind; a file named twice is refused (its rows would repeat)."""
    if not isinstance(path, str):
        return _detect_formats(list(path), fmt)
    if fmt == "hub":
        return "hub", path
    p = Path(path)
    if fmt in ("auto", "disk") and p.is_dir() and _is_unfinished_regeneration(p):
        raise RecipeError(f"recipe key `data.path` = {path!r} is an unfinished regeneration output (its "
                          f"`state.json`, written last, is not there yet): finish it by re-running the "
                          f"`dflash-prep regenerate` command (or the recipe with its `regenerate:` section) that "
                          f"made it, which resumes; then give the folder as `data.path`")
    if fmt == "disk" or (fmt == "auto" and p.is_dir() and (
            (p / "dataset_info.json").exists() or (p / "state.json").exists() or (p / "dataset_dict.json").exists())):
        if not p.is_dir():
            raise RecipeError(f"recipe key `data.path` = {path!r}: `data.format: disk` needs a save_to_disk folder")
        return "disk", path
    if p.is_dir():
        _refuse_unfinished_regeneration(p, path)
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


def _refuse_unfinished_regeneration(folder: Path, path: str) -> None:
    """A `dflash-prep regenerate` output whose run has not finished (its dataset files, written last, are not there
    yet) is refused as what it is, not as a folder of mixed files (RecipeError, exit code 2)."""
    try:
        state = json.loads((folder / "run_state.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(state, dict) and "regenerated rows" in str(state.get("format", "")):
        raise RecipeError(f"recipe key `data.path` = {path!r}: an unfinished regeneration output (its run has not "
                          f"written the dataset files yet): finish it first (re-run the `dflash-prep regenerate` "
                          f"command that made it: it resumes), or run a recipe with a `regenerate:` section, which "
                          f"completes its regeneration before it extracts")


def _detect_formats(paths: list[str], fmt: str) -> tuple[str, list[str]]:
    """`_detect_format` of a list of paths."""
    kinds, files = set(), []
    for path in paths:
        kind, found = _detect_format(path, fmt)
        if kind in ("hub", "disk"):
            raise RecipeError(f"recipe key `data.path` = {paths!r}: {path!r} is a {kind} dataset; a list of paths "
                              f"takes files, folders of files or globs (give a {kind} dataset alone)")
        kinds.add(kind)
        files += found
    twice = sorted({f for f in files if files.count(f) > 1})
    if len(kinds) != 1 or twice:
        why = f"{twice[0]} is named twice (its rows would repeat)" if twice else \
            f"the files have formats {sorted(kinds)}; expected files of one kind (or set `data.format`)"
        raise RecipeError(f"recipe key `data.path` = {paths!r}: {why}")
    return kinds.pop(), files


def data_files(section: DataSection) -> list[str] | None:
    """The local files the rows are read from (a `save_to_disk` folder: `_disk_dataset_files`), None for a hub
    dataset."""
    kind, source = _detect_format(section.path, section.format)
    if kind == "hub":
        return None
    if kind == "disk":
        return _disk_dataset_files(Path(source))
    return list(source)


def _disk_dataset_files(folder: Path) -> list[str]:
    """The files `datasets.load_from_disk` reads from a `save_to_disk` folder: each split's state.json, its
    dataset_info.json and the Arrow files its state.json lists (+ dataset_dict.json). Not the folder's other files:
    a regenerated-rows folder also holds its own index, locks and logs, which change on every run of it (a lease's
    generation) while its rows do not. A folder whose state.json cannot be read: every file."""
    states = [folder / "state.json"] if (folder / "state.json").is_file() else sorted(folder.glob("*/state.json"))
    files = [folder / "dataset_dict.json"] if (folder / "dataset_dict.json").is_file() else []
    try:
        for state in states:
            listed = [entry["filename"] for entry in json.loads(state.read_text()).get("_data_files", [])]
            info = state.parent / "dataset_info.json"
            files += [state, *(state.parent / name for name in listed), *([info] if info.is_file() else [])]
    except (OSError, ValueError, KeyError, TypeError):
        files = []
    if not states or not files:
        return sorted(str(p) for p in folder.rglob("*") if p.is_file())
    return sorted(str(p) for p in files)


def content_memo_dir() -> Path | None:
    """Where the digests of data files are remembered (fingerprints.files_sha256): beside the datasets cache."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "dflash_prep_content" / "sha256"


def data_files_fingerprint(section: DataSection) -> dict | None:
    """{"files": {path: sha256 of its bytes}} of the local data files (fingerprints.files_sha256), None for a hub
    dataset (its revision keys it). The job identity's `data_files`: a file edited in place, its modification time
    kept or not, is a different job."""
    files = data_files(section)
    return None if files is None else {"files": files_sha256(files, content_memo_dir())}


def describe_data_files_change(previous: dict, current: dict) -> str:
    """One phrase naming how the data files differ, e.g. '/data/chat.jsonl: its bytes changed'."""
    a, b = previous.get("files", {}), current.get("files", {})
    if set(a) != set(b):
        return f"the files {sorted(a)[:5]} became {sorted(b)[:5]}"
    changed = [name for name in sorted(a) if a[name] != b[name]]
    return f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}: its bytes changed since the output was made"


def _content_key(files: list[str]) -> str:
    """A key of the files' content (their sha256s, in order), for the caches of their loaded rows."""
    digests = files_sha256(files, content_memo_dir())
    return hashlib.sha256(json.dumps([digests[str(f)] for f in files]).encode()).hexdigest()[:32]


def _content_cache_dir(files: list[str]) -> str | None:
    """`cache_dir` of `datasets.load_dataset` for `files`: a folder of the datasets cache keyed on their content,
    since datasets keys a local file's cache on its path and modification time only (an edit that keeps the
    mtime would read the old rows back). None with datasets' caching disabled."""
    import datasets

    if not datasets.is_caching_enabled():
        return None
    return str(Path(datasets.config.HF_DATASETS_CACHE) / "dflash_prep_content" / _content_key(files))


def check_data_source(section: DataSection) -> None:
    """Fail (RecipeError naming the key) when `data.path`/`data.format` cannot be read; cheap, no loading. A
    `save_to_disk` folder is checked whole here (`check_disk_folder`), so a damaged one is refused before any
    output is claimed."""
    kind, source = _detect_format(section.path, section.format)
    if kind == "disk":
        check_disk_folder(Path(source), section.path)


_REGEN_FORMAT = "dflash-prep regenerated rows"  # regen/output.py's run_state.json `format` (data/ may not import it)


def _is_unfinished_regeneration(folder: Path) -> bool:
    """A regeneration's output folder whose dataset files (`state.json`, written last) are not there yet."""
    if (folder / "state.json").exists() or (folder / "dataset_dict.json").exists():
        return False
    try:
        return json.loads((folder / "run_state.json").read_text()).get("format") == _REGEN_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_disk_folder(folder: Path, key_value) -> None:
    """RecipeError (one line, naming the file) unless `folder` is a whole `save_to_disk` folder: every split's
    `state.json` and `dataset_info.json` parse, and every Arrow file a `state.json` lists is there and opens as an
    Arrow stream (its schema is read, not its rows). What `datasets.load_from_disk` would otherwise meet later,
    after the output was claimed, as a traceback or a FileNotFoundError."""
    import pyarrow as pa

    def bad(why: str) -> RecipeError:
        return RecipeError(f"recipe key `data.path` = {key_value!r}: the save_to_disk folder is damaged or "
                           f"incomplete ({why}); regenerate it, or give the files it was made from")
    try:
        if (folder / "dataset_dict.json").is_file():
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
            states = [folder / str(split) / "state.json" for split in splits]
        else:
            states = [folder / "state.json"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise bad(f"{folder / 'dataset_dict.json'}: {type(e).__name__}: {e}") from None
    for state in states:
        info = state.parent / "dataset_info.json"
        for path in (state, *([info] if info.exists() else [])):
            try:
                content = json.loads(path.read_text())
                if path == state and not [str(entry["filename"]) for entry in content["_data_files"]]:
                    raise ValueError("it lists no data file")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise bad(f"{path}: {type(e).__name__}: {str(e)[:160]}") from None
        listed = [str(entry["filename"]) for entry in json.loads(state.read_text())["_data_files"]]
        for name in listed:
            arrow = state.parent / name
            try:
                with pa.memory_map(str(arrow)) as source:
                    pa.ipc.open_stream(source).schema
            except (OSError, pa.ArrowException) as e:
                raise bad(f"{arrow}, listed in {state.name}: {type(e).__name__}: {str(e)[:160]}") from None


INVALID_UTF8_LINE = "\x00invalid utf-8\x00"  # stands for a line whose bytes are not UTF-8 (no JSON text is this)


JSON_LINES_VERSION = 1  # part of the cache key of `_load_json_lines`: bump when the line splitting changes


def _load_json_lines(files: list[str]):
    """JSON/JSONL files as one string column, one row per line (per element of a top-level JSON array), as a
    `datasets.Dataset` backed by an Arrow file in the datasets cache (HF_DATASETS_CACHE/dflash_prep_json_lines/KEY/),
    so that the tokenize map over it is cached like any loaded table's: KEY is the files' content key
    (`_content_key`: the sha256 of their bytes, not their modification time), written once (`.tmp`, fsync, rename)
    and read back after. With datasets' caching disabled, an in-memory dataset."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    if not datasets.is_caching_enabled():
        return _json_lines_in_memory(files)
    key = hashlib.sha256(json.dumps([JSON_LINES_VERSION, _content_key(files)]).encode()).hexdigest()[:32]
    folder = Path(datasets.config.HF_DATASETS_CACHE) / "dflash_prep_json_lines" / key
    path = folder / "lines.arrow"
    if path.is_file():
        try:
            return datasets.Dataset.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - an unreadable cache file is rebuilt
            log.warning("data: cached lines %s unreadable (%s); reading %d file(s) again", path, e, len(files))
    ds = _json_lines_in_memory(files)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"lines.arrow.{os.getpid()}.tmp"
    writer = ArrowWriter(path=str(tmp), features=ds.features)
    writer.write_table(ds.data.table)
    writer.finalize()
    writer.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
    return datasets.Dataset.from_file(str(path))


def _json_lines_in_memory(files: list[str]):
    """`_load_json_lines`' rows as an in-memory dataset. A line whose bytes are not UTF-8 becomes
    `INVALID_UTF8_LINE` (a skipped row), never text with U+FFFD in it."""
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


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate_escape(data: bytes) -> bool:
    """Whether JSON text `data` escapes a UTF-16 surrogate that is not half of a pair (`\\ud800` alone). pyarrow's
    JSON reader drops such a character without a word (a row kept with its text changed), where the line reader
    skips the row as invalid UTF-8. An escaped backslash before `ud800` reads as one too: that costs only the line
    reader's speed."""
    if b"\\ud" not in data and b"\\uD" not in data:
        return False
    hits, i = list(_SURROGATE_ESCAPE.finditer(data)), 0
    while i < len(hits):
        high = hits[i].group()[3:4] in b"89abAB"
        if high and i + 1 < len(hits) and hits[i + 1].start() == hits[i].end() \
                and hits[i + 1].group()[3:4] not in b"89abAB":
            i += 2
            continue
        return True
    return False


def _lines_are_objects(files: list[str], chunk_bytes: int = 16 << 20) -> bool:
    """True when every non-blank line of the JSON Lines files starts with `{` (a file that is one JSON array is
    left to the loader) and no line escapes a lone UTF-16 surrogate (`_lone_surrogate_escape`). A byte scan at C
    speed, no parsing: pyarrow's JSON reader kills the process (segfault, pyarrow 26) on a `null` line, so a file
    holding one must never reach it."""
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
                if _lone_surrogate_escape(data[:end]):
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
        check_disk_folder(Path(source), section.path)
        try:
            ds = datasets.load_from_disk(source)
        except (OSError, ValueError, KeyError, TypeError) as e:  # a folder damaged since the check
            raise RecipeError(f"recipe key `data.path` = {section.path!r}: cannot read the save_to_disk folder "
                              f"({type(e).__name__}: {str(e)[:160]})") from None
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
            ds = datasets.load_dataset(kind, data_files=source, split="train", cache_dir=_content_cache_dir(source))
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
            raise ValueError("a line is not a JSON object, or escapes a lone UTF-16 surrogate")
        ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=_content_cache_dir(files))
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


def row_of(batch: dict, columns: list[str], j: int) -> tuple[dict, str, str]:
    """Row j of a column batch -> (row, "", "") or ({}, skip reason, detail) for a line read as raw JSON text
    (`RAW_JSON_COLUMN`) that is not a JSON object, or not UTF-8."""
    if columns == [RAW_JSON_COLUMN]:
        line = batch[RAW_JSON_COLUMN][j]
        if line == INVALID_UTF8_LINE:
            return {}, SKIP_INVALID_UTF8, "the line's bytes are not UTF-8"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            return {}, SKIP_INVALID_JSON, f"the line is not JSON ({conversation.one_line(e, 120)})"
        if not isinstance(row, dict):
            return {}, SKIP_NOT_AN_OBJECT, f"the line holds a JSON {conversation.type_name(row)}, not an object"
        if ("\\ud" in line or "\\uD" in line) and _has_lone_surrogate(row):
            # its scalar fields that encode (the id, to name the row in skipped.jsonl), nothing else
            scalars = {k: v for k, v in row.items() if isinstance(v, (str, int)) and not _has_lone_surrogate({k: v})}
            return scalars, SKIP_INVALID_UTF8, "a string holds a lone UTF-16 surrogate"
        return row, "", ""
    return {c: batch[c][j] for c in columns}, "", ""


@dataclass
class RowOutcome:
    """What one row became: token ids and loss mask ([T] ints; empty when skipped), the skip reason ("" when kept)
    and its detail, and which kinds of content the row holds and its rendering keeps (`ROW_KINDS`)."""

    input_ids: list[int]
    loss_mask: list[int]
    reason: str = ""
    detail: str = ""
    has_tool_calls: bool = False
    has_reasoning: bool = False
    renders_tool_calls: bool = False
    renders_reasoning: bool = False
    suffix: str = ""  # of the sample id: "" (the row's one sample), `_tNNNN` (a `per_turn` sample of turn NNNN)
    sample_kind: str = ""  # "conversation" | "per_turn" (conversation rows), "" (pre-tokenized or skipped rows)
    counts: dict = field(default_factory=dict)  # samples.RowSamples' turn counts, on a row's first sample only
    conversation_tokens: int = 0  # per_turn rows' first sample: the tokens of the row as one sample


def _skip(reason: str, detail: str, **kinds) -> RowOutcome:
    return RowOutcome([], [], reason, detail, **kinds)


_CODE_SHA256: list[str] = []


def tokenization_code_sha256() -> str:
    """sha256 of the source of the modules that turn rows into samples (dflash_prep/data/*.py), computed once: part
    of the `datasets.map` cache key (`Tokenizer.code_sha256`). datasets hashes the callable by reference to its
    class, not its code, so without it a new version of these modules would read back rows an older one tokenized
    (its skip details, its masks) from the cache."""
    if not _CODE_SHA256:
        digest = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        _CODE_SHA256.append(digest.hexdigest())
    return _CODE_SHA256[0]


@dataclass
class Tokenizer:
    """Row -> tokenized record; a picklable callable for `datasets.map(batched=True, with_indices=True)`.

    `chat_template`: the template text replacing the tokenizer's own (`data.chat_template`, already read);
    `stop_token_ids`: the model's stop ids (None: `stop_token_ids_of(tokenizer)`)."""

    tokenizer: Any
    max_length: int
    overlong: str
    vocab_size: int
    id_column: str | None = None
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    stop_token_ids: list[int] | None = None
    samples: str = "auto"  # data.samples (samples.py)
    rules_version: int = 4  # part of the `datasets.map` cache key: bump when tokenization or masking rules change
    code_sha256: str = field(default_factory=tokenization_code_sha256)  # so is the code's own source (above)

    def __post_init__(self):
        missing = None
        if self.stop_token_ids is None:
            self.stop_token_ids = stop_token_ids_of(self.tokenizer)
            missing = generation_config_missing(self.tokenizer)
        self.renderer = chat.ChatRenderer(self.tokenizer, self.chat_template, self.chat_template_kwargs,
                                          self.stop_token_ids, missing_stop_source=missing)
        self.builder = samples.SampleBuilder(self.renderer, self.samples, self.stop_token_ids)

    def tokenize_row(self, row: dict) -> tuple[list[int], list[int], str]:
        """-> (input_ids, loss_mask, skip_reason) of the row's first sample; skip_reason is "" for a kept row."""
        outcome = self.process_row(row)
        return outcome.input_ids, outcome.loss_mask, outcome.reason

    def process_row(self, row: dict) -> RowOutcome:
        """One row -> its first sample's RowOutcome (see `process_row_samples`)."""
        return self.process_row_samples(row)[0]

    def process_row_samples(self, row: dict) -> list[RowOutcome]:
        """One row -> a RowOutcome per sample (one, or one per supervised turn: `data.samples`); never raises
        SkipRow: a row that cannot be a sample is one skip with its detail."""
        if row.get("input_ids") is not None and row.get("messages") is None and row.get("conversations") is None:
            return [self._checked(*self._pretokenized(row))]
        try:
            conv = chat.read_conversation(row)
        except chat.SkipRow as e:
            return [_skip(e.reason, e.detail)]
        kinds = {"has_tool_calls": any(m.get("tool_calls") for m in conv.messages),
                 "has_reasoning": any((m.get("reasoning_content") or "").strip() for m in conv.messages)}
        try:
            built = self.builder.build(conv, samples.generated_turns(row))
        except chat.SkipRow as e:
            return [_skip(e.reason, e.detail, **kinds)]
        if not built.samples:
            return [_skip(SKIP_NO_SUPERVISED_PAIR, "no assistant turn is supervised", **kinds)]
        counts = {k: getattr(built, k) for k in SAMPLE_COUNTS}
        out = []
        for k, sample in enumerate(built.samples):
            outcome = self._checked(sample.input_ids, sample.loss_mask, "", "", renders_tool_calls=
                                    built.renders_tool_calls, renders_reasoning=built.renders_reasoning, **kinds)
            outcome.suffix, outcome.sample_kind = sample.suffix, built.mode
            if k == 0:
                outcome.counts = counts
                outcome.conversation_tokens = built.conversation_tokens if built.mode == "per_turn" else 0
            out.append(outcome)
        return out

    @staticmethod
    def _pretokenized(row: dict) -> tuple[list, list, str, str]:
        """A pre-tokenized row -> (ids, mask, skip reason, detail)."""
        ids, mask = row["input_ids"], row.get("loss_mask")
        if not isinstance(ids, list):
            return [], [], SKIP_BAD_TOKEN_IDS, f"`input_ids` is {conversation.type_name(ids)}, not a list"
        if not _is_int_list(ids):
            return [], [], SKIP_BAD_TOKEN_IDS, "`input_ids` holds a value that is not an integer"
        if mask is None:
            return ids, [1] * len(ids), "", ""
        if not _is_int_list(mask, (0, 1)):
            return [], [], SKIP_BAD_LOSS_MASK, "`loss_mask` is not a list of 0/1 integers"
        if len(mask) != len(ids):
            return [], [], SKIP_BAD_LOSS_MASK, f"`loss_mask` has {len(mask)} values for {len(ids)} ids"
        return ids, mask, "", ""

    def _checked(self, ids: list, mask: list, reason: str, detail: str, **kinds) -> RowOutcome:
        """The checks every row passes: ids in the vocabulary, length (truncated or skipped), a supervised pair."""
        if reason:
            return _skip(reason, detail, **kinds)
        bad = next((p for p, t in enumerate(ids) if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            return _skip(SKIP_OUT_OF_VOCAB, f"token id {ids[bad]} at position {bad} is outside "
                                             f"0..{self.vocab_size - 1}", **kinds)
        if len(ids) > self.max_length:
            if self.overlong == "skip":
                return _skip(SKIP_TOO_LONG, f"{len(ids)} tokens > data.max_length={self.max_length}", **kinds)
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if len(ids) < 2:
            return _skip(SKIP_TOO_SHORT, f"{len(ids)} token(s)", **kinds)
        if not has_supervised_pair(mask):
            return _skip(SKIP_NO_SUPERVISED_PAIR, f"{sum(mask)} of {len(ids)} tokens supervised, no two in a row",
                         **kinds)
        return RowOutcome([int(t) for t in ids], [int(m) for m in mask], **kinds)

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = {k: [] for k in TOKENIZED_COLUMNS}
        columns = list(batch)
        for j, row_index in enumerate(indices):
            row, reason, detail = row_of(batch, columns, j)
            outcomes = [_skip(reason, detail)]
            if not reason:
                try:
                    outcomes = self.process_row_samples(row)
                except Exception as e:  # noqa: BLE001 - one bad row never ends the run: it is skipped, with a reason
                    log.debug("row %d: %s: %s", row_index, type(e).__name__, e)
                    outcomes = [_skip(SKIP_ROW_ERROR, f"{type(e).__name__}: {conversation.one_line(e, 200)}")]
            source_id = row.get(self.id_column or "id")
            if isinstance(source_id, (dict, list)):
                source_id = json.dumps(source_id, sort_keys=True)
            for outcome in outcomes:
                self._append(out, f"{row_index:010d}{outcome.suffix}", row_index, source_id, outcome)
        return out

    @staticmethod
    def _append(out: dict, sample_id: str, row_index: int, source_id, outcome: RowOutcome) -> None:
        out["sample_id"].append(sample_id)
        out["source_row"].append(int(row_index))
        out["source_id"].append(None if source_id is None else str(source_id))
        out["input_ids"].append(outcome.input_ids)
        out["loss_mask"].append(outcome.loss_mask)
        out["num_tokens"].append(len(outcome.input_ids))
        out["skip_reason"].append(outcome.reason)
        out["skip_detail"].append(outcome.detail)
        for kind in ROW_KINDS:
            out[f"has_{kind}"].append(getattr(outcome, f"has_{kind}"))
            out[f"renders_{kind}"].append(getattr(outcome, f"renders_{kind}"))
        out["sample_kind"].append(outcome.sample_kind)
        for key in SAMPLE_COUNTS:
            out[key].append(int(outcome.counts.get(key, 0)))
        out["conversation_tokens"].append(int(outcome.conversation_tokens))


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
    num_rows: int  # rows of the data read (a row cut into per-turn samples counts once)
    skipped_counts: dict[str, int]
    skipped_rows: list[dict]  # [{sample_id, source_row, source_id, reason, detail}]
    # per kind of ROW_KINDS the rows hold: {rows, kept_rendered, kept_without, skipped: {reason: n}}
    kinds: dict[str, dict] = field(default_factory=dict)
    samples: dict = field(default_factory=dict)  # samples_summary
    num_sample_candidates: int | None = None  # samples the rows gave, kept + skipped (None: num_rows, one a row)

    @property
    def num_candidates(self) -> int:
        return self.num_rows if self.num_sample_candidates is None else self.num_sample_candidates


def stop_token_ids_of(tokenizer) -> list[int]:
    """The ids the model stops generating on: the `eos_token_id` (an int or a list) of the checkpoint's
    generation_config.json, read from the tokenizer's own folder or hub id (`model.tokenizer`, else
    `model.name_or_path`), and the tokenizer's `eos_token_id`. Sorted; [] when none is known."""
    ids = {tokenizer.eos_token_id} if isinstance(getattr(tokenizer, "eos_token_id", None), int) else set()
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    config: dict = {}
    try:
        if (Path(source) / "generation_config.json").is_file():
            config = json.loads((Path(source) / "generation_config.json").read_text())
        elif source and not Path(source).exists():
            from transformers import GenerationConfig

            config = GenerationConfig.from_pretrained(source).to_dict()
    except Exception as e:  # noqa: BLE001 - no generation config: the tokenizer's eos only
        log.debug("no generation config for %s: %s", source, e)
    eos = config.get("eos_token_id")
    ids |= {int(i) for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)}
    return sorted(ids)


def generation_config_missing(tokenizer) -> str | None:
    """The generation_config.json `stop_token_ids_of` looked for in the tokenizer's folder and did not find, or
    None (found, or a hub id, whose config the hub answers for)."""
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    if not source or not Path(source).is_dir():
        return None
    path = Path(source) / "generation_config.json"
    return None if path.is_file() else str(path)


def tokenize_dataset(rows, tokenizer, section: DataSection, vocab_size: int,
                     stop_token_ids: list[int] | None = None) -> TokenizedData:
    """Tokenize every row through `datasets.map` (cached on disk; call on the main process first).
    `stop_token_ids`: the model's stop ids (default: `stop_token_ids_of(tokenizer)`)."""
    template = read_chat_template(section)
    needs_template = "messages" in rows.column_names or "conversations" in rows.column_names or (
        rows.column_names == [RAW_JSON_COLUMN]
        and any('"messages"' in r or '"conversations"' in r for r in rows[RAW_JSON_COLUMN]))
    if needs_template:
        check_chat_template(tokenizer, template)
    fn = Tokenizer(tokenizer=tokenizer, max_length=section.max_length, overlong=section.overlong,
                   vocab_size=vocab_size, id_column=section.id_column,
                   chat_template_kwargs=dict(section.chat_template_kwargs), chat_template=template,
                   stop_token_ids=None if stop_token_ids is None else list(stop_token_ids), samples=section.samples)
    try:
        tokenized = rows.map(fn, batched=True, batch_size=256, with_indices=True, remove_columns=rows.column_names,
                             num_proc=section.num_proc, desc="tokenize", features=_tokenized_features(),
                             **_disk_map_cache(section, rows, fn))
    except Exception as e:  # noqa: BLE001 - datasets can load a JSON table it then fails to decode (odd keys)
        kind, files = _detect_format(section.path, section.format)
        if kind != "json" or rows.column_names == [RAW_JSON_COLUMN]:
            raise
        log.warning("data: %s loads as a table whose rows cannot be decoded (%s: %s); reading it line by line",
                    section.path, type(e).__name__, str(e)[:200])
        rows = _load_json_lines(files)
        if section.max_samples is not None and section.max_samples < len(rows):
            rows = rows.select(range(section.max_samples))
        return tokenize_dataset(rows, tokenizer, section, vocab_size, stop_token_ids)
    reasons = list(tokenized["skip_reason"])
    counts = Counter(r for r in reasons if r)
    skipped_idx = [i for i, r in enumerate(reasons) if r]
    skipped_rows = []
    if skipped_idx:
        sub = tokenized.select(skipped_idx).select_columns(["sample_id", "source_row", "source_id", "skip_reason",
                                                             "skip_detail"])
        skipped_rows = [{"sample_id": r["sample_id"], "source_row": r["source_row"], "source_id": r["source_id"],
                         "reason": r["skip_reason"], "detail": r["skip_detail"]} for r in sub]
    kept_idx = [i for i, r in enumerate(reasons) if not r]
    kept = tokenized.select(kept_idx) if skipped_idx else tokenized
    num_rows = len(tokenized.unique("source_row")) if len(tokenized) else 0  # per-turn samples share their row
    return TokenizedData(kept=kept, num_rows=num_rows, skipped_counts=dict(sorted(counts.items())),
                         skipped_rows=skipped_rows, kinds=_kinds_summary(tokenized, reasons),
                         samples=samples_summary(kept), num_sample_candidates=len(tokenized))


def samples_summary(tokenized) -> dict:
    """How the conversation rows of `tokenized` (the kept samples: a skipped row is counted as skipped, not here)
    became samples (`data.samples`): rows kept whole, rows cut into one sample per
    turn, those samples and the tokens they add over one sample per row; and the generated turns of regenerated
    rows: built from the engine's ids, from text (no ids), whose ids differ from the template's rendering of their
    text (the ids won), cut by max_tokens. {} when no row is a conversation."""
    cols = tokenized.select_columns(["source_row", "sample_kind", "num_tokens", "conversation_tokens",
                                     *SAMPLE_COUNTS]).to_dict()
    kinds = cols["sample_kind"]
    if not any(kinds):
        return {}
    per_turn = [j for j, k in enumerate(kinds) if k == "per_turn"]
    rows_per_turn = len({cols["source_row"][j] for j in per_turn})
    out = {"conversation_rows": sum(1 for k in kinds if k == "conversation"),
           "per_turn_rows": rows_per_turn, "per_turn_samples": len(per_turn),
           "per_turn_extra_tokens": sum(cols["num_tokens"][j] for j in per_turn)
           - sum(cols["conversation_tokens"][j] for j in per_turn),
           "generated_turns": {k[len("turns_"):]: sum(cols[k]) for k in SAMPLE_COUNTS}}
    return out


def _disk_map_cache(section: DataSection, rows, fn) -> dict:
    """`map` arguments that keep the tokenization cache of a `save_to_disk` folder out of that folder and key it on
    the bytes of the files `load_from_disk` reads ({} for other sources, and with datasets' caching off).

    Why: `datasets` writes a mapped cache file beside the dataset's own Arrow files (inside the user's folder) and
    names it after the fingerprint in the folder's `state.json`, which an edit of the rows does not change, so an
    edited folder would read the old tokenized rows back. Here the cache file lives in the content-keyed folder of
    the project's cache (as local files' caches do) and its name joins the content key with datasets' own hash of
    the transform (the tokenizer, the template, the settings) and of the rows selected (`max_samples`)."""
    import datasets
    from datasets.fingerprint import Hasher

    kind, source = _detect_format(section.path, section.format)
    if kind != "disk" or not datasets.is_caching_enabled():
        return {}
    files = _disk_dataset_files(Path(source))
    folder = Path(_content_cache_dir(files))
    folder.mkdir(parents=True, exist_ok=True)
    key = Hasher.hash([_content_key(files), section.split, len(rows), fn, _tokenized_features().to_dict(), 256])
    return {"cache_file_name": str(folder / f"tokenized-{key}.arrow"), "new_fingerprint": key}


def _kinds_summary(tokenized, reasons: list[str]) -> dict[str, dict]:
    """Per kind of ROW_KINDS that some row holds: how many rows hold it, how many are kept with it in their
    rendering, kept without it, and skipped (by reason)."""
    out = {}
    first, seen = [], set()  # a row's first sample stands for the row (`per_turn` rows have several)
    for i, row in enumerate(tokenized["source_row"]):
        if row not in seen:
            seen.add(row)
            first.append(i)
    for kind in ROW_KINDS:
        has = tokenized[f"has_{kind}"]
        holding = [i for i in first if has[i]]
        if not holding:
            continue
        renders = tokenized[f"renders_{kind}"]
        skipped = Counter(reasons[i] for i in holding if reasons[i])
        kept_rendered = sum(1 for i in holding if not reasons[i] and renders[i])
        out[kind] = {"rows": len(holding), "kept_rendered": kept_rendered,
                     "kept_without": len(holding) - kept_rendered - sum(skipped.values()),
                     "skipped": dict(skipped.most_common())}
    return out


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
    example row (sample id, the row's own id and the skip's detail). A whole kind of row lost is a warning, or with
    `data.strict` the same error (`_check_kinds`)."""
    num_skipped = sum(data.skipped_counts.values())
    fraction = num_skipped / max(data.num_candidates, 1)  # of the samples the rows gave (per-turn: several a row)
    problem = None
    if len(data.kept) == 0:
        problem = f"no row kept: all {data.num_rows} skipped"
    elif fraction > section.max_skipped_fraction:
        problem = (f"{num_skipped} of {data.num_candidates} rows skipped ({fraction:.0%}), more than "
                   f"data.max_skipped_fraction={section.max_skipped_fraction}")
    verdict = f"{data.num_rows} rows: {len(data.kept)} kept, {num_skipped} skipped"
    if problem is None:
        _check_kinds(data, section)
        return verdict
    raise NothingToExtractError(f"{problem}{' - ' + describe_skips(data) if data.skipped_rows else ''}. Nothing was "
                                f"extracted; see `dflash-prep plan --show-sample N` for how a row is tokenized and "
                                f"masked")


def describe_skips(data: TokenizedData, top: int = 3) -> str:
    """The `top` skip reasons, each with its count and an example row: sample id, the row's own id, the detail."""
    example = {}
    for r in data.skipped_rows:
        example.setdefault(r["reason"], r)
    parts = []
    for reason, n in sorted(data.skipped_counts.items(), key=lambda kv: -kv[1])[:top]:
        row = example[reason]
        parts.append(f"{reason}: {n} (e.g. row {row['sample_id']}"
                     + (f", id {row['source_id']!r}" if row["source_id"] is not None else "")
                     + (f": {row['detail']}" if row.get("detail") else "") + ")")
    return "; ".join(parts)


def _check_kinds(data: TokenizedData, section: DataSection) -> None:
    """A whole kind of row lost (every row with tool calls, or with reasoning, skipped or rendered without it) is a
    warning with the counts, or, with `data.strict`, NothingToExtractError (exit code 2): it would go unnoticed
    under `data.max_skipped_fraction` when such rows are a minority."""
    lost = []
    for kind, k in data.kinds.items():
        if k["kept_rendered"] == 0:
            label = ROW_KINDS[kind]
            skipped = ", ".join(f"{reason} {n}" for reason, n in k["skipped"].items())
            lost.append(f"every row with {label} is lost: of {k['rows']} such rows, "
                        f"{sum(k['skipped'].values())} skipped{' (' + skipped + ')' if skipped else ''} and "
                        f"{k['kept_without']} kept with a rendering without their {label} (the chat template drops "
                        f"them)")
    if not lost:
        return
    if section.strict:
        raise NothingToExtractError("; ".join(lost) + " (data.strict: true). Nothing was extracted; see skipped "
                                                      "rows with `dflash-prep plan --show-sample N`")
    log.warning("data: %s; set data.strict: true to stop instead", "; ".join(lost))

