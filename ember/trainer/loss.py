"""Next-token cross-entropy and its gradient in one pass over token chunks, so [batch, length, vocab] logits
never exist and the LM head's forward GEMM runs once.

The tokens are cut into `n` chunks of strided positions (`strided_chunks`).
For each chunk the head runs once: its full-vocab logits give the chunk's log-sum-exp, NLL and z-loss and, at
once, the loss's gradient with respect to those logits, which the head's own backward (its VJP: quantized like
its forward where the recipe quantizes the head) turns into the chunk's hidden-state gradient and its share of
the head's weight gradient. The custom VJP keeps those gradients, not logits: the backward pass only scales them
by the loss's cotangent (the gradient is computed for the loss divided by the step's tokens, so in a train step
that cotangent is 1), as fused cross-entropy kernels do. The head's GEMMs: one forward, one dgrad, one wgrad.

The weight gradient sums over every token. Summed chunk by chunk by the compiler, each chunk's partial sum would
be reduced across the devices the tokens are split over (n reductions of the whole [D, V] float32 gradient a
step). So the chunks run in a shard_map over the mesh axes that split the tokens (the batch's and the length's):
each device sums its own tokens' shares locally ([D, V] in float32, the head's weight read whole on each device,
in the dtype its GEMMs read), and the sums leave the map stacked, one per device, to be summed once, after the
loop, where the compiler reduce-scatters them to the weight's sharding (in `Head.reduce_dtype`: bf16 with
train.grad_reduce_dtype=bfloat16, as every projection's weight gradient).

A step of micro-batches calls the loss once per micro-batch, and each call gathers the weight and reduces its
[D, V] float32 gradient again. Where the tokens are split across nodes that reduction crosses the network once a
micro-batch, so the step reads the head once instead (`read_once`): the weight gathered once in the dtype its
GEMMs read, and a zero input [devices, D, V] float32 whose "gradient" is each device's share of the weight
gradient, kept on the device. The step sums the shares over its micro-batches and reduces them across the
devices once (`with_head_gradient`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ember.layers.decoder import Head, keys_of
from ember.names import BATCH, EMBED, LENGTH, LM_HEAD, VOCAB
from ember.parallel import sharding
from ember.parallel.sharding import (active_mesh, active_rules, entry_axes, logical_to_spec, place, shard, shard_map,
                                     without_axes)
from ember.quant.varying import manual_axes

F32 = jnp.float32


def num_chunks(length: int, chunk_size: int) -> int:
  """Token chunks of a `length`-token row for a `chunk_size` budget: each chunk's logits hold about as many values
  as `chunk_size` tokens' full-vocab logits (0 or >= length: one chunk). The smallest count of at least
  ceil(length / chunk_size) that divides `length` (each chunk strides the row evenly)."""
  if not chunk_size or chunk_size >= length:
    return 1
  return next(n for n in range(-(-length // chunk_size), length + 1) if length % n == 0)


def strided_chunks(a_BxLx, n: int):
  """[B, L, ...] -> [B, L / n, n, ...]: chunk c (index c on axis 2) holds the positions c, c + n, c + 2n, ...
  (strided, so a length split over devices stays split inside every chunk, and a chunk is the same tokens on
  any split of the batch; a device holding part of each sequence, under `mesh.context`, cuts its own part into
  chunks of its own: docs/long_context.md, Numerics)."""
  b, length, *rest = a_BxLx.shape
  return a_BxLx.reshape(b, length // n, n, *rest)


def token_count(weights_BxL):
  """The loss's denominator: the tokens with weight > 0 (at least 1)."""
  return jnp.maximum(jnp.sum(weights_BxL.astype(F32)), 1.0)


