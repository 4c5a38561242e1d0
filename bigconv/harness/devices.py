"""Accelerators and interconnects the planner (``bigconv.harness.cost_model``) knows by name, with sources.

Every figure is the vendor's datasheet number unless its comment says otherwise; the *efficiencies* (how
much of a peak a training step sustains) are not datasheet numbers: where they were fitted to a published
measurement the comment says which and how (``python -m experiments.planner anchors`` refits them), and
where they are assumptions the comment says so. A user passes their own figures as ``NAME:key=value,...``
(``h100-80gb:memory_gib=64``), or a whole device as a JSON file of the same keys (``my_gpu.json``).

Units inside: bytes, FLOP/s, bytes/s, seconds. The keys users write: ``memory_gib``, ``reserve_gib``,
``<dtype>_tflops`` and ``<dtype>_efficiency`` (dtype: float64, float32, tf32, bfloat16, float16),
``hbm_gbs``, ``hbm_efficiency``, ``op_overhead_us``, ``gpus_per_node``, ``nics_per_node``; for links
``gbs`` (GB/s per direction, 1e9 bytes), ``latency_us``, ``message_overhead_us``, ``p2p_efficiency``,
``collective_efficiency``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .model_spec import parse_kwargs

GiB = 2**30
T = 1e12
G = 1e9
DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or a CPU host, see ``cpu_device``), as a training step sees it."""

    name: str
    memory_bytes: int
    """What CUDA reports as the device's total memory (``torch.cuda.get_device_properties().total_memory``)."""
    reserve_bytes: int
    """Held outside PyTorch's allocator on every process: CUDA context, cuBLAS/cuDNN handles, NCCL buffers."""
    flops: dict
    """dtype -> peak dense FLOP/s of the units that run convolutions and matmuls in that dtype."""
    efficiency: dict
    """dtype -> fraction of ``flops`` a convolution or matmul sustains in a training step."""
    hbm_bytes_s: float
    """Peak memory bandwidth: the bound of every op that is not a matmul (norms, activations, adds, copies)."""
    hbm_efficiency: float = 0.8
    op_overhead_s: float = 5e-6
    """Per op launched (kernel launch and framework dispatch), forward and backward each."""
    conv_float32: str = "float32"
    """The rate float32 convolutions run at: ``tf32`` where cuDNN uses TF32 by default (PyTorch's
    ``torch.backends.cudnn.allow_tf32`` is True), float32 matmuls stay float32 (``allow_tf32`` False)."""
    conv_workspace: tuple = (0.0, 0.0, 0.0)
    """Transient memory of a convolution beyond its operands, as multiples of (forward: its output; backward:
    its input, its output gradient). Zero for GPUs: cuDNN takes workspace from what is free, and picks
    another algorithm where none is (this project's H100 fitted 8064² CNN2D with none, see ``benchmarks/planner.md``)."""
    gpus_per_node: int = 8
    nics_per_node: int = 8
    """Network ports per node for the inter-node link; the GPUs of a node share them."""
    intra: str = "nvlink4"
    """The link between GPUs of one node this device usually comes with."""
    inter: str = "ib-ndr"
    sources: str = ""
    cores: int = 0
    """CPU hosts only: cores the processes of one host share (0 for an accelerator: one process each)."""
    co_run_slowdown: dict = field(default_factory=dict)
    """CPU hosts only: processes on the host -> how much slower each one computes than one alone."""

    def rate(self, dtype: str, conv: bool) -> float:
        """Sustained FLOP/s of a convolution (``conv``) or another matmul in ``dtype``."""
        key = self.conv_float32 if conv and dtype == "float32" else dtype
        if key not in self.flops:
            raise ValueError(f"{self.name} has no {key} throughput in the device table; give it as "
                             f"{self.name}:{key}_tflops=...,{key}_efficiency=...")
        return self.flops[key] * self.efficiency.get(key, self.efficiency.get("default", 0.5))

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


