"""What a compiled step costs on its target: the work it executes (GEMM FLOPs by precision, attention,
remat recompute) against the model's, where its bytes are, and a time floor.

The time floor is a roofline, a bound and not a prediction:
  * compute: each GEMM at its precision's dense peak, each cuDNN attention call at the bf16 peak; a kernel
    takes the larger of that and its own bytes at HBM bandwidth;
  * memory: every other kernel's bytes read and written (ember/program/hlo.py's rule) at HBM bandwidth;
  * collectives: the bytes each device sends, by the NCCL bus-bandwidth convention (all-gather,
    reduce-scatter, all-to-all: (n - 1) / n of what a device holds; all-reduce: 2 (n - 1) / n; a permute:
    all of it), at NVLink bandwidth when every replica group lies inside a node, else at the network's;
  * host: the bytes of the host transfers (ember/program/hlo.py: a policy's offloaded residuals), the larger
    direction, at the bandwidth of the GPU's link to the host.
`time_floor_s` overlaps collectives and host transfers with compute + memory (the largest of the three);
`time_serial_s` adds all four. Peaks and link bandwidths are ember/hardware/facts.toml's; HBM bandwidth is the
XLA spec's.
`mfu_ceiling` is the model FLOPs over the floor against the dense bf16 peak (how ember's MFU is measured,
whatever the recipe); `tokens_per_s_ceiling` is per device.
"""

from __future__ import annotations

import dataclasses

from ember import hardware
from ember.hardware import DeviceFacts, Rates
from ember.names import BACKWARD_SCOPE, EXPERT_GEMM_SCOPE, HADAMARD_SCOPE
from ember.program import hlo
from ember.quant.recipe import BF16  # Attention's precision: the compute dtype's.

TOP = 5  # Largest values and collectives reported.
TOP_MEMORY_OPS = 15  # Rows of `memory_by_op`.
FORWARD, BACKWARD, REMAT = "fwd", "bwd", "remat"  # The passes `memory_by_op` tells apart.
UNNAMED = "unnamed"  # A kernel XLA made with no op name (a combined gradient reduce-scatter, a copy it inserted).


@dataclasses.dataclass(frozen=True)
class Machine:
  """The target's figures the floor needs."""
  facts: DeviceFacts
  hbm_bytes_per_s: float
  node_of_partition: tuple[int, ...]  # The node of each SPMD partition (device) of the program.
  rates: Rates | None = None  # What its kernels reach in practice (ember/hardware/rates.toml): the prediction's.

  @classmethod
  def one_node(cls, gpu: str, num_devices: int = 1) -> "Machine":
    """`num_devices` GPUs `gpu` (one of ember/hardware/'s) in one node, with their rates."""
    g = hardware.gpu(gpu)
    return cls(g.facts, g.hbm_bytes_per_s, (0,) * num_devices, hardware.rates(gpu))

  @classmethod
  def of_mesh(cls, mesh) -> "Machine | None":
    """The GPUs of a mesh, a run's or a described target's, where ember/hardware/ has their kind's spec and rates,
    a node a process (a target's nodes are its processes; a run launches one process a node, docs/multihost.md:
    one a GPU would price every collective at the network's bandwidth); None for any other devices."""
    devices = list(mesh.devices.flat)
    facts = hardware.facts_for_kind(devices[0].device_kind) if devices[0].platform == "gpu" else None
    if facts is None or facts.name not in hardware.GPUS:
      return None
    g = hardware.gpu(facts.name)
    return cls(g.facts, g.hbm_bytes_per_s, tuple(d.process_index for d in devices), hardware.rates(facts.name))


