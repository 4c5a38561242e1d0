"""Results files: JSON lines, one record per configuration, written so that none is lost or doubled.

- ``append`` writes a whole line, flushes and fsyncs before returning: a record that was reported
  is on disk.
- ``load`` skips a torn last line (a run killed mid-write) and ``repair`` cuts it off before the
  next append, so the configuration it belonged to is simply run again.
- ``config_key`` is what makes two records the same configuration; a resumed sweep skips the keys
  already present.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterable

log = logging.getLogger(__name__)


def repair(path: str) -> int:
    """Cut a torn (newline-less) last line off ``path``; the number of bytes removed."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as fh:
        data = fh.read()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    log.warning("%s: removed a torn last line of %d bytes", path, len(data) - keep)
    return len(data) - keep


def load(path: str) -> list[dict]:
    """Every complete record of ``path`` (none if it does not exist)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d is not a complete record; ignored", path, n)
    return out


def load_many(paths: Iterable[str]) -> list[tuple[str, dict]]:
    return [(p, r) for p in paths for r in load(p)]


def append(path: str, record: dict) -> None:
    """Append one record as one line, durably."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    repair(path)
    line = json.dumps(record, sort_keys=True) + "\n"
    with open(path, "a") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def config_key(config: dict) -> str:
    """The identity of a configuration: every field except how long it may take. Unset (None) fields
    are left out, so adding an optional field keeps the keys of earlier records."""
    return json.dumps({k: v for k, v in config.items() if k != "timeout_s" and v is not None}, sort_keys=True)


def recorded_keys(path: str) -> dict[str, dict]:
    """Configuration key -> its last record, for the run records in ``path``."""
    return {config_key(r["config"]): r for r in load(path) if r.get("kind") == "run" and "config" in r}
