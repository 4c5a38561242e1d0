"""`pip install .` installs our packages only: no generic top-level names such as `experiments`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_the_wheel_holds_bigconv_and_multidsn_only(tmp_path):
    import importlib.util

    # Without setuptools in this environment (venvs of Python >= 3.12), pip builds in isolation.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, timeout=170, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"bigconv", "multidsn"}
    assert "bigconv/harness/recorder.py" in names and "bigconv/harness/records.py" in names


def test_harness_library_code_imports_from_bigconv():
    from bigconv.harness import recorder, records, registry, runner, workload  # noqa: F401