def step_cost(text: str | hlo.Program, *, model_flops: float, tokens: float, machine: Machine | None) -> dict:
  """The cost figures of an optimised HLO text or program. `model_flops` and `tokens` are per device per step;
  `machine` None (a CPU target) leaves the time floor out."""
  p = text if isinstance(text, hlo.Program) else hlo.Program(text)
  gemms, calls = hlo.gemms(p), hlo.attention_calls(p)
  executed = {prec: sum(g.flops_per_step for g in gemms if g.precision == prec and not g.recomputed)
              for prec in hlo.PRECISIONS}
  attention = sum(c.flops_per_step - c.recomputed_flops_per_step for c in calls)
  recompute = sum(g.flops_per_step for g in gemms if g.recomputed) + sum(c.recomputed_flops_per_step for c in calls)
  first_pass = sum(executed.values()) + attention
  moved = hlo.host_transfers(p)
  out = {
      "executed_flops": executed, "recompute_flops": recompute, "attention_flops": attention,
      "emulated_flops": sum(g.flops_per_step for g in gemms if g.emulated and not g.recomputed),
      "model_flops": model_flops, "executed_over_model": first_pass / model_flops if model_flops else None,
      "largest_values": largest_values(p), "largest_collectives": largest_collectives(p, machine),
      "memory_by_op": memory_by_op(p), "host_transfer_bytes": moved,
  }
  out.update(roofline(p, gemms, calls, model_flops=model_flops, tokens=tokens, machine=machine, moved=moved))
  return out


def roofline(p: hlo.Program, gemms, calls, *, model_flops: float, tokens: float, machine: Machine | None,
             moved: dict[str, float] | None = None) -> dict:
  """The floor and its ceilings; `moved`: the program's `hlo.host_transfers`, where the caller has them."""
  if machine is None:
    return {"time_floor_s": None, "time_serial_s": None, "mfu_ceiling": None, "tokens_per_s_ceiling": None}
  facts, hbm = machine.facts, machine.hbm_bytes_per_s
  compute = sum(max(g.flops / facts.peak_flops(g.precision), g.bytes / hbm) * g.times for g in gemms)
  compute += sum(max(c.flops / facts.peak_flops(BF16), c.bytes / hbm) * c.times for c in calls)
  memory = sum(k.bytes * k.times for k in hlo.memory_kernels(p)) / hbm
  network = sum(collective_seconds(c, machine) for c in hlo.collective_ops(p))
  host = max((hlo.host_transfers(p) if moved is None else moved).values()) / (facts.host_gb_s * 1e9)
  floor = max(compute + memory, network, host)
  return {
      "time_floor_s": floor, "time_serial_s": compute + memory + network + host,
      "mfu_ceiling": model_flops / floor / facts.mfu_peak_flops if floor else None,
      "tokens_per_s_ceiling": tokens / floor if floor else None,
      "time_floor_parts_s": {"compute": compute, "memory": memory, "collectives": network, "host": host},
  }


_SENT = {"all-gather": 1, "reduce-scatter": 1, "all-to-all": 1, "ragged-all-to-all": 1, "all-reduce": 2}


def collective_seconds(c: hlo.Collective, machine: Machine) -> float:
  """A collective's seconds per step at its link's full bandwidth."""
  sent, crosses = bytes_sent(c, machine)
  return c.times * sent / (link_bytes_per_s(machine, crosses))


def bytes_sent(c: hlo.Collective, machine: Machine) -> tuple[float, bool]:
  """(bytes a device sends per execution by the bus-bandwidth convention, whether its groups span nodes); 0
  for a group of one."""
  n, crosses = group_shape(c, machine.node_of_partition)
  if n <= 1:
    return 0.0, crosses
  return c.bytes * (_SENT[c.kind] * (n - 1) / n if c.kind in _SENT else 1.0), crosses


def link_bytes_per_s(machine: Machine, crosses: bool) -> float:
  return (machine.facts.nic_gb_s if crosses else machine.facts.nvlink_gb_s) * 1e9


def group_shape(c: hlo.Collective, node_of_partition: tuple[int, ...]) -> tuple[int, bool]:
  """(devices per replica group, whether a group spans nodes)."""
  groups = c.groups or (tuple(range(len(node_of_partition))),)
  nodes = lambda g: {node_of_partition[d] for d in g if d < len(node_of_partition)}
  return max(len(g) for g in groups), any(len(nodes(g)) > 1 for g in groups)


def largest_values(p: hlo.Program) -> list[dict]:
  """The TOP largest arrays of distinct types (a stacked buffer and its updates, or a gradient and its sum, are
  one entry: the first op to make it, by size)."""
  seen, out = set(), []
  for v in sorted(hlo.values(p), key=lambda v: -v.bytes):
    if v.shape in seen:
      continue
    seen.add(v.shape)
    out.append({"shape": v.shape, "dtype": v.dtype, "bytes": int(v.bytes), "op_name": v.op_name, "count": v.times})
    if len(out) == TOP:
      break
  return out


