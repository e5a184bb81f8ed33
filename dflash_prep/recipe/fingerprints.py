"""Content fingerprints of a job's inputs: the tokenized rows and the model's weights.

A resume must write what this job would write now. The recipe's keys say where the inputs are; these
fingerprints say what they hold, so a data file edited in place or a checkpoint overwritten in place is seen:

- `rows_fingerprint(kept)`: sha256 over the kept rows' `sample_id`, `source_id`, `input_ids` and `loss_mask`, in
  order (a shuffled file differs too), read from the tokenized Arrow table in batches (vectorised, no Python
  loop over tokens; measured 1.5 s for 100k rows of 500 tokens on one shared CPU core). Our own code because
  `datasets`' fingerprints hash the transforms and the files' names and times, not the rows' content;
- `weights_fingerprint(section)`: for a local checkpoint, per weight file its size in bytes, the sha256 of its
  safetensors header (tensor names, dtypes, shapes, offsets), the sha256 of `SAMPLE_CHUNKS` chunks of
  `SAMPLE_CHUNK_BYTES` spread evenly over the file, and the sha256 of a window inside EVERY tensor (its first
  `TENSOR_WINDOW_BYTES`, the whole tensor when smaller; found from the safetensors header), so an edit of any one
  tensor, a 1 KB norm included, is seen: 8 MiB + 4 KiB per tensor read per file (a 55 GB checkpoint of ~1,000
  tensors: ~100 MiB, not 55 GB; a fine-tune written over the same path changes every window). What is not
  seen: an edit inside a large tensor that leaves its first 4 KiB and the sampled chunks alone. `.bin`/`.pt`
  files (pickles: no header to find tensors in) get the size and the sampled chunks only;
  for a hub id, the commit the local cache resolves it to; for random weights (`model.config`), the init seed
  (the config itself is in `model_fingerprint`);
- `files_sha256(paths)`: the sha256 of each data file's bytes (the rows' content key: the datasets cache and the
  job identity, data/rows.py), remembered per (path, size, mtime, ctime, inode) so unchanged files are not read
  again: no userspace tool sets a file's ctime (an edit that keeps the mtime, `cp -p`, `rsync -t`, `touch -r`,
  `tar x`, still changes it), so a file whose every stamp is unchanged holds the bytes that were hashed;
- `inputs_stamp(recipe)`: not a content fingerprint but a cheap stamp, the size, modification and change times of
  every local input file with the recipe's content keys, so a re-run of a finished output can answer without
  reading anything when nothing was touched (anything else goes through the content checks above).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import struct
import time
from pathlib import Path

SAMPLE_CHUNKS = 8
SAMPLE_CHUNK_BYTES = 1 << 20
TENSOR_WINDOW_BYTES = 4096
HASH_READ_BYTES = 8 << 20
RACY_SECONDS = 2.0
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
ROW_COLUMNS = ("sample_id", "source_id", "input_ids", "loss_mask")


def rows_fingerprint(kept, batch_rows: int = 65536) -> dict:
    """{"sha256": hex, "num_rows": int} of the kept tokenized rows (a `datasets.Dataset` with ROW_COLUMNS).

    Each column of each batch contributes its values as little-endian bytes plus the row lengths (list columns)
    or the UTF-8 strings with their lengths (string columns; a null `source_id` hashes as length -1), so no two
    different row sequences give the same byte stream."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    digest = hashlib.sha256()
    columns = [c for c in ROW_COLUMNS if c in kept.column_names]
    for table in kept.select_columns(columns).with_format("arrow").iter(batch_size=batch_rows):
        for name in columns:
            col = table.column(name)
            digest.update(name.encode())
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                lengths = pc.fill_null(pc.list_value_length(col), -1).to_numpy(zero_copy_only=False)
                values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
                digest.update(np.ascontiguousarray(lengths, dtype="<i8").tobytes())
                digest.update(np.ascontiguousarray(values, dtype="<i8").tobytes())
            else:
                strings = col.to_pylist()
                lengths = np.array([-1 if s is None else len(s.encode()) for s in strings], dtype="<i8")
                digest.update(lengths.tobytes())
                digest.update("".join(s for s in strings if s is not None).encode())
    return {"sha256": digest.hexdigest(), "num_rows": len(kept)}


