"""Checkpoint and resume: a preempted run continues as if it had never stopped.

What a new World restores from a file is bit for bit what was saved (weights, buffers, optimizer
state, step count). 3 steps then equal 1 step, save, a new World, load, 2 steps, to 1e-12 on the
same or another worker count, and a plain model and optimizer continue from the same file exactly.

Why not bit for bit after the 2 steps as well: distributed autograd runs a worker's backward on
whichever RPC threads deliver its gradients, so on a loaded host the order in which two gradient
contributions are added can change from run to run, and with it a last bit (seen once in 15 steps
of the same uninterrupted run under a CPU burner; never on an idle host).
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path
import pathlib
import struct
import zipfile

import numpy as np
import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv import saving
from bigconv.models import CNN1D, CNN2D

TOL = 1e-12


def make_model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    # No bias before the BatchNorm: its gradient is zero up to rounding, which Adam would scale up to
    # lr-sized steps that differ with the rounding of each worker count.
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).double()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 1, 12, 10, generator=g, dtype=torch.float64), torch.randint(0, 3, (2,), generator=g))
            for _ in range(n)]


def train(net, data) -> None:
    for x, y in data:
        net.train_step(x, y, nn.CrossEntropyLoss())


def rel(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / (b[k].double().abs().max() + 1e-300))
               for k in b if b[k].is_floating_point())


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


def fresh(world, grid=None):
    net = bigconv.parallelize(make_model(seed=99), world, grid=grid)  # load must overwrite every weight
    net.optimizer(torch.optim.Adam, lr=0.01, betas=(0.8, 0.9))
    return net


@pytest.mark.own_world
@pytest.mark.timeout(240)
def test_resume_equals_uninterrupted_training(world_manager, tmp_path):
    data = batches(3)
    world = world_manager.get(2)
    ref = bigconv.parallelize(make_model(), world, grid=(2, 1))
    ref.optimizer(torch.optim.Adam, lr=0.01, betas=(0.8, 0.9))
    train(ref, data)
    want = ref.state_dict()

    first = bigconv.parallelize(make_model(), world, grid=(2, 1))
    first.optimizer(torch.optim.Adam, lr=0.01, betas=(0.8, 0.9))
    train(first, data[:1])
    path = first.save(tmp_path / "ck.pt")
    assert os.listdir(tmp_path) == ["ck.pt"]  # no temporary file left behind
    assert _bitwise_equal(torch.load(path, weights_only=True)["model"], first.state_dict())

    world_manager.close()  # the job is preempted
    world = world_manager.get(2)
    again = fresh(world, grid=(2, 1))
    again.load(path)
    assert again.steps == 1
    saved, restored = torch.load(path, weights_only=True), torch.load(again.save(tmp_path / "again.pt"),
                                                                      weights_only=True)
    assert _bitwise_equal(saved["model"], restored["model"]) and _bitwise_equal(saved["optimizer"],
                                                                                restored["optimizer"])
    train(again, data[1:])
    assert rel(again.state_dict(), want) <= TOL

    world = world_manager.get(4)
    other = fresh(world, grid=(2, 2))
    other.load(path)
    train(other, data[1:])
    assert rel(other.state_dict(), want) <= TOL

    plain = make_model()
    ck = torch.load(path, weights_only=True)
    plain.load_state_dict(ck["model"])
    opt = torch.optim.Adam(plain.parameters(), lr=0.01, betas=(0.8, 0.9))
    opt.load_state_dict(ck["optimizer"])
    for x, y in data[1:]:
        opt.zero_grad()
        nn.CrossEntropyLoss()(plain(x), y).backward()
        opt.step()
    assert rel(plain.state_dict(), want) <= 1e-9


def _corrupt(path, tmp_path):
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(open(path, "rb").read()[:300])
    return bad


def _flip_a_bit(path, record: str = "data/0") -> None:
    """Flip one bit inside the first tensor's bytes (a disk or copy error): the file stays a valid zip."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record))
    data = bytearray(open(path, "rb").read())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + 6] ^= 0x04  # a mantissa bit of the first float64
    open(path, "wb").write(bytes(data))


