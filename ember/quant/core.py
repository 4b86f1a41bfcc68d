"""The one quantized GEMM: y = x @ w with a custom VJP, for every layout of rows and kernels.

Every projection runs through `quantized_gemm`; what differs between a dense projection (quant/dot.py),
experts over sorted rows (`ragged_dot`, quant/grouped.py) and experts over slots of rows (batched GEMMs,
quant/batched.py) is a `Layout`: how the rows are prepared and padded, how a kernel is quantized (whole, or
per expert and possibly on its shard), and which GEMM multiplies the quantized operands. The rest is
written once, here:
  forward  y  = x @ w      x quantized along K (`x`), w along K (`kernel`);
  dgrad    dx = g @ w.T    g quantized along N (`grad`), w along N (`kernel_t`; per-tensor and 16x16-tile
                           recipes reuse `kernel`);
  wgrad    dw = x.T @ g    contracting the rows: per-tensor recipes reuse `x` and `grad`; block-scaled ones
                           quantize both along the rows (`x_t`, and g), after NVFP4's Hadamard transform.

Every quantized operand is wrapped in `checkpoint_name("quantized.<projection>.<operand>")`, in the primal
function and in the forward rule alike (both run `_quantize_operands`). That is what lets a remat policy
keep them: when the backward pass recomputes a GEMM's output it reuses the saved low-precision operands and
runs the GEMM alone, never a quantize op. Names only inside the forward rule would leave the quantize ops in
the recompute.

Delayed scaling: `history = (x [H], kernel [H] or [E, H], grad [H])`; the backward rule returns them with
this step's amaxes rolled in as their "cotangent", because gradient amaxes only exist in the backward pass
(trainer/step.py stores them). `stats`, the same triple of health-statistics inputs, gets the operands'
health (quant/health.py) as its cotangent. `error`, a [2] input (the precision probe, ember/plan/probe.py), gets
the forward output's error as its cotangent: (sum of (y - y_ref)^2, sum of y_ref^2), y_ref the float32 GEMM of
the same operands unquantized, so the error is the projection's own and not what it inherits from its input.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp

from ember.quant import one_pass
from ember.quant.naming import name_quantized
from ember.quant.quantizers import update_history
from ember.quant.recipe import ACTIVATION, GRADIENT, KERNEL, KERNEL_T, X, X_T, Recipe
from ember.quant.tensor import QuantizedTensor
from ember.quant.varying import sum_to, vma_of
from ember.remat import quantized_name

# Name scopes around every quantize call, so an analysis of a traced step can tell a forward operand's
# quantization (which a remat policy may recompute) from a gradient's (always in the backward pass) by
# `eqn.source_info.name_stack` (ember/plan/layer.py).
SCOPE_ACTIVATION = "quantize_activation"
SCOPE_WEIGHT = "quantize_weight"
SCOPE_GRADIENT = "quantize_gradient"


class Layout(Protocol):
  """How one family of GEMMs lays out its operands: static and hashable (a frozen dataclass). `rows` is the
  layout's runtime input (the group sizes of sorted rows), or None."""

  x_axis: int  # The contraction axis of x (and the output axis of g).
  row_axis: int  # The axis wgrad contracts (the rows), in the wgrad copies' layout.
  per_expert: bool  # Kernels [E, K, N] with per-expert scales and histories.
  transposed: bool  # First-axis block-scaled copies stored transposed (quant/dot.py's DenseLayout).
  reduce_axes: tuple[str, ...]  # Mesh axes the rows are sharded over: per-tensor amaxes are reduced over them.

  def prepare(self, a, rows, block: int) -> jax.Array:
    """x or g, ready to quantize along `x_axis`: padded to the block (and, for sorted rows, rows past the
    last group zeroed)."""

  def pad_kernel(self, w, block: int) -> jax.Array: ...

  def wgrad_rows(self, a, rows, block: int) -> jax.Array:
    """x or g in the layout the block-scaled wgrad copies are quantized along the rows in."""

  def wgrad_copy(self, q: QuantizedTensor) -> QuantizedTensor:
    """A block-scaled copy quantized along the rows, stored as wgrad reads it (transposed or as it is)."""

  def quantize_kernel(self, recipe: Recipe, w, history, axis: int, stats: bool, amax=None) -> QuantizedTensor:
    """`amax`: max|w| taken by the caller, or None (quantizers.py's `amax`)."""

  def whole(self, a):
    """A kernel (quantized or not) as the GEMMs read it (gathered where it is sharded)."""

  def forward(self, x, w, rows, dtype) -> jax.Array:
    """The forward GEMM on quantized operands, or (quant.forward = "bf16") on compute-dtype arrays."""

  def dgrad(self, g, w, rows, dtype, out) -> jax.Array: ...

  def wgrad(self, x, g, rows, block: int | None, dtype, out) -> jax.Array:
    """`block`: the operands are the block-scaled copies in `wgrad_rows`' layout for this block, or None."""

  def kernel_gradient(self, dw) -> jax.Array:
    """The whole kernel's gradient as the primal kernel's (reduce-scattered where it is sharded)."""

  def whole_kernel_shape(self, w) -> tuple[int, ...]: ...


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stacked"], meta_fields=["index"])
@dataclasses.dataclass(frozen=True)
class KernelRow:
  """A layer's kernel where it lies: row `index` of the stacked kernels [L, K, N] of unrolled layers. A kernel
  cast that reads it there (quant/fused_nvfp4.py's `row_of`) saves XLA a copy of the row for the cast's call."""
  stacked: jax.Array
  index: int


