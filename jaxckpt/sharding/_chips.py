"""The chip table: one row per accelerator a plan can be made for (TPU chips and NVIDIA GPUs), with the facts the
memory verdict and the time model read (memory, peak FLOP/s, HBM bandwidth, interconnects, host memory).
"""

from __future__ import annotations

from typing import NamedTuple

_GiB = 2**30


class Chip(NamedTuple):
  """Facts of one accelerator chip (per chip: a TPU chip, a GPU).

  Attributes:
    name: how tables show it (``"TPU v5e"``, ``"NVIDIA H100 SXM"``).
    device_kinds: JAX's ``device.device_kind`` strings of this chip (``"TPU v5 lite"``, ``"NVIDIA H100 80GB HBM3"``).
    memory_bytes: HBM per chip, bytes (a GPU: what the device reports, its target config's ``device_memory_size``).
    peak_flops: dense bfloat16 FLOP/s per chip (the vendor's peak, not an achieved rate).
    bandwidth: HBM bytes/s per chip.
    torus: TPU: the dimensions of the topology name (2 for v5e/v6e, 3 for v4/v5p); 0 for a GPU.
    chip_config: TPU: libtpu's chip config (``"megacore"``: both TensorCores of a chip are one device).
    cores: TPU: TensorCores per chip (Cloud's accelerator types count cores for v4 and v5p: ``v4-8`` is 4 chips).
    accelerator_type: TPU: the prefix of Cloud's accelerator type (``v5litepod`` in ``v5litepod-4``).
    ici_bandwidth: bytes/s per chip a collective (all-gather, reduce-scatter, all-reduce) moves over the chips'
      own links: half the datasheet's bidirectional bandwidth (TPU ICI: equals the "all-reduce bandwidth per Pod"
      divided by its chips where Cloud states it: v6e 102.4 TB/s / 256, v5e 51.2 TB/s / 256; a GPU: NVLink's
      inside a node).
    host_bandwidth: bytes/s per direction between the chip and its host's memory: what host offload moves
      residuals at (a GPU: PCIe x16, nominal, Gen5 63 GB/s, Gen4 31.5 GB/s; a TPU chip: the scaling book's per-chip
      figures, below).
    host_memory_bytes: the host's DRAM per chip (Cloud's "DRAM per host" or VM RAM over its chips; a DGX's over
      its GPUs): what host offload may fill.
    network_bandwidth: a GPU: bytes/s per GPU per direction between nodes (the node's GPU NICs over its GPUs; DGX
      H100/H200/B200 and A3 Ultra: 8 × 400 Gb/s per 8 GPUs = 50 GB/s per GPU; A3 Mega 25, A3 High 12.5); 0 for a
      TPU slice (one ICI).
    gpus_per_node: a GPU: how many share one NVLink domain in the node (HGX/DGX: 8); 0 for a TPU.
    target_config: a GPU: the file under ``jaxckpt/sharding/gpu_specs/`` with XLA's target config of this GPU
      (``GpuTargetConfigProto`` as text, the ``xla/tools/hlo_opt/gpu_specs`` format) the GPU compiler compiles for.
    clock_hz: TPU: the TensorCore clock, Hz: what turns the TPU compiler's ``estimated_cycles`` into seconds
      (:mod:`jaxckpt.timing`); 0 where not known (a GPU: XLA:GPU writes no cycle estimates).
    mxu_dim: TPU: the side of a matrix unit's systolic array (128; 256 on v6e): a matmul dimension is padded to a
      multiple of it; 0 for a GPU.
    ici_link_bandwidth: TPU: bytes/s one way over one ICI link (port); a collective over a torus dimension uses
      two links per chip where the dimension wraps around, one where it does not (:mod:`jaxckpt.timing`); 0 for a GPU.
    sm_count: a GPU: its streaming multiprocessors (a matmul's tiles run in waves of this many); 0 for a TPU.
    gpu: a cloud machine type's row (``a3-high``): the key of the GPU it carries (``"h100"``), whose kernel
      measurements apply (:mod:`jaxckpt.timing`); ``""`` for a GPU or TPU chip's own row.
  """

  name: str
  device_kinds: tuple[str, ...]
  memory_bytes: int
  peak_flops: float
  bandwidth: float
  torus: int = 0
  chip_config: str = "default"
  cores: int = 1
  accelerator_type: str | None = None
  ici_bandwidth: float = 0.0
  host_bandwidth: float = 0.0
  host_memory_bytes: int = 0
  network_bandwidth: float = 0.0
  gpus_per_node: int = 0
  target_config: str | None = None
  clock_hz: float = 0.0
  mxu_dim: int = 0
  ici_link_bandwidth: float = 0.0
  sm_count: int = 0
  gpu: str = ""

  @property
  def is_gpu(self) -> bool:
    """Whether this is an NVIDIA GPU (compiled for by XLA:GPU), not a TPU chip."""
    return self.target_config is not None


