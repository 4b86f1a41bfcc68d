"""Reading a compiled program (optimised HLO text): its GEMMs with their FLOPs and precision, its attention
kernels with theirs, its kernels' memory traffic, its collectives with the bytes they move per step.

Rules, in one place:
  * a GEMM is a cuBLAS / cuBLASLt custom call (`__cublas$gemm`, `__cublas$lt$matmul`,
    `__cublas$lt$matmul$f8`), cuDNN's block-scaled GEMM (`__cudnn$blockScaledDot`), a Triton or cuDNN GEMM
    fusion, a `ragged-dot`, or any other `dot` (the CPU's, fused or not). Its precision is `nvfp4` / `mxfp8`
    for a block-scaled GEMM (E2M1 / E4M3 data with block scales), `fp8` for cuBLASLt's FP8 kernel or float8
    operands, else `bf16` (bf16 / f16 operands) or `f32`. A GEMM under ember's `EMULATED_GEMM_SCOPE` is
    `emulated`: a block-scaled GEMM run in bf16 on a GPU without a kernel for it (ember/quant/gemm.py).
    `gemm_census` counts instructions by precision (a scan body's GEMMs once, whatever the depth), and how
    many of them are emulated.
  * a GEMM's FLOPs are 2 x output elements x contraction size per execution (a ragged dot contracting its
    ragged rows: 2 x rows x output elements per group), times the trip count of every loop around it.
  * a cuDNN attention call (`__cudnn$fmha*`) does 2 x B x H x Lq x Lk x (D + Dv) FLOPs forward (QK^T and
    PV) and 2 x B x H x Lq x Lk x (3 D + 2 Dv) backward (QK^T again, dV, dP, dQ, dK: 2.5x the forward, the
    FlashAttention convention, the kernel's own recompute of the scores included); a causal mask halves both.
  * work "recomputed" is work under JAX's `rematted_computation` name scope: the forward of a
    `jax.checkpoint`ed function run again in the backward pass; and a backward attention kernel's QK^T
    (2 x B x H x Lq x Lk x D, halved if causal), the scores it computes again rather than reading them.
  * attention is `cudnn` when the program calls cuDNN's fused attention, else `xla`.
  * a collective's bytes are what one device holds of it (all-gather: the gathered result; reduce-scatter:
    its input; ragged-all-to-all: the smaller of its operand and its output buffer, a bound on what the
    routing moves; the rest: the operand), times the trip count of every loop around it (XLA records
    `known_trip_count` on the while ops of a scan), so `collectives` is bytes per device per step.
  * a conditional's branches run as often as the conditional, except under ember's `RUNS_OF_SCOPE` (a pipeline's
    segments off the stages, on M of a pass's ticks): that share of its runs, and what they call in proportion.
    Where two such conditionals run on different stages (the first stage's, the last's), both are counted.
  * a host transfer is a copy (`copy-start` / `copy-done`, or a plain `copy`) whose source or destination lies in
    host memory (`S(5)`: a remat policy's offloaded residuals): its bytes, once a direction, over the GPU's link
    to the host; a copy from host memory to host memory goes over it both ways. An asynchronous fusion
    (`fusion-start` / `fusion-done`: a scan's slice or update of its residuals there) that reads or writes host
    memory is one too, of those bytes. They are no memory kernels. Another kernel that reads or writes host
    memory itself moves those bytes over the link, the rest through device memory.
  * a kernel's memory traffic is the bytes of its operands and results, except what it only slices
    (a fused `dynamic-slice` or `slice`, reached through bitcasts and elementwise ops: the slice, in the
    operand's dtype), what it updates in place (a `dynamic-update-slice` or `scatter` into its operand: the
    update, read and written), and the stacked operand (the largest) of a kernel under ember's
    `STACKED_ROW_SCOPE` (one row of its L, the part that kernel reads).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import jax.numpy as jnp
import numpy as np

from ember.names import EMULATED_GEMM_SCOPE, RUNS_OF_SCOPE, STACKED_ROW_SCOPE
from ember.quant import recipe as recipe_lib
from ember.quant.formats import hlo_type
from ember.quant.gemm import CUBLAS_FP8_GEMM, CUDNN_BLOCK_SCALED_GEMM

_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
# Bytes per element of each HLO element type: the integer ones spelled here, the float ones by their dtypes.
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
          **{hlo_type(d): np.dtype(d).itemsize * (0.5 if "float4" in np.dtype(d).name else 1) for d in (
              jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu, jnp.bfloat16, jnp.float16,
              jnp.float32, jnp.float64)}}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
PRECISIONS = recipe_lib.GEMM_PRECISIONS
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul", CUBLAS_FP8_GEMM)
_BLOCK_SCALED = CUDNN_BLOCK_SCALED_GEMM
_HALF = (hlo_type(jnp.bfloat16), hlo_type(jnp.float16))  # HLO element types of 16-bit floats.
# A fusion, or one XLA runs asynchronously (a `fusion-start` / `fusion-done` pair: the done moves nothing more),
# as its GPU pipeline does for the scan's dynamic slices and updates with while-loop double buffering on.
_FUSIONS = ("fusion", "fusion-start")
# One-operand elementwise ops: a fused value that reaches slices only through them is read only where sliced.
_ELEMENTWISE_UNARY = ("abs", "convert", "negate", "exponential", "log", "sqrt", "rsqrt", "tanh", "logistic",
                      "sign", "floor", "ceil", "round-nearest-even", "copy")
_STACKED_ROW = re.compile(STACKED_ROW_SCOPE.replace("{}", r"(\d+)"))
_RUNS_OF = re.compile(RUNS_OF_SCOPE.replace("{}", r"(\d+)"))
RECOMPUTE_SCOPE = "rematted_computation"  # JAX's name scope for a checkpointed forward run again.
# Instructions that launch no kernel of their own (control flow, aliases, bookkeeping, async halves whose
# work is counted elsewhere) and move no bytes in the memory term.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
              "get-dimension-size", "copy-start", "copy-done", "send", "send-done", "recv", "recv-done",
              "async-start", "async-update", "async-done"}


@dataclasses.dataclass(frozen=True)
class Instruction:
  computation: str
  name: str
  shape: str  # The result type, e.g. "f32[64,128]{1,0}" or a tuple "(f32[...], s8[...])".
  opcode: str
  line: str

  @functools.cached_property
  def operands(self) -> list[str]:
    body = self.line[self.line.index(self.opcode + "(") + len(self.opcode) + 1:]
    depth, end = 1, 0
    for end, ch in enumerate(body):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        break
    args = re.sub(r"/\*.*?\*/", "", body[:end])
    return [a.strip().lstrip("%") for a in args.split(",") if a.strip().lstrip("%")]

  def attribute(self, key: str) -> str | None:
    m = re.search(key + r'="([^"]+)"', self.line) or re.search(key + r"=\{?%?([\w.\-]+)", self.line)
    return m.group(1) if m else None

  def dims(self, key: str) -> list[int]:
    """An integer list attribute: `lhs_contracting_dims={1,2}` in HLO, `"lhs_contracting_dimensions":["1"]`
    in a backend config."""
    m = re.search(key + r'(?:=\{|"\s*:\s*\[)([^}\]]*)', self.line)
    return [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []

  @property
  def op_name(self) -> str:
    return self.attribute("op_name") or ""

  @property
  def recomputed(self) -> bool:
    return RECOMPUTE_SCOPE in self.op_name


class Program:
  """One optimised HLO module, parsed once: instructions by name and computation, loop trip counts."""

  def __init__(self, hlo: str):
    self.instructions: list[Instruction] = []
    self.entry, comp = None, None
    for line in hlo.splitlines():
      if not line.startswith(" "):
        m = _COMPUTATION.match(line)
        if m:
          comp = m.group(2)
          self.entry = comp if m.group(1) else self.entry
        continue
      parsed = _parse_definition(line)
      if parsed:
        self.instructions.append(Instruction(comp, *parsed, line))
    self.by_name = {i.name: i for i in self.instructions}
    self.computations: dict[str, list[Instruction]] = collections.defaultdict(list)
    for i in self.instructions:
      self.computations[i.computation].append(i)
    self.trips = loop_multipliers(self.instructions)

  def type_of(self, name: str) -> str:
    i = self.by_name.get(name)
    return i.shape if i else ""

  def times(self, i: Instruction) -> float:
    """How many times an instruction runs per execution of the program (loop trip counts applied)."""
    return self.trips.get(i.computation, 1)

  @functools.cached_property
  def kernel_computations(self) -> set[str]:
    """The computations whose instructions are kernels (the entry, loop bodies, branches, called and async
    computations), not fusion bodies or reducers."""
    out, todo = set(), [self.entry]
    while todo:
      comp = todo.pop()
      if comp in out or comp not in self.computations:
        continue
      out.add(comp)
      for i in self.computations[comp]:
        keys = _KERNEL_CALLEES.get(i.opcode, ())
        todo += [c for key in keys for c in callees(i.line, key)]
    return out

  def kernels(self) -> list[Instruction]:
    return [i for c in self.kernel_computations for i in self.computations[c]]

  @functools.cached_property
  def gemm_fusion_bodies(self) -> set[str]:
    """The bodies of GEMM fusions (a Triton or cuDNN kernel around a dot): their dots are the fusion's GEMM."""
    return {i.attribute("calls") for i in self.instructions if _fused_gemm_kind(i)}


