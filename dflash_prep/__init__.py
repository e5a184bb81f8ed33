"""dflash-prep: fast, exact, resumable hidden-state extraction for training speculative-decoding drafters.

The folders follow the data flow, each importing only those before it (tests/test_layout.py enforces it):

    io, errors, signals, faults, units
                         the ground floor: atomic writes, exit codes, stop signals, test-only fault injection,
                         figures for people (units.py)
    recipe/              the recipe and the fingerprints of a job's inputs
    data/                rows in: load, chat template, token ids, loss mask
    plan/                lengths -> batches or packed rows, rank split, collation
    target/              the model, its kernels and packing, replicas, the capture hooks
    store/               shards out: writer lanes, index, manifest, locks, sizes
    regen/               the target's own answers (on-policy data): engines, conversation rules, resumable output
    consume/             reader, exporters, draft vocabulary
    commands/            extract, plan, inspect, verify, launch, the CLI

The public API, what trainers and scripts import (stable; resolved on first use, so `import dflash_prep` loads no
torch, transformers or datasets):

    ShardDataset         torch IterableDataset over an output's shards (a folder or a URL; `follow=True` while
                         its extraction runs): consume/reader.py
    DFlashCollator       samples -> trainer batches (padded or packed): consume/collator.py
    ShardFormatError     a shard that disagrees with its manifest or the format
    read_manifest        OUT/manifest.json as a dict (store/manifest.py)
    load_recipe          a recipe file (+ `key=value` overrides) -> the validated Recipe (recipe/schema.py)
    export               an output written in a trainer's layout (specforge, speculators, modelopt)
    draft_vocab          supervised-token counts -> the draft vocabulary's (d2t, t2d) arrays
    read_token_freq      OUT/token_freq.safetensors -> counts per token id
    dequantize_fp8       fp8_e4m3 states + their per-token scales -> values (target/fp8.py)

The module paths of earlier versions (`dflash_prep.reader`, `dflash_prep.export`, `dflash_prep.vocab`,
`dflash_prep.cli`, ...) still import, as the modules that now hold their code, with a DeprecationWarning; they go
in a later version: import from `dflash_prep` instead.

The table below names modules as strings on purpose: the root is the facade above every folder, and loads
nothing until a name is asked for (tests/test_layout.py checks the table, tests/test_api.py the behaviour).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

# public name -> (module, attribute)
_PUBLIC = {
    "ShardDataset": ("dflash_prep.consume.reader", "ShardDataset"),
    "DFlashCollator": ("dflash_prep.consume.collator", "DFlashCollator"),
    "ShardFormatError": ("dflash_prep.consume.shard_format", "ShardFormatError"),
    "read_manifest": ("dflash_prep.store.manifest", "read_manifest"),
    "load_recipe": ("dflash_prep.recipe.schema", "load_recipe"),
    "export": ("dflash_prep.consume.export", "export"),
    "draft_vocab": ("dflash_prep.consume.vocab", "draft_vocab"),
    "read_token_freq": ("dflash_prep.consume.vocab", "read_token_freq"),
    "dequantize_fp8": ("dflash_prep.target.fp8", "dequantize"),
}

# module of an earlier version -> the module that holds its code now (a deprecation period)
_MOVED = {
    "dflash_prep.reader": "dflash_prep.consume.reader",
    "dflash_prep.collate": "dflash_prep.plan.batches",
    "dflash_prep.export": "dflash_prep.consume.export",
    "dflash_prep.vocab": "dflash_prep.consume.vocab",
    "dflash_prep.fp8": "dflash_prep.target.fp8",
    "dflash_prep.manifest": "dflash_prep.store.manifest",
    "dflash_prep.cli": "dflash_prep.commands.cli",
    "dflash_prep.extract": "dflash_prep.commands.extract",
    "dflash_prep.inspect_output": "dflash_prep.commands.inspect",
    "dflash_prep.verify": "dflash_prep.commands.verify",
    "dflash_prep.launch": "dflash_prep.commands.launch",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    """A public name, imported on first use (PEP 562); an earlier module path given as an attribute, too."""
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    if f"{__name__}.{name}" in _MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside this file, so the warning names the user's import line
    (`warnings` itself skips the import machinery's frames when counting a level above 1)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_code.co_filename == __file__):
        if frame.f_code.co_filename == __file__:
            level += 1
        frame = frame.f_back
    return level


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an earlier module path to the module that holds its code now: the same module object (one copy
    of its classes, so isinstance holds across both names), with a DeprecationWarning naming the new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = _MOVED[spec.name]
        warnings.warn(f"{spec.name} is deprecated and will be removed: import from dflash_prep "
                      f"(its public names) or {new}", DeprecationWarning, stacklevel=_caller_stacklevel())
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module is already executed under its new name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
