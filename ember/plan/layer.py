"""One decoder block under a remat policy, traced: what its forward pass saves, what its backward recomputes.

The block is the scan body (`Block` under `remat.checkpoint`), traced on abstract inputs
(`layer_problem`, `trace_layer`, `layer_report`): the residuals its forward pass saves for the
backward pass, and what its backward pass recomputes (low-precision casts of forward operands,
projection GEMMs, attention matmuls), read off the jaxpr of the vjp function alone.

Residual accounting follows what the layer scan keeps per iteration: the block's input (the scan
carry) and every residual computed from the input, the parameters or the block's key. Parameters
themselves are not counted (they are the train state, resident anyway), nor are residuals that
depend only on the segment ids and positions (the scan hoists loop invariants such as the mask).
Low-precision residuals travel as their bit patterns (uint8, uint4: see ember/quant/naming.py) and
are counted at the bits they take (uint4 = half a byte an element).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx
from jax._src import source_info_util
from jax._src.interpreters import partial_eval as pe

from ember import remat
from ember.config import Settings
from ember.config.model import ModelConfig
from ember.layers import linear
from ember.layers.decoder import Block, segments_of
from ember.parallel import sharding
from ember.plan.jaxpr import GEMM_PRIMITIVES, is_projection_gemm, is_quantize_cast, iter_eqns, name_stack, nbytes
from ember.quant.core import SCOPE_ACTIVATION, SCOPE_GRADIENT, SCOPE_WEIGHT
from ember.quant.recipe import Recipe


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


def _axis_size(cfg: Settings, mesh, axis: str) -> int:
  """A mesh axis's size: the mesh's, or that of a derived config (per-host size times the `dcn_*` host count)."""
  if mesh is not None:
    return int(mesh.shape[axis])
  return max(getattr(cfg.mesh, axis), 1) * getattr(cfg.mesh, f"dcn_{axis}", 1)


def per_device_batch(cfg: Settings, mesh=None) -> int:
  """Sequences per device of one micro-batch (train.grad_accum_steps; at least 1), along the batch's mesh
  axes (`_axis_size`)."""
  shards = sharding.shards(sharding.batch_axes(cfg.mesh.rules_dict), lambda a: _axis_size(cfg, mesh, a))
  return max(cfg.train.batch_size // shards // cfg.train.grad_accum_steps, 1)


def sequence_shards(cfg: Settings, mesh=None) -> int:
  """The devices each sequence is split over (context parallelism: the mesh axes `length` maps to)."""
  return sharding.shards(sharding.sequence_axes(cfg.mesh.rules_dict), lambda a: _axis_size(cfg, mesh, a))


def representative_block(model: ModelConfig, recipe: Recipe) -> int:
  """The first block of the largest segment (blocks `quant.exclude` keeps in bf16 are the odd ones)."""
  return max(segments_of(model, recipe), key=len)[0]


def layer_problem(cfg: Settings, *, batch: int | None = None) -> LayerProblem:
  """One `Block` of a derived config and its arguments, as shapes only (nothing is allocated)."""
  model = cfg.model
  first = representative_block(model, cfg.quant) * model.block_size
  with nnx.use_eager_sharding(False):
    block = nnx.eval_shape(lambda: Block(model, cfg.quant, first, nnx.Rngs(params=jax.random.key(0))))
  graphdef, state = nnx.split(block)
  b, l, d = batch or per_device_batch(cfg), model.seq_len // sequence_shards(cfg), model.d_model
  sds = jax.ShapeDtypeStruct
  key = jax.eval_shape(lambda: jax.random.key(0))
  return LayerProblem(graphdef, state, sds((b, l, d), model.dtype), sds((b, l), jnp.int32), sds((b, l), jnp.int32),
                      key, model.block_size)


def layer_fn(graphdef, preset: remat.Preset):
  """The scan body of ember/layers/decoder.py for one block: (x, state, segment_ids, positions, key, taken)
  -> (y, aux, per-layer counts), under `remat.checkpoint` with the preset's policy; `taken`: what the step makes
  once for the block's projections, outside every checkpoint (`layer_taken`)."""
  def body(x, state, segment_ids, positions, key, taken):
    return nnx.merge(graphdef, state)(x, segment_ids, positions, key, taken=taken)
  return remat.checkpoint(body, preset)