def quantized_gemm(x, w, rows, history, key, stats, *, layout: Layout, recipe: Recipe, name: str, dtype,
                   error=None, kernel_amax=None, kernel_row: KernelRow | None = None, kernel_copies=None):
  """x @ w in `recipe`'s format (see the module doc); `history` and `stats` are (x, kernel, grad) triples or
  None, `key` seeds stochastic rounding (nvfp4) or is None, `error` the probe's [2] input or None,
  `kernel_amax` max|w| taken by the caller (`tensor_amax`; a step of micro-batches takes it once) or None,
  `kernel_row` w where it lies in stacked kernels (w is its row) or None. `kernel_copies`: w's quantized copies
  ({kernel[, kernel_t]}, `quantize_kernel` of w as the GEMMs read it) made by the caller once for a step's
  micro-batches, or None: the GEMMs read them and quantize no kernel; w's gradient is w's as ever."""
  if history is None:  # Unused outside fp8_delayed; keeps one signature.
    kernel_rows = (w.shape[0], 1) if layout.per_expert else (1,)
    history = (jnp.zeros((1,), jnp.float32), jnp.zeros(kernel_rows, jnp.float32), jnp.zeros((1,), jnp.float32))
  # Static facts the backward rule needs (residuals must be arrays).
  operand_info = (x.shape, jnp.dtype(x.dtype), jnp.dtype(w.dtype), vma_of(x), vma_of(w), layout.whole_kernel_shape(w))
  return _gemm(x, w, rows, tuple(history), key, None if stats is None else tuple(stats), error, kernel_amax,
               kernel_row, kernel_copies, layout, recipe, name, jnp.dtype(dtype), operand_info)


