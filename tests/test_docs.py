"""The README, ``docs/`` and ``benchmarks/`` say what runs: every ``python`` and ``bash`` block runs as written,
unless its first line says it is a fragment (``# fragment: why``).

- The README's test command (after ``<!-- test-command -->``) is ``.ci/run``'s first step.
- A block that is not a fragment runs in a fresh process on CPU, from an empty folder that holds the
  checkout's ``.venv/bin/python`` and its read-only folders (``tests``, ``results``, ``experiments``, ...) as
  links and empty ``figures/`` and ``runs/`` of its own, with the checkout on ``PYTHONPATH``, as a user's copy of the command would run; ``python`` blocks as
  a file (so a spawned rank can import it), ``bash`` blocks through bash. A block marked ``<!-- slow -->`` on
  the line before its fence runs in the slow tier (``.ci/run``), the rest in the README's.
- A fragment still compiles (``python``) or parses (``bash -n``), and says why it is one.
- Every ``python -m TOOL ARGS`` in any ``bash`` block, fragment or not, is parsed by that tool's own argument
  parser: a renamed option or a deleted tool fails here even where the command is too long to run.

A failure names the file and the line of the block: the example went stale (an API or an option changed
under it) or was written wrong.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
FRAGMENT = re.compile(r"^#\s*fragment\b:?\s*(.*)$")
RUN_TIMEOUT_S = 600  # the planner blocks of docs/check.md take minutes on 2 cores
LANGUAGES = ("python", "bash")
LINKED = ("tests", "results", "experiments", "multidsn", "plots", "docs", "benchmarks", "README.md", "requirements.txt",
          "pyproject.toml")
"""What a runnable block finds beside it, as in the checkout (links: read only by convention; a block that
writes into them is a fragment). ``figures/`` and ``runs/`` are empty folders of its own."""


def blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, code, the HTML comment on the line before the fence or '') of each fenced block."""
    found, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening and opening[1]:
            marker = lines[i - 1].strip() if i > 0 and lines[i - 1].strip().startswith("<!--") else ""
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            found.append((i + 1, opening[1], "\n".join(lines[i + 1:end]), marker))
            i = end
        i += 1
    return found


def fragment_reason(code: str, marker: str = "") -> str | None:
    """Why the block does not run here (its first line's ``# fragment: ...``; the README's test command, which
    ``.ci/run`` runs), or None for a block that runs."""
    if marker == "<!-- test-command -->":
        return ".ci/run runs it"
    first = code.strip().split("\n", 1)[0].strip()
    match = FRAGMENT.match(first)
    return match[1].strip() if match else None


ALL = [(p, *b) for p in PAGES for b in blocks(p)]
CODE = [(p, line, lang, code, marker) for p, line, lang, code, marker in ALL if lang in LANGUAGES]


