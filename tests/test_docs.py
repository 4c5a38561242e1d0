"""The README and ``docs/`` say what runs: every ``python`` block compiles, and every block marked
``<!-- runnable -->`` on the line before its fence runs as written, in a fresh process on CPU.

A failure names the file and the line of the block: the example went stale (an API changed under it)
or was written wrong. Runnable blocks run from an empty folder with the checkout on ``PYTHONPATH``, as a
user's script would; ``python`` blocks run as a file (so a spawned rank can import it), ``bash`` blocks
through bash.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
RUN_TIMEOUT_S = 240


def blocks(path: Path) -> list[tuple[int, str, str, bool]]:
    """(line, language, code, runnable) of each fenced block of ``path``."""
    found, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening and opening[1]:
            runnable = i > 0 and lines[i - 1].strip() == "<!-- runnable -->"
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            found.append((i + 1, opening[1], "\n".join(lines[i + 1:end]), runnable))
            i = end
        i += 1
    return found


ALL = [(p, *b) for p in PAGES for b in blocks(p)]
RUNNABLE = [pytest.param(p, line, lang, code, id=f"{p.relative_to(ROOT)}:{line}")
            for p, line, lang, code, runnable in ALL if runnable]


def test_the_marked_blocks_exist():
    """Both modes' examples and the whole-slide one stay runnable (a dropped marker would hide them)."""
    readme = [code for p, _, _, code, runnable in ALL if p.name == "README.md" and runnable]
    assert any("bigconv.World(workers=" in c for c in readme)
    assert any('World.from_env(mode="spmd")' in c for c in readme)
    assert any("open_image(" in c and "train_step(" in c and ".ome.zarr" in c for c in readme)  # slide to pyramid


@pytest.mark.parametrize("path,line,code", [pytest.param(p, line, code, id=f"{p.relative_to(ROOT)}:{line}")
                                            for p, line, lang, code, _ in ALL if lang == "python"])
def test_every_python_block_compiles(path, line, code):
    compile(code, f"{path.name}:{line}", "exec")


@pytest.mark.own_world
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("path,line,lang,code", RUNNABLE)
def test_runnable_blocks_run_as_written(path, line, lang, code, tmp_path, exclusive):
    script = tmp_path / ("example.py" if lang == "python" else "example.sh")
    script.write_text(code + "\n")
    command = [sys.executable, str(script)] if lang == "python" else ["bash", str(script)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{path.name}:{line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path):
    """A page moved or renamed leaves no dead link behind."""
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"