@dataclass(frozen=True, kw_only=True)
class Link:
    """One interconnect, per GPU pair (intra-node) or per network port (inter-node)."""

    name: str
    bytes_s: float
    """Peak bandwidth per direction."""
    latency_s: float
    """Time of the smallest message through the communication library (NCCL, gloo): software included."""
    message_overhead_s: float = 1e-6
    """Each further message of one batched exchange (a batch's messages travel concurrently)."""
    p2p_efficiency: float = 0.8
    """Fraction of ``bytes_s`` point-to-point messages (the halos) reach."""
    collective_efficiency: float = 0.8
    """Fraction of ``bytes_s`` a ring allreduce's bus bandwidth reaches."""
    sync_s: float = 0.0
    """Per exchange, a wait no compute hides: the peer getting a core when processes share a CPU host's
    cores (measured there; 0 for GPUs, one process each)."""
    between_nodes: bool = False
    """A network port between nodes (InfiniBand, Slingshot), not a link between the GPUs of one node."""
    sources: str = ""


# -- the table -------------------------------------------------------------------------------------------

_HOPPER_RESERVE = int(1.8e9)
"""Measured on this project's H100 and H200 (one rank; torch 2.11, CUDA 13): NVML's per-process memory less
the allocator's reserved bytes, 1.79e9 both times (results/gpu_bench.jsonl, the largest-edge records)."""
_OTHER_RESERVE = int(1.5e9)
"""Assumed for Ampere and Volta (no measurement here): a CUDA context of ~0.5-1 GB with cuDNN and NCCL."""

_FIT = {"a100": {"tf32": 0.253, "bfloat16": 0.475, "float16": 0.475, "float32": 0.908, "float64": 0.908},
        "v100": {"float32": 0.908, "float16": 0.689, "bfloat16": 0.908, "float64": 0.908}}
"""Convolution efficiencies fitted to NVIDIA's DeepLearningExamples ResNet-50 v1.5 PyTorch training
throughput on one GPU (pytorch-21.03 container; github.com/NVIDIA/DeepLearningExamples,
PyTorch/Classification/ConvNets/resnet50v1.5/README.md): A100 80GB 938 img/s TF32 (fitted 0.253) and 2,470
img/s mixed precision (0.475); V100 16GB 367 img/s FP32 (0.908) and 1,200 img/s mixed precision (0.689). The
fit (``python -m experiments.planner anchors``, results/planner_anchors.jsonl): this cost model's step of
torchvision's resnet50 at 224² as plain PyTorch runs it (cuDNN's BatchNorm, no shards), the README's batch,
the memory-bound ops at ``hbm_efficiency`` 0.8 and ``op_overhead_s`` 5 µs, solved for the efficiency that
gives the published throughput. bfloat16 takes float16's fraction (the same tensor-core rate); float32
matmuls and float64 on A100 take V100's FP32 fraction (no anchor of their own). Hopper has no anchor here:
its entries take Ampere's fractions, so an H100's predicted step is an A100-efficiency step at H100 peaks."""

