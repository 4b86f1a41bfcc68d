"""Context parallelism: each sequence split over the mesh axes the rules map `length` to (`mesh.context`).

Every layer but attention works token by token, so the split is invisible to them; attention is the one place
it shows, and this module is where it is handled (docs/long_context.md).

The balanced layout. A sequence of L tokens is cut into 2n chunks of c = L / 2n for n context devices. Device r
holds chunks r and 2n-1-r (an early chunk and its mirror), so under the causal mask every device has the same
number of (query, key) pairs to attend: the trainer's contiguous layout (device r: chunks 2r and 2r+1) is
permuted into it when the decoder starts (`balance`: two collective permutes, each chunk sent once) and back
when it ends (`unbalance`). Positions and document ids travel with their tokens, so RoPE, the documents' masks,
the loss and the MoE routing never see the order.

The attention. Each device all-gathers its group's keys and values (one collective a layer, which XLA overlaps
with the projections; their gradients are reduce-scattered back) and attends its two chunks separately: the
early chunk to the early halves of every device (the first half of the sequence: all its keys can lie there),
the late one to the whole sequence, each under a mask of causality (by token index) and documents. So a
device attends c x 3L/2 (query, key) pairs of which about c x L are visible, against 2c x L if its queries
met every key, and every local attention is a single kernel (cuDNN's on GPUs) forward and backward: a ring
of partial softmaxes merged by their log-sum-exp would skip the rest, but JAX's cuDNN binding gives no
gradient for that log-sum-exp, and a mask aligned to the bottom right that would let the kernel skip tiles
without a merge is not exposed either.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ember.names import BATCH, HEAD_DIM, HEADS, KV_HEADS, LENGTH
from ember.parallel import sharding


def context_axes() -> tuple[str, ...]:
  """The mesh axes each sequence is split over (where the active rules map `length`), or () when it is whole."""
  mesh, rules = sharding.active_mesh(), sharding.active_rules()
  if mesh is None:
    return ()
  return sharding.entry_axes(sharding.logical_to_spec((LENGTH,), rules, mesh)[0])


def _devices(axes) -> int:
  mesh = sharding.active_mesh()
  return math.prod(mesh.shape[a] for a in axes)


def _moves(n: int) -> tuple[list, list]:
  """The two collective permutes from the contiguous layout (device s: chunks 2s, 2s+1) to the balanced one (device
  r: chunks r, 2n-1-r), as (source, destination) pairs: each device's first chunk, then its second."""
  holder = lambda chunk: chunk if chunk < n else 2 * n - 1 - chunk  # The balanced layout's device for `chunk`.
  return tuple([(s, holder(2 * s + half)) for s in range(n)] for half in (0, 1))


def _on_shards(fn, names: Sequence, *arrays) -> tuple:
  """`fn` (arrays -> a tuple of as many) on each device's shard of `arrays`, all with the logical axes `names`."""
  mesh, rules = sharding.active_mesh(), sharding.active_rules()
  specs = tuple(sharding.logical_to_spec(names, rules, mesh) for _ in arrays)
  return sharding.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs)(*arrays)


def balance(arrays: Sequence[jax.Array], names: Sequence) -> tuple[jax.Array, ...]:
  """Arrays of logical axes `names` ([B, L, ...], or [M, B, L]: a step's micro-batches) from the contiguous layout
  into the balanced one, along their LENGTH axis."""
  axes = context_axes()
  first, second = _moves(_devices(axes))
  length = list(names).index(LENGTH)

  def shard(*xs):
    even = jax.lax.axis_index(axes) % 2 == 0  # An even device's early chunk came first; an odd one's second.
    out = []
    for x in xs:
      early, late = jnp.split(x, 2, axis=length)
      a, b = jax.lax.ppermute(early, axes, first), jax.lax.ppermute(late, axes, second)
      out.append(jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)], axis=length))
    return tuple(out)

  return _on_shards(shard, names, *arrays)


