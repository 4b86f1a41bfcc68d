"""What a remat policy costs, measured on traced and compiled programs (shared by the tools and tests).

Two views, both from the real code:
  * one decoder block (the scan body: `Block` under `remat.checkpoint`), traced on abstract
    inputs (`trace_layer`, `layer_report`): the residuals its forward pass saves for the backward
    pass, and what its backward pass recomputes (low-precision casts of forward operands,
    projection GEMMs, attention matmuls), read off the jaxpr of the vjp function alone;
  * the whole train step on abstract sharded inputs (`trace_train_step`, `step_figures`): its
    FLOPs counted on the traced jaxpr, and XLA's peak bytes per device once compiled.

Residual accounting follows what the layer scan keeps per iteration: the block's input (the scan
carry) and every residual computed from the input, the parameters or the block's key. Parameters
themselves are not counted (they are the train state, resident anyway), nor are residuals that
depend only on the segment ids and positions (the scan hoists loop invariants such as the mask).
Low-precision residuals travel as their bit patterns (uint8, uint4: see ember/quant/naming.py) and
are counted at the bits they take (uint4 = half a byte an element).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import jax.extend
from flax import nnx
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe
from jax.sharding import NamedSharding

from ember import remat
from ember.layers.decoder import Block, block_size, segments_of
from ember.quant import dot
from ember.quant.recipe import Recipe
from ember.trainer.metrics import compiled_peak_bytes

# Casts to these dtypes are quantize ops (the E8M0 scales of MXFP8 are built with a bitcast).
LOW_PRECISION = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn))
_SUB_BYTE_BITS = {jnp.dtype(d): 4 for d in (jnp.uint4, jnp.int4, jnp.float4_e2m1fn)}


# ----------------------------------------------------------------------------- one block, traced

@dataclasses.dataclass(frozen=True)
class LayerProblem:
  """One scan block of a config, and its call arguments (shapes)."""
  graphdef: Any
  state: Any  # nnx.State: parameters (and delayed-scaling histories) of one block.
  x_BxLxD: jax.ShapeDtypeStruct
  segment_ids_BxL: jax.ShapeDtypeStruct
  positions_BxL: jax.ShapeDtypeStruct
  key: jax.ShapeDtypeStruct  # The block's stochastic-rounding key (the model folds in step and block id).
  layers_per_block: int

  @property
  def args(self):
    return self.x_BxLxD, self.state, self.segment_ids_BxL, self.positions_BxL, self.key


def per_device_batch(cfg) -> int:
  """Sequences per device along the data-parallel axes (at least 1)."""
  m = cfg.mesh
  shards = max(int(m.data), 1) * max(int(m.fsdp), 1) * max(int(m.expert), 1)
  return max(cfg.train.batch_size // shards, 1)


def representative_block(cfg) -> int:
  """The first block of the largest segment (blocks `quant.exclude` keeps in bf16 are the odd ones)."""
  segments = segments_of(cfg, Recipe.from_config(cfg.quant))
  return max(segments, key=len)[0]


def layer_problem(cfg, *, batch: int | None = None) -> LayerProblem:
  """One `Block` of a derived config and its arguments, as shapes only (nothing is allocated)."""
  recipe = Recipe.from_config(cfg.quant)
  first = representative_block(cfg) * block_size(cfg.model)
  with nnx.use_eager_sharding(False):
    block = nnx.eval_shape(lambda: Block(cfg, first, recipe, nnx.Rngs(params=jax.random.key(0))))
  graphdef, state = nnx.split(block)
  b, l, d = batch or per_device_batch(cfg), cfg.model.seq_len, cfg.model.d_model
  sds = jax.ShapeDtypeStruct
  key = jax.eval_shape(lambda: jax.random.key(0))
  return LayerProblem(graphdef, state, sds((b, l, d), jnp.dtype(cfg.model.dtype)), sds((b, l), jnp.int32),
                      sds((b, l), jnp.int32), key, block_size(cfg.model))


def layer_fn(graphdef, preset: remat.Preset):
  """The scan body of ember/layers/decoder.py for one block: (x, state, segment_ids, positions, key)
  -> (y, aux), under `remat.checkpoint` with the preset's policy."""
  def body(x, state, segment_ids, positions, key):
    return nnx.merge(graphdef, state)(x, segment_ids, positions, key)
  return remat.checkpoint(body, preset)


# ----------------------------------------------------------------------------- jaxpr walking

def _subjaxprs(eqn):
  for j in jax.extend.core.jaxprs_in_params(eqn.params):
    yield getattr(j, "jaxpr", j)


