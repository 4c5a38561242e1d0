"""Which code produced a result: the git commit of this checkout, and whether its code had local edits.

Benchmarks append to ``results/`` and draw into ``figures/`` while they run, so those two folders do
not count as edits: otherwise every record after a run's first line would read "dirty".
"""

from __future__ import annotations

import os
import subprocess

OUTPUT_FOLDERS = ("results", "figures")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout this package lives in: a fresh process started there imports this checkout's ``bigconv``."""


def source_commit(root: str | None = None) -> tuple[str | None, bool | None]:
    """(commit hash, True if tracked files outside ``OUTPUT_FOLDERS`` differ from it) of the checkout at
    ``root`` (default: the one this package lives in); (None, None) outside a git checkout or without git."""
    root = root or ROOT
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True,
                                cwd=root, timeout=10).stdout.strip()
        if not commit:
            return None, None
        excluded = [f":(exclude){folder}" for folder in OUTPUT_FOLDERS]
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded],
                                 check=False, capture_output=True, text=True, cwd=root, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(changed)