GPUS: dict[str, Device] = {d.name: d for d in (
    Device(name="h100-80gb", memory_bytes=85_017_493_504, reserve_bytes=_HOPPER_RESERVE,
           flops={"float64": 66.9 * T, "float32": 66.9 * T, "tf32": 494.7 * T, "bfloat16": 989.4 * T,
                  "float16": 989.4 * T},
           efficiency=dict(_FIT["a100"]), hbm_bytes_s=3.35e12, conv_float32="tf32", intra="nvlink4",
           inter="ib-ndr", gpus_per_node=8, nics_per_node=8,
           sources="NVIDIA H100 Tensor Core GPU datasheet (SXM5: FP64 tensor 67, FP32 67, TF32 495, BF16/FP16 "
                   "989 TFLOPS dense; HBM3 3.35 TB/s); memory as CUDA reported it on this project's H100 80GB "
                   "HBM3 (results/gpu_bench.jsonl); DGX H100: 8 GPUs, 8 ConnectX-7 NDR ports"),
    Device(name="h200", memory_bytes=150_109_880_320, reserve_bytes=_HOPPER_RESERVE,
           flops={"float64": 66.9 * T, "float32": 66.9 * T, "tf32": 494.7 * T, "bfloat16": 989.4 * T,
                  "float16": 989.4 * T},
           efficiency=dict(_FIT["a100"]), hbm_bytes_s=4.8e12, conv_float32="tf32", intra="nvlink4",
           inter="ib-ndr", gpus_per_node=8, nics_per_node=8,
           sources="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e at 4.8 TB/s, H100's compute); "
                   "memory as CUDA reported it on this project's H200 (results/gpu_bench.jsonl)"),
    Device(name="a100-80gb", memory_bytes=int(79.15 * GiB), reserve_bytes=_OTHER_RESERVE,
           flops={"float64": 19.5 * T, "float32": 19.5 * T, "tf32": 156 * T, "bfloat16": 312 * T, "float16": 312 * T},
           efficiency=dict(_FIT["a100"]), hbm_bytes_s=2.039e12, conv_float32="tf32", intra="nvlink3",
           inter="ib-hdr", gpus_per_node=8, nics_per_node=8,
           sources="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: FP64 tensor 19.5, FP32 19.5, TF32 156, "
                   "BF16/FP16 312 TFLOPS dense; HBM2e 2,039 GB/s); memory: the 79.15 GiB CUDA's out-of-memory "
                   "messages report; DGX A100: 8 GPUs, 8 HDR ports"),
    Device(name="a100-40gb", memory_bytes=int(39.59 * GiB), reserve_bytes=_OTHER_RESERVE,
           flops={"float64": 19.5 * T, "float32": 19.5 * T, "tf32": 156 * T, "bfloat16": 312 * T, "float16": 312 * T},
           efficiency=dict(_FIT["a100"]), hbm_bytes_s=1.555e12, conv_float32="tf32", intra="nvlink3",
           inter="ib-hdr", gpus_per_node=8, nics_per_node=8,
           sources="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: HBM2 1,555 GB/s); memory: the 39.59 GiB "
                   "CUDA's out-of-memory messages report"),
    Device(name="v100-32gb", memory_bytes=int(31.75 * GiB), reserve_bytes=_OTHER_RESERVE,
           flops={"float64": 7.8 * T, "float32": 15.7 * T, "float16": 125 * T, "bfloat16": 15.7 * T},
           efficiency=dict(_FIT["v100"]), hbm_bytes_s=0.9e12, intra="nvlink2", inter="ib-edr",
           gpus_per_node=8, nics_per_node=4,
           sources="NVIDIA Tesla V100 datasheet (SXM2: FP64 7.8, FP32 15.7, tensor FP16 125 TFLOPS; HBM2 900 "
                   "GB/s; no bfloat16 units: bfloat16 runs at the FP32 rate); memory: the 31.75 GiB CUDA reports"),
    Device(name="v100-16gb", memory_bytes=int(15.78 * GiB), reserve_bytes=_OTHER_RESERVE,
           flops={"float64": 7.8 * T, "float32": 15.7 * T, "float16": 125 * T, "bfloat16": 15.7 * T},
           efficiency=dict(_FIT["v100"]), hbm_bytes_s=0.9e12, intra="nvlink2", inter="ib-edr-summit",
           gpus_per_node=6, nics_per_node=1,
           sources="NVIDIA Tesla V100 datasheet (as v100-32gb); memory: the 15.78 GiB CUDA reports; node as "
                   "OLCF's Summit: 6 V100 16GB per node, NVLink 2 between GPU pairs, dual-rail EDR InfiniBand "
                   "(one 2-port link, see ib-edr-summit) per node (OLCF Summit User Guide)"),
)}