# Which called computations of an instruction hold kernels: loop bodies, branches, plain calls (command
# buffers), the ops an async pair wraps.
BRANCHES = ("branch_computations", "true_computation", "false_computation")  # A conditional's, in either form.
_KERNEL_CALLEES = {"while": ("body", "condition"), "conditional": BRANCHES, "call": ("to_apply",),
                   "async-start": ("calls",)}


def callees(line: str, key: str = "body|condition|calls|to_apply|called_computations|" + "|".join(BRANCHES)
             ) -> list[str]:
  # `key={%a, %b}` lists or `key=%a`; a list never runs on into the next attribute (`condition=%c, body=%b`).
  found = re.findall(rf"\b(?:{key})=(?:\{{([^}}]*)\}}|(%?[\w.\-]+))", line)
  return [c.strip().lstrip("%") for braced, single in found for c in (braced.split(",") if braced else [single])
          if c.strip()]


def instructions(hlo: str) -> list[Instruction]:
  return Program(hlo).instructions


def _parse_definition(line: str) -> tuple[str, str, str] | None:
  """(name, result type, opcode) of an instruction line `%name = TYPE opcode(...)`; tuple types nest."""
  m = _NAME.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    depth = 0
    for end, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    shape, rest = rest[: end + 1], rest[end + 1:]
  else:
    shape, _, rest = rest.partition(" ")
  op = re.match(r"\s*([a-z][\w\-]*)\(", rest)
  return (m.group(1), shape, op.group(1)) if op else None


