"""Reading a compiled program (optimised HLO text): its GEMMs by operand type, its attention kernel, its
collectives with the bytes they move per step.

Rules, in one place:
  * a GEMM is a cuBLAS / cuBLASLt custom call (`__cublas$gemm`, `__cublas$lt$matmul`,
    `__cublas$lt$matmul$f8`), a Triton GEMM fusion, or any other `dot` (the CPU's, fused or not);
    it is `fp8` when it is cuBLASLt's FP8 kernel or its operands are float8, else `bf16` (bf16 / f16
    operands) or `f32`. Each instruction counts once (a scan body's GEMMs once, whatever the depth).
  * attention is `cudnn` when the program calls cuDNN's fused attention (`__cudnn$fmha*`), else `xla`.
  * a collective's bytes are what one device holds of it (all-gather: the gathered result; reduce-scatter:
    its input; ragged-all-to-all: the smaller of its operand and its output buffer, a bound on what the
    routing moves; the rest: the operand), times the trip count of every loop around it (XLA records
    `known_trip_count` on the while ops of a scan), so `collectives` is bytes per device per step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "f8e8m0fnu": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
          "u64": 8}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_HALF = ("bf16", "f16")  # HLO element types of 16-bit floats.


@dataclasses.dataclass(frozen=True)
class Instruction:
  computation: str
  name: str
  shape: str  # The result type, e.g. "f32[64,128]{1,0}" or a tuple "(f32[...], s8[...])".
  opcode: str
  line: str

  @property
  def operands(self) -> list[str]:
    m = re.search(re.escape(self.opcode) + r"\(([^)]*)\)", self.line)
    return [a.strip().lstrip("%") for a in m.group(1).split(",") if a.strip()] if m else []

  def attribute(self, key: str) -> str | None:
    m = re.search(key + r'="([^"]+)"', self.line) or re.search(key + r"=\{?%?([\w.\-]+)", self.line)
    return m.group(1) if m else None


def instructions(hlo: str) -> list[Instruction]:
  out, comp = [], None
  for line in hlo.splitlines():
    if not line.startswith(" "):
      m = _COMPUTATION.match(line)
      comp = m.group(1) if m else comp
      continue
    parsed = _parse_definition(line)
    if parsed:
      out.append(Instruction(comp, *parsed, line))
  return out


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


def _dtype(shape: str) -> str:
  m = _SHAPE.search(shape)
  return m.group(1) if m else "?"


def nbytes(shape: str) -> float:
  return sum(_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE.findall(shape))


def loop_multipliers(instrs: list[Instruction]) -> dict[str, int]:
  """{computation: how many times it runs per execution of the program} for loop bodies (others: 1)."""
  calls = collections.defaultdict(set)
  loops = []  # (caller, body, trip count)
  for i in instrs:
    for callee in re.findall(r"(?:body|condition|calls|to_apply|branch_computations|called_computations)="
                             r"\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)", i.line):
      calls[i.computation].update(c.strip().lstrip("%") for c in callee.split(","))
    if i.opcode == "while":
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.line)
      loops.append((i.computation, i.attribute("body"), int(trip.group(1)) if trip else 1))
  factor: dict[str, int] = {}

  def mark(comp, n, seen):
    if comp in seen:
      return
    seen.add(comp)
    factor[comp] = factor.get(comp, 1) * n
    for c in calls.get(comp, ()):
      mark(c, n, seen)

  for _, body, n in loops:
    mark(body, n, set())
  return factor


@dataclasses.dataclass(frozen=True)
class Gemm:
  kind: str  # The custom-call target, "triton_gemm" or "dot".
  operand_dtypes: tuple[str, ...]
  precision: str  # fp8 | bf16 | f32
  op_name: str


def gemms(hlo: str) -> list[Gemm]:
  instrs = instructions(hlo)
  types = {i.name: i.shape for i in instrs}
  is_triton_gemm = lambda i: i.opcode == "fusion" and re.search(r'"kind":"__triton_(nested_)?gemm', i.line)
  triton_bodies = {i.attribute("calls") for i in instrs if is_triton_gemm(i)}
  out = []
  for i in instrs:
    target = i.attribute("custom_call_target") if i.opcode == "custom-call" else None
    if target in _CUBLAS:
      kind = target
    elif is_triton_gemm(i):
      kind = "triton_gemm"
    elif i.opcode == "dot" and i.computation not in triton_bodies:
      kind = "dot"
    else:
      continue
    dtypes = tuple(_dtype(types.get(o, "?")) for o in i.operands[:2])
    if kind.endswith("$f8") or any(d.startswith("f8") for d in dtypes):
      precision = "fp8"
    elif all(d in _HALF for d in dtypes):
      precision = "bf16"
    else:
      precision = "f32"
    out.append(Gemm(kind, dtypes, precision, i.attribute("op_name") or ""))
  return out


def gemm_census(hlo: str) -> dict[str, int]:
  counts = collections.Counter(g.precision for g in gemms(hlo))
  return {p: counts.get(p, 0) for p in ("fp8", "bf16", "f32")}


def attention(hlo: str) -> dict[str, object]:
  """{"kernel": cudnn | xla, "forward": cuDNN forward calls, "backward": cuDNN backward calls}."""
  targets = [i.attribute("custom_call_target") for i in instructions(hlo) if i.opcode == "custom-call"]
  fmha = [t for t in targets if t and t.startswith("__cudnn$fmha")]
  backward = sum("Backward" in t for t in fmha)
  return {"kernel": "cudnn" if fmha else "xla", "forward": len(fmha) - backward, "backward": backward}


def collectives(hlo: str) -> dict[str, float]:
  """{kind: bytes per device per step} (see the module doc)."""
  instrs = instructions(hlo)
  factor = loop_multipliers(instrs)
  types = {i.name: i.shape for i in instrs}
  totals: dict[str, float] = collections.defaultdict(float)
  for i in instrs:
    op = i.opcode[: -len("-start")] if i.opcode.endswith("-start") else i.opcode
    if op not in COLLECTIVES:
      continue
    parts = _top_level(i.shape)
    if op == "reduce-scatter":  # Its input: the operands.
      held = sum(nbytes(types.get(o, "")) for o in i.operands)
    elif op == "ragged-all-to-all":  # Operands (data, output buffer, offsets and sizes...): at most the data
      # leaves a device and at most the output buffer arrives.
      held = min(nbytes(types.get(i.operands[0], "")), nbytes(types.get(i.operands[1], "")))
    elif i.opcode.endswith("-start") and op != "all-reduce" and len(parts) >= 2:
      held = nbytes(parts[1])  # An async start's type is (inputs, outputs[, context]): the outputs.
    else:
      held = nbytes(i.shape)
    totals[op] += held * factor.get(i.computation, 1)
  return dict(totals)


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


def host_placements(hlo: str) -> int:
  """Tensors a program places in host memory: `annotate_device_placement` custom calls to pinned_host
  (lowered StableHLO) plus `S(5)` memory-space layouts (compiled GPU HLO)."""
  return sum(1 for line in hlo.splitlines()
             if ("annotate_device_placement" in line and "pinned_host" in line) or "S(5)" in line)
