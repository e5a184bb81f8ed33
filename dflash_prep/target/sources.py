"""Where the target's files come from, checked before anything loads (no torch or transformers imported here, so
the launcher's preflight can call it): a local folder that is not there, or a hub id no hub can serve, is refused
in a second with one line instead of transformers' half a minute of retries."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_prep.recipe.schema import ModelSection, RecipeError

HUB_PROBE_SECONDS = 3.0  # a reachable hub answers a TCP connect in milliseconds


def check_model_source(source: str, key: str) -> None:
    """Refuse at once a `source` (a model folder or hub id, recipe key `key`) that can only fail to load:
    - a local path that does not exist: one that starts with `/`, `./`, `../` or `~`, has more than one `/`, or
      whose first part is a folder here (`models/my-llama` beside a `models/` folder: a typo, not a hub id);
    - a hub id (`name` or `org/name`) that is not in the hub cache while the hub endpoint does not answer a TCP
      connect within HUB_PROBE_SECONDS (transformers would retry for half a minute, then say "check your internet
      connection"). With HF_HUB_OFFLINE set nothing is probed: the cache alone answers.
    Raises RecipeError (one line, exit code 2)."""
    p = Path(source).expanduser()
    if p.exists():
        return
    first = Path(source).parts[0] if Path(source).parts else ""
    if source.startswith(("/", "./", "../", "~")) or source.count("/") > 1 or (
            "/" in source and Path(first).is_dir()):
        raise RecipeError(f"recipe key `{key}` = {source!r}: no such file or folder ({p.resolve()})")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(source, "config.json"), str) or isinstance(
            try_to_load_from_cache(source, "tokenizer_config.json"), str):
        return  # cached: transformers loads it (and checks for updates itself)
    why = _unreachable(constants.ENDPOINT)
    if why is not None:
        raise RecipeError(f"recipe key `{key}` = {source!r}: not a local folder, and the hub that would serve it, "
                          f"{constants.ENDPOINT}, cannot be reached ({why}): give the model's local folder, or set "
                          f"HF_HUB_OFFLINE=1 to load it from the hub cache")


_REACHED: set[str] = set()  # endpoints that answered in this process (a failure is probed again next time)


def _unreachable(endpoint: str) -> str | None:
    """Why a TCP connect to `endpoint`'s host fails (a name that does not resolve, a refusal, a timeout), or None.
    An endpoint that answered once is not probed again in this process (the config's and tokenizer's checks)."""
    if endpoint in _REACHED:
        return None
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e.strerror or e}"
    _REACHED.add(endpoint)
    return None


def config_source(section: ModelSection) -> tuple[str, str]:
    """(where the model's config comes from, the recipe key that names it)."""
    return (section.config, "model.config") if section.config else (section.name_or_path, "model.name_or_path")


def tokenizer_source(section: ModelSection) -> tuple[str, str]:
    """(where the tokenizer comes from, the recipe key that names it)."""
    return section.tokenizer_path, "model.tokenizer" if section.tokenizer else "model.name_or_path"


def check_model_sources(section: ModelSection) -> None:
    """`check_model_source` for the model's config source and its tokenizer's (the recipe keys that name them)."""
    for source, key in (config_source(section), tokenizer_source(section)):
        if source:
            check_model_source(source, key)
