"""AdamW's schedule, weight-decay mask and clipping against hand-computed values."""

import math
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ember.trainer.optimizer import learning_rate_schedule, make_optimizer
from tests import helpers


def _train_cfg(**overrides):
  t = ml_collections.ConfigDict(dict(learning_rate=1e-3, warmup_steps=10, decay_steps=90, min_lr_ratio=0.1, b1=0.9,
                                     b2=0.95, eps=1e-8, weight_decay=0.1, decay_norms_and_embeddings=False,
                                     grad_clip_norm=1.0, optimizer="adamw", optimizer_state_dtype="float32"))
  t.update(overrides)
  return t


def _adamw(train_cfg):
  """make_optimizer on settings whose train section is `train_cfg` (AdamW reads nothing else)."""
  return make_optimizer(types.SimpleNamespace(train=train_cfg))


def test_warmup_then_cosine_to_the_floor():
  lr = learning_rate_schedule(_train_cfg())
  peak, floor = 1e-3, 1e-4
  for step, expected in [(0, 0.0), (5, peak / 2), (10, peak), (55, floor + (peak - floor) * 0.5),
                         (100, floor), (500, floor)]:
    assert math.isclose(float(lr(step)), expected, rel_tol=1e-5, abs_tol=1e-9), (step, float(lr(step)), expected)
  quarter = floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * 0.25))  # Cosine at 1/4 of the decay.
  assert math.isclose(float(lr(10 + 90 // 4)), floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * 22 / 90)),
                      rel_tol=1e-5)
  assert float(lr(32)) > quarter > float(lr(33))  # Step 32.5 is a quarter of the way through the decay.


def _params():
  return {"embed": {"embedding": jnp.ones((4, 3))}, "norm": {"scale": jnp.ones((3,))},
          "layer": {"kernel": jnp.ones((3, 2))}, "bias_like": jnp.ones((2,))}


def test_weight_decay_applies_to_matrices_only():
  """With zero gradients AdamW's update is the decay alone: -lr * wd * p, on kernels only."""
  tx, schedule = _adamw(_train_cfg(warmup_steps=0, grad_clip_norm=0.0))
  params = _params()
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  lr = float(schedule(0))
  np.testing.assert_allclose(updates["layer"]["kernel"], -lr * 0.1 * np.ones((3, 2)), rtol=1e-6)
  for path in (("embed", "embedding"), ("norm", "scale")):
    np.testing.assert_array_equal(updates[path[0]][path[1]], 0.0)
  np.testing.assert_array_equal(updates["bias_like"], 0.0)  # 1-D: not a matrix.
  tx_all, _ = _adamw(_train_cfg(warmup_steps=0, grad_clip_norm=0.0, decay_norms_and_embeddings=True))
  updates, _ = tx_all.update(zeros, tx_all.init(params), params)
  assert float(jnp.max(jnp.abs(updates["embed"]["embedding"]))) > 0


def test_clipping_by_global_norm():
  """Adam normalises the first update's magnitude, so clipping is seen in the moments: the first
  moment after one step is (1 - b1) * clipped gradient."""
  tx, _ = _adamw(_train_cfg(warmup_steps=0, weight_decay=0.0, grad_clip_norm=1.0))
  params = _params()
  grads = jax.tree.map(lambda p: 3.0 * jnp.ones_like(p), params)  # Global norm 3 * sqrt(23).
  norm = 3.0 * math.sqrt(sum(p.size for p in jax.tree.leaves(params)))
  _, state = tx.update(grads, tx.init(params), params)
  adam = next(s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
  np.testing.assert_allclose(adam.mu["layer"]["kernel"], 0.1 * 3.0 / norm * np.ones((3, 2)), rtol=1e-5)
  tx_off, _ = _adamw(_train_cfg(warmup_steps=0, weight_decay=0.0, grad_clip_norm=0.0))
  _, state = tx_off.update(grads, tx_off.init(params), params)
  adam = next(s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
  np.testing.assert_allclose(adam.mu["layer"]["kernel"], 0.1 * 3.0 * np.ones((3, 2)), rtol=1e-5)


def test_a_resume_on_another_schedule_says_so(tmp_path, capsys):
  """A run extended from 10 to 20 steps with the default decay length (0: until `steps`) stretches the cosine decay
  from the step it resumes at; it says so, and says nothing resumed on the schedule it was saved with."""
  from ember.trainer.checkpointing import Checkpointer
  from ember.trainer.loop import _check_schedule
  start = helpers.one_device_start(**{"steps": 10, "train.warmup_steps": 2})
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), every_steps=1, keep=2, async_save=False)
  ckpt.save(5, start.state, None, seed=start.cfg.seed, metadata={"config": start.cfg.to_dict()})
  _check_schedule(ckpt.custom_metadata(5), start.cfg, 5)
  assert capsys.readouterr().err == ""
  _check_schedule(ckpt.custom_metadata(5), helpers.settings(**{"steps": 20, "train.warmup_steps": 2}), 5)
  assert ("note: the learning-rate schedule differs from the one step 5 was trained on: train.decay_steps 8 -> 18"
          in capsys.readouterr().err)
  ckpt.close()
