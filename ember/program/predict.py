"""A predicted step: the optimised program walked in its scheduled order, each kernel at what its GPU reaches in
practice, each asynchronous collective overlapped only with the work scheduled between its start and its done.

The rules, in one place (the rates are the GPU's row of ember/hardware/rates.toml):
  * a GEMM takes the larger of its FLOPs at `gemm_<precision>` x its precision's dense peak x its wave
    efficiency, and its bytes at `hbm` x the HBM bandwidth. Wave efficiency: the GEMM's output cut into
    `tile_m` x `tile_n` tiles runs in waves of one tile per SM; the useful fraction of the tiles x waves it
    occupies is what a small or ragged GEMM loses;
  * a cuDNN attention call: its FLOPs at `attention_forward` / `attention_backward` x the bf16 peak, or its bytes;
  * every other kernel: its bytes (ember/program/hlo.py's rule) at `hbm` x the HBM bandwidth, or those it reads or
    writes in host memory itself at `host` x the host link's bandwidth, whichever takes longer;
  * every kernel adds `launch_s`;
  * a collective takes `collective_latency_s` plus the bytes it sends (the roofline's bus-bandwidth rule) at
    `nvlink` or `nic` x the link's bandwidth. Collectives share the network one at a time. An asynchronous one
    (a `*-start` / `*-done` pair) starts where the schedule starts it (or when the network frees) and is hidden
    behind the kernels scheduled before its done; whatever is left when the done is reached is exposed: the
    step waits. A synchronous one is exposed whole. A wait is charged to whatever holds the link while the step
    waits: a small collective queued behind a large one shows the large one's time as the large one's, not its own;
  * a host transfer (ember/program/hlo.py: a policy's offloaded residuals) takes its bytes at `host` x the
    bandwidth of the link to the host, each direction a link of its own that its transfers share one at a
    time, hidden or exposed as a collective is;
  * a loop body is walked once and counted its trip count times; a called computation is walked in place; a
    conditional takes its longest branch, in the share of its runs that its branches run (ember/program/hlo.py:
    a pipeline's segments off the stages run once a micro-batch, not every tick).
The step is the compute stream's time at the end of the entry computation. What it leaves out: kernels running
concurrently on other streams, NCCL kernels slowing the GEMMs they overlap, the host's own work, and L2 reuse.

`predicted_step_s`, `tokens_per_s_predicted` (per device) and `mfu_predicted` (model FLOPs against the dense
bf16 peak, as a run's MFU is) go into the compile report, the bench and the planner; `time_by_op` says where
the predicted time goes.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from ember.hardware import Rates
from ember.program import cost, hlo
from ember.quant.recipe import BF16  # Attention's precision: the compute dtype's.

GEMM, ATTENTION_FORWARD, ATTENTION_BACKWARD, MEMORY = range(4)
_KIND_NAMES = {GEMM: "gemm", ATTENTION_FORWARD: "attention", ATTENTION_BACKWARD: "attention", MEMORY: "memory"}


@dataclasses.dataclass(frozen=True)
class _Span:  # Kernels [start, stop) of the program's table, run one after another.
  start: int
  stop: int


@dataclasses.dataclass(frozen=True)
class _Call:  # A computation run `times` times in place (a loop body, a loop condition, a call).
  computations: tuple[str, ...]  # More than one: a conditional's branches, the longest taken.
  times: float = 1


@dataclasses.dataclass(frozen=True)
class _Start:  # An asynchronous transfer's start: a collective's, or a host transfer's where `host`.
  index: int  # Into Walk.collectives, or Walk.host_transfers.
  name: str
  host: bool = False


@dataclasses.dataclass(frozen=True)
class _Done:
  start: str  # The start's name.


@dataclasses.dataclass(frozen=True)
class _Sync:  # A synchronous transfer.
  index: int
  host: bool = False


class Walk:
  """A program's kernels, collectives and host transfers in scheduled order, read once: the kernel table (one row
  per kernel instruction: its class, precision, FLOPs and bytes per execution, executions per step, op and pass,
  bytes over the host link, name), the instructions that start its transfers, and each computation's events.
  `predict` times it for a GPU's rates; a fit times it many times."""

  def __init__(self, p: hlo.Program):
    self.program = p
    rows, self.events = [], {}
    self.collectives: list[hlo.Collective] = []
    self.host_transfers: list[hlo.HostTransfer] = []
    self.transfer_names: dict[tuple[bool, int], str] = {}  # (host, index) -> the instruction that starts it.
    self._waves: dict[tuple[int, int, int], np.ndarray] = {}  # Wave efficiencies by (tile_m, tile_n, SMs).
    for comp in (c for c in p.computations if c in p.kernel_computations):
      events: list = []
      for i in p.computations[comp]:
        event = self._event(p, i, rows)
        if isinstance(event, int):  # A kernel: extend the current span or open one.
          if events and isinstance(events[-1], _Span) and events[-1].stop == event:
            events[-1] = _Span(events[-1].start, event + 1)
          else:
            events.append(_Span(event, event + 1))
        elif isinstance(event, list):
          events += event
        elif event is not None:
          events.append(event)
      self.events[comp] = events
    self.kind = np.array([r[0] for r in rows], dtype=np.int8)
    self.precision = [r[1] for r in rows]
    self.flops = np.array([r[2] for r in rows], dtype=np.float64)
    self.bytes = np.array([r[3] for r in rows], dtype=np.float64)
    self.times = np.array([r[4] for r in rows], dtype=np.float64)
    self.output = [r[5] for r in rows]
    self.labels = [(r[6], r[7]) for r in rows]  # (op, pass)
    self.host_bytes = np.array([r[8] for r in rows], dtype=np.float64)  # Over the host link's busier direction.
    self.names = [r[9] for r in rows]  # Each kernel's instruction.

  def _event(self, p: hlo.Program, i: hlo.Instruction, rows: list):
    """The event an instruction is, or the index of the kernel row it adds, or None."""
    if i.opcode == "while":  # Its condition as often as hlo.Program.times counts it (once), its body trips times.
      body, condition = i.attribute("body"), i.attribute("condition")
      trips = round(p.trips.get(body, 1) / max(p.times(i), 1))
      return [_Call((c,), n) for c, n in ((condition, 1), (body, trips)) if c in p.computations]
    if i.opcode in ("call", "async-start"):
      callee = i.attribute("to_apply" if i.opcode == "call" else "calls")
      return _Call((callee,)) if callee in p.computations else None
    if i.opcode == "conditional":  # Its branches on the iterations they run (hlo.loop_multipliers: all, or fewer).
      branches = tuple(c for c in hlo.callees(i.line, "|".join(hlo.BRANCHES)) if c in p.computations)
      runs = max((p.trips.get(c, 1) for c in branches), default=1) / max(p.times(i), 1)
      return _Call(branches, min(runs, 1.0)) if branches else None
    if i.opcode.endswith("-done"):  # (Ignored where it ends no transfer: a fusion-done of device memory.)
      return _Done(i.operands[0]) if i.operands else None
    transfer = hlo.host_transfer_of(p, i)
    if transfer is not None:
      self.host_transfers.append(transfer)
      index = len(self.host_transfers) - 1
      self.transfer_names[(True, index)] = i.name
      return _Start(index, i.name, host=True) if i.opcode.endswith("-start") else _Sync(index, host=True)
    collective = hlo.collective_of(p, i)
    if collective is not None:
      self.collectives.append(collective)
      index = len(self.collectives) - 1
      self.transfer_names[(False, index)] = i.name
      return _Start(index, i.name) if i.opcode.endswith("-start") else _Sync(index)
    label = (cost.op_of(i.op_name) if i.op_name else f"({i.opcode})", cost.pass_of(i.op_name))
    gemm = hlo.gemm_of(p, i)
    if gemm is not None:
      rows.append((GEMM, gemm.precision, gemm.flops, gemm.bytes, gemm.times, gemm.output_dims, *label, 0.0, i.name))
      return len(rows) - 1
    call = hlo.attention_of(p, i)
    if call is not None:
      kind = ATTENTION_BACKWARD if call.backward else ATTENTION_FORWARD
      rows.append((kind, BF16, call.flops, call.bytes, call.times, (), "attention", label[1], 0.0, i.name))
      return len(rows) - 1
    if hlo.is_memory_kernel(i):
      traffic = hlo.kernel_traffic(p, i)
      rows.append((MEMORY, "", 0.0, traffic.device, p.times(i), (), *label, traffic.host, i.name))
      return len(rows) - 1
    return None

  def kernel_seconds(self, machine: cost.Machine, rates: Rates) -> np.ndarray:
    """Each kernel's seconds per execution."""
    facts = machine.facts
    efficiency = np.array([_efficiency(k, prec, rates) * facts.peak_flops(prec or BF16) for k, prec in
                           zip(self.kind, self.precision)], dtype=np.float64)
    waves = self._wave_efficiency(int(rates["tile_m"]), int(rates["tile_n"]), rates.sms)
    with np.errstate(divide="ignore", invalid="ignore"):
      compute = np.where(self.flops > 0, self.flops / (efficiency * waves), 0.0)
    memory = self.bytes / (machine.hbm_bytes_per_s * rates["hbm"])
    host = self.host_bytes / (facts.host_gb_s * 1e9 * rates["host"])
    return np.maximum(np.maximum(compute, memory), host) + rates["launch_s"]

  def _wave_efficiency(self, tile_m: int, tile_n: int, sms: int) -> np.ndarray:
    """Each kernel's wave efficiency (1 for a kernel that is no GEMM), computed once per tile and SM count."""
    key = (tile_m, tile_n, sms)
    if key not in self._waves:
      self._waves[key] = np.array([wave_efficiency(dims, tile_m, tile_n, sms) if kind == GEMM and dims else 1.0
                                   for kind, dims in zip(self.kind, self.output)])
    return self._waves[key]