@pytest.mark.world(2)
@pytest.mark.parametrize("case,match", [
    ("truncated", "truncated, corrupt or not a torch file"),
    ("bitflip", r"ck.pt' is corrupt: Bad CRC-32 for file '\w+/data/0'.*use an intact copy"),
    ("missing", "no checkpoint at"),
    ("foreign", "not a bigconv checkpoint"),
    ("architecture", r"from another architecture: it has no 'features.0.weight'"),
    ("no_optimizer", r"has no optimizer; call net.optimizer\(torch.optim.adam.Adam"),
    ("other_optimizer", "this model's optimizer is torch.optim.sgd.SGD"),
])
def test_a_bad_checkpoint_is_refused_and_leaves_the_model_alone(world, tmp_path, rpc_calls, case, match):
    src = fresh(world)
    train(src, batches(1))
    path = src.save(tmp_path / "ck.pt")
    target = bigconv.parallelize(make_model(), world)
    if case != "no_optimizer":
        target.optimizer(torch.optim.SGD if case == "other_optimizer" else torch.optim.Adam, lr=0.01)
    if case == "truncated":
        path = _corrupt(path, tmp_path)
    elif case == "bitflip":
        _flip_a_bit(path)
    elif case == "missing":
        path = tmp_path / "nothing.pt"
    elif case == "foreign":
        torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
        path = tmp_path / "foreign.pt"
    elif case == "architecture":
        target = bigconv.parallelize(CNN2D(in_channels=1, num_classes=3).double(), world)
        target.optimizer(torch.optim.Adam, lr=0.01)
    before = target.state_dict()
    rpc_calls.clear()
    with pytest.raises(ValueError, match=match):
        target.load(path)
    assert rpc_calls == [], "the checks must run before any worker is touched"
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_crash_while_writing_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    saving.atomic_save({"format": saving.FORMAT, "step": 1}, path)

    def torn(obj, fh):
        fh.write(b"half a file")
        raise KeyboardInterrupt  # the job is killed mid-write

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(KeyboardInterrupt):
        saving.atomic_save({"format": saving.FORMAT, "step": 2}, path)
    monkeypatch.undo()
    assert saving.read(path)["step"] == 1
    assert os.listdir(tmp_path) == ["ck.pt"]


@pytest.mark.world(2)
def test_a_plain_checkpoint_of_a_model_without_optimizer_loads_weights_only(world, tmp_path):
    src = bigconv.parallelize(CNN1D(1, 2).double(), world)
    path = src.save(tmp_path / "w.pt")
    ck = torch.load(path, weights_only=True)
    assert ck["optimizer"] is None and ck["step"] == 0 and len(ck["rng"]["workers"]) == 2
    dst = bigconv.parallelize(copy.deepcopy(CNN1D(1, 2).double()), world)
    dst.load(path)
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))


def test_an_interrupted_save_leaves_no_debris_after_the_next(tmp_path):
    """A save killed between its write and its rename (a preempted job) leaves a temporary file; the
    next save of that path removes it, and only names (never deletes) look-alikes it cannot place."""
    import signal
    import subprocess
    import sys

    script = (
        "import os, signal, torch\n"
        "from bigconv import saving\n"
        "def dying(obj, fh):\n"
        "    fh.write(b'x' * 4096); fh.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "torch.save = dying\n"
        f"saving.atomic_save({{'a': 1}}, {str(tmp_path / 'ck.pt')!r})\n"
    )
    for _ in range(2):  # preempted twice
        done = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, check=False)
        assert done.returncode == -signal.SIGKILL, done.stderr
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".tmp")]) == 1  # the second swept the first's
    (tmp_path / "ck.pt.notes.tmp").write_text("not ours")
    with pytest.warns(UserWarning, match="ck.pt.notes.tmp"):
        saving.atomic_save({"a": 2}, tmp_path / "ck.pt")
    assert sorted(os.listdir(tmp_path)) == ["ck.pt", "ck.pt.notes.tmp"]
    assert torch.load(tmp_path / "ck.pt") == {"a": 2}


