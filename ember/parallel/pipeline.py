"""Pipeline parallelism: the decoder's layers split into stages over the mesh axis `pipeline`.

Each device along `pipeline` holds one stage: a contiguous run of the stacked layers (the `layers` rule maps them
to this axis, so a stage's rows are its shard of every stacked parameter; checkpoints keep the model's own
layout and restore onto any mesh). A step's `train.grad_accum_steps` micro-batches flow through the stages in a
`shard_map` manual over `pipeline` alone (the other axes stay the compiler's, so FSDP, tensor and expert
parallelism run inside a stage as they do without a pipeline):

  iteration t = 0 .. M + S - 2 (M micro-batches, S stages): stage s runs micro-batch t - s, if there is one,
  then hands its output to stage s + 1 with a `ppermute` (one point-to-point transfer per stage boundary, the
  least any schedule moves; XLA schedules it as an asynchronous collective-permute that overlaps the next
  iteration's work).

This is the GPipe schedule: autodiff of that loop runs every micro-batch's backward after every forward, in
reverse, with the same transfers backwards. Its idle share (the bubble) is (S - 1) / (M + S - 1) of a step
(`bubble_fraction`). In the iterations where a stage has no micro-batch it runs on zeros whose segment ids mark
padding: the layers map them to zeros (no bias terms; norms of zero are zero), no token is routed, and the
results are masked out of the outputs, losses and statistics.

Values that are "gradients" of a whole-step kind rather than sums (delayed-scaling histories, health
statistics) reach every iteration through `fan_out`, whose transpose combines the iterations' cotangents as the
micro-batch loop does (max, `health.combine`) instead of summing them.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ember.names import PIPELINE


def stages(mesh) -> int:
  """How many pipeline stages `mesh` has (1: no pipeline)."""
  return 1 if mesh is None else int(mesh.shape.get(PIPELINE, 1))


def iterations(micro_batches: int, num_stages: int) -> int:
  """The loop's length: the last micro-batch enters stage 0 at M - 1 and leaves the last stage S - 1 later."""
  return micro_batches + num_stages - 1


def ticks(micro_batches: int, num_stages: int) -> int:
  """The 1F1B loop's length: micro-batch M - 1's backward pass reaches stage 0 2(S - 1) ticks after it entered."""
  return micro_batches + 2 * num_stages - 2


def loop_length(micro_batches: int, num_stages: int, schedule: str) -> int:
  """The schedule's loop: GPipe's `iterations` (of each pass), 1F1B's `ticks`."""
  return (ticks if schedule == "1f1b" else iterations)(micro_batches, num_stages)


def bubble_fraction(micro_batches: int, num_stages: int, schedule: str = "gpipe") -> float:
  """The share of a step each stage idles: GPipe (S - 1) / (M + S - 1) of its forward and of its backward
  iterations; ember's 1F1B, whose stages run one forward and one backward pass every tick in lockstep (the
  backward pass of a micro-batch reaches stage s a tick after stage s + 1), 2(S - 1) / (M + 2S - 2) of its ticks."""
  return 1 - micro_batches / loop_length(micro_batches, num_stages, schedule)


def stage_index() -> jax.Array:
  """This device's stage (inside the pipeline's shard_map)."""
  return jax.lax.axis_index(PIPELINE)


def to_next_stage(x: jax.Array, num_stages: int) -> jax.Array:
  """Each stage's `x` at the next stage (the first stage receives zeros)."""
  return jax.lax.ppermute(x, PIPELINE, [(s, s + 1) for s in range(num_stages - 1)])


def to_previous_stage(x: jax.Array, num_stages: int) -> jax.Array:
  """Each stage's `x` at the previous stage (the last stage receives zeros): a gradient on its way back."""
  return jax.lax.ppermute(x, PIPELINE, [(s + 1, s) for s in range(num_stages - 1)])


def from_last_stage(x_MxN: jax.Array, num_stages: int) -> jax.Array:
  """The last stage's [M, ...] split over the stages along M (stage s gets rows [s M / S, (s + 1) M / S)): one
  reduce-scatter, so the loss after the pipeline runs on every stage's share of the micro-batches."""
  last = stage_index() == num_stages - 1
  return jax.lax.psum_scatter(jnp.where(last, x_MxN, jnp.zeros_like(x_MxN)), PIPELINE, scatter_dimension=0,
                              tiled=True)


def fan_out(tree, valid_T: jax.Array, combine: Callable, identity: Callable):
  """`tree` broadcast along a new leading axis of len(valid_T) (one copy per loop iteration), whose transpose
  combines the iterations' cotangents with `combine` (taking only the `valid` iterations; `identity(shape)`: the
  value `combine` leaves unchanged) instead of summing them. Floating leaves only; others pass as they are."""
  leaves, treedef = jax.tree.flatten(tree)
  floating = [jnp.issubdtype(a.dtype, jnp.floating) for a in leaves]
  fanned = _fan_out([a for a, f in zip(leaves, floating) if f], valid_T, combine, identity)
  it = iter(fanned)
  n = valid_T.shape[0]
  out = [next(it) if f else jnp.broadcast_to(a, (n, *a.shape)) for a, f in zip(leaves, floating)]
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fan_out(leaves, valid_T, combine, identity):
  return [jnp.broadcast_to(a, (valid_T.shape[0], *a.shape)) for a in leaves]


def _fan_out_fwd(leaves, valid_T, combine, identity):
  return _fan_out(leaves, valid_T, combine, identity), valid_T


def _fan_out_bwd(combine, identity, valid_T, cts):
  def reduce(ct_T):
    start = identity(ct_T.shape[1:]).astype(ct_T.dtype)
    masked = jnp.where(valid_T.reshape((-1,) + (1,) * (ct_T.ndim - 1)), ct_T, start)
    return jax.lax.scan(lambda acc, c: (combine(acc, c), None), start, masked)[0]
  return [reduce(ct) for ct in cts], None


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def lowest(shape) -> jax.Array:
  """The identity of `jnp.maximum`."""
  return jnp.full(shape, -jnp.inf, jnp.float32)