def _efficiency(kind: int, precision: str, rates: Rates) -> float:
  if kind == GEMM:
    return rates.gemm(precision)
  if kind == ATTENTION_FORWARD:
    return rates["attention_forward"]
  if kind == ATTENTION_BACKWARD:
    return rates["attention_backward"]
  return 1.0


def wave_efficiency(output_dims: tuple[int, ...], tile_m: int, tile_n: int, sms: int) -> float:
  """The useful fraction of the tiles x waves a GEMM's output [..., M, N] occupies (see the module doc)."""
  n = output_dims[-1]
  m = output_dims[-2] if len(output_dims) > 1 else 1
  batch = math.prod(output_dims[:-2])
  tiles = batch * math.ceil(m / tile_m) * math.ceil(n / tile_n)
  waves = math.ceil(tiles / sms)
  return batch * m * n / (waves * sms * tile_m * tile_n)


@dataclasses.dataclass(frozen=True)
class Prediction:
  step_s: float
  kernel_s: np.ndarray  # Per execution, as Walk's table.
  collective_s: np.ndarray  # Per execution, as Walk.collectives.
  exposed_s: np.ndarray  # Per execution: what the step waits while each collective holds its link.
  host_s: np.ndarray  # Per execution, as Walk.host_transfers.
  host_exposed_s: np.ndarray  # Per execution: what the step waits while each host transfer holds its link.


