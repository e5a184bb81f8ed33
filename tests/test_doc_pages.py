"""The README and the docs/ pages as a reader runs them: every `dflash-prep` command shown names a real command,
options the command takes, recipe keys that exist and files of this repository; every link leads to a file; the
README stays a front page; `.ci/run` runs the README's own commands. (What the commands then do is tested where
their code is: tests/test_package.py runs the Quick start from a wheel, test_docs.py the reading examples.)"""

from __future__ import annotations

import dataclasses
import re
import shlex
import typing
from pathlib import Path

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SOURCE = "\n".join(p.read_text() for p in (REPO / "dflash_prep").rglob("*.py"))
COMMANDS = {"extract", "launch", "export", "inspect", "plan", "verify", "vocab", "regenerate", "demo-server"}


def bash_lines(path: Path) -> list[str]:
    """The command lines of a page's ```bash blocks: continuations joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.split(r"\s+#\s", line)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def recipe_keys() -> set[str]:
    from dflash_prep.recipe.schema import Recipe

    keys = set()

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            keys.add(prefix + f.name)
            hint = typing.get_type_hints(cls).get(f.name)
            if dataclasses.is_dataclass(hint):
                walk(hint, prefix + f.name + ".")
            for arg in typing.get_args(hint):
                if dataclasses.is_dataclass(arg):
                    walk(arg, prefix + f.name + ".")

    walk(Recipe, "")
    return keys


OURS = [(p, line) for p in PAGES for line in bash_lines(p)
        if line.startswith(("dflash-prep ", "accelerate launch extract.py"))]


def test_the_pages_show_commands():
    assert len(OURS) > 25
    assert {p.name for p, _ in OURS} >= {"README.md", "ON_POLICY.md", "GPUS.md", "TRAINING.md", "VERIFY.md"}


@pytest.mark.parametrize("page,line", OURS, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(OURS)])
def test_a_shown_command_names_real_commands_options_keys_and_files(page, line):
    keys = recipe_keys()
    words = shlex.split(line.replace("...", ""))
    if words[0] == "dflash-prep":
        assert words[1] in COMMANDS, line
    for i, word in enumerate(words):
        value = words[i + 1] if i + 1 < len(words) else ""
        if word == "--set":
            key = value.split("=", 1)[0]
            assert key in keys, f"{page.name}: `{line}`: no recipe key {key}"
        elif word in ("--recipe", "--config_file") and "/" in value:
            assert (REPO / value).is_file(), f"{page.name}: `{line}`: no file {value}"
        elif word == "-m":
            assert (REPO / (value.replace(".", "/") + ".py")).is_file() or \
                (REPO / value.replace(".", "/") / "__main__.py").is_file(), line
        elif word.startswith("--") and words[0] == "dflash-prep" and word not in ("--config_file", "--machine_rank",
                                                                                   "--rdzv_conf", "--multi_gpu",
                                                                                   "--num_processes"):
            assert f'"{word}"' in SOURCE, f"{page.name}: `{line}`: no command takes {word}"
        elif word.endswith(".py") and not word.startswith(("scripts/", "/")):
            assert (REPO / word).is_file(), line


def test_every_relative_link_leads_to_a_file():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name}: a link to {target}"


def test_the_readme_is_a_front_page_linking_every_docs_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"the README does not link docs/{page.name}"
    assert "accelerate launch extract.py --recipe recipes/" in text


def test_ci_runs_the_readme_own_commands():
    """Each command `.ci/run` runs after the venv is set up is one the README shows (a `-q` aside)."""
    shown = {line.replace(" -q", "") for line in bash_lines(REPO / "README.md")}
    ci = (REPO / ".ci" / "run").read_text().split("python -m pip install -q --upgrade pip\n", 1)[1]
    ran = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    ran = [line.replace(" -q", "") for line in ran if not line.startswith('cd "$work"')]
    assert ran and all(line in shown for line in ran), [line for line in ran if line not in shown]
    assert "torch" not in ci  # no torch build of its own: the one the README's install gives
