"""The optimizer of `train.optimizer`: AdamW, or Muon on the projection kernels with AdamW on the rest; linear
warm-up then cosine decay, global-norm clipping, a weight-decay mask, and the state's dtype
(`train.optimizer_state_dtype`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ember.config import Settings
from ember.trainer import muon
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
      layouts.update({muon.keys_of(path): muon.matrix_layout(muon.keys_of(path), tuple(spec)) for path, spec in flat})
    layouts = {path: layout for path, layout in layouts.items() if layout is not None}
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "muon" if muon.keys_of(path) in layouts else "adamw", params)
    matrices = optax.chain(
        muon.scale_by_muon(layouts, beta=t.muon_momentum, steps=t.muon_ns_steps, ns_dtype=jnp.dtype(t.muon_ns_dtype)),
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