LINKS: dict[str, Link] = {k.name: k for k in (
    Link(name="nvlink2", bytes_s=50 * G, latency_s=5e-6,
         sources="Summit: GPU pairs joined by 2 NVLink 2 bricks, 50 GB/s per direction (OLCF Summit User Guide; "
                 "Tesla V100 datasheet: 300 GB/s over 6 bricks, both directions); latency assumed"),
    Link(name="nvlink3", bytes_s=300 * G, latency_s=4e-6,
         sources="A100 SXM4 + NVSwitch: 600 GB/s per GPU, both directions (A100 datasheet); latency assumed"),
    Link(name="nvlink4", bytes_s=450 * G, latency_s=3e-6, p2p_efficiency=0.4,
         sources="H100/H200 SXM + NVSwitch: 900 GB/s per GPU, both directions (H100 datasheet); latency ~3 µs "
                 "(nccl-tests sendrecv, NVIDIA/nccl#1487); point-to-point efficiency 0.4: NCCL sendrecv between two "
                 "H100s plateaued near 180 GB/s where nvbandwidth read 260 (NVIDIA/nccl-tests#268)"),
    Link(name="pcie3", bytes_s=15.75 * G, latency_s=10e-6, sources="PCIe 3.0 x16: 8 GT/s x 16 lanes, 128b/130b; latency assumed"),
    Link(name="pcie4", bytes_s=31.5 * G, latency_s=10e-6, sources="PCIe 4.0 x16: 16 GT/s x 16 lanes; latency assumed"),
    Link(name="pcie5", bytes_s=63 * G, latency_s=10e-6, sources="PCIe 5.0 x16: 32 GT/s x 16 lanes; latency assumed"),
    Link(name="ib-edr", bytes_s=12.5 * G, latency_s=15e-6, p2p_efficiency=0.9, collective_efficiency=0.9,
         between_nodes=True,
         sources="InfiniBand EDR: 100 Gb/s per port (IBTA); latency through NCCL assumed: tens of µs across nodes "
                 "(NVIDIA/nccl-tests#214 measured 31 µs between two A40 nodes), less on InfiniBand"),
    Link(name="ib-edr-summit", bytes_s=25 * G, latency_s=15e-6, p2p_efficiency=0.9, collective_efficiency=0.9,
         between_nodes=True,
         sources="Summit's dual-rail EDR: two 100 Gb/s ports per node, 25 GB/s per direction per node (OLCF Summit "
                 "User Guide); latency as ib-edr"),
    Link(name="ib-hdr", bytes_s=25 * G, latency_s=10e-6, p2p_efficiency=0.9, collective_efficiency=0.9,
         between_nodes=True,
         sources="InfiniBand HDR: 200 Gb/s per port (IBTA); latency assumed as ib-edr, less"),
    Link(name="ib-ndr", bytes_s=50 * G, latency_s=10e-6, p2p_efficiency=0.9, collective_efficiency=0.9,
         between_nodes=True,
         sources="InfiniBand NDR: 400 Gb/s per port (IBTA; ConnectX-7); latency assumed as ib-hdr"),
    Link(name="slingshot", bytes_s=25 * G, latency_s=10e-6, p2p_efficiency=0.9, collective_efficiency=0.9,
         between_nodes=True,
         sources="HPE Slingshot 11: 200 Gb/s per NIC (HPE; Frontier and Perlmutter have 4 per node); latency "
                 "assumed"),
)}
INTRA_LINKS = [name for name, k in LINKS.items() if not k.between_nodes]
"""The links between the GPUs of one node (``--link``)."""
INTER_LINKS = [name for name, k in LINKS.items() if k.between_nodes]
"""The links between nodes (``--inter``)."""


# -- user figures ---------------------------------------------------------------------------------------