def _sample_sha256(path: Path, size_bytes: int) -> str:
    """sha256 of SAMPLE_CHUNKS chunks spread evenly from the start to the end of the file (the whole file when
    it is smaller than that)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size_bytes <= SAMPLE_CHUNKS * SAMPLE_CHUNK_BYTES:
            digest.update(f.read())
            return digest.hexdigest()
        last = size_bytes - SAMPLE_CHUNK_BYTES
        for i in range(SAMPLE_CHUNKS):
            f.seek(last * i // (SAMPLE_CHUNKS - 1))
            digest.update(f.read(SAMPLE_CHUNK_BYTES))
    return digest.hexdigest()


def _read_safetensors_header(f) -> bytes | None:
    """The JSON header of a safetensors file open at its start (8-byte little-endian length, then the header); None
    when it cannot be one."""
    head = f.read(8)
    if len(head) < 8:
        return None
    (length,) = struct.unpack("<Q", head)
    return None if length > 100_000_000 else f.read(length)


def _safetensors_header_sha256(path: Path) -> str | None:
    """sha256 of the JSON header of a safetensors file."""
    with open(path, "rb") as f:
        header = _read_safetensors_header(f)
    return None if header is None else hashlib.sha256(header).hexdigest()


def _tensors_sha256(path: Path) -> str | None:
    """sha256 over every tensor of a safetensors file, in data order: its name, then its first TENSOR_WINDOW_BYTES
    (all of it when smaller). None when the header does not read (then the other keys still see the file)."""
    with open(path, "rb") as f:
        raw = _read_safetensors_header(f)
        try:
            header = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        if not isinstance(header, dict):
            return None
        base = f.tell()  # the data follow the header
        tensors = sorted((v["data_offsets"][0], v["data_offsets"][1], name) for name, v in header.items()
                         if name != "__metadata__" and isinstance(v, dict) and "data_offsets" in v)
        digest = hashlib.sha256()
        for start, end, name in tensors:
            digest.update(name.encode() + b"\0")
            f.seek(base + start)
            digest.update(f.read(min(end - start, TENSOR_WINDOW_BYTES)))
    return digest.hexdigest()


def _local_weights(folder: Path) -> dict:
    files = {}
    for path in weight_files(folder):
        size = path.stat().st_size
        entry = {"bytes": size, "sample_sha256": _sample_sha256(path, size)}
        if path.suffix == ".safetensors":
            entry["header_sha256"] = _safetensors_header_sha256(path)
            entry["tensors_sha256"] = _tensors_sha256(path)
        files[str(path.relative_to(folder))] = entry
    return {"files": files}


def weight_files(folder: Path) -> list[Path]:
    """The weight files (WEIGHT_SUFFIXES) under a local model folder."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _hub_commit(repo_id: str) -> str | None:
    """The commit the local hub cache resolves `repo_id` to (its config.json is cached once the config loaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(found, str) and "snapshots" in Path(found).parts:
        return Path(found).parent.name
    return None


def weights_fingerprint(section) -> dict:
    """What identifies the weights of `section` (a recipe's ModelSection), as a JSON-ready dict:
    {"random_init_seed": s} | {"files": {relative path: {"bytes", "sample_sha256", "header_sha256"}}} |
    {"hub": id, "commit": sha or None}. Raises OSError when a local weight file cannot be read."""
    if section.config is not None:
        return {"random_init_seed": section.init_seed}
    source = Path(os.path.expanduser(section.name_or_path))
    if source.is_dir():
        return _local_weights(source)
    return {"hub": section.name_or_path, "commit": _hub_commit(section.name_or_path)}


_WEIGHT_KEYS = (("bytes", "size"), ("header_sha256", "safetensors header"),
                ("tensors_sha256", "tensors (a window of every tensor)"), ("sample_sha256", "sampled bytes"))


def describe_weights_change(previous: dict, current: dict) -> str | None:
    """One phrase naming how the weights differ, e.g. 'model.safetensors: tensors (a window of every tensor)
    differ', or None when they agree. Per file, only the keys both fingerprints hold are compared (an output made
    before `tensors_sha256` existed is judged on the others)."""
    if "files" in previous and "files" in current:
        a, b = previous["files"], current["files"]
        if set(a) != set(b):
            return f"weight files {sorted(a)} became {sorted(b)}"
        for name in sorted(a):
            for key, what in _WEIGHT_KEYS:
                if key in a[name] and key in b[name] and a[name][key] != b[name][key]:
                    return f"{name}: {what} differ"
        return None
    if previous == current:
        return None
    return (f"output has {json.dumps(previous, sort_keys=True)[:200]}, "
            f"this run has {json.dumps(current, sort_keys=True)[:200]}")


_HASHED: dict[tuple, str] = {}  # (path, size, mtime_ns, ctime_ns, inode) -> sha256, for this process


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def files_sha256(paths: list, memo_dir: Path | None = None) -> dict[str, str]:
    """{path (as given): sha256 of its bytes} (module docstring). `memo_dir`: a folder where the digests of files
    are remembered across processes, keyed on their stat (None: this process only). Raises OSError when a file
    cannot be read."""
    out = {}
    for path in paths:
        key = _stat_key(Path(path))
        memo = (Path(memo_dir) / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:40]) if memo_dir else None
        if key not in _HASHED and memo is not None and memo.is_file():
            text = memo.read_text().strip()
            if len(text) == 64:
                _HASHED[key] = text
        if key not in _HASHED:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(HASH_READ_BYTES):
                    digest.update(chunk)
            # Remembered only when not written while being read, and not changed within the last 2 s: on a
            # filesystem with coarse times, a later edit in the same second would keep the key (git's "racy" rule).
            if _stat_key(Path(path)) == key and time.time() - os.stat(path).st_ctime > RACY_SECONDS:
                _HASHED[key] = digest.hexdigest()
                if memo is not None:
                    _remember(memo, _HASHED[key])
            out[str(path)] = digest.hexdigest()
            continue
        out[str(path)] = _HASHED[key]
    return out


def _remember(memo: Path, digest: str) -> None:
    """Write a memo (tmp + rename: a reader sees all of it or nothing); a cache that cannot be written is skipped."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:
        pass


