"""Which fitting configuration trains fastest: a roofline time model of the compiled step, and measurement.

For a global batch G, each policy and each micro-batch b that fits and divides G gives k = G / b accumulation
steps. FLOPs alone cannot rank them (accumulation costs no FLOPs, so ``none`` at b = 1 would always win), so the
step time is estimated as

    time(policy, b, k) = k × (max(FLOPs(b) / peak_flops, bytes_accessed(b) / bandwidth(footprint(b))) + overhead)

the roofline model (Williams, Waterman & Patterson, CACM 2009) of one micro-step plus a fixed per-micro-step
overhead (launch, loop and optimizer bookkeeping). ``FLOPs(b)`` counts recomputation (the jaxpr count of
:mod:`jaxckpt.analysis._flops`, scan bodies × trip count) and ``bytes_accessed(b)`` is XLA's cost analysis scaled the same
way; both are affine in b, fitted from the compiles the batch search already made (no new compile). A small
micro-batch pays the overhead k times and streams the parameters k times: the reason people trade recompute for
a bigger batch.

``bandwidth(footprint)`` is the device's memory bandwidth, except on a calibrated CPU (:func:`calibrate`), where it
is measured at several working-set sizes: a micro-step whose footprint stays in the caches streams its bytes faster
than one that spills to main memory (the cache-aware roofline). The table's accelerators use their HBM bandwidth at
every size.

Under a mesh (a TPU topology's too) each device computes its share of the step: the FLOPs and bytes of the step
divided by the devices the batch is split over (:func:`candidates`); ``bytes_accessed`` then comes from the
compiler of the mesh's platform (the TPU compiler's cost analysis for a topology), ``peak_flops`` and ``bandwidth``
from its chip (:data:`jaxckpt.sharding.CHIPS`).

At pod scale two more terms decide, each reported per candidate (:attr:`Candidate.terms`) so a user sees which
dominates:

- **host transfers**: an offload policy moves its offloaded residuals to host memory in the forward pass and back
  in the backward pass, 2 × the compiled host footprint per device per micro-step, over the chip's host link
  (``host_bandwidth``, PCIe, per direction);
- **collectives**: with parameters split over ``fsdp`` (size f) every micro-step all-gathers them in the forward
  pass, again in the backward pass (FSDP per layer re-gathers) and reduce-scatters the gradients: each a ring
  collective moving (f − 1)/f of the parameter bytes per device (Patarasuk & Yuan 2009, bandwidth-optimal ring
  all-reduce; ZeRO stage 3's 1.5× of data parallelism's traffic, Rajbhandari et al. 2020); over ``data`` (size d)
  the gradient shards are all-reduced, 2 (d − 1)/d of their bytes; over ``tensor`` (size t, Megatron-style tensor
  parallelism, Shoeybi et al. 2019) each layer's attention and MLP outputs are all-reduced in the forward pass and
  their gradients in the backward pass, 2 (t − 1)/t of the target's activation bytes per example
  (``tensor_allreduce_bytes_per_example`` of the model, e.g. :class:`jaxckpt.models.llm.LLM`; a model without it
  has no tensor term) × the examples per device; over ``expert`` (size e, expert parallelism, Lepikhin et al. 2020,
  GShard) a Mixture of Experts' dispatch and combine are all-to-alls, each moving (e − 1)/e of a device's buffer (every
  device keeps 1/e of it: the pairwise-exchange all-to-all of Thakur, Rabenseifner & Gropp 2005, "Optimization of
  Collective Communication Operations in MPICH", §3), two in the forward pass and two in the backward pass per MoE
  layer (``expert_alltoall_bytes_per_example`` of the model, :class:`jaxckpt.models.llm.LLM`), and the gradients of
  the parameters an expert axis does not split (the batch is split over it) are all-reduced over it once per step,
  2 (e − 1)/e of their bytes. With ``tensor`` the FSDP and data terms move 1/t of the parameters per device (each
  tensor rank holds its slice), with ``expert`` 1/e of the experts' parameters. Each collective is priced by the
  timing room's link model (:func:`traffic_seconds`, :mod:`jaxckpt.timing`), the one that times compiled programs:
  the mesh laid over the chip's links (a TPU slice's ICI torus, the dimensions an axis spans; NVLink inside a GPU
  node, an all-reduce there by NVLink SHARP; NCCL's rings over the nodes' NICs across them).

XLA overlaps collectives and host transfers with compute (asynchronous collectives, MaxText's host-offload
flags), so one micro-step takes the largest of its terms — compute, HBM, host, collectives — plus the overhead:
a roofline with four ceilings. This ranks configurations; it does not promise seconds (peaks, not achieved rates).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxckpt._units import format_bytes
from jaxckpt.errors import JaxckptError
from jaxckpt.fit._model import fit_affine, line_through
from jaxckpt.fit._search import BatchFit
from jaxckpt.sharding import CHIPS, chip_for_kind
from jaxckpt.timing import Links, axis_group, collective_seconds, mesh_links


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """What the time model needs of a device.

  Attributes:
    name: shown in tables.
    peak_flops: FLOP/s (dense bfloat16 on GPU/TPU, float32 measured on CPU).
    bandwidth: memory bytes/s (the main memory's: HBM, or DRAM on a CPU).
    overhead_s: seconds per micro-step beyond the roofline.
    memory_bytes: the device's memory (informational; the fit uses ``memory=``), ``None`` if unknown.
    bandwidth_curve: ``((working set bytes, bytes/s), ...)`` ascending, measured by :func:`calibrate` on a CPU: a
      step whose working set (its compiled footprint) stays in the caches streams faster than :attr:`bandwidth`
      (the cache-aware roofline, Ilic, Pratas & Sousa, IEEE CAL 2014). Empty: :attr:`bandwidth` at every size.
    ici_bandwidth: bytes/s per device of a collective over the chips (ICI, NVLink); 0: unknown (not modelled).
    host_bandwidth: bytes/s per direction between the device and host memory (PCIe); 0: unknown (not modelled).
    host_memory_bytes: host memory per device that offloaded residuals may fill (the chip table's DRAM per chip),
      ``None``: unbounded (unknown). A candidate whose host bytes exceed it does not fit (:func:`candidates`).
    network_bandwidth: a GPU's bytes/s per direction to other nodes (its share of the node's NICs); 0: one
      interconnect (a TPU slice's ICI, or unknown).
    gpus_per_node: GPUs that share NVLink in a node (0: not a GPU cluster).
    chip: the key in the chip table (:data:`jaxckpt.sharding.CHIPS`, ``"v6e"``, ``"h100"``) of the chip whose links
      price the collectives (the timing room's link model, :func:`jaxckpt.timing.mesh_links`: a TPU's ICI torus,
      NVLink inside a GPU node and NCCL's rings over the nodes' NICs); ``None`` (a calibrated CPU, a hand-made
      device): no collective term. The bandwidth fields above describe the same chip for tables.
  """

  name: str
  peak_flops: float
  bandwidth: float
  overhead_s: float = 20e-6
  memory_bytes: int | None = None
  bandwidth_curve: tuple[tuple[int, float], ...] = ()
  ici_bandwidth: float = 0.0
  host_bandwidth: float = 0.0
  host_memory_bytes: int | None = None
  network_bandwidth: float = 0.0
  gpus_per_node: int = 0
  chip: str | None = None

  def links(self, mesh_shape: Mapping[str, int] | None) -> Links | None:
    """The links of a mesh of ``mesh_shape`` over this device's chips (:func:`jaxckpt.timing.mesh_links`), or
    ``None`` without a :attr:`chip` (no collective term).

    Raises:
      JaxckptError: a :attr:`chip` that is not a key of the chip table.
    """
    if self.chip is None:
      return None
    if self.chip not in CHIPS:
      raise JaxckptError(f"Accelerator(chip={self.chip!r}) is not in the chip table; valid: {', '.join(CHIPS)}")
    return mesh_links(CHIPS[self.chip], dict(mesh_shape or {}))

  def link_bandwidth(self, axis: str, mesh_shape: Mapping[str, int]) -> float:
    """Bytes/s per device of a collective over mesh axis ``axis`` (:meth:`jaxckpt.timing.Links.route` of the axis's
    group: the ICI torus dimensions it spans, NVLink inside a GPU node, the nodes' NICs across them, each at NCCL's
    ring efficiency on a GPU); 0: unknown (no :attr:`chip`)."""
    links = self.links(mesh_shape)
    if links is None or mesh_shape.get(axis, 1) <= 1:
      return 0.0
    return links.route(axis_group(mesh_shape, axis))[1]

  def bandwidth_at(self, working_set: float | None) -> float:
    """Bytes/s for a working set of ``working_set`` bytes: :attr:`bandwidth_curve` interpolated in log size
    (clamped to its ends), or :attr:`bandwidth` without a curve or a working set."""
    curve = self.bandwidth_curve
    if not curve or working_set is None:
      return self.bandwidth
    if working_set <= curve[0][0]:
      return curve[0][1]
    for (s0, b0), (s1, b1) in zip(curve, curve[1:]):
      if working_set <= s1:
        t = (math.log(working_set) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return b0 + t * (b1 - b0)
    return curve[-1][1]

  def micro_step_s(self, flops: float, bytes_accessed: float | None, working_set: float | None = None) -> float:
    """Roofline seconds of one micro-step plus the overhead.

    Args:
      flops: FLOPs of the micro-step.
      bytes_accessed: bytes it reads and writes (``None``: compute only).
      working_set: its compiled footprint in bytes (selects the bandwidth on :attr:`bandwidth_curve`).
    """
    return max(self.terms(flops, bytes_accessed, working_set).values()) + self.overhead_s

  def terms(self, flops: float, bytes_accessed: float | None, working_set: float | None = None, *,
            host_bytes: float = 0.0, collective_s: float = 0.0) -> dict[str, float]:
    """Seconds of one micro-step per ceiling of the roofline (module docstring), without the overhead.

    Args:
      flops: FLOPs of the micro-step on this device.
      bytes_accessed: bytes it reads and writes in device memory (``None``: 0).
      working_set: its compiled footprint in bytes (selects the bandwidth on :attr:`bandwidth_curve`).
      host_bytes: bytes it moves between device and host (both directions summed).
      collective_s: seconds its collectives take on their links (:func:`traffic_seconds`).

    Returns:
      ``{"compute_s", "hbm_s", "host_s", "collectives_s"}``; a term whose bandwidth is unknown (0) is 0.
    """
    return {"compute_s": flops / self.peak_flops,
            "hbm_s": (bytes_accessed or 0.0) / self.bandwidth_at(working_set),
            "host_s": host_bytes / self.host_bandwidth if self.host_bandwidth else 0.0,
            "collectives_s": collective_s}


ACCELERATORS: dict[str, Accelerator] = {
    key: Accelerator(chip.name, chip.peak_flops, chip.bandwidth, 20e-6, chip.memory_bytes,
                     ici_bandwidth=chip.ici_bandwidth, host_bandwidth=chip.host_bandwidth,
                     host_memory_bytes=chip.host_memory_bytes or None, network_bandwidth=chip.network_bandwidth,
                     gpus_per_node=chip.gpus_per_node, chip=key)
    for key, chip in CHIPS.items()
}
"""The chips of :data:`jaxckpt.sharding.CHIPS` (the one table of vendor datasheet figures: dense bf16 FLOP/s,
HBM bandwidth and size, ICI and host-link bandwidth) as the time model's devices, each with 20 µs per micro-step of
overhead. Peaks, not achieved rates: the model ranks, it does not promise seconds."""


_CALIBRATED: dict[tuple[str, int], Accelerator] = {}


def _best_s(f, x, repeats: int) -> float:
  """Least wall seconds of ``repeats`` calls of ``f(x)`` (compiled and warmed up first): the least-disturbed run."""
  jax.block_until_ready(f(x))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return min(times)


def calibrate(*, repeats: int = 7, refresh: bool = False) -> Accelerator:
  """This device's achieved figures for the time model, measured once per process (about a second; cached).

  Measures, each as the least of ``repeats`` timed calls after a warm-up (the run least disturbed by other jobs on
  a shared machine):

  - ``peak_flops``: float32 matmuls of 256², 512² and 1024² (2n³ FLOPs each), the best rate;
  - ``bandwidth_curve``: ``y = 2·x`` over float32 vectors whose working set (x and y) is 256 KiB, 2 MiB, 16 MiB and
    128 MiB (2·n·4 bytes moved each): what a step streams at from the caches up to main memory; ``bandwidth`` is
    the largest size's (main memory);
  - ``overhead_s``: a jitted ``x + 1`` on 8 floats (dispatch and synchronisation of one program).

  Args:
    repeats: timed calls per measurement (≥ 1).
    refresh: measure again instead of returning this process's cached figures.

  Returns:
    An :class:`Accelerator` named ``"<platform> (calibrated)"``.

  Raises:
    JaxckptError: ``repeats`` < 1.
  """
  if repeats < 1:
    raise JaxckptError(f"repeats={repeats} must be ≥ 1")
  device = jax.devices()[0]
  key = (device.platform, repeats)
  if key in _CALIBRATED and not refresh:
    return _CALIBRATED[key]
  matmul = jax.jit(lambda x: x @ x)
  flops = max(2 * n**3 / _best_s(matmul, jnp.ones((n, n), jnp.float32), repeats) for n in (256, 512, 1024))
  scale = jax.jit(lambda x: x * 2.0)
  curve = []
  for working_set in (2**18, 2**21, 2**24, 2**27):
    v = jnp.ones((working_set // 8,), jnp.float32)  # x and y: working_set bytes
    curve.append((working_set, working_set / _best_s(scale, v, repeats)))
    del v
  tiny = jax.jit(lambda x: x + 1.0)
  overhead = max(_best_s(tiny, jnp.ones((8,), jnp.float32), repeats), 1e-6)
  out = Accelerator(f"{device.platform} (calibrated)", flops, curve[-1][1], overhead, None, tuple(curve))
  _CALIBRATED[key] = out
  return out


def measure_cpu(*, repeats: int = 7) -> Accelerator:
  """This host's calibrated figures (:func:`calibrate`; kept for callers of the earlier name)."""
  return calibrate(repeats=repeats)


def accelerator(name: str | None = None, *, peak_flops: float | None = None, bandwidth: float | None = None,
                overhead_s: float | None = None, device: Any = None,
                host_memory_bytes: int | None = None) -> Accelerator:
  """The accelerator to model: a table entry, this device, or the given figures.

  Args:
    name: a key of :data:`ACCELERATORS` (``h100``, ``h200``, ``a100``, ``v4``, ``v5e``, ``v5p``, ``v6e``), ``"cpu"``
      (this host, measured by :func:`calibrate`), or ``None`` for ``device`` (its ``device_kind`` matched against
      the table; a CPU calibrated).
    peak_flops, bandwidth, overhead_s: override the figures (FLOP/s, bytes/s, seconds).
    device: the device planned for when ``name`` is ``None``: a TPU topology's chip
      (:mod:`jaxckpt.sharding`), default ``jax.devices()[0]``.
    host_memory_bytes: override the host memory per device offload may fill (bytes; the chip table's otherwise).

  Returns:
    The :class:`Accelerator`.

  Raises:
    JaxckptError: an unknown name, or a figure ≤ 0 (or an unknown device without ``peak_flops`` and ``bandwidth``).
  """
  for arg, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth), ("overhead_s", overhead_s),
                     ("host_memory_bytes", host_memory_bytes)):
    if value is not None and value <= 0 and not (arg == "overhead_s" and value == 0):
      raise JaxckptError(f"{arg}={value} must be > 0")
  base: Accelerator | None = None
  if name is not None:
    key = name.lower()
    if key == "cpu":
      if jax.devices()[0].platform != "cpu":
        raise JaxckptError(f"device={name!r} is calibrated by measuring this host, but JAX runs on "
                           f"{jax.devices()[0].platform}; give peak_flops= and bandwidth=, or a table device")
      base = calibrate()
    elif key in ACCELERATORS:
      base = ACCELERATORS[key]
    else:
      raise JaxckptError(f"device={name!r} is unknown; valid: {', '.join([*ACCELERATORS, 'cpu'])} (or give "
                         "peak_flops=FLOPS and bandwidth=BYTES_PER_S)")
  else:
    device = jax.devices()[0] if device is None else device
    if device.platform == "cpu":
      base = calibrate() if peak_flops is None or bandwidth is None else Accelerator("cpu", 1.0, 1.0, 50e-6)
    else:
      chip = chip_for_kind(device.device_kind)
      base = next((ACCELERATORS[k] for k, c in CHIPS.items() if c == chip), None) if chip is not None else None
      if base is None and (peak_flops is None or bandwidth is None):
        raise JaxckptError(f"device {device.device_kind!r} is not in the table ({', '.join(ACCELERATORS)}); give "
                           "peak_flops=FLOPS and bandwidth=BYTES_PER_S")
      base = base or Accelerator(device.device_kind, 1.0, 1.0)
  changes = {k: v for k, v in (("peak_flops", peak_flops), ("bandwidth", bandwidth), ("overhead_s", overhead_s),
                                ("host_memory_bytes", host_memory_bytes)) if v is not None}
  if changes and name is None and base.name.startswith("cpu"):
    changes["name"] = "cpu (given)"
  if "bandwidth" in changes:
    changes["bandwidth_curve"] = ()  # a given bandwidth holds at every size
  return dataclasses.replace(base, **changes)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way to train a global batch: a policy, a micro-batch and accumulation steps.

  Attributes:
    policy: the policy's text.
    micro_batch: examples per micro-step b.
    accum: micro-steps per step k = G / b.
    footprint_bytes: compiled footprint of a micro-step at b (compiled if it was, else predicted by the affine
      model; the winner is compiled with accumulation by :func:`jaxckpt.fit._plan.plan_fit`).
    compiled: whether ``footprint_bytes`` came from a compile.
    flops: FLOPs of one micro-step (recompute included).
    bytes_accessed: bytes accessed per micro-step (``None`` where unknown).
    est_step_s: estimated seconds of the whole step, k micro-steps (on one device of the mesh: its share of the
      FLOPs and bytes).
    measured_step_s: measured seconds per step (``--measure``), else ``None``.
    terms: seconds of the whole step per ceiling, k × each micro-step's (:meth:`Accelerator.terms`:
      ``compute_s``, ``hbm_s``, ``host_s``, ``collectives_s``) and ``overhead_s``; the step takes the largest
      ceiling plus the overhead.
    host_bytes: host footprint per device of a micro-step (offloaded residuals), ``None`` where unknown.
    mesh: ``{axis: size}`` of the mesh it was compiled on, ``None`` for one device.
    compiled_step: on a topology, the step as it will run (accumulation at G) compiled and timed from its program
      (:meth:`jaxckpt.timing.StepTime.as_dict`: ``seconds``, ``bound``, ``terms``, ``exposed``, ...; docs/timing.md),
      else ``None``.
  """

  policy: str
  micro_batch: int
  accum: int
  footprint_bytes: int
  compiled: bool
  flops: float
  bytes_accessed: float | None
  est_step_s: float
  measured_step_s: float | None = None
  terms: Mapping[str, float] = dataclasses.field(default_factory=dict)
  host_bytes: int | None = None
  mesh: Mapping[str, int] | None = None
  compiled_step: Mapping[str, Any] | None = None

  @property
  def step_s(self) -> float:
    """Seconds per step: the compiled program's estimate where it was timed, else the roofline's."""
    return self.compiled_step["seconds"] if self.compiled_step else self.est_step_s

  @property
  def bound(self) -> str:
    """What bounds the step: the compiled program's term where it was timed (``compute``, ``memory``,
    ``collectives:ici``, ...), else the roofline's ceiling (:attr:`dominant`)."""
    return self.compiled_step["bound"] if self.compiled_step else self.dominant

  @property
  def dominant(self) -> str:
    """The ceiling that sets the step time (``compute``, ``hbm``, ``host``, ``collectives``), or ``""``."""
    ceilings = {k: v for k, v in self.terms.items() if k != "overhead_s"}
    return max(ceilings, key=ceilings.get).removesuffix("_s") if ceilings else ""

  def as_row(self) -> dict[str, Any]:
    """The JSON form."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Traffic:
  """What a model moves over the mesh axes beyond its parameters, read from its abstract model
  (:func:`jaxckpt.fit.traffic_of`).

  Attributes:
    tensor_bytes_per_example: activation bytes a ``tensor`` axis all-reduces per example per step, before the ring
      factor (the model's ``tensor_allreduce_bytes_per_example``); 0: none known.
    expert_bytes_per_example: activation bytes an ``expert`` axis's all-to-alls move per example per step, before
      the (e − 1)/e factor (the model's ``expert_alltoall_bytes_per_example``); 0: none (a dense model, a dropless
      dispatch that gathers its experts instead).
    expert_param_bytes: bytes of the parameters an ``expert`` axis splits (logical name ``exp``), unsharded.
  """

  tensor_bytes_per_example: float = 0.0
  expert_bytes_per_example: float = 0.0
  expert_param_bytes: float = 0.0

  def per_device(self, examples: float) -> dict[str, float]:
    """The keyword arguments of :func:`traffic_seconds` for ``examples`` examples per device per micro-step."""
    return {"tensor_bytes": self.tensor_bytes_per_example * examples,
            "expert_bytes": self.expert_bytes_per_example * examples, "expert_param_bytes": self.expert_param_bytes}


class AxisCollective(NamedTuple):
  """One collective a training step runs over one mesh axis, by the fit's account of its traffic
  (:func:`traffic_collectives`)."""

  axis: str  # the mesh axis its groups run along ("fsdp", "data", "tensor", "expert")
  kind: str  # a jaxckpt.analysis.COLLECTIVE_KINDS entry: "all-gather", "reduce-scatter", "all-reduce", "all-to-all"
  payload_bytes: float  # per device per run, as the timing room's collective_seconds takes it (all-gather: its
  # output; reduce-scatter: its input; all-reduce: its buffer; all-to-all: its input)
  per_micro: int  # runs per micro-step
  per_step: int  # runs per step (gradients accumulate locally: their reduction runs once)


def traffic_collectives(param_bytes: float, mesh_shape: Mapping[str, int] | None, *, tensor_bytes: float = 0.0,
                        expert_bytes: float = 0.0, expert_param_bytes: float = 0.0) -> list[AxisCollective]:
  """The collectives of one device's training step over a mesh, each with its payload and runs (the module
  docstring's traffic; :func:`collective_bytes` for the arguments): FSDP's two all-gathers and one reduce-scatter of
  a device's parameters per micro-step, the tensor all-reduce of the activations, the expert all-to-alls, and per
  step the gradient all-reduces over ``data`` and over ``expert`` (of the parameters it does not split)."""
  shape = dict(mesh_shape or {})
  f, d, t, e = shape.get("fsdp", 1), shape.get("data", 1), shape.get("tensor", 1), shape.get("expert", 1)
  dense = max(param_bytes - expert_param_bytes, 0.0)
  local = (dense + expert_param_bytes / e) / t  # a device's share once gathered over fsdp
  out = []
  if f > 1:
    out += [AxisCollective("fsdp", "all-gather", local, 2, 0), AxisCollective("fsdp", "reduce-scatter", local, 1, 0)]
  if t > 1 and tensor_bytes:
    out.append(AxisCollective("tensor", "all-reduce", tensor_bytes, 1, 0))
  if e > 1:
    if expert_bytes:
      out.append(AxisCollective("expert", "all-to-all", expert_bytes, 1, 0))
    out.append(AxisCollective("expert", "all-reduce", dense / (f * t), 0, 1))
  if d > 1:
    out.append(AxisCollective("data", "all-reduce", local / f, 0, 1))
  return out


def _wire_factor(kind: str, n: int) -> float:
  """Bytes on the wire per payload byte of a ring collective over n devices (Patarasuk & Yuan 2009)."""
  return (2 if kind == "all-reduce" else 1) * (n - 1) / n


def collective_bytes_by_axis(param_bytes: float, mesh_shape: Mapping[str, int] | None, *,
                             tensor_bytes: float = 0.0, expert_bytes: float = 0.0,
                             expert_param_bytes: float = 0.0) -> dict[str, tuple[float, float]]:
  """Bytes one device moves in collectives per mesh axis: ``{axis: (per micro-step, per step)}`` for the axes that
  move any (:func:`collective_bytes` sums them; the formulas are there)."""
  shape = dict(mesh_shape or {})
  out: dict[str, tuple[float, float]] = {}
  for c in traffic_collectives(param_bytes, shape, tensor_bytes=tensor_bytes, expert_bytes=expert_bytes,
                               expert_param_bytes=expert_param_bytes):
    factor = _wire_factor(c.kind, shape[c.axis])
    micro, step = out.get(c.axis, (0.0, 0.0))
    out[c.axis] = (micro + factor * c.payload_bytes * c.per_micro, step + factor * c.payload_bytes * c.per_step)
  return out


def traffic_seconds(device: Accelerator, param_bytes: float, mesh_shape: Mapping[str, int] | None, *,
                    tensor_bytes: float = 0.0, expert_bytes: float = 0.0,
                    expert_param_bytes: float = 0.0) -> tuple[float, float]:
  """Seconds of one device's collectives, ``(per micro-step, per step)``: each collective of
  :func:`traffic_collectives` priced by the timing room's link model (:func:`jaxckpt.timing.collective_seconds` over
  the group of its axis, :func:`jaxckpt.timing.axis_group`, on the links of the mesh laid over the device's chips,
  :meth:`Accelerator.links`): ICI over the torus dimensions an axis spans on a TPU; NVLink inside a GPU node (an
  all-reduce there by NVLink SHARP on Hopper and later) and NCCL's rings over the nodes' NICs across them, at the
  ring's 92% efficiency. The same model times a compiled program's collectives (:func:`jaxckpt.timing.
  estimate_step_time`). 0 without a link model (a device without a chip of the table)."""
  shape = dict(mesh_shape or {})
  links = device.links(shape)
  if links is None:
    return 0.0, 0.0
  micro = step = 0.0
  for c in traffic_collectives(param_bytes, shape, tensor_bytes=tensor_bytes, expert_bytes=expert_bytes,
                               expert_param_bytes=expert_param_bytes):
    _, seconds = collective_seconds(c.kind, c.payload_bytes, axis_group(shape, c.axis), links)
    micro, step = micro + seconds * c.per_micro, step + seconds * c.per_step
  return micro, step


def collective_bytes(param_bytes: float, mesh_shape: Mapping[str, int] | None, *,
                     tensor_bytes: float = 0.0, expert_bytes: float = 0.0,
                     expert_param_bytes: float = 0.0) -> tuple[float, float]:
  """Bytes one device moves in collectives: ``(per micro-step, per step)`` (module docstring).

  Args:
    param_bytes: bytes of all parameters (unsharded).
    mesh_shape: ``{axis: size}`` of the mesh, or ``None`` (one device: no collectives).
    tensor_bytes: activation bytes a ``tensor`` axis all-reduces per device per micro-step, before the ring factor
      (the model's ``tensor_allreduce_bytes_per_example`` × examples per device); 0 when unknown.
    expert_bytes: activation bytes an ``expert`` axis's all-to-alls move per device per micro-step, before the
      (e − 1)/e factor (the model's ``expert_alltoall_bytes_per_example`` × examples per device); 0 when unknown.
    expert_param_bytes: the part of ``param_bytes`` an ``expert`` axis splits (the experts').

  Returns:
    Per micro-step: FSDP's two all-gathers and one reduce-scatter, 3 (f − 1)/f × P (f the ``fsdp`` size, P a
    device's parameters once gathered: (``param_bytes`` − X + X / e) / t, X the experts' bytes, e the ``expert``
    size, t the ``tensor`` size); the tensor all-reduces, 2 (t − 1)/t × ``tensor_bytes``; the expert all-to-alls,
    (e − 1)/e × ``expert_bytes``. Per step: the gradient all-reduce over ``data`` (size d), 2 (d − 1)/d × P / f
    (each device's gradient shard), and over ``expert`` of the parameters it does not split, 2 (e − 1)/e ×
    (``param_bytes`` − X) / (f·t), once per step (gradients accumulate locally).
  """
  by_axis = collective_bytes_by_axis(param_bytes, mesh_shape, tensor_bytes=tensor_bytes, expert_bytes=expert_bytes,
                                     expert_param_bytes=expert_param_bytes).values()
  return sum(m for m, _ in by_axis), sum(s for _, s in by_axis)


def estimate_step(device: Accelerator, *, flops: float, bytes_accessed: float | None, working_set: float | None,
                  host_bytes: float, per_micro_s: float, per_step_s: float, accum: int
                  ) -> tuple[dict[str, float], float]:
  """The time model of one training step of ``accum`` micro-steps on one device (module docstring).

  Args:
    device: the :class:`Accelerator`.
    flops: FLOPs of one micro-step on this device (its share of the mesh's).
    bytes_accessed: bytes one micro-step reads and writes in device memory on this device (``None``: 0).
    working_set: the micro-step's footprint per device, bytes (the bandwidth on a calibrated curve).
    host_bytes: the micro-step's host footprint per device (offloaded residuals), bytes: moved out in the forward
      pass and back in the backward pass (2 × over the host link).
    per_micro_s, per_step_s: collective seconds per device per micro-step and per step (:func:`traffic_seconds`).
    accum: micro-steps per step k ≥ 1.

  Returns:
    ``(terms, seconds)``: the step's seconds per ceiling (``compute_s``, ``hbm_s``, ``host_s``, ``collectives_s``,
    k × each micro-step's, the per-step collectives added) and ``overhead_s``; the step's estimate, k × (the largest
    ceiling of a micro-step + the overhead) + the per-step collectives.
  """
  micro = device.terms(flops, bytes_accessed, working_set, host_bytes=2.0 * host_bytes, collective_s=per_micro_s)
  terms = {key: accum * value for key, value in micro.items()}
  terms["collectives_s"] += per_step_s
  terms["overhead_s"] = accum * device.overhead_s
  return terms, accum * (max(micro.values()) + device.overhead_s) + per_step_s


def candidates(fits: Sequence[BatchFit], global_batch: int, device: Accelerator, *,
               mesh_shape: Mapping[str, int] | None = None,
               tensor_bytes_per_example: float | None = None, traffic: Traffic | None = None) -> list[Candidate]:
  """Every (policy, micro-batch, accumulation) reaching ``global_batch`` within memory, fastest estimate first.

  Args:
    fits: per-policy batch fits (:func:`jaxckpt.fit._search.fit_policies`).
    global_batch: examples per optimizer step G ≥ 1.
    device: the :class:`Accelerator` to model.
    mesh_shape: ``{axis: size}`` of the mesh the fits were compiled for (``None``: one device), for the collective
      term (:func:`collective_bytes`); the parameter bytes come from the fits' compiles.
    tensor_bytes_per_example: activation bytes a ``tensor`` axis all-reduces per example per step (the model's
      ``tensor_allreduce_bytes_per_example``), or ``None``: no tensor term.
    traffic: the model's :class:`Traffic` (its tensor and expert terms; supersedes ``tensor_bytes_per_example``).

  Returns:
    Candidates sorted by estimated step time (ties: fewer FLOPs, then larger micro-batch); a candidate whose host
    bytes per device exceed ``device.host_memory_bytes`` is left out (it does not fit the host). Under a mesh (a fit's
    :attr:`~jaxckpt.fit.BatchFit.unit` > 1) each device computes 1/unit of the step's FLOPs and bytes: the batch is
    split over that many devices, and a ``tensor`` axis splits each example's work over its t devices too (the
    optimizer's update of replicated parameters, O(parameters), is neglected). Each candidate carries the mesh.

  Raises:
    JaxckptError: ``global_batch`` < 1, or no fitting micro-batch divides it (the message lists the largest
      fitting micro-batch per policy and the global batches that work).
  """
  if global_batch < 1:
    raise JaxckptError(f"global_batch_size={global_batch} must be ≥ 1")
  out: list[Candidate] = []
  over_host: list[str] = []
  traffic = traffic or Traffic(tensor_bytes_per_example=tensor_bytes_per_example or 0.0)
  for fit in fits:
    sizes = [b for b in range(fit.unit, (fit.max_batch_size or 0) + 1, fit.unit) if global_batch % b == 0]
    if not sizes:
      continue
    pts = fit.points
    flops_model = line_through([(p.batch, p.flops) for p in pts])
    known = [p for p in pts if p.bytes_accessed is not None]
    # one compiled batch (a pinned batch, a guess at the cap): the bytes in proportion to the batch, so a smaller
    # micro-batch is not credited with moving nothing (with accumulation the step moves as much; its FSDP gathers
    # repeat per micro-step in the collectives term)
    bytes_model = line_through([(p.batch, int(p.bytes_accessed)) for p in known]) if known else None
    hosted = [p for p in pts if p.host_bytes is not None]
    host_model = fit_affine([(p.batch, p.host_bytes) for p in hosted]) if len({p.batch for p in hosted}) > 1 \
        else None
    params = max((p.param_bytes for p in pts), default=0)
    tensor = dict(mesh_shape or {}).get("tensor", 1)
    by_batch = fit.by_batch
    for b in sizes:
      per_micro, per_step = traffic_seconds(device, params, mesh_shape, **traffic.per_device(b / fit.unit))
      k = global_batch // b
      point = by_batch.get(b)
      flops = float(point.flops) if point else flops_model(b)
      accessed = (point.bytes_accessed if point and point.bytes_accessed is not None
                  else (bytes_model(b) if bytes_model else None))
      foot = point.footprint_bytes if point else int(round(fit.model(b)))
      host = (point.host_bytes if point and point.host_bytes is not None
              else (max(0, int(round(host_model(b)))) if host_model else (hosted[0].host_bytes if hosted else None)))
      share = fit.unit * tensor  # devices the batch is split over, × tensor: each computes its share of the step
      terms, est = estimate_step(device, flops=flops / share, bytes_accessed=None if accessed is None else accessed / share,
                                 working_set=foot, host_bytes=host or 0, per_micro_s=per_micro, per_step_s=per_step,
                                 accum=k)
      if host and device.host_memory_bytes is not None and host > device.host_memory_bytes:
        over_host.append(f"{fit.policy} at {b}: {format_bytes(host)}")
        continue  # its offloaded residuals do not fit the host's memory
      out.append(Candidate(fit.policy, b, k, foot, point is not None, flops, accessed, est, terms=terms,
                           host_bytes=host, mesh=dict(mesh_shape) if mesh_shape else None))
  if not out and over_host:
    raise JaxckptError(f"global_batch_size={global_batch}: every candidate that fits the device offloads more than "
                       f"the host memory per device ({format_bytes(device.host_memory_bytes)} on {device.name}; "
                       f"{', '.join(over_host[:4])}): give more host memory per device (host_memory_bytes) or a "
                       "policy that offloads less")
  if not out:
    largest = {f.policy: f.max_batch_size for f in fits}
    units = {f.unit for f in fits}
    raise JaxckptError(f"global_batch_size={global_batch}: no micro-batch that fits divides it (largest fitting "
                       f"micro-batch per policy: {largest}); use a multiple of {min(units)} whose divisors include a "
                       "fitting micro-batch")
  out.sort(key=lambda c: (c.est_step_s, c.flops * c.accum, -c.micro_batch))
  return out