_DEVICE_UNITS = {"memory_gib": ("memory_bytes", GiB), "reserve_gib": ("reserve_bytes", GiB),
                 "hbm_gbs": ("hbm_bytes_s", G), "hbm_efficiency": ("hbm_efficiency", 1),
                 "op_overhead_us": ("op_overhead_s", 1e-6), "gpus_per_node": ("gpus_per_node", 1),
                 "nics_per_node": ("nics_per_node", 1), "cores": ("cores", 1)}
_LINK_UNITS = {"gbs": ("bytes_s", G), "latency_us": ("latency_s", 1e-6),
               "message_overhead_us": ("message_overhead_s", 1e-6), "p2p_efficiency": ("p2p_efficiency", 1),
               "collective_efficiency": ("collective_efficiency", 1)}


def _split(text: str, table: dict, what: str) -> tuple[dict | None, str, dict]:
    """``NAME[:k=v,...]`` or ``file.json[:k=v,...]`` -> (base fields or None, name, overrides)."""
    name, _, rest = text.partition(":")
    overrides = parse_kwargs(rest) if rest else {}
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"{what} file {name} does not exist")
        data = json.loads(path.read_text())
        return None, str(data.pop("name", path.stem)), {**data, **overrides}
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(table)}, or a JSON file of its figures "
                         f"(keys as in bigconv/harness/devices.py)")
    return table[name], name, overrides


def device(text: str) -> Device:
    """``h100-80gb``, ``h100-80gb:memory_gib=64,bfloat16_efficiency=0.5`` or ``my_gpu.json``."""
    base, name, overrides = _split(text, GPUS, "GPU")
    kwargs: dict = {} if base is None else {f.name: getattr(base, f.name) for f in fields(Device)}
    kwargs["name"] = name if not overrides or base is None else f"{name} (user figures)"
    flops, eff = dict(kwargs.get("flops", {})), dict(kwargs.get("efficiency", {}))
    for key, value in overrides.items():
        if key in _DEVICE_UNITS:
            attr, unit = _DEVICE_UNITS[key]
            kwargs[attr] = type(kwargs.get(attr, 0.0))(value * unit) if attr in kwargs else value * unit
        elif key.endswith("_tflops") and key[:-7] in DTYPES:
            flops[key[:-7]] = float(value) * T
        elif key.endswith("_efficiency") and key[:-11] in DTYPES:
            eff[key[:-11]] = float(value)
        elif key in ("intra", "inter", "conv_float32", "sources"):
            kwargs[key] = str(value)
        else:
            raise ValueError(f"unknown GPU figure {key!r}; use {', '.join([*_DEVICE_UNITS, 'intra', 'inter'])} or "
                             f"<dtype>_tflops / <dtype>_efficiency with dtype in {', '.join(DTYPES)}")
    kwargs.update(flops=flops, efficiency=eff)
    missing = [k for k in ("memory_bytes", "hbm_bytes_s") if k not in kwargs] + ([] if flops else ["<dtype>_tflops"])
    if missing:
        raise ValueError(f"GPU {name} lacks {', '.join(missing)}")
    kwargs.setdefault("reserve_bytes", _OTHER_RESERVE)
    return Device(**kwargs)


def link(text: str) -> Link:
    """``nvlink4``, ``ib-ndr:latency_us=5`` or ``my_link.json``."""
    base, name, overrides = _split(text, LINKS, "link")
    kwargs: dict = {} if base is None else {f.name: getattr(base, f.name) for f in fields(Link)}
    kwargs["name"] = name if not overrides or base is None else f"{name} (user figures)"
    for key, value in overrides.items():
        if key not in _LINK_UNITS:
            raise ValueError(f"unknown link figure {key!r}; use {', '.join(_LINK_UNITS)}")
        attr, unit = _LINK_UNITS[key]
        kwargs[attr] = float(value) * unit
    for key in ("bytes_s", "latency_s"):
        if key not in kwargs:
            raise ValueError(f"link {name} lacks {key}")
    return Link(**kwargs)


def with_efficiency(dev: Device, efficiency: dict) -> Device:
    return replace(dev, efficiency={**dev.efficiency, **efficiency})