def iter_eqns(jaxpr):
  """Every equation of `jaxpr` and, recursively, of its sub-jaxprs (jit, remat, custom rules, scan)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _subjaxprs(eqn):
      yield from iter_eqns(sub)


def _name_stack(eqn) -> str:
  return str(eqn.source_info.name_stack)


def is_quantize_cast(eqn) -> bool:
  return (eqn.primitive.name == "convert_element_type"
          and jnp.dtype(eqn.params["new_dtype"]) in LOW_PRECISION)


def _is_projection_gemm(eqn) -> bool:
  """Projections are 2-D GEMMs ([M, K] @ [K, N], see quant/dot.py) or grouped ones (MoE experts,
  `ragged_dot_general`); attention's matmuls are batched dot_generals."""
  if eqn.primitive.name == "ragged_dot_general":
    return True
  if eqn.primitive.name != "dot_general":
    return False
  (_, _), (batch_l, batch_r) = eqn.params["dimension_numbers"]
  return not batch_l and not batch_r and all(v.aval.ndim == 2 for v in eqn.invars)


@dataclasses.dataclass(frozen=True)
class BackwardCounts:
  """Operations in the backward pass of one block (the vjp function's jaxpr, sub-jaxprs included)."""
  quantize_ops: int  # Low-precision casts outside gradient quantization: forward operands recomputed.
  gradient_quantize_ops: int  # Low-precision casts of gradients (legitimately in the backward pass).
  projection_gemms: int  # 2-D and grouped GEMMs: the backward's, plus recomputed forward projections.
  batched_matmuls: int  # Batched dot_generals (attention), backward plus recomputed.


def backward_counts(bwd_jaxpr) -> BackwardCounts:
  q = gq = gemm = bmm = 0
  quantizing = (dot.SCOPE_ACTIVATION, dot.SCOPE_WEIGHT, dot.SCOPE_GRADIENT)
  for eqn in iter_eqns(bwd_jaxpr):
    stack = _name_stack(eqn)
    if is_quantize_cast(eqn):
      if dot.SCOPE_GRADIENT in stack:
        gq += 1
      else:
        q += 1
    elif eqn.primitive.name in ("dot_general", "ragged_dot_general") and not any(s in stack for s in quantizing):
      # (NVFP4's Hadamard transform is a matmul inside a quantize scope: part of quantizing.)
      if _is_projection_gemm(eqn):
        gemm += 1
      else:
        bmm += 1
  return BackwardCounts(q, gq, gemm, bmm)


# ----------------------------------------------------------------------------- residuals

@dataclasses.dataclass(frozen=True)
class Residual:
  name: str  # The checkpoint name, or the producing primitive and source line for unnamed ones.
  dtype: str  # As saved (low-precision tensors are saved as uint8/uint4 bit patterns).
  shape: tuple[int, ...]
  bytes: float
  format: str | None = None  # The low-precision format behind a bit pattern (e.g. float8_e4m3fn).
  offloaded: bool = False  # Moved to host memory by the policy.

  def to_json(self) -> dict:
    out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "bytes": self.bytes}
    if self.format:
      out["format"] = self.format
    if self.offloaded:
      out["offloaded"] = True
    return out


def nbytes(aval) -> float:
  """Bytes an array of `aval` takes: sub-byte dtypes at their bits; PRNG keys as their key data."""
  dtype = aval.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, dtype))
    return float(data.size * data.dtype.itemsize)
  bits = _SUB_BYTE_BITS.get(jnp.dtype(dtype), jnp.dtype(dtype).itemsize * 8)
  return math.prod(aval.shape) * bits / 8


@dataclasses.dataclass(frozen=True)
class LayerTrace:
  residuals: tuple[Residual, ...]
  backward: BackwardCounts

  @property
  def residual_bytes(self) -> float:
    return sum(r.bytes for r in self.residuals)


def trace_layer(problem: LayerProblem, preset: remat.Preset) -> LayerTrace:
  """Residuals the block's forward pass saves, and the operations of its backward pass."""
  fn = layer_fn(problem.graphdef, preset)
  leaves, in_tree = jax.tree.flatten(problem.args)

  def fwd(*leaves):
    return jax.vjp(fn, *jax.tree.unflatten(in_tree, leaves))

  closed, (out_shape, vjp_shape) = jax.make_jaxpr(fwd, return_shape=True)(*leaves)
  res_structs, vjp_tree = jax.tree.flatten(vjp_shape)
  bwd = jax.make_jaxpr(lambda res, ct: jax.tree.unflatten(vjp_tree, res)(ct))(res_structs, out_shape)
  # A custom VJP's residuals that its backward rule ignores (e.g. the amax of a current-scaling
  # tensor) are dropped by the scan's dead-code elimination in the real step: drop them here too.
  _, used = pe.dce_jaxpr(bwd.jaxpr, [True] * len(bwd.jaxpr.outvars))
  residuals = _residuals(closed.jaxpr, used[:len(res_structs)], problem)
  return LayerTrace(tuple(residuals), backward_counts(bwd.jaxpr))