def _files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


# --------------------------------------------------------------------------------------- names that travel
# A job's identity names its input files the way they read from any install and any place: the package's own
# assets package-relative (`dflash_prep:demo/...`), a user's files relative to the folder the recipe names (the
# model's, the tokenizer's, the data's), under the role they play: `model/config.json`, `tokenizer/tokenizer.json`,
# `data/chat.jsonl`, `chat_template`. Moving a folder, or installing the package another way, keeps the names; the
# content (sha256, the weights' fingerprint) decides whether the job is the same.

def _named(role: str, root: Path, files: list[Path]) -> dict[str, Path]:
    """{role/relative name: path} of `files` under `root` (a file's own name when `root` is the file)."""
    base = root if root.is_dir() else root.parent
    return {f"{role}/{f.relative_to(base).as_posix()}": f for f in files}


def _data_roots(data) -> list[tuple[Path, list[Path]]] | None:
    """(the folder a data entry names, its files) per entry of `data.path`, or None when one is not local."""
    roots = []
    for pattern in data.path if isinstance(data.path, list) else [data.path]:  # `data.path` may list several
        expanded = os.path.expanduser(pattern)
        if any(c in pattern for c in "*?["):
            fixed = Path(re.split(r"[*?\[]", expanded, maxsplit=1)[0] + "x").parent  # the folder before any wildcard
            roots.append((fixed, [Path(p) for p in sorted(glob.glob(expanded, recursive=True)) if Path(p).is_file()]))
        elif Path(expanded).exists():
            roots.append((Path(expanded), _files_under(Path(expanded))))
        else:
            return None
    return roots


def named_inputs(recipe) -> dict[str, Path] | None:
    """{name: path} of every local file the job's inputs are read from (the model's folder or config, the tokenizer's
    folder, the chat template's file, the data files), named as above; None when an input is not local (a hub id)."""
    model, data = recipe.model, recipe.data
    weights = Path(os.path.expanduser(model.config if model.config is not None else model.name_or_path))
    tokenizer = Path(os.path.expanduser(model.tokenizer_path))
    roots = _data_roots(data) if data.format != "hub" else None
    if not weights.exists() or not tokenizer.is_dir() or roots is None:
        return None
    named = {**_named("model", weights, _files_under(weights)),
             **_named("tokenizer", tokenizer, _files_under(tokenizer))}
    for base, files in roots:
        named.update(_named("data", base, files))
    template = data.chat_template
    if template is not None and "{%" not in template and "{{" not in template and Path(template).is_file():
        named["chat_template"] = Path(template)
    return named