_NETWORK, _TO_HOST, _FROM_HOST = "network", "to host", "from host"  # The links transfers take one at a time.


@dataclasses.dataclass(frozen=True)
class _Held:  # A transfer on a link: it holds the link from `begin` to `end`; the step's waits then go to waits[index].
  link: str
  begin: float
  end: float
  waits: np.ndarray
  index: int


def _links(transfer: hlo.HostTransfer) -> tuple[str, ...]:
  return (_TO_HOST,) * bool(transfer.to_host) + (_FROM_HOST,) * bool(transfer.from_host)


def predict(walk: Walk, machine: cost.Machine, rates: Rates | None = None) -> Prediction:
  """The predicted step of a walked program on `machine` (at `rates`, by default the machine's)."""
  rates = rates or machine.rates
  kernel_s = walk.kernel_seconds(machine, rates)
  cumulative = np.concatenate([[0.0], np.cumsum(kernel_s)])
  collective_s = np.array([_collective_seconds(c, machine, rates) for c in walk.collectives])
  host_s = np.array([_host_seconds(t, machine, rates) for t in walk.host_transfers])
  exposed, host_exposed = np.zeros(len(walk.collectives)), np.zeros(len(walk.host_transfers))
  durations: dict[str, float] = {}

  def transfer(e) -> tuple[float, tuple[str, ...], np.ndarray]:  # (seconds, links, exposed array) of a transfer.
    if e.host:
      return host_s[e.index], _links(walk.host_transfers[e.index]), host_exposed
    return collective_s[e.index], (_NETWORK,), exposed

  def run(comp: str) -> float:
    if comp in durations:
      return durations[comp]
    t, pending = 0.0, {}
    # Each link's transfers in the order it runs them, from the last one that ended before the step's time on.
    held: dict[str, collections.deque[_Held]] = collections.defaultdict(collections.deque)

    def wait_for(h: _Held) -> None:  # The step waits from t to h's end: charged to whatever holds the link.
      nonlocal t
      if h.end > t:
        for other in held[h.link]:
          other.waits[other.index] += max(min(other.end, h.end) - max(other.begin, t), 0.0)
        t = h.end
        for queue in held.values():
          while len(queue) > 1 and queue[0].end <= t:
            queue.popleft()

    for e in walk.events.get(comp, ()):
      if isinstance(e, _Span):
        t += cumulative[e.stop] - cumulative[e.start]
      elif isinstance(e, _Call):
        t += e.times * max(run(c) for c in e.computations)
      elif isinstance(e, (_Start, _Sync)):
        seconds, links, waits = transfer(e)
        begin = max([t, *(held[link][-1].end for link in links if held[link])])
        # Its wait is read off the link that made it wait (or its only one); it holds each of its links.
        binding = max(links, key=lambda link: held[link][-1].end if held[link] else t)
        h = _Held(binding, begin, begin + seconds, waits, e.index)
        for link in links:
          held[link].append(dataclasses.replace(h, link=link))
        if isinstance(e, _Start):
          pending[e.name] = h
        else:
          wait_for(h)
      elif isinstance(e, _Done) and e.start in pending:
        wait_for(pending.pop(e.start))
    for h in pending.values():  # Started and never waited for here: the computation ends after it.
      wait_for(h)
    durations[comp] = t
    return t

  return Prediction(run(walk.program.entry), kernel_s, collective_s, exposed, host_s, host_exposed)