_GEN5, _GEN4 = 63e9, 31.5e9  # PCIe x16 per direction, nominal
_NICS = 8 * 400e9 / 8 / 8  # 8 × 400 Gb/s NICs per 8-GPU node, bytes/s per GPU per direction

CHIPS: dict[str, Chip] = {
    "a100-40gb": Chip("NVIDIA A100 40GB", ("NVIDIA A100-SXM4-40GB",), 42_331_013_120, 312e12, 1.555e12,
                      ici_bandwidth=300e9, host_bandwidth=_GEN4, host_memory_bytes=128 * _GiB,
                      network_bandwidth=8 * 200e9 / 8 / 8, gpus_per_node=8,
                      target_config="a100-40gb.txtpb", sm_count=108),
    "a100-80gb": Chip("NVIDIA A100 80GB", ("NVIDIA A100-SXM4-80GB",), 85_100_068_864, 312e12, 2.039e12,
                      ici_bandwidth=300e9, host_bandwidth=_GEN4, host_memory_bytes=256 * _GiB,
                      network_bandwidth=8 * 200e9 / 8 / 8, gpus_per_node=8,
                      target_config="a100-80gb.txtpb", sm_count=108),
    "h100": Chip("NVIDIA H100 SXM", ("NVIDIA H100 80GB HBM3",), 84_978_434_048, 989e12, 3.35e12,
                 ici_bandwidth=450e9, host_bandwidth=_GEN5, host_memory_bytes=256 * _GiB,
                 network_bandwidth=_NICS, gpus_per_node=8,
                 target_config="h100.txtpb", sm_count=132),
    "h200": Chip("NVIDIA H200 SXM", ("NVIDIA H200",), 150_109_945_856, 989e12, 4.8e12,
                 ici_bandwidth=450e9, host_bandwidth=_GEN5, host_memory_bytes=256 * _GiB,
                 network_bandwidth=_NICS, gpus_per_node=8,
                 target_config="h200.txtpb", sm_count=132),
    "b200": Chip("NVIDIA B200", ("NVIDIA B200",), 191_502_483_456, 2.25e15, 8e12,
                 ici_bandwidth=900e9, host_bandwidth=_GEN5, host_memory_bytes=512 * _GiB,
                 network_bandwidth=_NICS, gpus_per_node=8,
                 target_config="b200.txtpb", sm_count=148),
    "v4": Chip("TPU v4", ("TPU v4",), 32 * _GiB, 275e12, 1.2e12, 3, "megacore", 2, "v4",
               ici_bandwidth=1.1e15 / 4096, host_bandwidth=16e9, host_memory_bytes=407 * 10**9 // 4,
               clock_hz=1.05e9, mxu_dim=128, ici_link_bandwidth=45e9),
    "v5e": Chip("TPU v5e", ("TPU v5 lite", "TPU v5e"), 16 * _GiB, 197e12, 819e9, 2, "default", 1, "v5litepod",
                ici_bandwidth=200e9, host_bandwidth=15e9, host_memory_bytes=512 * _GiB // 8,
                clock_hz=1.5e9, mxu_dim=128, ici_link_bandwidth=50e9),
    "v5p": Chip("TPU v5p", ("TPU v5", "TPU v5p"), 95 * _GiB, 459e12, 2.765e12, 3, "megacore", 2, "v5p",
                ici_bandwidth=600e9, host_bandwidth=15e9, host_memory_bytes=448 * 10**9 // 4,
                clock_hz=459e12 / (2 * 4 * 128 * 128 * 2), mxu_dim=128, ici_link_bandwidth=100e9),
    "v6e": Chip("TPU v6e", ("TPU v6 lite", "TPU v6e"), 32 * _GiB, 918e12, 1.64e12, 2, "default", 1, "v6e",
                ici_bandwidth=400e9, host_bandwidth=32e9, host_memory_bytes=1536 * _GiB // 8,
                clock_hz=918e12 / (4 * 256 * 256 * 2), mxu_dim=256, ici_link_bandwidth=100e9),
}
"""Chip key -> :class:`Chip`: the one table of accelerator facts (the memory verdict, the time model, the tools'
headers). The keys are the chip part of topology names (``v5e`` in ``v5e:2x2``, ``h100`` in ``h100:32x8``).

Sources. NVIDIA datasheets: A100 (dense BF16 312 TFLOP/s; HBM 1,555 GB/s for 40 GB, 2,039 GB/s for 80 GB SXM;
NVLink 600 GB/s bidirectional), H100 SXM (989 TFLOP/s dense BF16, 3.35 TB/s, NVLink 900 GB/s), H200 SXM (989
TFLOP/s, 141 GB at 4.8 TB/s, NVLink 900 GB/s), HGX B200 (2.25 PFLOP/s dense BF16 per GPU — 18 PFLOP/s per 8 with
sparsity halved —, 8 TB/s, fifth-generation NVLink 1.8 TB/s); memory in bytes as each device reports it (XLA's
``gpu_specs`` files ``a100_sxm_40``, ``a100_sxm_80``, ``h100_sxm``: ``device_memory_size``; H200 and B200: their
141 GB and 180 GB — 1,440 GB per HGX B200 over 8 — as CUDA reports them, ``jaxckpt/sharding/gpu_specs/``). Between
nodes: DGX H100/H200/B200 and Google Cloud A3 Ultra/A4 carry 8 × 400 Gb/s NICs per 8 GPUs (50 GB/s per GPU
per direction); DGX A100 8 × 200 Gb/s. Google Cloud's H100 machine types carry less, so each is a row of its own
(``a3-high``, ``a3-mega``: an H100 whose ``gpu`` is ``h100``; Google Cloud, "Networking and GPU machines"): A3 High
(``a3-highgpu-8g``, MaxText's ``h100-80gb-8``) up to 1,000 Gb/s, of which GPUDirect-TCPX's 4 × 200 Gb/s NICs carry
the GPUs' traffic (12.5 GB/s per GPU); A3 Mega (``a3-megagpu-8g``, ``h100-mega-80gb-8``) GPUDirect-TCPXO over 8 × 200
Gb/s (25 GB/s per GPU); both with 1,872 GB of VM memory over 8 GPUs. Host memory: a DGX H100/H200's 2 TB, a DGX
A100's 1 TB (80 GB) or 1 TB over 8 GPUs, a DGX B200's 4 TB, over their 8 GPUs. Google Cloud TPU docs, "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e"
(BF16 peak compute, HBM capacity and bandwidth per chip; bidirectional ICI bandwidth per chip: v5e 400 GB/s, v6e
800 GB/s, v5p 1200 GB/s; v4's all-reduce bandwidth per Pod, 1.1 PB/s over 4096 chips; DRAM per host: v5e 512 GiB
and v6e 1536 GiB over 8 chips, the 4-chip VM's RAM for v5p (448 GB) and v4 (407 GB); v6e "connects to the host
through a PCIe Gen5 interface"). Host link per TPU chip, per direction ("How to Scale Your Model", "How to Think
About TPUs"): v4 16 GB/s ("PCIe bandwidth for TPU v4 is 16GB / second each way"), v5e and v5p 15 GB/s ("typically
around 1.5e10 bytes / second per chip"), v6e 32 GB/s ("Trillium (TPU v6e) has 32GB/s, about 2x higher than v5"): a
chip's share of its host's PCIe, about half a x16 link.

The time model's figures (:mod:`jaxckpt.timing`). **Clocks**: v5e 1.5 GHz, stated in "How to Scale Your Model"
(Austin et al., Google DeepMind 2025, "How to Think About TPUs": "about 5e13 bf16 FLOPs/s per MXU at 1.5GHz on TPU
v5e"), which with Cloud's four 128×128 MXUs gives Cloud's 197 TFLOP/s (4 × 128² × 2 × 1.5e9 = 196.6e12); v4 1,050
MHz (Jouppi et al., "TPU v4", ISCA 2023, its table of chip features; 2 TensorCores × 4 MXUs × 128² × 2 × 1.05e9 =
275e12, Cloud's peak). v5p and v6e clocks are not published: they are *derived* from Cloud's peak and MXUs, peak /
(2 × MAC cells per cycle): v5p 459e12 / (2 TensorCores × 4 MXUs × 128² × 2) = 1.75 GHz; v6e 918e12 / (4 × 256² × 2)
= 1.75 GHz, with four 256×256 arrays' worth of MACs per cycle. Cloud's v6e page says each TensorCore has *two*
256×256 MXUs, which would need 3.5 GHz; the TPU compiler's own cycle estimate rules that reading out: it gives a
2048 × 8192 × 8192 bf16 matmul 606,880 cycles (libtpu 0.0.42.1, v6e:1x1), 452,936 FLOPs per cycle, more than two
arrays can do in a cycle (262,144) and 86% of four's (524,288); the same matmul on v5e is 126,869 FLOPs per cycle,
97% of v5e's 131,072. **MXU side**: 128, and 256 on v6e (Cloud's v6e page; the scaling book: "Weight matrices need
to be padded to at least size 128 (256 on TPU v6)"). **ICI per link, one way**: Cloud's bidirectional ICI bandwidth
per chip over its 4 ports (2-D torus) or 6 (3-D): v5e 400 GB/s → 50 GB/s, v6e 800 GB/s → 100 GB/s, v5p 1,200 GB/s →
100 GB/s; v4 45 GB/s (the scaling book's table; 6 × 45 GB/s = Cloud's 1.1 PB/s all-reduce bandwidth per 4,096-chip
pod per chip, 268 GB/s). **SMs**: A100 108, H100 SXM and H200 132 (NVIDIA's A100 and H100 whitepapers), B200 148
(the shipped target config's ``core_count``)."""