def cross_entropy(hidden_BxLxD, targets_BxL, weights_BxL, head: Head, *, key=None, chunk_size: int = 0,
                  count=None, z_loss_weight: float = 0.0, once: HeadOnce | None = None):
  """(loss, ce, z): ce the weighted mean next-token NLL, z the weighted mean log(Z)^2 over tokens with weight > 0,
  loss = ce + z_loss_weight * z. Only `loss` carries a gradient (ce and z are its parts, to log).

  `chunk_size` bounds the live logits (`num_chunks`, of each device's share of the length). `count`: the
  denominator, when these tokens are one micro-batch of a larger step (its weighted tokens); default these
  tokens' own. `once`: the head as the step read it for all its micro-batches (`read_once`): the weight
  gradient goes to `once.partial`, each device's share its own, and none to `head.weight`."""
  weights_BxL = weights_BxL.astype(F32)
  count = token_count(weights_BxL) if count is None else jnp.asarray(count, F32)
  plan = _Plan(head.logits, float(z_loss_weight), chunk_size, jnp.dtype(head.read_dtype),
               jnp.dtype(head.reduce_dtype), head.weight.dtype, once is not None)
  weight, partial = (head.weight, None) if once is None else (once.weight, once.partial)
  loss, ce, z = _fused(plan, hidden_BxLxD, weight, partial, targets_BxL, weights_BxL, count, key)
  return loss, jax.lax.stop_gradient(ce), jax.lax.stop_gradient(z)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadOnce:
  """The LM head read once for a step's micro-batches (module doc): `weight` [D, V] in the dtype its GEMMs read,
  gathered over the mesh axes that split the tokens; `partial` [devices along those axes, D, V] float32 zeros, whose
  gradient is each device's share of the head's weight gradient."""
  weight: jax.Array
  partial: jax.Array


def read_once(head: Head) -> HeadOnce | None:
  """`head` read for a step's micro-batches; None where no mesh axis splits the tokens (nothing to gather or
  reduce)."""
  axes = _token_axes()
  if not axes:
    return None
  mesh = active_mesh()
  spec = without_axes(logical_to_spec(_WEIGHT_AXES, active_rules(), mesh), axes)
  weight = place(head.weight.astype(head.read_dtype), spec)
  devices = math.prod(mesh.shape[a] for a in axes)
  return HeadOnce(weight, place(jnp.zeros((devices, *weight.shape), F32), P(axes, *spec)))