def _id(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


RUNNABLE = [pytest.param(p, line, lang, code, id=_id(p, line), marks=[pytest.mark.slow] if "slow" in marker else [])
            for p, line, lang, code, marker in CODE if fragment_reason(code, marker) is None]
FRAGMENTS = [pytest.param(p, line, lang, code, marker, id=_id(p, line))
             for p, line, lang, code, marker in CODE if fragment_reason(code, marker) is not None]


def test_the_readme_examples_run():
    """Both modes' examples and the whole-slide one are among the blocks that run (a fragment marker would
    hide them)."""
    readme = [code for p, _, _, code, marker in CODE if p.name == "README.md" and fragment_reason(code, marker) is None]
    assert any("bigconv.World(workers=" in c for c in readme)
    assert any('World.from_env(mode="spmd")' in c for c in readme)
    assert any("open_image(" in c and "train_step(" in c and ".ome.zarr" in c for c in readme)  # slide to pyramid


@pytest.mark.parametrize("path,line,lang,code,marker", FRAGMENTS)
def test_fragments_say_why_and_still_parse(path, line, lang, code, marker):
    assert fragment_reason(code, marker), f"{path.name}:{line}: say why after '# fragment:'"
    if lang == "python":
        compile(code, f"{path.name}:{line}", "exec")
    else:
        done = subprocess.run(["bash", "-n"], input=code + "\n", capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{path.name}:{line}: {done.stderr}"


def _workspace(tmp_path: Path) -> Path:
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    for name in ("figures", "runs"):
        (tmp_path / name).mkdir()
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the whole environment: a lone python link would lose it
    return tmp_path


@pytest.mark.own_world
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("path,line,lang,code", RUNNABLE)
def test_blocks_run_as_written(path, line, lang, code, tmp_path, exclusive):
    where = _workspace(tmp_path)
    script = where / ("example.py" if lang == "python" else "example.sh")
    script.write_text(code + "\n")
    command = [sys.executable, str(script)] if lang == "python" else ["bash", "-e", str(script)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{path.name}:{line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


PYTHON = re.compile(r"(^|/)python3?$")


def commands(code: str) -> list[tuple[str, list[str]]]:
    """Every ``python -m TOOL ARGS`` of a bash block: continued lines joined, comments dropped, one per
    segment between ``&&``, ``;`` and ``|``; environment assignments before it skipped."""
    found = []
    text = re.sub(r"\\\n", " ", code)
    for line in text.split("\n"):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # a heredoc's body or an unbalanced quote: no command of ours
            continue
        segment: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "|", "||"):
                while segment and re.match(r"^\w+=", segment[0]):
                    segment.pop(0)
                if len(segment) >= 3 and PYTHON.search(segment[0]) and segment[1] == "-m":
                    found.append((segment[2], segment[3:]))
                segment = []
            else:
                segment.append(word)
    return found


DOCUMENTED = [pytest.param(module, args, id=f"{_id(p, line)}:{module}")
              for p, line, lang, code, _ in CODE if lang == "bash" for module, args in commands(code)
              if module.split(".")[0] in ("bigconv", "experiments", "multidsn", "plots")]


class _Parsing(Exception):
    def __init__(self, parser, args) -> None:
        self.parser, self.args = parser, args


def parser_for(module_name: str, args: list[str], monkeypatch):
    """The parser ``python -m module_name args`` parses its arguments with, and the arguments it gives it (a tool
    may hand its arguments on to another's parser: ``experiments.context --tissue``). Nothing runs past it."""
    def capture(self, given=None, namespace=None):
        raise _Parsing(self, list(given) if given is not None else list(sys.argv[1:]))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(sys, "argv", [module_name, *args])
    module = importlib.import_module(module_name + (".__main__" if module_name == "plots" else ""))
    try:
        module.main(list(args)) if inspect.signature(module.main).parameters else module.main()
    except _Parsing as got:
        return got.parser, got.args
    raise AssertionError(f"{module_name}.main() never parsed its arguments")


@pytest.mark.parametrize("module,args", DOCUMENTED)
def test_documented_commands_parse(module, args, monkeypatch):
    """The tool exists and its parser takes the documented arguments (nothing runs)."""
    parser, given = parser_for(module, args, monkeypatch)
    monkeypatch.undo()
    try:
        parser.parse_args(given)
    except SystemExit as exc:
        pytest.fail(f"python -m {module} {shlex.join(args)}: its parser refuses the documented arguments "
                    f"(exit {exc.code})")


def test_commands_are_found_in_blocks():
    code = ("PYTHONPATH=. OMP_NUM_THREADS=1 python -m experiments.x --a 1 \\\n    --b 2   # a comment\n"
            "cd /tmp && .venv/bin/python -m plots results/a.jsonl --out figures/ | tee log\n")
    assert commands(code) == [("experiments.x", ["--a", "1", "--b", "2"]),
                              ("plots", ["results/a.jsonl", "--out", "figures/"])]


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path):
    """A page moved or renamed leaves no dead link behind."""
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"