def unbalance(x: jax.Array, names: Sequence) -> jax.Array:
  """The inverse of `balance` for one array."""
  axes = context_axes()
  first, second = ([(dst, src) for src, dst in moves] for moves in _moves(_devices(axes)))

  def shard(x):
    even = jax.lax.axis_index(axes) % 2 == 0  # An even device holds an even chunk early, an odd one late.
    c = x.shape[1] // 2
    early, late = x[:, :c], x[:, c:]
    a = jax.lax.ppermute(jnp.where(even, early, late), axes, first)
    b = jax.lax.ppermute(jnp.where(even, late, early), axes, second)
    return (jnp.concatenate([a, b], axis=1),)

  return _on_shards(shard, names, x)[0]


def visibility(segment_ids_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Which keys each query may see, for the balanced layout's `segment_ids_BxL`: (early [B, 1, L/2, L/2], late
  [B, 1, L/2, L]) booleans, rows split over the context devices as their queries are (device r: its early chunk's
  rows of the first, its late chunk's of the second), keys in the order `attention` gathers them: same document
  and not after the query."""
  axes = context_axes()
  n = _devices(axes)
  mesh, rules = sharding.active_mesh(), sharding.active_rules()

  def shard(segment_ids_BxT):
    b, t = segment_ids_BxT.shape
    c = t // 2
    r = jax.lax.axis_index(axes)
    gathered_BxL = jax.lax.all_gather(segment_ids_BxT, axes, axis=1, tiled=True)  # Device-major: early, late.
    chunk = np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1)  # [device, half] -> chunk.
    index_L = (chunk[:, :, None] * c + np.arange(c)).reshape(-1)  # Each gathered key's index in the sequence.
    early_keys = gathered_BxL.reshape(b, n, 2, c)[:, :, 0].reshape(b, n * c)
    local = jnp.arange(c)

    def visible(query_segments, query_index, key_segments, key_index):
      same = query_segments[:, :, None] == key_segments[:, None, :]
      return (same & (key_index[None, None, :] <= query_index[None, :, None]))[:, None]

    early = visible(segment_ids_BxT[:, :c], r * c + local, early_keys, jnp.arange(n * c))  # Chunks 0..n-1.
    late = visible(segment_ids_BxT[:, c:], (2 * n - 1 - r) * c + local, gathered_BxL, jnp.asarray(index_L))
    return early, late

  row_spec = sharding.logical_to_spec((BATCH, None, LENGTH, None), rules, mesh)
  return sharding.shard_map(shard, mesh=mesh, in_specs=(sharding.logical_to_spec((BATCH, LENGTH), rules, mesh),),
                            out_specs=(row_spec, row_spec))(segment_ids_BxL)


def attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, biases, local_attention: Callable):
  """Attention of the balanced layout's queries, keys and values; `biases`: the (early, late) additive biases of
  `visibility`; `local_attention(q, k, v, bias)`: one device's attention, non-causal (the bias carries it)."""
  axes = context_axes()
  n = _devices(axes)
  mesh, rules = sharding.active_mesh(), sharding.active_rules()
  spec = lambda names: sharding.logical_to_spec(names, rules, mesh)
  q_spec, kv_spec = spec((BATCH, LENGTH, HEADS, HEAD_DIM)), spec((BATCH, LENGTH, KV_HEADS, HEAD_DIM))
  row_spec = spec((BATCH, None, LENGTH, None))

  def shard(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, early_bias, late_bias):
    c = q_BxTxNxH.shape[1] // 2
    k_BxLxKxH, v_BxLxKxH = (jax.lax.all_gather(a, axes, axis=1, tiled=True) for a in (k_BxTxKxH, v_BxTxKxH))
    early_half = lambda a: a.reshape(a.shape[0], n, 2, c, *a.shape[2:])[:, :, 0].reshape(a.shape[0], n * c,
                                                                                         *a.shape[2:])
    early = local_attention(q_BxTxNxH[:, :c], early_half(k_BxLxKxH), early_half(v_BxLxKxH), early_bias)
    late = local_attention(q_BxTxNxH[:, c:], k_BxLxKxH, v_BxLxKxH, late_bias)
    return jnp.concatenate([early, late], axis=1)

  return sharding.shard_map(shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec),
                            out_specs=q_spec)(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, *biases)