def input_files_sha256(recipe) -> dict[str, str] | None:
    """{name: sha256} of the job's small input files: every file of the model's folder but its weights (config.json,
    generation_config.json, ...), the random-weights config, the tokenizer's files and the chat template's file
    (the weights have `weights_fingerprint`, the data files `data_files`). None when an input is not local."""
    named = named_inputs(recipe)
    if named is None:
        return None
    small = {name: path for name, path in named.items()
             if not name.startswith("data/") and not path.name.endswith(WEIGHT_SUFFIXES)}
    digests = files_sha256(list(small.values()))
    return {name: digests[str(path)] for name, path in small.items()}


def portable_files(files: dict) -> dict:
    """A `{path: value}` map of files named by absolute path (the data files' fingerprint), renamed relative to their
    common folder (the package's own files package-relative): what stays the same when the folder moves."""
    from dflash_prep.recipe.location import PACKAGE_PREFIX, portable_path

    if not files or not all(str(k).startswith("/") for k in files):
        return dict(files)
    if all(portable_path(str(k)).startswith(PACKAGE_PREFIX) for k in files):  # this or another install's assets
        return {portable_path(str(k)): v for k, v in files.items()}
    common = Path(os.path.commonpath([str(k) for k in files]))
    base = common.parent if str(common) in {str(k) for k in files} else common
    return {Path(k).relative_to(base).as_posix(): v for k, v in files.items()}


def portable_location(value):
    """A path-like recipe value as a job's identity holds it: the package's own assets package-relative, a local
    absolute path (or glob) by its last component (the content decides the rest), hub ids and inline text as they
    are."""
    from dflash_prep.recipe.location import PACKAGE_PREFIX, portable_path

    if isinstance(value, list):
        return [portable_location(v) for v in value]
    if not isinstance(value, str) or value.startswith(PACKAGE_PREFIX) or "{%" in value or "{{" in value:
        return value
    if portable_path(value) != value:
        return portable_path(value)
    return Path(value).name if Path(value).is_absolute() else value


def inputs_stamp(recipe) -> dict | None:
    """{"recipe": the recipe's content fingerprint, "data": its data keys, "files": {name: [bytes, mtime_ns,
    ctime_ns]}} of the job's local inputs (`named_inputs`), or None when an input is not local (hub ids: no stamp,
    the content checks decide).

    Equal stamps mean the recipe asks for the same content and no input file was written since (a write changes
    the change time, which no userspace tool sets back, unlike the modification time); a stamp is never evidence
    of a change, only of its absence: a file whose stamp differs is compared by content."""
    named = named_inputs(recipe)
    if named is None:
        return None
    files = {}
    for name, path in named.items():
        try:
            st = path.stat()
        except OSError:
            return None
        files[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    data = {k: portable_location(v) if k in ("path", "chat_template") else v
            for k, v in recipe.to_dict()["data"].items() if k != "num_proc"}
    return {"recipe": recipe.fingerprint(template_content=False), "data": data, "files": files}


def describe_files_change(previous: dict, current: dict, shown: dict | None = None) -> str:
    """One phrase naming how two {name: sha256} maps differ, e.g. '/models/x/tokenizer.json: its bytes changed
    since the output was made' (`shown`: name -> how to show it, the path this run reads)."""
    def show(names):
        return ", ".join(str((shown or {}).get(n, n)) for n in names[:3]) + (" ..." if len(names) > 3 else "")
    changed = [n for n in sorted(set(previous) & set(current)) if previous[n] != current[n]]
    gone, new = sorted(set(previous) - set(current)), sorted(set(current) - set(previous))
    parts = ([f"{show(changed)}: its bytes changed since the output was made"] if changed else []) + \
        ([f"{show(gone)}: gone"] if gone else []) + ([f"{show(new)}: new"] if new else [])
    return "; ".join(parts) or "the same files"