def layer_args(problem: LayerProblem, preset: remat.Preset) -> tuple:
  """`layer_fn`'s arguments (shapes) under `preset`: the problem's and what the step makes once (`layer_taken`)."""
  return (*problem.args, jax.eval_shape(functools.partial(layer_taken, problem.graphdef, preset=preset),
                                        problem.state))


def layer_taken(graphdef, state, preset: remat.Preset) -> dict:
  """What the step makes once for the block's projections under `preset` (layers/linear.py's `once_a_step`: the
  kernels' amaxes and quantized copies), which the block's GEMMs read and no remat policy saves or recomputes."""
  return linear.once_a_step(nnx.merge(graphdef, state), preset.remat)


# ----------------------------------------------------------------------------- the backward pass

@dataclasses.dataclass(frozen=True)
class BackwardCounts:
  """Operations in the backward pass of one block (the vjp function's jaxpr, sub-jaxprs included)."""
  quantize_ops: int  # Low-precision casts outside gradient quantization: forward operands recomputed.
  gradient_quantize_ops: int  # Low-precision casts of gradients (legitimately in the backward pass).
  projection_gemms: int  # 2-D and grouped GEMMs: the backward's, plus recomputed forward projections.
  batched_matmuls: int  # Batched dot_generals (attention), backward plus recomputed.


def backward_counts(bwd_jaxpr) -> BackwardCounts:
  q = gq = gemm = bmm = 0
  quantizing = (SCOPE_ACTIVATION, SCOPE_WEIGHT, SCOPE_GRADIENT)
  for eqn in iter_eqns(bwd_jaxpr):
    stack = name_stack(eqn)
    if is_quantize_cast(eqn):
      if SCOPE_GRADIENT in stack:
        gq += 1
      else:
        q += 1
    elif eqn.primitive.name in GEMM_PRIMITIVES and not any(s in stack for s in quantizing):
      # (NVFP4's Hadamard transform is a matmul inside a quantize scope: part of quantizing.)
      if is_projection_gemm(eqn):
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
  args = layer_args(problem, preset)
  leaves, in_tree = jax.tree.flatten(args)

  def fwd(*leaves):
    return jax.vjp(fn, *jax.tree.unflatten(in_tree, leaves))

  closed, (out_shape, vjp_shape) = jax.make_jaxpr(fwd, return_shape=True)(*leaves)
  res_structs, vjp_tree = jax.tree.flatten(vjp_shape)
  bwd = jax.make_jaxpr(lambda res, ct: jax.tree.unflatten(vjp_tree, res)(ct))(res_structs, out_shape)
  # A custom VJP's residuals that its backward rule ignores (e.g. the amax of a current-scaling
  # tensor) are dropped by the scan's dead-code elimination in the real step: drop them here too.
  _, used = pe.dce_jaxpr(bwd.jaxpr, [True] * len(bwd.jaxpr.outvars))
  residuals = _residuals(closed.jaxpr, used[:len(res_structs)], problem, len(jax.tree.leaves(args[-1])))
  return LayerTrace(tuple(residuals), backward_counts(bwd.jaxpr))


def _residuals(jaxpr, used: list[bool], problem: LayerProblem, n_taken: int) -> list[Residual]:
  """Reads the residual outputs of the jaxpr of `jax.vjp` (as `jax.ad_checkpoint` does in
  `saved_residuals`), keeping those the layer scan stores per block (see the module doc); the last `n_taken`
  inputs are what the step made once (`layer_taken`), held as the parameters are."""
  res_vars = [v for v, u in zip(jaxpr.outvars[len(jaxpr.outvars) - len(used):], used) if u]
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  offloaded = set()
  source = functools.partial(_source, producer=producer, offloaded=offloaded)

  n_x = 1
  n_state = len(jax.tree.leaves(problem.state))
  invars = jaxpr.invars
  layer_input, params = invars[0], set(invars[n_x:n_x + n_state]) | set(invars[len(invars) - n_taken:])
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
    named, moved = (remat.LAYER_INPUT, None), False
    if v is not layer_input:
      named, moved = _named_within(e, v, producer)
      if named is None and e is not None:
        named = (f"{e.primitive.name} ({_where(e)})", None)
    if named is None:
      continue  # A constant.
    aval = v.aval
    out.append(Residual(named[0], str(aval.dtype), tuple(aval.shape), nbytes(aval), named[1],
                        v in offloaded or moved))
  return out