def pass_of(op_name: str) -> str:
  """The pass a kernel belongs to, from its op name: `remat` (a checkpointed forward run again in the backward
  pass), `bwd` (JAX's transpose of the forward: every cotangent and custom-VJP backward rule; and a pipeline
  tick's backward work around the VJP it takes, BACKWARD_SCOPE), `unnamed` (no op name to tell by), else `fwd`."""
  if not op_name:
    return UNNAMED
  if hlo.RECOMPUTE_SCOPE in op_name:
    return REMAT
  return BACKWARD if "transpose(" in op_name or BACKWARD_SCOPE in op_name else FORWARD


# Primitives that only wrap a kernel (a Pallas kernel inside a custom partitioning): named by the scope around them.
_WRAPPERS = ("custom_partitioning", "pallas_call")


def op_of(op_name: str) -> str:
  """The op a kernel is named by: the last part of its op name, past the wrappers around a Pallas kernel."""
  parts = op_name.split("/")
  while len(parts) > 1 and parts[-1] in _WRAPPERS:
    parts.pop()
  return parts[-1]


def memory_by_op(p: hlo.Program, top: int = TOP_MEMORY_OPS) -> list[dict]:
  """Where the memory term's bytes go: the memory kernels' bytes per device per step grouped by the last part
  of their op name (the JAX primitive that made the fusion's root: `reduce_max`, `transpose`, ...; for a Pallas
  kernel the scope around it, e.g. `mxfp8_quantize_both`; the opcode in parentheses where XLA recorded none) and
  the pass, largest first."""
  totals: dict[tuple[str, str], float] = {}
  for k in hlo.memory_kernels(p):
    name = p.by_name[k.name].op_name
    key = (op_of(name) if name else f"({k.opcode})", pass_of(name))
    totals[key] = totals.get(key, 0.0) + k.bytes * k.times
  rows = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
  return [{"op": op, "pass": pass_, "bytes": int(b)} for (op, pass_), b in rows]


def largest_collectives(p: hlo.Program, machine: Machine | None) -> list[dict]:
  out = []
  for c in sorted(hlo.collective_ops(p), key=lambda c: -c.bytes_per_step)[:TOP]:
    row = {"kind": c.kind, "shape": c.shape, "dtype": hlo.dtype_of(c.shape), "bytes": int(c.bytes_per_step),
           "op_name": c.op_name, "count": c.times}
    if machine is not None:
      row["group_size"], row["crosses_nodes"] = group_shape(c, machine.node_of_partition)
    out.append(row)
  return out


def expert_gemms(text_or_program) -> dict:
  """The expert GEMMs of an MoE step (those under EXPERT_GEMM_SCOPE, not the Hadamard transforms of their
  operands): the rows of the forward GEMMs (the largest, per execution) and the first-pass FLOPs by
  precision, per device per step."""
  p = text_or_program if isinstance(text_or_program, hlo.Program) else hlo.Program(text_or_program)
  experts = [g for g in hlo.gemms(p) if EXPERT_GEMM_SCOPE in g.op_name and HADAMARD_SCOPE not in g.op_name]
  forward = [g for g in experts if pass_of(g.op_name) == FORWARD]
  rows = max((_rows(g) for g in forward), default=0)
  flops = {prec: sum(g.flops_per_step for g in experts if g.precision == prec and not g.recomputed)
           for prec in hlo.PRECISIONS}
  return {"gemm_rows_per_rank": rows, "expert_gemm_flops": flops}


def largest_expert_copy(p: hlo.Program, *, local_experts: int, rows: int) -> dict | None:
  """The largest value with the local-expert count as a dimension beside the expert GEMMs' `rows` (per
  device): a copy of every routed row for each local expert, the mark of a masked ragged_dot expansion;
  None if there is none."""
  def per_expert_rows(v):
    dims = hlo.dims_of(v.shape)
    return local_experts in dims and rows in dims
  v = max((v for v in hlo.values(p) if per_expert_rows(v)), key=lambda v: v.bytes, default=None)
  return None if v is None else {"shape": v.shape, "bytes": int(v.bytes), "op_name": v.op_name}


def _rows(g: hlo.Gemm) -> int:
  """Rows of a forward expert GEMM's output [..., rows, N]: every dimension but the last."""
  n = 1
  for d in g.output_dims[:-1]:
    n *= d
  return n