def waits_s(walk: Walk, machine: cost.Machine, prediction: Prediction | None = None) -> float:
  """What the predicted step of a walked program waits on its transfers (collectives, copies to and from the
  host): its time less that of its kernels alone, transfers taking none. Another schedule of the same kernels can
  win back no more. `prediction`: `predict(walk, machine)`, where already made."""
  prediction = prediction or predict(walk, machine)
  free = machine.rates.with_values({"collective_latency_s": 0.0, "nvlink": math.inf, "nic": math.inf,
                                    "host": math.inf})
  return max(prediction.step_s - predict(walk, machine, free).step_s, 0.0)


def _host_seconds(t: hlo.HostTransfer, machine: cost.Machine, rates: Rates) -> float:
  return t.bytes / (machine.facts.host_gb_s * 1e9 * rates["host"])


def _collective_seconds(c: hlo.Collective, machine: cost.Machine, rates: Rates) -> float:
  sent, crosses = cost.bytes_sent(c, machine)
  if sent <= 0:
    return 0.0
  return rates["collective_latency_s"] + sent / (cost.link_bytes_per_s(machine, crosses) * rates["nic" if crosses
                                                                                                  else "nvlink"])


def latency_profile(walk: Walk, machine: cost.Machine) -> str:
  """The time of each kernel and transfer of a walked program on `machine`, as predicted, in the form XLA's
  latency-hiding scheduler reads a measured profile (a text `ProfiledInstructionsProto`: the cost of each
  instruction by name, in microseconds; an asynchronous transfer's under the instruction that starts it). A kernel
  inside a loop is timed per execution, as the scheduler weighs it."""
  rates = machine.rates
  timed = list(zip(walk.names, walk.kernel_seconds(machine, rates)))
  timed += [(walk.transfer_names[(False, k)], _collective_seconds(c, machine, rates))
            for k, c in enumerate(walk.collectives)]
  timed += [(walk.transfer_names[(True, k)], _host_seconds(t, machine, rates))
            for k, t in enumerate(walk.host_transfers)]
  return "".join(f'costs {{ name: "{name}" cost_us: {seconds * 1e6:.3f} }}\n' for name, seconds in timed)


def time_by_op(walk: Walk, prediction: Prediction) -> list[dict]:
  """Where the predicted time goes, per device per step: kernels by op (the last part of the op name, as
  `memory_by_op`), kind (gemm, attention, memory) and pass; collectives by kind and pass, and host transfers
  (kind `host`) by direction and pass, the exposed part and the hidden part in rows of their own. The exposed
  rows sum to the step. Exposed transfers (collectives, host) first, then the rest, each by seconds."""
  totals: dict[tuple[str, str, str, bool], float] = collections.defaultdict(float)
  for k, (op, pass_) in enumerate(walk.labels):
    totals[(op, pass_, _KIND_NAMES[int(walk.kind[k])], True)] += prediction.kernel_s[k] * walk.times[k]
  transfers = [("collective", walk.collectives, prediction.collective_s, prediction.exposed_s, lambda c: c.kind),
               ("host", walk.host_transfers, prediction.host_s, prediction.host_exposed_s,
                lambda t: " and ".join(_links(t)))]
  for kind, items, seconds, waits, op_of in transfers:
    for k, t in enumerate(items):
      key, exposed = (op_of(t), cost.pass_of(t.op_name), kind), waits[k] * t.times
      totals[(*key, True)] += exposed
      totals[(*key, False)] += seconds[k] * t.times - exposed
  rows = [{"op": op, "pass": pass_, "kind": kind, "seconds": s, "exposed": exposed}
          for (op, pass_, kind, exposed), s in totals.items() if s > 0]
  return sorted(rows, key=lambda r: (not (r["kind"] in ("collective", "host") and r["exposed"]), -r["seconds"]))


def predicted_step(p: hlo.Program, machine: cost.Machine | None, *, model_flops: float, tokens: float) -> dict:
  """The report's prediction figures for an optimised program (nulls without a GPU's rates)."""
  if machine is None or machine.rates is None:
    return {"predicted_step_s": None, "tokens_per_s_predicted": None, "mfu_predicted": None, "time_by_op": []}
  walk = Walk(p)
  prediction = predict(walk, machine)
  step = prediction.step_s
  return {"predicted_step_s": step, "tokens_per_s_predicted": tokens / step if step else None,
          "mfu_predicted": model_flops / step / machine.facts.mfu_peak_flops if step else None,
          "time_by_op": time_by_op(walk, prediction)}