def _named_within(e, v, producer, depth: int = 0) -> tuple[tuple[str, str | None] | None, bool]:
  """(`_named`'s answer, offloaded) for output `v` of equation `e`, looking into the calls that made it: a residual
  made inside a shard_map (an MoE layer's) or a call in it is named, and offloaded, where its body made it."""
  named = _named(e, producer)
  inner = None if e is None or named is not None or depth > 8 else e.params.get("jaxpr", e.params.get("call_jaxpr"))
  if inner is None:
    return named, False
  inner = getattr(inner, "jaxpr", inner)
  inner_producer = {w: q for q in inner.eqns for w in q.outvars}
  offloaded = set()
  w = _source(inner.outvars[e.outvars.index(v)], inner_producer, offloaded)
  named, moved = _named_within(inner_producer.get(w), w, inner_producer, depth + 1)
  return named, moved or w in offloaded


def _source(v, producer, offloaded: set):
  """Where residual `v` was made: saved floats pass through reduce_precision, offloaded ones through device_put
  (each added to `offloaded`), looked through."""
  while True:
    e = producer.get(v)
    if e is None or e.primitive.name not in ("reduce_precision", "device_put"):
      return v
    if e.primitive.name == "device_put":
      offloaded.add(e.invars[0])
    v = e.invars[0]


def _named(e, producer) -> tuple[str, str | None] | None:
  """(checkpoint name, the low-precision format it holds or None) of a residual made by `e`, or None: a `name`
  equation, or a low-precision tensor viewed back from its named bits."""
  if e is None:
    return None
  if e.primitive.name == "name":
    src = producer.get(e.invars[0])
    fmt = jnp.dtype(src.invars[0].aval.dtype).name if src is not None and \
        src.primitive.name == "bitcast_convert_type" else None
    return e.params["name"], fmt
  if _named_bits(e, producer):
    return producer[e.invars[0]].params["name"], None
  return None


def _named_bits(eqn, producer) -> bool:
  src = producer.get(eqn.invars[0]) if eqn.primitive.name == "bitcast_convert_type" else None
  return src is not None and src.primitive.name == "name"


def _where(eqn) -> str:
  frame = source_info_util.user_frame(eqn.source_info.traceback)
  return f"{os.path.basename(frame.file_name)}:{frame.start_line}" if frame else "?"


def layer_report(cfg: Settings, presets: dict[str, remat.Preset], *, batch: int | None = None) -> dict[str, dict]:
  """Per preset: residuals of one block, their bytes, and what its backward pass recomputes
  (quantize ops; projection GEMMs and attention matmuls beyond those of policy `none`)."""
  problem = layer_problem(cfg, batch=batch)
  base = trace_layer(problem, remat.PRESETS["none"]).backward
  out = {}
  for name, p in presets.items():
    t = trace_layer(problem, p)
    out[name] = {
        "residual_bytes_per_layer": t.residual_bytes / problem.layers_per_block,
        # Of those, the quantized kernel copies: the parameters' size, whatever the batch.
        "kernel_residual_bytes_per_layer": sum(r.bytes for r in t.residuals if r.name in remat.QUANTIZED_KERNEL_NAMES)
                                           / problem.layers_per_block,
        "residuals": [r.to_json() for r in t.residuals],
        "recomputed_quantize_ops_per_layer": t.backward.quantize_ops / problem.layers_per_block,
        "recomputed_gemms_per_layer": (t.backward.projection_gemms - base.projection_gemms) / problem.layers_per_block,
        "recomputed_attention_matmuls_per_layer": (t.backward.batched_matmuls - base.batched_matmuls)
                                                  / problem.layers_per_block,
        "offloaded_bytes_per_layer": sum(r.bytes for r in t.residuals if r.offloaded) / problem.layers_per_block,
    }
  return out