def dtype_of(shape: str) -> str:
  m = _SHAPE.search(shape)
  return m.group(1) if m else "?"


def dims_of(shape: str) -> list[int]:
  """The dimensions of an array type (the first array of a tuple type)."""
  m = _SHAPE.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def nbytes(shape: str) -> float:
  return sum(_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(shape))


def loop_multipliers(instrs: list[Instruction]) -> dict[str, float]:
  """{computation: how many times it runs per execution of the program} for loop bodies and the branches that run
  on a share of their conditional's runs (others: 1)."""
  calls = collections.defaultdict(set)
  by_name = {i.name: i for i in instrs}
  roots = {i.computation: i for i in instrs if i.line.lstrip().startswith("ROOT ")}
  loops = []  # (caller, body, trip count)
  for i in instrs:
    calls[i.computation].update(callees(i.line))
    if i.opcode == "while":
      loops.append((i.computation, i.attribute("body"), trip_count(i, by_name, roots)))
  factor: dict[str, float] = {}

  def mark(comp, n, seen):
    if comp in seen:
      return
    seen.add(comp)
    factor[comp] = factor.get(comp, 1) * n
    for c in calls.get(comp, ()):
      mark(c, n, seen)

  for _, body, n in loops:
    mark(body, n, set())
  for i in instrs:  # A conditional that runs its branches on a stated share of its runs: them, and what they call.
    share = _RUNS_OF.search(i.op_name) if i.opcode == "conditional" else None
    if share and int(share.group(1)) < int(share.group(2)):
      seen = set()
      for branch in callees(i.line, "|".join(BRANCHES)):
        scale(branch, int(share.group(1)) / int(share.group(2)), calls, factor, seen)
  return factor


def scale(comp: str, share: float, calls: dict[str, set[str]], factor: dict[str, float], seen: set[str]):
  """`comp` and what it calls run `share` of the times they were counted."""
  if comp in seen:
    return
  seen.add(comp)
  factor[comp] = factor.get(comp, 1) * share
  for c in calls.get(comp, ()):
    scale(c, share, calls, factor, seen)