def _residuals(jaxpr, used: list[bool], problem: LayerProblem) -> list[Residual]:
  """Reads the residual outputs of the jaxpr of `jax.vjp` (as `jax.ad_checkpoint` does in
  `saved_residuals`), keeping those the layer scan stores per block (see the module doc)."""
  res_vars = [v for v, u in zip(jaxpr.outvars[len(jaxpr.outvars) - len(used):], used) if u]
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  # Saved floats pass through reduce_precision, offloaded ones through device_put: look through.
  offloaded = set()

  def source(v):
    while True:
      e = producer.get(v)
      if e is None or e.primitive.name not in ("reduce_precision", "device_put"):
        return v
      if e.primitive.name == "device_put":
        offloaded.add(e.invars[0])
      v = e.invars[0]

  n_x = 1
  n_state = len(jax.tree.leaves(problem.state))
  invars = jaxpr.invars
  layer_input, params = invars[0], set(invars[n_x:n_x + n_state])
  varying = {layer_input, *params, *invars[n_x + n_state + 2:]}  # Input, parameters, key.
  for e in jaxpr.eqns:
    if any(not isinstance(v, jax.extend.core.Literal) and v in varying for v in e.invars):
      varying.update(e.outvars)

  out, seen = [], set()
  for v in res_vars:
    if isinstance(v, jax.extend.core.Literal):
      continue
    v = source(v)
    if v in seen or v in params or v not in varying:
      continue
    seen.add(v)
    e = producer.get(v)
    fmt = None
    if v is layer_input:
      name = remat.LAYER_INPUT
    elif e is not None and e.primitive.name == "name":
      name = e.params["name"]
      src = producer.get(e.invars[0])
      if src is not None and src.primitive.name == "bitcast_convert_type":
        fmt = jnp.dtype(src.invars[0].aval.dtype).name
    elif e is not None and _named_bits(e, producer):
      name = producer[e.invars[0]].params["name"]  # A low-precision tensor viewed back from its bits.
    elif e is not None:
      name = f"{e.primitive.name} ({_where(e)})"
    else:
      continue  # A constant.
    aval = v.aval
    out.append(Residual(name, str(aval.dtype), tuple(aval.shape), nbytes(aval), fmt, v in offloaded))
  return out


def _named_bits(eqn, producer) -> bool:
  src = producer.get(eqn.invars[0]) if eqn.primitive.name == "bitcast_convert_type" else None
  return src is not None and src.primitive.name == "name"


def _where(eqn) -> str:
  frame = source_info_util.user_frame(eqn.source_info.traceback)
  return f"{os.path.basename(frame.file_name)}:{frame.start_line}" if frame else "?"


def layer_report(cfg, presets: dict[str, remat.Preset], *, batch: int | None = None) -> dict[str, dict]:
  """Per preset: residuals of one block, their bytes, and what its backward pass recomputes
  (quantize ops; projection GEMMs and attention matmuls beyond those of policy `none`)."""
  problem = layer_problem(cfg, batch=batch)
  base = trace_layer(problem, remat.PRESETS["none"]).backward
  out = {}
  for name, p in presets.items():
    t = trace_layer(problem, p)
    out[name] = {
        "residual_bytes_per_layer": t.residual_bytes / problem.layers_per_block,
        "residuals": [r.to_json() for r in t.residuals],
        "recomputed_quantize_ops_per_layer": t.backward.quantize_ops / problem.layers_per_block,
        "recomputed_gemms_per_layer": (t.backward.projection_gemms - base.projection_gemms) / problem.layers_per_block,
        "recomputed_attention_matmuls_per_layer": (t.backward.batched_matmuls - base.batched_matmuls)
                                                  / problem.layers_per_block,
        "offloaded_bytes_per_layer": sum(r.bytes for r in t.residuals if r.offloaded) / problem.layers_per_block,
    }
  return out


# ----------------------------------------------------------------------------- the whole train step

