"""The optimizer of `train.optimizer`: AdamW, or Muon on the projection kernels with AdamW on the rest; linear
warm-up then cosine decay, global-norm clipping, a weight-decay mask, and the state's dtype
(`train.optimizer_state_dtype`).

Muon (`train.optimizer=muon`): momentum orthogonalised by a Newton-Schulz iteration, for the projection kernels.
Which parameters, and as which matrices (`matrix_layout`, from each parameter's logical axes): every
projection kernel but the LM head. Its `layers` and `expert` axes are a batch of separate matrices; the
rows are the kernel's input axes (`embed` for the QKV, gate/up and expert-in kernels; the heads for the
attention output; the hidden units for the down projections) and the columns its output axes. A fused kernel
(QKV, gate + up) is orthogonalised as the one matrix it is. Everything else (embeddings, norms, the router,
the LM head) stays with AdamW.

The update of one matrix G (momentum m, coefficient beta; Nesterov as in Keller Jordan's Muon):
    m <- beta m + (1 - beta) G;  U = (1 - beta) G + beta m
    X = U / (|U|_F + 1e-7), transposed so that rows <= columns
    5 times: A = X X^T;  X <- a X + (b A + c A A) X     (a, b, c) = (3.4445, -4.7750, 2.0315)
    update = X (transposed back) * sqrt(max(1, columns / rows))
in float32, or with X in bfloat16 (`train.muon_ns_dtype`); then decoupled weight decay and the learning
rate (`train.muon_learning_rate`, `train.muon_weight_decay`) as the optimizer chains them.

Sharded kernels: before the iteration each kernel's momentum is laid out as [matrices, rows, columns] with
the matrices split over the mesh's devices and each matrix whole on one device (an all-to-all of the
momentum's shards, shown among the compile report's collectives); the orthogonalised update goes back to
the kernel's own sharding the same way. A device thus orthogonalises whole matrices, with no collective
inside the iteration.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from ember.config import Settings
from ember.layers.decoder import keys_of
from ember.names import EDGE_LAYERS, EMBED, EXPERT, LAYERS, LM_HEAD
from ember.parallel import sharding
from ember.trainer.state import logical_axes


def learning_rate_schedule(train_cfg, peak: float | None = None) -> optax.Schedule:
  """Warm-up to `peak` (default `train.learning_rate`), then cosine decay to peak * min_lr_ratio."""
  t = train_cfg
  peak = t.learning_rate if peak is None else peak
  warmup = optax.linear_schedule(0.0, peak, max(t.warmup_steps, 1))
  cosine = optax.cosine_decay_schedule(peak, max(t.decay_steps, 1), alpha=t.min_lr_ratio)
  return optax.join_schedules([warmup, cosine], [t.warmup_steps])


def _decays(path, leaf) -> bool:
  """Weight decay applies to matrices; not to norm scales or embeddings (unless configured)."""
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  return not any(n in ("embedding", "scale") for n in names) and getattr(leaf, "ndim", 0) >= 2


def adamw(train_cfg, schedule: optax.Schedule) -> optax.GradientTransformation:
  t = train_cfg
  mask = None if t.decay_norms_and_embeddings else (lambda params: jax.tree_util.tree_map_with_path(_decays, params))
  return optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=mask)


def make_optimizer(cfg: Settings) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(the run's optimizer, its learning-rate schedule) for settings `cfg`."""
  t = cfg.train
  schedule = learning_rate_schedule(t)
  if t.optimizer == "muon":
    # Every precision phase's parameter paths: a phase whose quant.exclude regroups the layers stacks them into
    # other scan segments, and the one optimizer serves every phase.
    layouts = {}
    for phase in range(len(cfg.phases)):
      _, axes, _ = logical_axes(cfg.at_phase(phase))
      flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda a: isinstance(a, tuple))[0]
      layouts.update({keys_of(path): matrix_layout(keys_of(path), tuple(spec)) for path, spec in flat})
    layouts = {path: layout for path, layout in layouts.items() if layout is not None}
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "muon" if keys_of(path) in layouts else "adamw", params)
    matrices = optax.chain(
        scale_by_muon(layouts, beta=t.muon_momentum, steps=t.muon_ns_steps, ns_dtype=jnp.dtype(t.muon_ns_dtype)),
        optax.add_decayed_weights(t.muon_weight_decay),
        optax.scale_by_learning_rate(learning_rate_schedule(t, t.muon_learning_rate)))
    update = optax.multi_transform({"adamw": adamw(t, schedule), "muon": matrices}, labels)
  else:
    update = adamw(t, schedule)
  update = stored_in(update, jnp.dtype(t.optimizer_state_dtype))
  chain = [optax.clip_by_global_norm(t.grad_clip_norm)] if t.grad_clip_norm > 0 else []
  return optax.chain(*chain, update), schedule