def with_head_gradient(grads, head: Head, partial_grad):
  """`grads` (a tree of the model's state) with the head's weight gradient added to its parameter's: the devices'
  shares (`HeadOnce.partial`'s gradient, summed over the step's micro-batches) summed across the devices, once, in
  the head's reduction dtype."""
  dw = jnp.sum(partial_grad.astype(head.reduce_dtype), axis=0, dtype=head.reduce_dtype)
  dw = shard(dw, _WEIGHT_AXES)
  dw = dw.T if head.transposed else dw
  found = []

  def add(path, g):
    if keys_of(path) != head.param:
      return g
    found.append(path)
    return g + dw.astype(g.dtype)

  grads = jax.tree_util.tree_map_with_path(add, grads)
  if len(found) != 1:  # A head that names no parameter of the tree would lose its gradient silently.
    raise ValueError(f"with_head_gradient: {len(found)} leaves at the head's parameter {head.param!r}")
  return grads


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What `_fused` is traced for (its static argument)."""
  logits: Callable
  z_loss_weight: float
  chunk_size: int
  read_dtype: jnp.dtype
  reduce_dtype: jnp.dtype
  w_dtype: jnp.dtype
  once: bool = False  # The head read once for the step (`HeadOnce`): its weight gradient goes to the shares.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan: _Plan, h_BxLxD, w_DxV, partial, targets_BxL, weights_BxL, count, key):
  """(loss, ce, z), as `cross_entropy` returns them; `partial`: `HeadOnce.partial`, or None."""
  return _run(plan, h_BxLxD, w_DxV, targets_BxL, weights_BxL, count, key, grads=False)[0]


def _fused_fwd(plan, h_BxLxD, w_DxV, partial, targets_BxL, weights_BxL, count, key):
  out, dh_BxLxD, dw_SxDxV = _run(plan, h_BxLxD, w_DxV, targets_BxL, weights_BxL, count, key, grads=True)
  return out, (dh_BxLxD, dw_SxDxV)


def _fused_bwd(plan, residuals, g):
  dh_BxLxD, dw_SxDxV = residuals
  g_loss = g[0]  # ce and z leave `cross_entropy` through stop_gradient: their cotangents are zeros.
  dh = shard((dh_BxLxD * g_loss).astype(dh_BxLxD.dtype), (BATCH, LENGTH, EMBED))  # dh is in h's dtype.
  if plan.once:  # Each device's share stays its own (`HeadOnce`); the weight read for the step gets none.
    return dh, None, dw_SxDxV * g_loss, None, None, None, None
  # One sum over the devices' shares (a reduce-scatter to the weight's sharding), in the reduction's dtype.
  dw = jnp.sum((dw_SxDxV * g_loss).astype(plan.reduce_dtype), axis=0, dtype=plan.reduce_dtype)
  dw = shard(dw.astype(plan.w_dtype), _WEIGHT_AXES)
  return dh, dw, None, None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


_WEIGHT_AXES = (EMBED, VOCAB)  # The head's weight [D, V], as the loss reads it.


def _token_axes() -> tuple[str, ...]:
  return tuple(a for entry in _token_spec() for a in entry_axes(entry))


def _token_spec() -> P:
  """How the tokens [B, L] are split over the mesh axes not already manual (the loss's map: its axes), P() with
  no active mesh."""
  mesh = active_mesh()
  if mesh is None:
    return P()
  return without_axes(sharding.token_spec(active_rules(), mesh), manual_axes())


def _run(plan: _Plan, h_BxLxD, w_DxV, targets_BxL, weights_BxL, count, key, grads: bool):
  """((loss, ce, z), dh [B, L, D] in h's dtype or None, dw [devices, D, V] float32 or None) over the token chunks,
  in a shard_map over the axes that split the tokens (none: on the arrays as they are)."""
  rows = _token_spec()
  axes = _token_axes()
  w_read = w_DxV.astype(plan.read_dtype)  # Gathered as the GEMMs read it.
  # Inside the step's replicas' map (parallel/sharding.py's `shard_map`) values carry no varying-axes types.
  vary = bool(axes) and not manual_axes()
  local = functools.partial(_local, plan, axes=axes, vary=vary, grads=grads)
  if not axes:
    return local(h_BxLxD, w_read, targets_BxL, weights_BxL, count, key)
  stacked = P(axes, None, None)
  # The key goes in as an input, not captured: inside a step's own map (replicas, stages) a captured value lies on
  # that map's mesh, where this map's axes are the compiler's, and the shard's index cannot be folded into it.
  keyed = () if key is None else (key,)
  mapped = shard_map(lambda h, w, t, wt, c, *k: local(h, w, t, wt, c, *(k or (None,))), mesh=active_mesh(),
                     in_specs=(P(*rows, None), P(), rows, rows, P()) + (P(),) * len(keyed),
                     out_specs=((P(), P(), P()), P(*rows, None) if grads else None, stacked if grads else None),
                     axis_names=set(axes))
  return mapped(h_BxLxD, w_read, targets_BxL, weights_BxL, count, *keyed)


def _local(plan: _Plan, h_BxLxD, w_read, targets_BxL, weights_BxL, count, key, *, axes, vary: bool, grads: bool):
  """`_run` on each device's tokens (`axes`: the map's, summed over at the end; `vary`: the map types values by
  the axes they vary over)."""
  b, l, d = h_BxLxD.shape
  n = num_chunks(l, plan.chunk_size)
  h4, t3, wt3 = (strided_chunks(a, n) for a in (h_BxLxD, targets_BxL, weights_BxL))
  chunk = lambda a, c: jax.lax.dynamic_index_in_dim(a, c, axis=2, keepdims=False)
  # The weight varies over the map's axes, so its gradient is each device's own partial sum (the transpose of
  # an invariant input would sum it over them, once a chunk).
  w_in = jax.lax.pcast(w_read, axes, to="varying") if vary else w_read
  if key is not None and axes:  # A quantized head's stochastic rounding: noise of its own on every token shard.
    key = jax.random.fold_in(key, jax.lax.axis_index(axes))

  def one_chunk(c):
    """(the chunk's [NLL sum, z sum], its dh in h's dtype, its dw in float32), no gradients without `grads`."""
    h, targets, weights = chunk(h4, c), chunk(t3, c), chunk(wt3, c)
    chunk_key = None if key is None else jax.random.fold_in(key, c)  # And on every chunk.
    apply = lambda h, w: _logits(plan.logits, h, w, chunk_key)
    # The VJP is taken at the weight in its own dtype, so the chunk's weight gradient is too; the cast is made
    # here, beside the head's cast back to `read_dtype`, so the compiler drops the exact round trip.
    w = w_in.astype(plan.w_dtype)
    if grads:
      out, head_vjp = jax.vjp(apply, h, w)
    else:
      out = apply(h, w)
    lse = _logsumexp(out)
    hit = jax.lax.broadcasted_iota(jnp.int32, out.shape, 2) == targets[..., None]
    target_logit = jnp.sum(jnp.where(hit, out, 0.0), axis=-1)
    sums = jnp.stack([jnp.sum((lse - target_logit) * weights), jnp.sum(lse * lse * weights)])
    if not grads:
      return sums, None, None
    # d/dlogits of (w * (lse - target) + z_w * w * lse^2) / count: w (1 + 2 z_w lse) softmax - w onehot, / count.
    softmax_coeff = (weights * (1.0 + 2.0 * plan.z_loss_weight * lse) / count)[..., None]
    d_out = softmax_coeff * jnp.exp(out - lse[..., None]) - jnp.where(hit, (weights / count)[..., None], 0.0)
    dh, dw = head_vjp(d_out)
    return sums, dh.astype(h_BxLxD.dtype), dw.astype(F32)

  # Chunk 0 starts the sums (no zeros written for the [D, V] accumulator); the others add to them, each weight
  # gradient in its GEMM (cuBLAS accumulates into the carried sum), and hand out their dh.
  sums, dh0, dw = one_chunk(0)

  def body(carry, c):
    sums, dw = carry
    sums_c, dh, dw_c = one_chunk(c)
    return (sums + sums_c, None if dw is None else dw + dw_c), dh

  (sums, dw), dh_rest = jax.lax.scan(body, (sums, dw), jnp.arange(1, n))
  if axes:
    sums = jax.lax.psum(sums, axes)
  nll_sum, z_sum = sums[0], sums[1]
  out = ((nll_sum + plan.z_loss_weight * z_sum) / count, nll_sum / count, z_sum / count)
  if not grads:
    return out, None, None
  dh_NxBxCxD = jnp.concatenate([dh0[None], dh_rest])  # [n, B, L / n, D]: back to the positions' order.
  return out, jnp.moveaxis(dh_NxBxCxD, 0, 2).reshape(b, l, d), dw[None]


def _logsumexp(x_BxCxV):
  """log(sum(exp(x))) over the vocab, reading the chunk's float32 logits once: one reduction of (running max, sum
  of exp(x - running max)) pairs, as online softmax does, where `jax.nn.logsumexp` reads them twice (its max, then
  its sum). Where the vocab is split over mesh axes (the head's tensor parallelism) the pairs cannot be combined by
  an all-reduce, and the two-read form is kept."""
  mesh = active_mesh()
  split = mesh is not None and math.prod(
      mesh.shape[a] for e in logical_to_spec((VOCAB,), active_rules(), mesh) for a in entry_axes(e)) > 1
  if split:
    return jax.nn.logsumexp(x_BxCxV, axis=-1)

  def combine(a, b):
    (m_a, s_a), (m_b, s_b) = a, b
    m = jnp.maximum(m_a, m_b)
    # A side that holds nothing yet (max -inf, sum 0) adds nothing; exp(-inf - -inf) would be NaN.
    scaled = lambda m_x, s_x: jnp.where(s_x > 0, s_x * jnp.exp(m_x - m), 0.0)
    return m, scaled(m_a, s_a) + scaled(m_b, s_b)

  m, s = jax.lax.reduce((x_BxCxV, jnp.ones_like(x_BxCxV)), (jnp.array(-jnp.inf, F32), jnp.array(0.0, F32)),
                        combine, (x_BxCxV.ndim - 1,))
  return m + jnp.log(s)


def _logits(logits: Callable, h_BxCxD, w_DxV, key):
  """Float32 logits of a chunk, scoped `lm_head` (the compiled step's ops of the head are found by name)."""
  with jax.named_scope(LM_HEAD):
    return shard(logits(h_BxCxD, w_DxV, key).astype(F32), (BATCH, LENGTH, VOCAB))
