"""Import order never matters: each model library imports first, in a fresh interpreter, in this environment.

The README's install puts torchvision's CUDA wheel beside a CPU torch; ``import torchvision`` (and
timm, segmentation_models_pytorch, lightning, which import it) then raises ``operator
torchvision::nms does not exist`` unless the fix in ``bigconv.compat`` ran first. An installed bigconv
runs it from torch's ``torch.backends`` entry point (``pyproject.toml``). The fresh interpreters here
see that entry point through a dist-info written from ``pyproject.toml``'s own declaration, so the test
holds whether or not the environment's bigconv was installed before the declaration existed. A failure
points at ``bigconv.import_guard`` (the plugin, the guard) or at the declaration.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ["timm", "torchvision", "segmentation_models_pytorch", "lightning"]


def _declared() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["torch.backends"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding a dist-info whose entry points are pyproject.toml's ``torch.backends`` ones."""
    folder = tmp_path_factory.mktemp("site")
    info = folder / "bigconv_entry_points-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bigconv-entry-points\nVersion: 0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in _declared().items())
    (info / "entry_points.txt").write_text("[torch.backends]\n" + lines)
    return folder


def _run(code: str, site: Path, **env) -> subprocess.CompletedProcess:
    import os

    environ = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}", **env}
    # Run outside the checkout, so nothing but PYTHONPATH puts bigconv on the path.
    return subprocess.run([sys.executable, "-c", code], cwd=site, env=environ, capture_output=True, text=True,
                          timeout=240)


def test_the_entry_point_is_declared_and_callable():
    assert _declared() == {"bigconv_torchvision_guard": "bigconv.import_guard:torch_plugin"}
    from bigconv import import_guard

    import_guard.torch_plugin()  # idempotent: one guard, whatever the calls
    import_guard.torch_plugin()
    assert sum(isinstance(f, import_guard.TorchvisionGuard) for f in sys.meta_path) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("library", LIBRARIES)
def test_each_library_imports_first_in_a_fresh_interpreter(site, library):
    if importlib.util.find_spec(library) is None:
        pytest.fail(f"{library} is not installed; the README's install (requirements.txt) installs it")
    code = f"import {library}, sys; print('imported', sorted(m for m in sys.modules if m.startswith('bigconv')))"
    done = _run(code, site)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported" in done.stdout
    # The plugin loads only bigconv's root, the guard and compat, never its runtime.
    assert "['bigconv', 'bigconv.compat', 'bigconv.import_guard']" in done.stdout, done.stdout


@pytest.mark.timeout(300)
def test_torchvision_models_run_after_importing_timm_first(site):
    code = ("import timm, torch, torchvision\n"
            "out = torchvision.models.resnet18(weights=None, num_classes=3).eval()(torch.randn(1, 3, 32, 32))\n"
            "print(tuple(out.shape))")
    done = _run(code, site)
    assert done.returncode == 0 and "(1, 3)" in done.stdout, done.stderr[-3000:]


@pytest.mark.timeout(300)
def test_import_torch_alone_loads_no_torchvision(site):
    done = _run("import torch, sys; print('torchvision' in sys.modules)", site)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-3000:]


@pytest.mark.timeout(300)
def test_without_the_plugin_this_environment_fails(site):
    """The control: with torch's plugins off, ``import timm`` fails here where torchvision's ops cannot load,
    so the tests above see the plugin's effect, not an environment that never needed it."""
    probe = _run("import torch, glob, os, importlib.util as u\n"
                 "d = os.path.dirname(u.find_spec('torchvision').origin)\n"
                 "ok = False\n"
                 "for lib in glob.glob(os.path.join(d, '_C*.so')):\n"
                 "    try:\n        torch.ops.load_library(lib); ok = True\n"
                 "    except (OSError, RuntimeError):\n        pass\n"
                 "print('loads' if ok else 'cannot')", site, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert probe.returncode == 0, probe.stderr[-3000:]
    if "loads" in probe.stdout:
        pytest.skip("torchvision's compiled ops load in this environment: there is nothing for the plugin to fix")
    done = _run("import timm", site, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert done.returncode != 0 and "torchvision::nms does not exist" in done.stderr, done.stderr[-3000:]


@pytest.mark.timeout(300)
def test_calling_the_fix_directly_beside_the_guard(site):
    """bigconv imported first (torch's plugin then loads while bigconv is half imported), and the fix called
    directly as workers and the test zoo do: the guard must not run it a second time from inside that call
    (torch refuses a second library for one namespace)."""
    code = ("import bigconv.compat as c\n"
            "c.allow_torchvision_without_ops(); c.allow_torchvision_without_ops()\n"
            "import timm\nprint('ok')")
    done = _run(code, site)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
