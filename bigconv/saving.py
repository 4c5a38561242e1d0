"""Checkpoint files: one atomic write, readable by a plain model and optimizer.

The file is a ``torch.save`` of plain data (loadable with ``weights_only=True``):

- ``"model"``: weights and buffers under the single-process names;
- ``"optimizer"``: the state a plain optimizer over ``model.parameters()`` would hold (its
  ``state_dict()``), or None;
- ``"optimizer_class"``, ``"step"``, ``"rng"`` (the driver's and each worker's generator states),
  ``"workers"``, ``"format"``, ``"version"``;
- ``"scheduler"`` (the ``scheduler=`` factory's scheduler's ``state_dict()``, or None) and ``"epoch"``
  (what ``save(..., epoch=)`` was given, or None): with the above, what a preempted run needs to resume
  exactly;
- ``"ema"``: the driver mode's moving average of the weights (``net.optimizer(..., ema=)``) under the
  single-process names, where one is kept;
- ``"draws"``: ``{"seed", "forwards"}`` of the model's random draws (``bigconv.ops.random``), so that a
  resumed run draws the dropout masks the saved run would have drawn next (absent in older files).

A plain process continues with ``model.load_state_dict(ck["model"])`` and
``optimizer.load_state_dict(ck["optimizer"])``.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import tempfile
import warnings
from typing import Any

import torch

FORMAT = "bigconv-checkpoint"
VERSION = 1


def _owner_tag() -> str:
    """This process in a temporary file's name: host (dots kept out) and pid."""
    return f"{socket.gethostname().replace('.', '_')}.{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_stale(path: str) -> None:
    """Remove the temporary files that interrupted saves of ``path`` left (a SIGTERM or SIGKILL between
    the write and the rename: a preempted job repeats it every time), and name in a warning those we
    cannot tell are dead. Ours are ``NAME.HOST.PID.RANDOM.tmp``: one whose process on this host is gone
    is debris; anything else that looks like one (another host's, an older bigconv's, a user's) is
    only named, never deleted."""
    folder, name = os.path.split(os.path.abspath(path))
    ours = re.compile(re.escape(name) + r"\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[^.]+\.tmp$")
    host = socket.gethostname().replace(".", "_")
    unknown = []
    for other in sorted(glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".*.tmp"))):
        match = ours.match(os.path.basename(other))
        if match and match["host"] == host and int(match["pid"]) != os.getpid() and not _alive(int(match["pid"])):
            try:
                os.unlink(other)
            except FileNotFoundError:  # another save swept it first
                pass
        else:
            unknown.append(other)
    if unknown:
        warnings.warn(f"temporary files beside {path!r} may be left by interrupted saves: {', '.join(unknown)}; "
                      "delete them if no save of this file is running", stacklevel=3)


def atomic_save(obj: Any, path: str | os.PathLike) -> str:
    """Write ``obj`` to ``path`` so that a crash leaves the old file or the new one, never a torn one;
    and the temporary files of earlier interrupted saves are removed (``sweep_stale``)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    sweep_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(path)}.{_owner_tag()}.", suffix=".tmp", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it, not mkstemp's owner-only mode
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # the rename itself must reach the disk too
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def read(path: str | os.PathLike) -> dict:
    """A checkpoint written by ``save``; a clear ValueError for a missing, truncated or foreign file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path!r}; give the path that net.save() wrote")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"cannot read the checkpoint {path!r}: it is truncated, corrupt or not a torch file "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); use an intact copy"
        ) from exc
    if not (isinstance(ck, dict) and ck.get("format") == FORMAT):
        raise ValueError(f"{path!r} is not a bigconv checkpoint (no format tag {FORMAT!r}); write it with net.save()")
    if ck.get("version", 0) > VERSION:
        raise ValueError(f"{path!r} was written by a newer bigconv (format version {ck['version']}); upgrade bigconv")
    return ck


def check_model_state(saved: dict, expected: dict, path: str) -> None:
    """The saved weights fit a model whose state dict is ``expected`` (names, shapes, dtypes)."""
    for name, tensor in expected.items():
        if name not in saved:
            raise ValueError(
                f"the checkpoint {path!r} is from another architecture: it has no {name!r}; "
                "load it into the model it was saved from"
            )
        got = saved[name]
        if tuple(got.shape) != tuple(tensor.shape):
            raise ValueError(
                f"the checkpoint {path!r} is from another architecture: {name!r} has shape {tuple(got.shape)} there "
                f"but {tuple(tensor.shape)} in this model; load it into the model it was saved from"
            )
    extra = [k for k in saved if k not in expected]
    if extra:
        raise ValueError(
            f"the checkpoint {path!r} is from another architecture: this model has no {extra[0]!r}; "
            "load it into the model it was saved from"
        )


def check_optimizer_state(saved: dict | None, saved_class: str | None, params_per_group: list[int],
                          current_class: str | None, path: str) -> None:
    if saved is None:
        return
    if current_class is None:
        raise ValueError(
            f"the checkpoint {path!r} holds {saved_class} state but this model has no optimizer; call "
            f"net.optimizer({saved_class}, ...) with the arguments of the saved run before net.load()"
        )
    if current_class != saved_class:
        raise ValueError(
            f"the checkpoint {path!r} holds {saved_class} state but this model's optimizer is {current_class}; "
            f"create it with net.optimizer({saved_class}, ...)"
        )
    groups = [len(g["params"]) for g in saved["param_groups"]]
    if groups != params_per_group:
        raise ValueError(
            f"the checkpoint {path!r} has parameter groups of sizes {groups} but this model's optimizer has "
            f"{params_per_group}; create the optimizer over the same parameters as the saved run"
        )


def check_scheduler_state(saved: dict | None, has_scheduler: bool, path: str) -> None:
    if saved is not None and not has_scheduler:
        raise ValueError(f"the checkpoint {path!r} holds a learning-rate scheduler's state but this model's optimizer "
                         "has none; create it with net.optimizer(..., scheduler=...) as in the saved run before "
                         "net.load()")


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def checkpoint(model: dict, optimizer: dict | None, optimizer_class: str | None, step: int,
               worker_rng: list | None = None, workers: int = 0, **fields) -> dict:
    """The file's content (see the module's docstring); ``fields`` adds entries such as ``extra``."""
    return {"format": FORMAT, "version": VERSION, "model": model, "optimizer": optimizer,
            "optimizer_class": optimizer_class, "step": step,
            "rng": {"driver": torch.get_rng_state(), "workers": worker_rng or []}, "workers": workers, **fields}


def to_cpu(obj):
    """A detached CPU copy of every tensor in a nest of dicts, lists and tuples (optimizer state)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)