CHIPS.update({
    "a3-high": CHIPS["h100"]._replace(network_bandwidth=4 * 200e9 / 8 / 8, host_memory_bytes=1872 * 10**9 // 8,
                                      gpu="h100"),
    "a3-mega": CHIPS["h100"]._replace(network_bandwidth=8 * 200e9 / 8 / 8, host_memory_bytes=1872 * 10**9 // 8,
                                      gpu="h100"),
})

GPU_CHIPS: tuple[str, ...] = tuple(key for key, chip in CHIPS.items() if chip.is_gpu)
"""The GPUs of :data:`CHIPS` (``a100-40gb``, ``a100-80gb``, ``h100``, ``h200``, ``b200``) and the cloud machine
types with a GPU of the table and a network of their own (``a3-high``, ``a3-mega``)."""

TPU_CHIPS: tuple[str, ...] = tuple(key for key, chip in CHIPS.items() if chip.torus)
"""The TPU chips of :data:`CHIPS`."""


def chip_for_kind(device_kind: str) -> Chip | None:
  """The :class:`Chip` of a JAX ``device_kind`` (``"TPU v5 lite"`` → v5e; ``"NVIDIA H100 80GB HBM3"`` → h100), or
  ``None`` when the table has no such chip.

  A GPU whose kind the table does not list word for word is found by its model and memory in the kind
  (``"NVIDIA H100 SXM5 80GB"`` → h100; ``"NVIDIA A100-PCIE-40GB"`` → a100-40gb). A device does not tell the machine
  type it is in: a cloud machine type's row (``a3-high``) is never the answer, its GPU's row is.
  """
  for chip in CHIPS.values():
    if device_kind in chip.device_kinds:
      return chip
  squeezed = device_kind.lower().replace(" ", "").replace("-", "")
  for key in GPU_CHIPS:
    if CHIPS[key].gpu:  # a cloud machine type: its GPU's own row answers
      continue
    model, _, memory = key.partition("-")
    if model in squeezed and memory in squeezed:
      return CHIPS[key]
  return None