@pytest.mark.world(2)
@pytest.mark.parametrize("extra,where,kind", [
    ({"args": argparse.Namespace(lr=0.1)}, r"extra\['args'\]", r"argparse.Namespace.*vars\(args\)"),
    ({"out": pathlib.Path("runs")}, r"extra\['out'\]", r"pathlib.PosixPath.*str\(path\)"),
    ({"stats": {"mean": np.zeros(3)}}, r"extra\['stats'\]\['mean'\]", r"numpy.ndarray.*torch.from_numpy"),
])
def test_save_refuses_what_load_cannot_read_back(world, tmp_path, extra, where, kind):
    """Issue 52: such values were written, and load then called the good file corrupt. Refused before a byte
    is written, naming the entry and its type; the file already there stays loadable."""
    net = fresh(world)
    path = net.save(tmp_path / "ck.pt")
    train(net, batches(1))
    with pytest.raises(ValueError, match=f"cannot save {where}, of type {kind}.*Nothing was written"):
        net.save(path, extra=extra)
    assert saving.read(path)["step"] == 0 and os.listdir(tmp_path) == ["ck.pt"]
    with pytest.raises(ValueError, match="cannot save epoch"):
        net.save(path, epoch=Path("3"))
    assert net.epoch is None  # a refused epoch is not kept for the next save
    net.save(path)


@pytest.mark.world(2)
def test_numpy_scalars_are_saved_as_the_numbers_they_hold(world, tmp_path):
    """An epoch from ``np.arange`` made every later save of the model unloadable: numpy scalars are stored as
    Python numbers (``.item()``), the epoch carried by the next saves included."""
    net = fresh(world)
    train(net, batches(1))
    net.save(tmp_path / "a.pt", extra={"lr": np.float32(0.5), "seen": [np.int64(3), np.bool_(True)]},
             epoch=np.int64(4))
    net.save(tmp_path / "b.pt")  # the model keeps the epoch it was given
    extra = saving.read(tmp_path / "a.pt")["extra"]
    assert extra == {"lr": 0.5, "seen": [3, True]} and [type(v) for v in extra["seen"]] == [int, bool]
    other = fresh(world)
    other.load(tmp_path / "b.pt")
    assert other.epoch == 4 and type(other.epoch) is int


def test_an_intact_file_a_safe_load_refuses_is_not_called_corrupt(tmp_path):
    """A file an older bigconv wrote with such a value is intact: the error says what it holds and how to read
    it if trusted, never "corrupt"."""
    path = tmp_path / "old.pt"
    torch.save({"format": saving.FORMAT, "version": saving.VERSION, "extra": {"args": argparse.Namespace(lr=1)}},
               path)
    with pytest.raises(ValueError) as info:
        saving.read(path)
    message = str(info.value)
    assert "is intact but holds a value of type argparse.Namespace" in message and "corrupt" not in message
    with torch.serialization.safe_globals([argparse.Namespace]):  # the way the message gives
        assert saving.read(path)["extra"]["args"].lr == 1


@pytest.mark.world(2)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(world, tmp_path, monkeypatch):
    """Issue 52: a full disk read ``RuntimeError: [enforce fail at inline_container.cc...]``. The save's
    temporary file is written to /dev/full, whose every write fails with ENOSPC as a full disk's does."""
    net = fresh(world)
    path = net.save(tmp_path / "ck.pt")
    train(net, batches(1))
    real = saving.tempfile.mkstemp

    def on_a_full_disk(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(saving.tempfile, "mkstemp", on_a_full_disk)
    with pytest.raises(OSError, match=r"cannot write the checkpoint .*ck.pt': the disk is full where it goes "
                                      r"\('.*'.*MiB free there\); the previous checkpoint at .*ck.pt' is kept"):
        net.save(path)
    monkeypatch.undo()
    assert saving.read(path)["step"] == 0 and os.listdir(tmp_path) == ["ck.pt"]
