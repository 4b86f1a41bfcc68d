"""The one-pass quantize kernels as the GEMM core (quant/core.py) sees them, whatever their format.

Each kernel module (quant/fused.py for MXFP8, quant/fused_nvfp4.py for NVFP4) offers the same casts and answers
None where it does not run (another recipe, health statistics wanted, off a GPU, blocks that do not divide
among the devices): `operand_copies` (an operand's two copies read from it once), `operand_rows` (its copy
along the last axis alone), `kernel_copies` (a kernel's copies) and `casts_kernel_tiles`. The core asks here
and takes the recipe's quantizer where every kernel declines; a new format's kernel joins `KERNELS`.
"""

from __future__ import annotations

import dataclasses

import jax

from ember.quant import fused, fused_nvfp4
from ember.quant.recipe import Recipe
from ember.quant.varying import vma_of

KERNELS = (fused, fused_nvfp4)


def _first(results):
  return next((r for r in results if r is not None), None)


def operand_copies(layout, recipe: Recipe, quantizer, a: jax.Array, stats: bool, keys=None):
  """(a quantized along its last axis, a's wgrad copy) from a one-pass kernel, or None where none runs: the
  same copies as `quantizer`'s, read from the tensor once. `keys` seed the two copies' stochastic rounding
  where `quantizer` rounds so."""
  return _first(k.operand_copies(layout, recipe, quantizer, a, stats, keys) for k in KERNELS)


def operand_rows(recipe: Recipe, quantizer, a: jax.Array, axis: int, stats: bool, reduce_axes):
  """`quantizer.quantize(a, axis)` from a one-pass kernel where one applies, or None: a's copy along its last
  axis alone (an expert layout's x, which only the forward GEMM reads so), a viewed as 2-d [rows, K] (block and
  tensor scales are the same either way). Not inside `shard_map`, where a Pallas call's outputs would need
  their varying axes spelled out: expert layers under a mesh take the quantizer."""
  if axis != a.ndim - 1 or a.ndim < 2 or vma_of(a):
    return None
  rows = a.reshape(-1, a.shape[-1])
  q = _first(k.operand_rows(recipe, quantizer, rows, stats, reduce_axes) for k in KERNELS)
  if q is None:
    return None
  return dataclasses.replace(q, data=q.data.reshape(a.shape), scale_inv=q.scale_inv.reshape(*a.shape[:-1], -1),
                             axis=axis)


def kernel_copies(layout, recipe: Recipe, w: jax.Array, stats: bool, amax=None, row_of=None) -> dict | None:
  """The kernel's copies ({kernel[, kernel_t]}) from a one-pass kernel, or None. `amax`: max|w| taken by the
  caller (`casts_kernel_tiles`), or None; `row_of`: (stacked, i) where w lies in stacked kernels, or None."""
  return _first(k.kernel_copies(layout, recipe, w, stats, amax, row_of) for k in KERNELS)


def casts_kernel_tiles(recipe: Recipe) -> bool:
  """Whether a dense kernel of `recipe` traced now is cast in tiles after an amax pass of its own, which a step
  of micro-batches then takes once, and which can read the kernel where it lies in stacked kernels."""
  return any(k.casts_kernel_tiles(recipe) for k in KERNELS)
