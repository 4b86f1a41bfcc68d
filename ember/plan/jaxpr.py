"""Walking traced programs (jaxprs): every equation, quantize casts, projection GEMMs, bytes, FLOPs.

The counting rules the planning tools share (ember/plan/layer.py, ember/plan/step.py).
"""

from __future__ import annotations

import math

import jax
import jax.extend
import jax.numpy as jnp

from ember.parallel.sharding import entry_axes

# Casts to these dtypes are quantize ops (the E8M0 scales of MXFP8 are built with a bitcast).
LOW_PRECISION = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn))
_SUB_BYTE_BITS = {jnp.dtype(d): 4 for d in (jnp.uint4, jnp.int4, jnp.float4_e2m1fn)}


def _subjaxprs(eqn):
  for j in jax.extend.core.jaxprs_in_params(eqn.params):
    yield getattr(j, "jaxpr", j)


def iter_eqns(jaxpr):
  """Every equation of `jaxpr` and, recursively, of its sub-jaxprs (jit, remat, custom rules, scan)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _subjaxprs(eqn):
      yield from iter_eqns(sub)


def name_stack(eqn) -> str:
  return str(eqn.source_info.name_stack)


def is_quantize_cast(eqn) -> bool:
  return (eqn.primitive.name == "convert_element_type"
          and jnp.dtype(eqn.params["new_dtype"]) in LOW_PRECISION)


# The block-scaled GEMMs of quant/gemm.py (`jax.lax.scaled_dot`; `jax.nn.scaled_matmul`'s primitives): every
# one a projection (dense or expert), contracting the lhs's last axis unless its dimension numbers say.
BLOCK_SCALED_GEMMS = ("scaled_dot", "scaled_matmul_wrapper", "scaled_matmul")
GEMM_PRIMITIVES = ("dot_general", "ragged_dot_general") + BLOCK_SCALED_GEMMS


def is_projection_gemm(eqn) -> bool:
  """Projections are 2-D GEMMs ([M, K] @ [K, N], see quant/dot.py), block-scaled ones, or grouped ones
  (MoE experts, `ragged_dot_general`); attention's matmuls are batched dot_generals."""
  if eqn.primitive.name == "ragged_dot_general" or eqn.primitive.name in BLOCK_SCALED_GEMMS:
    return True
  if eqn.primitive.name != "dot_general":
    return False
  (_, _), (batch_l, batch_r) = eqn.params["dimension_numbers"]
  return not batch_l and not batch_r and all(v.aval.ndim == 2 for v in eqn.invars)


def nbytes(aval) -> float:
  """Bytes an array of `aval` takes: sub-byte dtypes at their bits; PRNG keys as their key data."""
  dtype = aval.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, dtype))
    return float(data.size * data.dtype.itemsize)
  bits = _SUB_BYTE_BITS.get(jnp.dtype(dtype), jnp.dtype(dtype).itemsize * 8)
  return math.prod(aval.shape) * bits / 8


_FREE = frozenset(("reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
                   "dynamic_update_slice", "concatenate", "pad", "iota", "device_put", "name", "sharding_constraint",
                   "bitcast_convert_type", "copy", "copy_p", "random_wrap", "random_unwrap", "stop_gradient",
                   "select_n", "mesh_cast", "reduce_precision", "pvary"))
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
    elif name == "shard_map":  # The body has one device's shapes: times the shards of the operand split the most
      # ways (the MoE layer's tokens: not its first operand, since remat puts the residuals it saved first); devices
      # that repeat a shard's work (replicas along other axes) add no FLOPs.
      mesh = eqn.params["mesh"]
      shards = max((math.prod(mesh.shape[a] for entry in spec for a in entry_axes(entry))
                    for spec in eqn.params["in_specs"]), default=1)
      total += shards * sum(jaxpr_flops(getattr(j, "jaxpr", j)) for j in subs)
    elif subs:
      total += sum(jaxpr_flops(getattr(j, "jaxpr", j)) for j in subs)
    elif name == "dot_general" or name in BLOCK_SCALED_GEMMS:
      dims = eqn.params.get("dimension_numbers")
      contract_l = dims[0][0] if dims is not None else (eqn.invars[0].aval.ndim - 1,)
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