def stored_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`inner` with its floating-point state (moments, momentum) stored in `dtype` between steps and computed in
  float32: each step reads the state up to float32 and rounds the new state to `dtype` (to nearest)."""
  if dtype == jnp.float32:
    return inner

  def cast(tree, to):
    return jax.tree.map(lambda a: a.astype(to) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

  def update(updates, state, params=None):
    new_updates, new_state = inner.update(updates, cast(state, jnp.float32), params)
    return new_updates, cast(new_state, dtype)

  return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


NS_COEFFS = (3.4445, -4.7750, 2.0315)
BATCH_AXES = (LAYERS, EDGE_LAYERS, EXPERT)  # Axes of a stacked kernel that hold separate matrices.


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
  """How a kernel's dimensions form matrices: batch dims, rows (its inputs), columns (its outputs); and its
  logical axes (where the kernel itself is sharded)."""
  batch: tuple[int, ...]
  rows: tuple[int, ...]
  cols: tuple[int, ...]
  axes: tuple = dataclasses.field(default=(), compare=False)

  @classmethod
  def of(cls, axes: tuple) -> "MatrixLayout | None":
    """The layout of a projection kernel with logical `axes` (None if it reads or writes no `embed`)."""
    batch = tuple(i for i, a in enumerate(axes) if a in BATCH_AXES)
    rest = [i for i in range(len(axes)) if i not in batch]
    if len(rest) < 2 or EMBED not in (axes[i] for i in rest):
      return None
    embed = next(i for i in rest if axes[i] == EMBED)
    others = tuple(i for i in rest if i != embed)
    if embed == rest[0]:  # Reads the residual stream: embed in, the rest out.
      return cls(batch, (embed,), others, tuple(axes))
    return cls(batch, others, (embed,), tuple(axes))  # Writes it: embed out.

  def matrices(self, x: jax.Array) -> jax.Array:
    """Kernel-shaped `x` as [matrices, rows, columns]."""
    batch, rows = (math.prod(x.shape[i] for i in dims) for dims in (self.batch, self.rows))
    return jnp.transpose(x, self.batch + self.rows + self.cols).reshape(batch, rows, -1)

  def kernel(self, m: jax.Array, shape: tuple) -> jax.Array:
    """[matrices, rows, columns] `m` back in the kernel's `shape` (the inverse of `matrices`)."""
    order = self.batch + self.rows + self.cols
    return jnp.transpose(m.reshape([shape[i] for i in order]), [order.index(i) for i in range(len(shape))])


def matrix_layout(path: tuple, axes: tuple) -> MatrixLayout | None:
  """The layout of parameter `path` with logical `axes` if Muon updates it, else None (AdamW)."""
  if not path or path[-1] != "kernel" or LM_HEAD in path:
    return None
  return MatrixLayout.of(axes)


def newton_schulz(u_RxC: jax.Array, steps: int, dtype) -> jax.Array:
  """The quintic Newton-Schulz iteration of one matrix (module doc), in `dtype`; returns float32."""
  x = u_RxC.astype(jnp.float32)
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  x = (x / (jnp.linalg.norm(x) + 1e-7)).astype(dtype)
  a, b, c = NS_COEFFS
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  x = x.astype(jnp.float32)
  return x.T if transposed else x


def orthogonalize(u: jax.Array, layout: MatrixLayout, steps: int, dtype) -> jax.Array:
  """Muon's update of a (stacked) kernel's momentum `u`: every matrix of `layout` orthogonalised and scaled by
  sqrt(max(1, columns / rows)), in `u`'s shape and dtype."""
  matrices = layout.matrices(u)
  m = _whole_matrices(matrices)
  _, rows, cols = m.shape
  out = jax.vmap(lambda x: newton_schulz(x, steps, dtype))(m)[:matrices.shape[0]] * max(1.0, cols / rows) ** 0.5
  return _as_kernel(layout.kernel(out, u.shape).astype(u.dtype), layout)


def _as_kernel(x: jax.Array, layout: MatrixLayout) -> jax.Array:
  """`x` (a kernel's gradient, momentum or update) sharded as the kernel is; as it is without logical axes."""
  return sharding.shard(x, layout.axes) if layout.axes else x


def _whole_matrices(m_BxRxC: jax.Array) -> jax.Array:
  """`m` with its matrices split over all the active mesh's devices, each matrix whole on one (module doc), padded
  with zero matrices (orthogonalised to zero, sliced off after) to a multiple of the device count: a count the
  mesh's axes did not divide (llama3_70b's 80 layers on 64 GPUs, deepseek_v3's 58 MoE layers) left every matrix on
  every device, the whole stack gathered to each and its Newton-Schulz iterations run there."""
  mesh = sharding.active_mesh()
  if mesh is None or mesh.size == 1:
    return m_BxRxC
  axes = tuple(name for name, n in mesh.shape.items() if n > 1)
  b = m_BxRxC.shape[0]
  padded = -(-b // mesh.size) * mesh.size
  m_BxRxC = jnp.pad(m_BxRxC, ((0, padded - b), (0, 0), (0, 0)))
  return jax.lax.with_sharding_constraint(m_BxRxC, NamedSharding(mesh, P(axes, None, None)))


def scale_by_muon(layouts: dict, *, beta: float, steps: int, ns_dtype) -> optax.GradientTransformation:
  """Muon's direction (module doc) for the parameters whose path is in `layouts` ({path: MatrixLayout});
  within `optax.multi_transform` the others arrive masked. State: the momentum (float32 here; the
  optimizer may store it in another dtype)."""

  def init(params):
    return {"mu": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)}

  def update(grads, state, params=None):
    del params
    # Gradients as the kernels are sharded (reduce-scattered), before the momentum and the relayout.
    grads = jax.tree_util.tree_map_with_path(lambda path, g: _as_kernel(g, layouts[keys_of(path)]), grads)
    mu = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g.astype(jnp.float32), state["mu"], grads)
    nesterov = jax.tree.map(lambda m, g: (1 - beta) * g.astype(jnp.float32) + beta * m, mu, grads)
    updates = jax.tree_util.tree_map_with_path(
        lambda path, u: orthogonalize(u, layouts[keys_of(path)], steps, ns_dtype), nesterov)
    return updates, {"mu": mu}

  return optax.GradientTransformation(init, update)
