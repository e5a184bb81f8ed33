"""The package's folders follow the data flow: each imports only itself, the folders before it and the ground floor,
and no import circle exists, counting imports made inside functions (lazy imports) too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_prep"

# The order of the data flow (dflash_prep/__init__.py): a module may import its own folder and those ranked lower.
RANKS = {"": 0, "io": 0, "errors": 0, "faults": 0, "signals": 0, "units": 0, "recipe": 1, "data": 2, "plan": 3, "target": 4, "store": 5,
         "regen": 6, "consume": 7, "commands": 8, "demo": 0}


def module_names(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under `root` (a package `__init__` named as the package)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join([package, *parts])] = path
    return names


def imports_of(path: Path, name: str, known: set[str], package: str) -> set[str]:
    """The package modules `name` imports anywhere in its file (top level, functions, conditionals)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a function or class: its module
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] == package and target != name:
                found.add(target)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    names = module_names(root, package)
    return {name: imports_of(path, name, set(names), package) for name, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, as one path around it per strongly connected component (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circle_including_lazy_imports():
    assert cycles(import_graph(PACKAGE, "dflash_prep")) == []


def test_each_folder_imports_only_earlier_stages():
    upward = []
    for module, targets in import_graph(PACKAGE, "dflash_prep").items():
        for target in targets:
            if RANKS[folder_of(target)] > RANKS[folder_of(module)]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_folder_is_known_and_says_what_it_owns():
    for folder in [p for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))]:
        assert folder.name in RANKS, f"{folder.name}: give it a rank in the data flow (dflash_prep/__init__.py)"
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.name}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{folder.name}/__init__.py: say what the folder owns and may import"


@pytest.mark.parametrize("lazy", [False, True])
def test_the_check_finds_a_circle(tmp_path, lazy):
    """The checker itself: a two-module circle, one side imported inside a function, is found."""
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("from pkg.b import two\n")
    (pkg / "b.py").write_text("def f():\n    from .a import one\n" if lazy else "from pkg.a.one import x\n")
    assert cycles(import_graph(pkg, "pkg")) == [["pkg.a.one", "pkg.b"]]