def _quantize_operands(layout: Layout, x, w, rows, history, recipe: Recipe, name: str, stats: bool = False,
                       kernel_amax=None, kernel_row: KernelRow | None = None, kernel_copies=None):
  """Every operand copy the recipe's GEMMs read, each named for remat (the kernel's: `kernel_copies` where the
  caller made them). A sharded kernel's copies are its shard's: what remat saves is the shard, gathered again
  where a GEMM reads it."""
  h_x, h_k, _ = history
  act, b, q = recipe.quantizer(ACTIVATION, h_x), recipe.block_size, {}
  with jax.named_scope(SCOPE_ACTIVATION):
    copies = one_pass.operand_copies(layout, recipe, act, x, stats)
    if copies is not None:
      q[X], q[X_T] = copies
    else:
      q[X] = one_pass.operand_rows(recipe, act, x, layout.x_axis, stats, layout.reduce_axes)
      if q[X] is None:
        q[X] = act.quantize(x, axis=layout.x_axis, reduce_axes=layout.reduce_axes, stats=stats)
      if recipe.has_x_t:
        x_rows = recipe.wgrad_transform(layout.wgrad_rows(x, rows, b), layout.row_axis)
        q[X_T] = layout.wgrad_copy(act.quantize(x_rows, axis=layout.row_axis, reduce_axes=layout.reduce_axes))
  if kernel_copies is None:
    q.update(quantize_kernel(layout, recipe, w, h_k, stats, kernel_amax, kernel_row))
  q = {k: name_quantized(v, quantized_name(name, k)) for k, v in q.items()}
  # Copies made ahead come from outside any remat region: nothing recomputes them, and named, a policy that
  # keeps kernels would save each layer's a second time.
  return q if kernel_copies is None else dict(q, **kernel_copies)


def quantize_kernel(layout: Layout, recipe: Recipe, w, history, stats: bool = False, amax=None,
                    kernel_row: KernelRow | None = None) -> dict:
  """The kernel's copies the recipe's GEMMs read ({kernel[, kernel_t]}), from w padded to the block; `history` its
  delayed-scaling amax history (or the placeholder), `amax` max|w| taken by the caller or None."""
  with jax.named_scope(SCOPE_WEIGHT):
    in_place = kernel_row is not None and kernel_row.stacked.shape[1:] == w.shape  # Not where w was padded.
    copies = one_pass.kernel_copies(layout, recipe, w, stats, amax,
                                    (kernel_row.stacked, kernel_row.index) if in_place else None)
    if copies is not None:
      return copies
    copies = {KERNEL: layout.quantize_kernel(recipe, w, history, 0, stats, amax)}
    if recipe.has_kernel_t:
      copies[KERNEL_T] = layout.quantize_kernel(recipe, w, history, 1, False, amax)
    return copies


def _forward(x, w, rows, history, layout: Layout, recipe: Recipe, name, dtype, kernel_shape, stats=False,
             kernel_amax=None, kernel_row=None, kernel_copies=None):
  b = recipe.block_size
  xp, wp = layout.prepare(x, rows, b), layout.pad_kernel(w, b)
  q = _quantize_operands(layout, xp, wp, rows, history, recipe, name, stats, kernel_amax, kernel_row, kernel_copies)
  if recipe.forward_quantized:
    y = layout.forward(q[X], layout.whole(q[KERNEL]), rows, dtype)
  else:  # quant.forward = "bf16": only the backward GEMMs read the quantized copies.
    y = layout.forward(xp, layout.whole(wp.astype(dtype)), rows, dtype)
  return _unpadded(y, x.shape, kernel_shape).astype(dtype), q


def _unpadded(y, x_shape, kernel_shape):
  return y[tuple(slice(0, s) for s in x_shape[:-1]) + (slice(0, kernel_shape[-1]),)]


def _output_error(x, w, rows, y, error, layout: Layout, recipe: Recipe, kernel_shape):
  """(sum of (y - y_ref)^2, sum of y_ref^2), y_ref the float32 GEMM of the unquantized operands (module doc),
  summed over the shards the rows vary over as `error`'s cotangent must be."""
  b = recipe.block_size
  xp, wp = layout.prepare(x, rows, b).astype(jnp.float32), layout.pad_kernel(w, b).astype(jnp.float32)
  y_ref = _unpadded(layout.forward(xp, layout.whole(wp), rows, jnp.float32), x.shape, kernel_shape)
  sums = jnp.stack([jnp.sum(jnp.square(y.astype(jnp.float32) - y_ref)), jnp.sum(jnp.square(y_ref))])
  return sum_to(sums, vma_of(error)).astype(error.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13, 14))
def _gemm(x, w, rows, history, key, stats, error, kernel_amax, kernel_row, kernel_copies, layout, recipe, name, dtype,
          operand_info):
  return _forward(x, w, rows, history, layout, recipe, name, dtype, operand_info[-1], kernel_amax=kernel_amax,
                  kernel_row=kernel_row, kernel_copies=kernel_copies)[0]