def trip_count(loop: Instruction, by_name: dict[str, Instruction], roots: dict[str, Instruction]) -> int:
  """How many times a while loop runs its body: XLA's `known_trip_count` where the loop records it, else read off
  the loop (the loops XLA's collective pipeliner peels lose the record): the induction variable's initial constant,
  the constant its condition compares it with and the constant its body adds. 1 where any of them is not a constant.
  `roots`: each computation's ROOT instruction."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.line)
  if known:
    return int(known.group(1))
  index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', loop.line)
  init_tuple = by_name.get(loop.operands[0]) if loop.operands else None
  if not index or init_tuple is None or init_tuple.opcode != "tuple":
    return 1
  k = int(index.group(1))
  init = _folded(init_tuple.operands[k], by_name) if k < len(init_tuple.operands) else None
  compare, caller = _through_fusion(roots.get(loop.attribute("condition")), by_name, roots)
  update = roots.get(loop.attribute("body"))
  step = None
  if update is not None and update.opcode == "tuple" and k < len(update.operands):
    add, add_caller = _through_fusion(by_name.get(update.operands[k]), by_name, roots)
    if add is not None and add.opcode == "add":
      step = next((v for v in (_folded(o, by_name, add_caller) for o in add.operands) if v is not None), None)
  if compare is None or compare.opcode != "compare" or init is None or not step:
    return 1
  lhs, rhs = (_folded(o, by_name, caller) for o in compare.operands[:2])
  direction = compare.attribute("direction")
  if rhs is None:  # The bound on the left: `bound > i` is `i < bound`.
    flipped = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE", "NE": "NE"}
    rhs, direction = lhs, flipped.get(direction)
  if rhs is None:
    return 1
  span = {"LT": rhs - init, "NE": rhs - init, "LE": rhs - init + (1 if step > 0 else -1),
          "GT": rhs - init, "GE": rhs - init + (1 if step > 0 else -1)}.get(direction)
  trips = None if span is None else -(-span // step)
  return trips if trips and trips > 0 else 1  # A step away from the bound: not a loop read right.


def _through_fusion(i: Instruction | None, by_name, roots) -> tuple[Instruction | None, Instruction | None]:
  """(the instruction that computes `i`'s value, the fusion it sits in or None): a fusion's ROOT in its place."""
  if i is not None and i.opcode == "fusion":
    return roots.get(i.attribute("calls")), i
  return i, None


def _folded(name: str, by_name: dict[str, Instruction], fusion: Instruction | None = None) -> int | None:
  """The integer value of a scalar that is a constant (through copies, bitcasts and converts, and from a fused
  computation's parameter to the fusion's operand), or None."""
  i = by_name.get(name)
  while i is not None and i.opcode in ("copy", "bitcast", "convert") and i.operands:
    i = by_name.get(i.operands[0])
  if i is None:
    return None
  if i.opcode == "constant":
    value = re.search(r"constant\((-?\d+)\)", i.line)
    return int(value.group(1)) if value else None
  if i.opcode == "parameter" and fusion is not None:
    n = int(re.search(r"parameter\((\d+)\)", i.line).group(1))
    return _folded(fusion.operands[n], by_name) if n < len(fusion.operands) else None
  return None


# --- GEMMs ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gemm:
  kind: str  # The custom-call target, "triton_gemm", "cudnn_gemm", "ragged_dot" or "dot".
  operand_dtypes: tuple[str, ...]
  precision: str  # One of PRECISIONS.
  op_name: str
  flops: float = 0.0  # Per execution.
  times: int = 1  # Executions per program run (loop trip counts).
  bytes: float = 0.0  # Operands and results, per execution.
  output_dims: tuple[int, ...] = ()
  recomputed: bool = False

  @property
  def emulated(self) -> bool:
    return EMULATED_GEMM_SCOPE in self.op_name

  @property
  def flops_per_step(self) -> float:
    return self.flops * self.times


def gemms(hlo: str | Program) -> list[Gemm]:
  p = hlo if isinstance(hlo, Program) else Program(hlo)
  return [g for i in p.instructions if (g := gemm_of(p, i)) is not None]


def gemm_of(p: Program, i: Instruction) -> Gemm | None:
  """The GEMM an instruction runs (see the module doc), None if it runs none."""
  target = i.attribute("custom_call_target") if i.opcode == "custom-call" else None
  if target in _CUBLAS or target == _BLOCK_SCALED:
    kind, dot = target, i
  elif _fused_gemm_kind(i):
    kind = _fused_gemm_kind(i)
    dot = next((d for d in p.computations[i.attribute("calls")] if d.opcode in ("dot", "scaled-dot")), None)
    if dot is None:
      return None
  elif i.opcode in ("dot", "ragged-dot", "scaled-dot") and i.computation not in p.gemm_fusion_bodies:
    kind, dot = i.opcode.replace("-", "_"), i
  else:
    return None
  dtypes = tuple(dtype_of(p.type_of(o)) for o in dot.operands[:2])
  return Gemm(kind, dtypes, _precision(kind, dtypes), i.op_name, _gemm_flops(p, dot), p.times(i), kernel_bytes(p, i),
              tuple(dims_of(_first(i.shape))), i.recomputed)


def _fused_gemm_kind(i: Instruction) -> str | None:
  """"triton_gemm" / "cudnn_gemm" for a GEMM fusion (a Triton or cuDNN kernel around a dot), else None."""
  m = i.opcode in _FUSIONS and re.search(r'"kind":"__(triton_(?:nested_)?gemm|cudnn\$fusion)"', i.line)
  return ("cudnn_gemm" if "cudnn" in m.group(1) else "triton_gemm") if m else None


def _precision(kind: str, dtypes: tuple[str, ...]) -> str:
  if kind == _BLOCK_SCALED or (kind == "scaled_dot" and dtypes and dtypes[0].startswith(("f8", "f4"))):
    return recipe_lib.block_scaled_precision(dtypes)
  if kind.endswith("$f8") or any(d.startswith("f8") for d in dtypes):
    return recipe_lib.FP8
  if dtypes and all(d in _HALF for d in dtypes):
    return recipe_lib.BF16
  return recipe_lib.F32


def _gemm_flops(p: Program, dot: Instruction) -> float:
  """2 x output elements x contraction size (see the module doc)."""
  out = dims_of(_first(dot.shape))
  lhs = dims_of(p.type_of(dot.operands[0]))
  if dot.opcode == "custom-call":
    contracting = dot.dims("lhs_contracting_dimensions")
    if dot.attribute("custom_call_target") == _BLOCK_SCALED and not contracting:
      contracting = [len(lhs) - 1]  # cuDNN's block-scaled GEMM contracts the operands' last (minor) axis.
  else:
    contracting = dot.dims("lhs_contracting_dims")
  k = math.prod(lhs[d] for d in contracting if d < len(lhs))
  if dot.opcode == "ragged-dot" and set(dot.dims("lhs_ragged_dims")) & set(contracting):
    groups = dims_of(p.type_of(dot.operands[2]))
    return 2.0 * math.prod(out) / max(groups[0] if groups else 1, 1) * k  # Each row is in one group.
  return 2.0 * math.prod(out) * k


def gemm_census(hlo: str | Program) -> dict[str, int]:
  """GEMM instructions by precision, and `emulated`: how many of them emulate a block-scaled GEMM."""
  found = gemms(hlo)
  counts = collections.Counter(g.precision for g in found)
  return {**{p: counts.get(p, 0) for p in PRECISIONS}, "emulated": sum(g.emulated for g in found)}


def _first(shape: str) -> str:
  return _top_level(shape)[0]


# --- Attention ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  backward: bool
  causal: bool
  flops: float  # Per execution.
  times: int
  bytes: float
  recomputed: bool
  op_name: str
  rescored_flops: float = 0.0  # Per execution, of `flops`: a backward kernel's QK^T, the scores computed again.

  @property
  def flops_per_step(self) -> float:
    return self.flops * self.times

  @property
  def recomputed_flops_per_step(self) -> float:
    """What the call computes again per step: all of it under remat, else the scores it recomputes."""
    return self.flops_per_step if self.recomputed else self.rescored_flops * self.times


def attention_calls(hlo: str | Program) -> list[AttentionCall]:
  p = hlo if isinstance(hlo, Program) else Program(hlo)
  return [c for i in p.instructions if (c := attention_of(p, i)) is not None]


def attention_of(p: Program, i: Instruction) -> AttentionCall | None:
  """The cuDNN attention call an instruction is (see the module doc), None if it is none."""
  target = i.attribute("custom_call_target") if i.opcode == "custom-call" else ""
  if not (target or "").startswith("__cudnn$fmha"):
    return None
  backward = "Backward" in target
  causal = bool(re.search(r'"mask_type":\s*"CAUSAL"', i.line))
  # The score matrix [B, H, Lq, Lk] is in the backend config; head dims are the last of Q's and V's.
  m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', i.line)
  q, v = (dims_of(p.type_of(o)) for o in (i.operands + ["", "", ""])[:3:2])
  flops = rescored = 0.0
  if m and q and v:
    b, h, lq, lk = (int(d) for d in re.findall(r"\d+", m.group(1)))
    d, dv = q[-1], v[-1]
    per_dim = 2.0 * b * h * lq * lk * (0.5 if causal else 1.0)
    flops = per_dim * ((3 * d + 2 * dv) if backward else (d + dv))
    rescored = per_dim * d if backward else 0.0
  return AttentionCall(backward, causal, flops, p.times(i), kernel_bytes(p, i), i.recomputed, i.op_name, rescored)


def attention(hlo: str | Program) -> dict[str, object]:
  """{"kernel": cudnn | xla, "forward": cuDNN forward calls, "backward": cuDNN backward calls}."""
  calls = attention_calls(hlo)
  backward = sum(c.backward for c in calls)
  return {"kernel": "cudnn" if calls else "xla", "forward": len(calls) - backward, "backward": backward}


# --- Memory traffic -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Traffic:
  """A kernel's bytes per execution (see the module doc): through device memory, and over the link to host memory
  where it reads or writes host memory itself."""
  device: float
  to_host: float = 0.0
  from_host: float = 0.0

  @property
  def host(self) -> float:
    """The bytes over the host link's busier direction."""
    return max(self.to_host, self.from_host)


def kernel_bytes(p: Program, i: Instruction) -> float:
  """The bytes a kernel reads and writes in device memory (see the module doc)."""
  return kernel_traffic(p, i).device


def kernel_traffic(p: Program, i: Instruction) -> Traffic:
  """The bytes a kernel reads and writes (see the module doc), each where it lies: an operand or a result in host
  memory (`S(5)`) moves over the link to the host."""
  on_host = lambda shape: HOST_MEMORY in shape
  if i.opcode in ("dynamic-update-slice", "dynamic-slice", "slice"):
    moved = nbytes(p.type_of(i.operands[1])) if i.opcode == "dynamic-update-slice" else nbytes(i.shape)
    source = p.type_of(i.operands[1 if i.opcode == "dynamic-update-slice" else 0])
    return _traffic([(moved, on_host(source))], [(moved, on_host(i.shape))])
  types = [p.type_of(o) for o in i.operands]
  operands = [nbytes(t) for t in types]
  row_of = _STACKED_ROW.search(i.op_name or "")
  if row_of and operands:  # The stacked operand is the largest.
    largest = max(range(len(operands)), key=operands.__getitem__)
    operands[largest] /= int(row_of.group(1))
  parts = _top_level(i.shape)
  if i.opcode == "custom-call" and len(parts) > 1 and dtype_of(parts[-1]) in ("s8", "u8"):
    parts = parts[:-1]  # A library call's scratch workspace: no data moves through it.
  if i.opcode == "fusion-start":  # ((operands), output, context): the fusion's own output is what it writes.
    parts = parts[1:2]
  results = [(nbytes(x), on_host(x)) for x in parts]
  if i.opcode in _FUSIONS:
    body = p.computations.get(i.attribute("calls") or "", [])
    params = {int(re.search(r"parameter\((\d+)\)", b.line).group(1)): b.name for b in body if b.opcode == "parameter"}
    users = collections.defaultdict(list)
    for b in body:
      for o in b.operands:
        users[o].append(b)

    def reads(name):  # The slices a fused value is read through (bitcasts, elementwise ops followed), or None: all.
      uses = users.get(name, [])
      if not uses:
        return None
      out = []
      for u in uses:
        if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == name:
          sliced = [u]
        else:
          sliced = reads(u.name) if u.opcode == "bitcast" or u.opcode in _ELEMENTWISE_UNARY else None
        if sliced is None:
          return None
        out += sliced
      return out

    def viewed_by(name):  # The users of a fused value and of every bitcast of it (the same buffer, viewed).
      out = []
      for u in users.get(name, []):
        out += viewed_by(u.name) if u.opcode == "bitcast" else [u]
      return out

    def sliced_bytes(index, slices):  # Each slice's elements in operand `index`'s own dtype.
      return _BYTES.get(dtype_of(types[index]), 4) * sum(math.prod(dims_of(u.shape)) for u in slices)

    for index, name in params.items():
      sliced = reads(name) if index < len(operands) else None
      if sliced is not None:
        operands[index] = sliced_bytes(index, sliced)
    for index, update, whole, read in in_place_updates(p, i):
      if index < len(operands):  # What it reads of the buffer: a combining scatter's rows, and any slice read back
        # (a bounds-checked update's select reads the slot it overwrites).
        back = [u for u in viewed_by(params.get(index)) if u.opcode in ("dynamic-slice", "slice")]
        operands[index] = read + sliced_bytes(index, back)
        results.append((update - whole, on_host(types[index])))  # In place: only the update is written.
  return _traffic(list(zip(operands, map(on_host, types))), results)


def _traffic(reads: list[tuple[float, bool]], writes: list[tuple[float, bool]]) -> Traffic:
  """Traffic from (bytes, in host memory) reads and writes; writes of a side sum to no less than zero."""
  written = lambda host: max(sum(b for b, h in writes if h == host), 0.0)
  read = lambda host: sum(b for b, h in reads if h == host)
  return Traffic(read(False) + written(False), written(True), read(True))


def _is_fill(p: Program, i: Instruction) -> bool:
  """A broadcast of a scalar (alone or as a fusion's roots): memory set to a constant."""
  roots = _fusion_roots(p, i)
  return i.opcode == "broadcast" or (bool(roots) and all(r.opcode == "broadcast" for r in roots))


def _fusion_roots(p: Program, fusion: Instruction) -> list[Instruction]:
  """The root instructions of a fusion's body (each element of a root tuple); [] for another instruction."""
  body = p.computations.get(fusion.attribute("calls") or "", []) if fusion.opcode in _FUSIONS else []
  root = next((b for b in body if b.line.lstrip().startswith("ROOT")), None)
  if root is None:
    return []
  return [p.by_name[n] for n in root.operands if n in p.by_name] if root.opcode == "tuple" else [root]


def in_place_updates(p: Program, fusion: Instruction) -> list[tuple[int, float, float, float]]:
  """(operand index, update bytes, whole buffer bytes, bytes of the buffer read) of every buffer a fusion updates
  in place: a root `dynamic-update-slice` or `scatter` into one of its parameters (a bitcast of one too, which
  XLA's emitter updates in place as well). A scatter that combines (a scatter-add: an embedding's gradient) reads
  the rows it writes; one that overwrites, and a dynamic-update-slice, read none of the buffer."""
  out = []
  for r in _fusion_roots(p, fusion):
    r = _through_bitcasts(p, r)
    if r is None or r.opcode not in ("dynamic-update-slice", "scatter"):
      continue
    target = _through_bitcasts(p, p.by_name.get(r.operands[0]))
    if target is not None and target.opcode == "parameter":
      # A scatter's operands: n buffers, their indices, n updates (one of each here).
      update = nbytes(p.type_of(r.operands[1 if r.opcode == "dynamic-update-slice" else len(r.operands) // 2 + 1]))
      read = update if r.opcode == "scatter" and not _overwrites(p, r) else 0.0
      out.append((int(re.search(r"parameter\((\d+)\)", target.line).group(1)), update, nbytes(r.shape), read))
  return out


def _through_bitcasts(p: Program, i: Instruction | None) -> Instruction | None:
  """The instruction a chain of bitcasts starting at `i` views (`i` itself if it is none)."""
  while i is not None and i.opcode == "bitcast" and i.operands:
    i = p.by_name.get(i.operands[0])
  return i


def _overwrites(p: Program, scatter: Instruction) -> bool:
  """Whether a scatter's combiner returns the update as it is (`x.at[i].set`), not a sum with what is there."""
  body = p.computations.get(scatter.attribute("to_apply") or "", [])
  root = next((b for b in body if b.line.lstrip().startswith("ROOT")), None)
  return root is not None and root.opcode == "parameter"


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A kernel-level instruction that moves memory: neither a GEMM, an attention call nor a collective."""
  name: str
  opcode: str
  bytes: float  # Per execution, through device memory.
  times: int
  to_host: float = 0.0  # Per execution, what it writes to host memory itself and reads from there.
  from_host: float = 0.0


def memory_kernels(p: Program) -> list[Kernel]:
  return [Kernel(i.name, i.opcode, t.device, p.times(i), t.to_host, t.from_host) for i in p.kernels()
          if is_memory_kernel(i) and host_transfer_of(p, i) is None for t in (kernel_traffic(p, i),)]


def is_memory_kernel(i: Instruction) -> bool:
  """A kernel-level instruction that launches a kernel moving memory: not a GEMM, an attention call, a
  collective, the done half of an async pair, or an instruction that launches nothing (a buffer's allocation:
  the `AllocateBuffer` of a scan's stacked residuals in host memory)."""
  op = i.opcode[: -len("-start")] if i.opcode.endswith("-start") else i.opcode
  allocation = i.opcode == "custom-call" and i.attribute("custom_call_target") == "AllocateBuffer"
  return not (i.opcode in _NO_KERNEL or op in COLLECTIVES or i.opcode.endswith("-done") or _is_compute(i)
              or allocation)


def _is_compute(i: Instruction) -> bool:
  target = i.attribute("custom_call_target") if i.opcode == "custom-call" else ""
  if target in _CUBLAS or target == _BLOCK_SCALED or (target or "").startswith("__cudnn$fmha"):
    return True
  if i.opcode in ("dot", "ragged-dot", "scaled-dot"):
    return True
  return _fused_gemm_kind(i) is not None


@dataclasses.dataclass(frozen=True)
class Value:
  """A buffer the program produces: one array of a kernel's result."""
  shape: str
  dtype: str
  bytes: float
  op_name: str
  times: int


def values(p: Program) -> list[Value]:
  """Every array the step's kernels compute (loop bodies' once, with how many times they run). A buffer
  updated in place (a scan's stacked residuals or gradients, one slice a step) and its initialisation (a
  broadcast of a constant) are not computed values: they show in the peak memory."""
  out = []
  for i in p.kernels():
    # An async fusion's value is its done's, updated in place or filled as its start's fusion says.
    work = p.by_name.get(i.operands[0], i) if i.opcode == "fusion-done" and i.operands else i
    if (i.opcode in _NO_KERNEL or i.opcode.endswith("-start") or i.opcode in ("dynamic-update-slice", "scatter")
        or in_place_updates(p, work) or _is_fill(p, work)):
      continue
    for part in _top_level(i.shape):
      if _SHAPE.search(part):
        out.append(Value(_SHAPE.search(part).group(0), dtype_of(part), nbytes(part), i.op_name, p.times(i)))
  return out


# --- Collectives --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  shape: str  # What one device holds of it (see the module doc).
  bytes: float  # Per execution, per device.
  times: int
  groups: tuple[tuple[int, ...], ...]  # Replica groups (partition ids); () = all devices.
  op_name: str

  @property
  def bytes_per_step(self) -> float:
    return self.bytes * self.times


def collective_ops(hlo: str | Program) -> list[Collective]:
  p = hlo if isinstance(hlo, Program) else Program(hlo)
  return [c for i in p.instructions if (c := collective_of(p, i)) is not None]


def collective_of(p: Program, i: Instruction) -> Collective | None:
  """The collective an instruction starts or runs (see the module doc), None if it is none."""
  op = i.opcode[: -len("-start")] if i.opcode.endswith("-start") else i.opcode
  if op not in COLLECTIVES:
    return None
  parts = _top_level(i.shape)
  if op == "reduce-scatter":  # Its input: the operands.
    held = " ".join(p.type_of(o) for o in i.operands)
  elif op == "ragged-all-to-all":  # Operands (data, output buffer, offsets and sizes...): at most the data
    # leaves a device and at most the output buffer arrives.
    held = min((p.type_of(o) for o in i.operands[:2]), key=nbytes)
  elif i.opcode.endswith("-start") and op != "all-reduce" and len(parts) >= 2:
    held = parts[1]  # An async start's type is (inputs, outputs[, context]): the outputs.
  else:
    held = i.shape
  return Collective(op, held, nbytes(held), p.times(i), replica_groups(i.line), i.op_name)


def collectives(hlo: str | Program) -> dict[str, float]:
  """{kind: bytes per device per step} (see the module doc)."""
  totals: dict[str, float] = collections.defaultdict(float)
  for c in collective_ops(hlo):
    totals[c.kind] += c.bytes_per_step
  return dict(totals)


def replica_groups(line: str) -> tuple[tuple[int, ...], ...]:
  """The groups of a collective: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, over the
  axes of a device mesh (`mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}`), or
  `source_target_pairs` (each pair a group); () when it names none (all devices)."""
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    ids = _iota(m.group(2), m.group(3))
    size = shape[-1]
    return tuple(tuple(ids[g * size:(g + 1) * size]) for g in range(len(ids) // size))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
                line)
  if m:
    return _mesh_groups(m)
  m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", line)
  if m:
    return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
  return ()


def _iota(dims: str, perm: str | None) -> list[int]:
  """The device ids of an iota `[dims]` (comma-separated), transposed by `perm` if given, in row-major order."""
  sizes = [int(x) for x in dims.split(",")]
  if not perm:
    return list(range(math.prod(sizes)))
  order = [int(x) for x in perm.split(",")]
  strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
  return _iota_transposed([sizes[k] for k in order], [strides[k] for k in order])


def _mesh_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
  """The groups of `replica_groups=mesh[...]`: the mesh's positions hold `device_ids` (an iota when absent) in
  row-major order; a group is the devices whose positions differ only along the named axes."""
  axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
  sizes = [size for _, size in axes]
  ids = _iota(m.group(2), m.group(3)) if m.group(2) else list(range(math.prod(sizes)))
  grouped = set(re.findall(r"'([^']+)'", m.group(4)))
  strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
  inside = [(size, stride) for (name, size), stride in zip(axes, strides) if name in grouped]
  outside = [(size, stride) for (name, size), stride in zip(axes, strides) if name not in grouped]
  offsets = lambda dims: _iota_transposed([n for n, _ in dims], [s for _, s in dims])
  return tuple(tuple(ids[base + k] for k in offsets(inside)) for base in offsets(outside))


def _iota_transposed(dims: list[int], strides: list[int]) -> list[int]:
  """Row-major enumeration of an iota array viewed with these dimensions and strides."""
  out = [0]
  for n, s in zip(dims, strides):
    out = [base + k * s for base in out for k in range(n)]
  return out


def _top_level(shape: str) -> list[str]:
  """The top-level elements of a tuple type "(a, (b, c), d)"; [shape] for a plain array type."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  out, depth, cur = [], 0, ""
  for ch in shape[1:-1]:
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
      continue
    depth += ch in "({["
    depth -= ch in ")}]"
    cur += ch
  return out + ([cur.strip()] if cur.strip() else [])


# --- Host transfers ---------------------------------------------------------------------------------------

HOST_MEMORY = "S(5)"  # A layout's memory space in a GPU program: host memory.


@dataclasses.dataclass(frozen=True)
class HostTransfer:
  """A copy between device and host memory (see the module doc), per device."""
  to_host: float  # Bytes a direction, per execution.
  from_host: float
  times: int
  op_name: str

  @property
  def bytes(self) -> float:
    return max(self.to_host, self.from_host)


def host_transfer_of(p: Program, i: Instruction) -> HostTransfer | None:
  """The host transfer a `copy-start`, a `copy` or a `fusion-start` is (see the module doc), None for any other
  instruction or one inside device memory."""
  if i.opcode == "fusion-start":  # An asynchronous slice or update of a buffer in host memory: a copy.
    traffic = kernel_traffic(p, i)
    if not (traffic.to_host or traffic.from_host):
      return None
    return HostTransfer(traffic.to_host, traffic.from_host, p.times(i), i.op_name)
  if i.opcode == "copy-start":  # (destination, source, context)
    destination, source = _top_level(i.shape)[:2]
  elif i.opcode == "copy" and i.operands:
    destination, source = i.shape, p.type_of(i.operands[0])
  else:
    return None
  to_host, from_host = HOST_MEMORY in destination, HOST_MEMORY in source
  if not (to_host or from_host):
    return None
  size = nbytes(destination)
  return HostTransfer(size if to_host else 0.0, size if from_host else 0.0, p.times(i), i.op_name)


def host_transfers(hlo: str | Program) -> dict[str, float]:
  """{"to_host", "from_host": bytes per device per step}: the copies' and what kernels read and write in host
  memory themselves."""
  p = hlo if isinstance(hlo, Program) else Program(hlo)
  moved = [t for i in p.kernels() if (t := host_transfer_of(p, i)) is not None] + [
      k for k in memory_kernels(p) if k.to_host or k.from_host]  # Host transfers are no memory kernels.
  return {"to_host": sum(t.to_host * t.times for t in moved), "from_host": sum(t.from_host * t.times for t in moved)}


def host_placements(hlo: str) -> int:
  """Tensors a program places in host memory: `annotate_device_placement` custom calls to pinned_host
  (lowered StableHLO) plus `S(5)` memory-space layouts (compiled GPU HLO)."""
  return sum(1 for line in hlo.splitlines()
             if ("annotate_device_placement" in line and "pinned_host" in line) or "S(5)" in line)
