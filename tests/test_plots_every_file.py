"""``python -m plots`` draws every results file it is given, or names why it cannot: the context, the DSN
paper recipe, the alternatives and the core benchmark's files included. A failure points at plots/__main__.py
or the module that draws the file's records."""

from __future__ import annotations

import os

import pytest

from plots.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_every_committed_kind_is_drawn_or_named(tmp_path, capsys):
    files = {name: os.path.join(ROOT, "results", f"{name}.jsonl")
             for name in ("context", "multidsn_paper", "alternatives", "bench_core", "faults")}
    main([*files.values(), str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "figs")])
    printed = capsys.readouterr().out
    drawn = sorted(os.listdir(tmp_path / "figs"))
    for stem in ("context", "multidsn_paper", "alternatives", "bench_core_memory"):
        assert f"{stem}.png" in drawn and f"{stem}.pdf" in drawn, (stem, drawn)
    assert f"{files['faults']}: skipped: no figure is made for its records (faults x" in printed
    assert "missing.jsonl: no such file; skipped" in printed
    assert "skipped" not in "".join(line for line in printed.splitlines() if "faults" not in line
                                    and "missing" not in line)
