"""AdamW with linear warm-up then cosine decay, global-norm clipping, and a weight-decay mask."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  t = train_cfg
  warmup = optax.linear_schedule(0.0, t.learning_rate, max(t.warmup_steps, 1))
  cosine = optax.cosine_decay_schedule(t.learning_rate, max(t.decay_steps, 1), alpha=t.min_lr_ratio)
  return optax.join_schedules([warmup, cosine], [t.warmup_steps])


def _decays(path, leaf) -> bool:
  """Weight decay applies to matrices; not to norm scales or embeddings (unless configured)."""
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  return not any(n in ("embedding", "scale") for n in names) and getattr(leaf, "ndim", 0) >= 2


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
  t = train_cfg
  schedule = learning_rate_schedule(t)
  mask = None if t.decay_norms_and_embeddings else (lambda params: jax.tree_util.tree_map_with_path(_decays, params))
  chain = []
  if t.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(t.grad_clip_norm))
  chain.append(optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=mask))
  return optax.chain(*chain), schedule
