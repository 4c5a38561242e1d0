"""``bigconv.provenance.source_commit``: results name the commit that made them, and "dirty" means the
code changed, not that a benchmark appended to ``results/`` or drew into ``figures/``.

A failure points at bigconv/provenance.py.
"""

import shutil
import subprocess

import pytest

from bigconv.provenance import source_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git executable")


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_output_folders_do_not_make_a_checkout_dirty(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "figures").mkdir()
    (tmp_path / "results" / "run.jsonl").write_text("{}\n")
    (tmp_path / "figures" / "f.png").write_text("png")
    (tmp_path / "model.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "first")
    head = git(tmp_path, "rev-parse", "HEAD")
    assert source_commit(str(tmp_path)) == (head, False)
    (tmp_path / "results" / "run.jsonl").write_text("{}\n{}\n")
    (tmp_path / "figures" / "f.png").write_text("png2")
    (tmp_path / "results" / "new.jsonl").write_text("{}\n")  # untracked: never counts
    assert source_commit(str(tmp_path)) == (head, False)
    (tmp_path / "model.py").write_text("x = 2\n")
    assert source_commit(str(tmp_path)) == (head, True)


def test_outside_a_checkout_there_is_no_commit(tmp_path):
    assert source_commit(str(tmp_path)) == (None, None)