def _gemm_fwd(x, w, rows, history, key, stats, error, kernel_amax, kernel_row, kernel_copies, layout, recipe, name,
              dtype, operand_info):
  y, q = _forward(x, w, rows, history, layout, recipe, name, dtype, operand_info[-1], stats is not None,
                  kernel_amax, kernel_row, kernel_copies)
  err = None if error is None else _output_error(x, w, rows, y, error, layout, recipe, operand_info[-1])
  return y, (q, rows, history, key, err)


def _gemm_bwd(layout: Layout, recipe: Recipe, name, dtype, operand_info, res, g):
  q, rows, history, key, err = res
  x_shape, x_dtype, w_dtype, x_vma, w_vma, kernel_shape = operand_info
  with_stats = q[X].health is not None
  b = recipe.block_size
  g = layout.prepare(g, rows, b)
  grad_q = recipe.quantizer(GRADIENT, history[2])
  key_dgrad = key_wgrad = None
  if key is not None:
    key_dgrad, key_wgrad = jax.random.split(key)
  with jax.named_scope(SCOPE_GRADIENT):
    copies = one_pass.operand_copies(layout, recipe, grad_q, g, with_stats,
                                     None if key is None else (key_dgrad, key_wgrad))
    if copies is not None:
      g_rows, g_m = copies
    else:
      g_rows = grad_q.quantize(g, axis=layout.x_axis, rng=key_dgrad, reduce_axes=layout.reduce_axes,
                               stats=with_stats)
  if recipe.delayed:  # Per-tensor: wgrad reads this copy too, transposed. The barrier makes the transpose one of
    # E5M2 data: without it XLA casts the gradient twice in one kernel (a copy in each layout), which then cannot take
    # the amax, read again in a pass of its own (llama3_8b, unrolled `minimal`: 4.4 ms a step). Not under current
    # scaling, whose cast waits for the amax's pass either way: there the transpose would be a pass more.
    g_rows = dataclasses.replace(g_rows, data=jax.lax.optimization_barrier(g_rows.data))
  dx = layout.dgrad(g_rows, layout.whole(q.get(KERNEL_T, q[KERNEL])), rows, dtype, x_dtype)
  if not recipe.has_x_t:  # Per-tensor: the forward copy of x and the dgrad copy of g serve wgrad too.
    x_m, g_m = q[X], g_rows
  else:  # Block-scaled: both along the rows (NVFP4 after the Hadamard transform, which cancels in the product).
    if copies is None:
      with jax.named_scope(SCOPE_GRADIENT):
        g_m = layout.wgrad_copy(grad_q.quantize(recipe.wgrad_transform(layout.wgrad_rows(g, rows, b), layout.row_axis),
                                                axis=layout.row_axis, rng=key_wgrad, reduce_axes=layout.reduce_axes))
    x_m = q[X_T]
  dw = layout.wgrad(x_m, g_m, rows, b if recipe.has_x_t else None, dtype, recipe.wgrad_out(w_dtype))
  h_x, h_k, h_g = history
  if recipe.delayed:
    update_kernel = jax.vmap(update_history) if layout.per_expert else update_history
    new_history = (update_history(h_x, q[X].amax), update_kernel(h_k, q[KERNEL].amax),
                   update_history(h_g, g_rows.amax))
  else:
    new_history = jax.tree.map(jnp.zeros_like, history)
  dx = sum_to(dx[tuple(slice(0, s) for s in x_shape)], x_vma).astype(x_dtype)
  dw = layout.kernel_gradient(dw[tuple(slice(0, s) for s in kernel_shape)])
  dw = sum_to(dw, w_vma).astype(w_dtype)
  health = (q[X].health, q[KERNEL].health, g_rows.health) if with_stats else None
  return dx, dw, None, new_history, None, health, err, None, None, None  # Stacked kernels' and copies': w's.


_gemm.defvjp(_gemm_fwd, _gemm_bwd)

