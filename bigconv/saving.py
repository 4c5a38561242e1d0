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

What a file may hold is what ``torch.load(weights_only=True)`` reads back (so that loading never runs code
from the file): None, bools, numbers, strings, bytes, tensors, torch sizes, dtypes and devices, and lists,
tuples, dicts and sets of them. ``checkpoint`` refuses anything else before a byte is written, naming the
entry (e.g. ``extra['args']``) and its type; numpy scalars (``np.int64(3)``, ``np.float32(0.5)``) are
stored as the Python number they hold (``.item()``).

Integrity: every record of the file carries a CRC-32 (``torch.save`` writes them; ``atomic_save`` makes
sure it does), which ``read`` checks before it trusts a byte, so a changed bit is an error naming the
file, not a weight that is silently off.
"""

from __future__ import annotations

import errno
import glob
import io
import os
import re
import shutil
import socket
import sys
import tempfile
import warnings
import zipfile
from collections import Counter, OrderedDict
from typing import Any

import torch

FORMAT = "bigconv-checkpoint"
VERSION = 1


def _owner_tag() -> str:
    """This process in a temporary file's name: host (dots kept out) and pid."""
    return f"{socket.gethostname().replace('.', '_')}.{os.getpid()}"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (another user's counts as running)."""
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
        if match and match["host"] == host and int(match["pid"]) != os.getpid() and not process_alive(int(match["pid"])):
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
    and the temporary files of earlier interrupted saves are removed (``sweep_stale``). A full disk is an
    ``OSError`` saying so and where; the old file stays as it was."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    sweep_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(path)}.{_owner_tag()}.", suffix=".tmp", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it, not mkstemp's owner-only mode
    crc = torch.serialization.get_crc32_options()
    try:
        torch.serialization.set_crc32_options(True)  # read checks them (someone may have turned them off)
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        full = _no_space(exc)
        if full is not None:
            raise OSError(full.errno, _disk_full_message(path, folder, full)) from exc
        raise
    finally:
        torch.serialization.set_crc32_options(crc)
    try:  # the rename itself must reach the disk too
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _no_space(exc: BaseException) -> OSError | None:
    """The no-space error (a full disk or quota) behind ``exc``, if any: torch's own writer reports it as a
    bare ``RuntimeError: [enforce fail at inline_container.cc...]`` with the ``OSError`` as its context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _disk_full_message(path: str, folder: str, exc: OSError) -> str:
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "free space unknown"
    what = "the disk quota of this account is used up" if exc.errno == errno.EDQUOT else "the disk is full"
    kept = f"the previous checkpoint at {path!r} is kept as it was" if os.path.exists(path) else "nothing was written"
    return (f"cannot write the checkpoint {path!r}: {what} where it goes ({folder!r}, {free}); {kept}. Free some "
            "space there or save elsewhere")


def verify(path: str) -> bool:
    """Check every record's CRC-32 in the zip file torch wrote at ``path``; a ValueError naming the file and
    the first bad record. False where nothing could be checked (not a zip file: ``torch.load`` decides; a
    record whose CRC is 0 is one written with CRCs turned off and is not checked)."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                with archive.open(info) as record:  # raises at its end if the CRC differs
                    while record.read(2**24):
                        pass
    except Exception as exc:  # noqa: BLE001 - a bad CRC, header or name: the file changed after it was written
        raise ValueError(f"the checkpoint {path!r} is corrupt: {exc} (its bytes changed after it was written); "
                         "use an intact copy") from exc
    return True


def read(path: str | os.PathLike) -> dict:
    """A checkpoint written by ``save``; a clear ValueError for a missing, truncated, corrupt (checked by the
    records' CRCs) or foreign file, and for an intact one holding a value a weights-only load does not read."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint at {path!r}; give the path that net.save() wrote")
    intact = verify(path)
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        unsupported = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if intact and unsupported:
            name = unsupported.group(1)
            raise ValueError(
                f"the checkpoint {path!r} is intact but holds a value of type {name}, which a weights-only load "
                "does not read "
                "(bigconv never runs code from a checkpoint). An older bigconv wrote such values from "
                "save(extra=...) or epoch=; if you trust the file, load it with "
                f"`with torch.serialization.safe_globals([{name}]): ...` around the load, then save it again"
            ) from exc
        raise ValueError(
            f"cannot read the checkpoint {path!r}: it is truncated, corrupt or not a torch file "
            f"({type(exc).__name__}: {first}); use an intact copy"
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
    """The file's content (see the module's docstring); ``fields`` adds entries such as ``extra``. Refused (a
    ValueError naming the entry and its type) when it holds what ``read`` could not read back."""
    ck = {"format": FORMAT, "version": VERSION, "model": model, "optimizer": optimizer,
          "optimizer_class": optimizer_class, "step": step,
          "rng": {"driver": torch.get_rng_state(), "workers": worker_rng or []}, "workers": workers, **fields}
    return {key: plain(value, key) for key, value in ck.items()}


_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype, torch.device,
           torch.Tensor, torch.nn.Parameter)
_HINTS = {"pathlib": "store str(path) instead", "argparse.Namespace": "store vars(args) instead",
          "numpy.ndarray": "store torch.from_numpy(array) or array.tolist() instead",
          "datetime": "store value.isoformat() instead"}


def plain(value: Any, where: str) -> Any:
    """``value`` as a checkpoint may hold it (see the module's docstring): numpy scalars become the Python
    number they hold; anything ``torch.load(weights_only=True)`` would not read back is a ValueError naming
    ``where`` (e.g. ``extra['args']``) and its type, before anything is written."""
    kind = type(value)
    if kind in _LEAVES:
        return value
    if kind in (dict, OrderedDict, Counter):
        items = [(plain(k, f"{where} key {k!r}"), plain(v, f"{where}[{k!r}]")) for k, v in value.items()]
        same = all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, value.items()))
        return value if same else kind(items)  # as it was (a state dict's _metadata too) unless a number changed
    if kind in (list, tuple, set):
        elements = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value if all(e is v for e, v in zip(elements, value)) else kind(elements)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic) and not isinstance(value, numpy.datetime64):
        return plain(value.item(), where)
    if not _reads_back(value):
        name = f"{kind.__module__}.{kind.__qualname__}"
        hint = next((h for prefix, h in _HINTS.items() if name.startswith(prefix)),
                    "store plain data instead: None, bool, int, float, str, bytes, tensors, and lists, tuples, "
                    "dicts and sets of them")
        raise ValueError(f"cannot save {where}, of type {name}: torch.load(weights_only=True) does not read that "
                         f"type back (bigconv never runs code from a checkpoint); {hint}. Nothing was written")
    return value


def _reads_back(value: Any) -> bool:
    """Whether a weights-only load reads ``value`` back (a tensor subclass, a named tuple...): tried in memory."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - whatever the reason, the file would not load
        return False
    return True


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