_FREE = frozenset(("reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
                   "dynamic_update_slice", "concatenate", "pad", "iota", "device_put", "name", "sharding_constraint",
                   "bitcast_convert_type", "copy", "copy_p", "random_wrap", "random_unwrap", "stop_gradient",
                   "select_n", "mesh_cast", "reduce_precision"))
_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax",
                         "argmin", "cumsum", "cumlogsumexp", "cummax"))


def _size(v) -> int:
  shape = getattr(v.aval, "shape", ())
  return math.prod(shape)


def jaxpr_flops(jaxpr) -> float:
  """FLOPs of a jaxpr with loop trip counts applied: 2*M*N*K per dot_general (exact), one per element
  for other arithmetic, nothing for data movement. XLA's `cost_analysis()` counts a while loop's
  body once, so it cannot give a scanned model's step FLOPs; this can (remat recompute included:
  after autodiff, the backward scan holds it)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
    if name == "scan":
      total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)
    elif name == "cond":
      total += max(jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
    elif subs:
      total += sum(jaxpr_flops(getattr(j, "jaxpr", j)) for j in subs)
    elif name == "dot_general":
      (contract_l, _), _ = eqn.params["dimension_numbers"]
      k = math.prod(eqn.invars[0].aval.shape[d] for d in contract_l)
      total += 2.0 * _size(eqn.outvars[0]) * k
    elif name == "ragged_dot_general":  # Each lhs element meets the rhs's free dims once (one group).
      nums = eqn.params["ragged_dot_dimension_numbers"]
      (_, contract_r), (_, batch_r) = nums.dot_dimension_numbers
      rhs = eqn.invars[1].aval.shape
      skip = set(contract_r) | set(batch_r) | set(nums.rhs_group_dimensions)
      total += 2.0 * _size(eqn.invars[0]) * math.prod(n for d, n in enumerate(rhs) if d not in skip)
    elif name in _REDUCTIONS:
      total += sum(_size(v) for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
    elif name not in _FREE:
      total += sum(_size(v) for v in eqn.outvars)
  return total


def abstract_batch(cfg, mesh) -> tuple[dict, NamedSharding]:
  from ember.trainer.step import batch_sharding
  sharding = batch_sharding(cfg, mesh)
  shape = (cfg.train.batch_size, cfg.model.seq_len)
  keys = ("inputs", "targets", "segment_ids", "positions")
  return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in keys}, sharding


def trace_train_step(cfg, mesh, tx, schedule, preset: remat.Preset):
  """The real train step (`trainer.step.train_step`, policy overridden), jitted as the loop jits it
  and traced on abstract sharded inputs: `.jaxpr`, `.lower()`, `.lower(lowering_platforms=...)`."""
  from ember.parallel.sharding import use_rules
  from ember.trainer.state import state_shardings
  from ember.trainer.step import jit_train_step
  with use_rules(mesh, cfg.mesh.rules):
    graphdef, shardings, abstract = state_shardings(cfg, mesh, tx, preset)
    batch, _ = abstract_batch(cfg, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    step = jit_train_step(cfg, mesh, graphdef, tx, schedule, shardings, policy=preset)
    return step.trace(abstract, batch)


@dataclasses.dataclass(frozen=True)
class StepFigures:
  flops: float  # Whole step (all devices), from the traced jaxpr: forward, recompute, backward, update.
  peak_bytes: int | None  # Per device: XLA's memory analysis of the compiled step (None: not compiled).
  xla_flops: float | None  # XLA's cost_analysis() of the compiled per-device program (loop bodies once).


def step_figures(cfg, mesh, tx, schedule, preset: remat.Preset, *, compile: bool = True) -> StepFigures:
  traced = trace_train_step(cfg, mesh, tx, schedule, preset)
  flops = jaxpr_flops(traced.jaxpr.jaxpr)
  if not compile:
    return StepFigures(flops, None, None)
  compiled = traced.lower().compile()
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_flops = float(cost["flops"]) if cost and "flops" in cost else None
  except Exception:
    xla_flops = None
  return StepFigures(flops, compiled_peak_bytes(compiled), xla_flops)


def host_placements(hlo_text: str) -> int:
  """Tensors a program places in host memory: `annotate_device_placement` custom calls to pinned_host
  (lowered StableHLO) plus `S(5)` memory-space layouts (compiled GPU HLO)."""
  lines = hlo_text.splitlines()
  return sum(1 for l in lines if ("annotate_device_placement" in l and "pinned_host" in l) or "S(5)" in l)


def format_bytes(n: float | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} B"


def format_flops(n: float | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} FLOP"
