"""The expert GEMMs over the capacity layout: y[e] = x[e] @ w[e] for x [E, C, K] (each local expert's rows
in a slot of C, zero rows past its count) and w [E, K, N], as one batched `dot_general` each way:
  forward  y[E, C, N]  = x[E, C, K] . w[E, K, N]     (batch E, contract K),
  dgrad    dx[E, C, K] = g[E, C, N] . w[E, K, N]     (batch E, contract N),
  wgrad    dw[E, K, N] = x[E, C, K] . g[E, C, N]     (batch E, contract C).
Unlike `ragged_dot` (quant/grouped.py), which XLA's GPU compiler expands into a GEMM over every row for every
local expert, these are batched GEMMs whose work is E x C rows: the routed copies and the slots' slack.

The quantized GEMM and its custom VJP are quant/core.py's, with `CapacityLayout`: kernels as grouped.py's
(`ExpertLayout`: per expert, possibly on their shard), activations and gradients with one amax over all rows,
reduced over `reduce_axes`, and block-scaled wgrad operands quantized along C, so a block never spans two
experts.

Per-tensor recipes multiply their scales into the *output* (x's and g's scalar, each expert's kernel scale
along E) and feed the GEMM the raw E4M3 / E5M2 values: XLA's GPU compiler runs that as one batched
cuBLASLt FP8 GEMM, where scales inside the operands (a per-expert vector) would leave it a bf16 GEMM.
Block-scaled recipes take quant/gemm.py's path for the platform (cuDNN's block-scaled GEMM on Blackwell).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ember.names import EXPERT_GEMM_SCOPE
from ember.quant.core import quantized_gemm
from ember.quant.gemm import block_scaled_dot, output_dtype
from ember.quant.grouped import ExpertLayout, Shards
from ember.quant.recipe import Recipe, pad_to
from ember.quant.tensor import QuantizedTensor
from ember.quant.unquantized import unquantized_matmul

F32 = jnp.float32
FORWARD = (((2,), (1,)), ((0,), (0,)))
DGRAD = (((2,), (2,)), ((0,), (0,)))
WGRAD = (((1,), (1,)), ((0,), (0,)))


def batched_matmul(x_ExCxK: jax.Array, w_ExKxN: jax.Array, *, recipe: Recipe, name: str,
                   history: tuple[jax.Array, jax.Array, jax.Array] | None = None, key: jax.Array | None = None,
                   dtype=jnp.bfloat16, reduce_axes: tuple[str, ...] = (),
                   stats: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                   kernel_shards: Shards = None, error: jax.Array | None = None) -> jax.Array:
  """Each expert's slot of rows times its kernel, in `recipe`'s format; the arguments are
  `grouped_matmul`'s (quant/grouped.py), with the rows in the capacity layout instead of sorted."""
  dtype = jnp.dtype(dtype)
  with jax.named_scope(EXPERT_GEMM_SCOPE):
    if not recipe.quantized:
      assert kernel_shards is None, "an unquantized kernel is gathered whole before the GEMM"
      return unquantized_matmul(_contract, x_ExCxK, w_ExKxN.astype(dtype), dtype=dtype,
                                wgrad_dtype=recipe.wgrad_out(w_ExKxN.dtype))
    layout = CapacityLayout(reduce_axes=tuple(reduce_axes), shards=kernel_shards)
    return quantized_gemm(x_ExCxK, w_ExKxN, None, history, key, stats, layout=layout, recipe=recipe, name=name,
                          dtype=dtype, error=error)


def _dot(a, b, dims, out=F32):
  """f32 accumulation; written in `out` on GPUs (quant/gemm.py's `output_dtype`)."""
  return jax.lax.dot_general(a, b, dims, preferred_element_type=output_dtype(out)).astype(out)


def _contract(a, b, groups, step, preferred):
  """The capacity layout's three batched GEMMs (quant/unquantized.py)."""
  return jax.lax.dot_general(a, b, {"forward": FORWARD, "dgrad": DGRAD, "wgrad": WGRAD}[step],
                             preferred_element_type=preferred)


def product(a, b, dims, dtype, out):
  """The batched GEMM of two quantized operands (see the module doc) for a consumer of dtype `out`: per-tensor
  ones on their raw values with the scales on the float32 output (a per-expert scale is no GEMM epilogue's
  scalar), block-scaled ones by quant/gemm.py."""
  if a.block:
    (ca, cb), _ = dims
    return block_scaled_dot(a, b, (ca[0], cb[0]), batched=True, dtype=dtype, out=out)
  return (_dot(a.data.astype(dtype), b.data.astype(dtype), dims) * _along_experts(a) * _along_experts(b)).astype(out)


def _along_experts(q):
  """A per-tensor scale, or each expert's (a per-expert kernel's [E]), shaped to scale a [E, ., .] output."""
  s = q.scale_inv.astype(F32)
  return s.reshape(-1, 1, 1) if s.ndim == 1 else s


@dataclasses.dataclass(frozen=True)
class CapacityLayout(ExpertLayout):
  """Each local expert's rows in a slot of C: x [E, C, K] (see the module doc)."""
  x_axis = 2
  row_axis = 1

  def prepare(self, a_ExCxK, rows, block):
    return pad_to(a_ExCxK, (1, block, block))

  def wgrad_rows(self, a_ExCxK, rows, block):
    return a_ExCxK

  def forward(self, x, w, rows, dtype):
    if isinstance(x, QuantizedTensor):
      return product(x, w, FORWARD, dtype, dtype)
    return _dot(x.astype(dtype), w, FORWARD, dtype)

  def dgrad(self, g, w, rows, dtype, out):
    return product(g, w, DGRAD, dtype, out)

  def wgrad(self, x, g, rows, block, dtype, out):
    return product(x, g, WGRAD, dtype, out)
