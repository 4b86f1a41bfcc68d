"""Precision schedules: phases from the config, errors naming the entry, histories carried across a switch,
and the bf16-forward variant (the forward GEMM unquantized, the backward GEMMs in the recipe)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember import config as config_lib
from ember.errors import ConfigError
from ember.layers.decoder import layer_slots
from ember.parallel.sharding import batch_sharding
from ember.quant import dot
from ember.quant.recipe import Recipe
from ember.trainer import precision
from ember.trainer.checkpointing import Checkpointer
from ember.trainer.loop import _check_phase
from ember.trainer.state import state_shardings
from ember.trainer.step import jit_train_step
from tests import helpers


def _phases(schedule, steps=100, **overrides):
  cfg = helpers.config(**{"steps": steps, "quant.recipe": "nvfp4", "quant.schedule": schedule, **overrides})
  return precision.Phases(config_lib.derive(cfg, 1))


def test_phases_from_steps_and_fractions():
  p = _phases(((0.9, {"forward": "bf16"}), (95, {"recipe": "bf16"})))
  assert [p.start(i) for i in range(len(p))] == [0, 90, 95]
  assert [p.at(s) for s in (0, 89, 90, 94, 95, 99)] == [0, 0, 1, 1, 2, 2]
  assert p.state_phase(90) == 0 and p.state_phase(91) == 1  # The state after 90 steps was made by phase 0.
  assert p.cfg(1).quant.name == "nvfp4" and p.cfg(1).quant.forward == "bf16"
  assert p.cfg(2).quant.name == "bf16" and p.cfg(2).quant.forward == "bf16"  # Overrides accumulate.
  assert p.cfg(2).model == p.cfg(0).model  # One model shape in every phase: the phase hands the layers its recipe.


@pytest.mark.parametrize("schedule,message", [
    (((1.5, {"forward": "bf16"}),), r"quant\.schedule\[0\].*fraction.*\(0, 1\)"),
    (((0, {"forward": "bf16"}),), r"quant\.schedule\[0\].*outside \[1, steps=100\)"),
    (((0.996, {"forward": "bf16"}),), r"quant\.schedule\[0\]: starts at step 100 \(round\(0\.996 x steps=100\)\)"),
    (((50, {"forward": "bf16"}), (40, {"recipe": "bf16"})), r"quant\.schedule\[1\].*not after"),
    (((50, {"fowrard": "bf16"}),), r"quant\.schedule\[0\].*'fowrard'"),
    (((50, {"recipe": "fp6"}),), r"quant\.schedule\[0\].*from step 50.*quant\.recipe.*fp6"),
    (((50, {"forward": "fp8"}),), r"quant\.schedule\[0\].*quant\.forward.*fp8"),
    ((("half", {"forward": "bf16"}),), r"quant\.schedule\[0\].*int or a fraction"),
])
def test_bad_schedules_name_the_entry(schedule, message):
  cfg = helpers.config(**{"steps": 100, "quant.schedule": schedule})
  with pytest.raises(ConfigError, match=message):
    config_lib.validate(cfg, 1)


def _one_device_start(**overrides):
  """(phases, the start-up) of a 10-step one-device run of the config."""
  start = helpers.one_device_start(**{"steps": 10, **overrides})
  return precision.Phases(start.cfg), start


def test_muon_kernels_stay_muon_when_a_phase_regroups_the_segments():
  """Muon's table of matrices was read off phase 0's stacking: a later phase whose quant.exclude splits the layers
  into more scan segments had its new segments' kernels labelled AdamW, and the switch failed on their moments."""
  phases, start = _one_device_start(**{
      "train.optimizer": "muon", "quant.recipe": "fp8_current", "model.num_layers": 4, "quant.exclude": ("lm_head",),
      "quant.schedule": ((5, {"exclude": ("lm_head", "layers[1]")}),)})
  with start.rules():
    cfg = phases.cfg(1)
    graphdef, shardings, abstract = state_shardings(cfg, start.mesh, start.tx)
    assert len(abstract.params["segments"]) == 3 > len(start.state.params["segments"])
    moved = precision.carry(start.state, phases.cfg(0), cfg, abstract, shardings)
    step = jit_train_step(cfg, start.mesh, graphdef, start.tx, start.schedule, shardings, donate=False)
    batch = helpers.random_batch(helpers.config(**{"model.num_layers": 4}))
    sharding = batch_sharding(cfg.mesh.rules_dict, start.mesh)
    _, metrics = step(moved, {k: jax.device_put(v, sharding) for k, v in batch.items()})
  assert jnp.isfinite(metrics["loss"])


def test_histories_carry_over_where_the_next_phase_keeps_them():
  phases, start = _one_device_start(**{
      "quant.recipe": "fp8_delayed",
      "quant.schedule": ((4, {"forward": "bf16"}), (6, {"recipe": "fp8_current"}),
                         (8, {"recipe": "fp8_delayed", "amax_history_len": 8}))})
  state = start.state
  with start.rules():
    filled = jax.tree.map(lambda h: h + 3.0, state.quant_state)
    state = state.__class__(state.step, state.params, state.opt_state, filled)
    moved = [state]
    for phase in (1, 2, 3):
      _, shardings, abstract = state_shardings(phases.cfg(phase), start.mesh, start.tx)
      moved.append(precision.carry(moved[-1], phases.cfg(phase - 1), phases.cfg(phase), abstract, shardings))
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), moved[0].quant_state, moved[1].quant_state)
  assert all(jax.tree.leaves(same))  # bf16 forward keeps fp8_delayed's histories.
  assert jax.tree.leaves(moved[2].quant_state) == []  # fp8_current keeps none.
  assert all(float(jnp.abs(h).max()) == 0 and h.shape[-1] == 8 for h in jax.tree.leaves(moved[3].quant_state))
  equal = lambda a, b: all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b)))
  assert equal(moved[3].params, state.params) and equal(moved[3].opt_state, state.opt_state)


def test_a_new_history_length_keeps_the_newest_entries():
  """A switch of `quant.amax_history_len` alone: each history cut to its newest entries, or padded with zeros (the
  entries a history starts with); before, every history restarted at zeros, and the switch's first step scaled
  every tensor by 1 (a trained model's weights subnormal in E4M3, its gradients flushed to zero in E5M2)."""
  phases, start = _one_device_start(**{
      "quant.recipe": "fp8_delayed", "quant.amax_history_len": 6,
      "quant.schedule": ((4, {"amax_history_len": 4}), (6, {"amax_history_len": 8}))})
  state = start.state
  with start.rules():
    filled = jax.tree.map(lambda h: h + jnp.arange(1.0, h.shape[-1] + 1), state.quant_state)  # Newest first: 1.
    moved = [state.__class__(state.step, state.params, state.opt_state, filled)]
    for phase in (1, 2):
      _, shardings, abstract = state_shardings(phases.cfg(phase), start.mesh, start.tx)
      moved.append(precision.carry(moved[-1], phases.cfg(phase - 1), phases.cfg(phase), abstract, shardings))
  histories = [jax.tree.leaves(m.quant_state) for m in moved]
  assert histories[0] and len(histories[0]) == len(histories[1]) == len(histories[2])
  for h in histories[1]:
    np.testing.assert_array_equal(h, jnp.broadcast_to(jnp.arange(1.0, 5.0), h.shape))
  for h in histories[2]:
    np.testing.assert_array_equal(h, jnp.broadcast_to(jnp.asarray([1.0, 2, 3, 4, 0, 0, 0, 0]), h.shape))


@pytest.mark.long
def test_bf16_forward_keeps_the_recipes_backward():
  """forward="bf16": the output is the unquantized product; the gradients are the recipe's (bitwise)."""
  x = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (64, 48), jnp.float32) * 0.1
  g = jax.random.normal(jax.random.key(2), (32, 48), jnp.float32)
  for name in ("fp8_current", "nvfp4"):
    quantized, bf16_forward = Recipe(name=name), Recipe(name=name, forward="bf16")
    run = lambda r: jax.vjp(lambda x, w: dot.quantized_matmul(x, w, recipe=r, name="wi", dtype=jnp.float32,
                                                               key=jax.random.key(3)), x, w)
    (y_q, vjp_q), (y_b, vjp_b) = run(quantized), run(bf16_forward)
    np.testing.assert_allclose(y_b, jnp.dot(x, w), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(y_q - jnp.dot(x, w)).max()) > 1e-3  # The quantized forward is not that.
    for a, b in zip(vjp_q(g), vjp_b(g)):
      np.testing.assert_array_equal(a, b)


def test_each_layer_follows_itself_when_exclude_regroups_the_segments():
  """quant.exclude of layer 1 makes segments [0], [1], [2, 3]; without it one segment [0..3]: each layer's
  parameters, moments and history must land on the same layer, and the next phase's step must take the state."""

  phases, start = _one_device_start(**{
      "quant.recipe": "fp8_delayed", "model.num_layers": 4, "quant.exclude": ("lm_head", "layers[1]"),
      "quant.schedule": ((5, {"exclude": ("lm_head",)}),)})
  state = start.state
  with start.rules():
    # Mark each layer's qkv history, kernel and first moment with its layer number + 1 (layer 1, in bf16, has
    # no history).
    quant = jax.tree.map(lambda a: a, state.quant_state)
    params = jax.tree.map(lambda a: a, state.params)
    mu = jax.tree.map(lambda a: a, state.opt_state[1][0].mu)
    assert set(quant["segments"]) == {0, 2} and set(params["segments"]) == {0, 1, 2}
    for slot in layer_slots(phases.cfg(0).model, phases.cfg(0).quant):
      for tree in (params, mu):
        node = tree["segments"][slot.segment]["blocks"]["layers"][slot.j]["attn"]["qkv"]
        node["kernel"] = node["kernel"].at[slot.index].set(slot.layer + 1.0)
      if slot.layer != 1:
        node = quant["segments"][slot.segment]["blocks"]["layers"][slot.j]["attn"]["qkv"]
        node["amax_history"] = node["amax_history"].at[slot.index].set(slot.layer + 1.0)
    clip, (adam, *rest) = state.opt_state  # Clipping's (empty) state, then AdamW's chain.
    opt_state = (clip, (adam._replace(mu=mu), *rest))
    state = state.__class__(state.step, params, opt_state, quant)
    cfg = phases.cfg(1)
    graphdef, shardings, abstract = state_shardings(cfg, start.mesh, start.tx)
    moved = precision.carry(state, phases.cfg(0), cfg, abstract, shardings)
    step = jit_train_step(cfg, start.mesh, graphdef, start.tx, start.schedule, shardings, donate=False)
    batch = helpers.random_batch(helpers.config(**{"model.num_layers": 4}))
    sharding = batch_sharding(cfg.mesh.rules_dict, start.mesh)
    _, metrics = step(moved, {k: jax.device_put(v, sharding) for k, v in batch.items()})
  assert len(moved.quant_state["segments"]) == 1 and len(moved.params["segments"]) == 1

  def layer_of(tree) -> list[float]:
    """The mark each layer's qkv leaf carries, in layer order (the one segment stacks them so)."""
    (leaf,) = jax.tree.leaves(tree["segments"][0]["blocks"]["layers"][0]["attn"]["qkv"])
    return [float(leaf[layer].max()) for layer in range(4)]

  assert layer_of(moved.params) == layer_of(moved.opt_state[1][0].mu) == [1.0, 2.0, 3.0, 4.0]
  # Layer 1 was bf16 (no history) in phase 0: it starts from zeros; the others keep theirs.
  assert layer_of(moved.quant_state) == [1.0, 0.0, 3.0, 4.0]
  assert np.isfinite(float(metrics["loss"]))


def test_a_checkpoint_of_another_phase_is_warned_about(tmp_path, capsys):
  """The phase a checkpoint was saved in is in its metadata; a schedule edited since is said on resume."""

  phases, start = _one_device_start(**{"quant.schedule": ((2, {"forward": "bf16"}),)})
  capsys.readouterr()  # The config's own warnings (a short run's warm-up).
  state = start.state
  cfg = phases.cfg(0)
  ckpt = Checkpointer(str(tmp_path / "checkpoints"), every_steps=1, keep=2, async_save=False)
  ckpt.save(4, state, None, seed=cfg.seed, metadata={"quant_phase": 1})
  ckpt.save(5, state, None, seed=cfg.seed, metadata={"quant_phase": 0})
  _check_phase(ckpt.custom_metadata(4), phases, 4)  # Saved in phase 1, and phase 1 made step 4: quiet.
  assert "warning" not in capsys.readouterr().err
  _check_phase(ckpt.custom_metadata(5), phases, 5)
  assert "saved in precision phase 0" in capsys.readouterr().err
  # Saved with its config: quiet for the same precision keys, said for a recipe changed since (one of the same
  # state: fp8_current to bf16 resumes).
  ckpt.save(6, state, None, seed=cfg.seed, metadata={"quant_phase": 1, "config": phases.settings.to_dict()})
  _check_phase(ckpt.custom_metadata(6), phases, 6)
  assert "warning" not in capsys.readouterr().err
  later = _one_device_start(**{"quant.schedule": ((2, {"forward": "bf16"}), (8, {"recipe": "bf16"}))})[0]
  capsys.readouterr()
  _check_phase(ckpt.custom_metadata(6), later, 6)  # A phase added after the step: nothing it trained differs.
  assert "warning" not in capsys.readouterr().err
  other = _one_device_start(**{"quant.recipe": "bf16", "quant.schedule": ((2, {"forward": "bf16"}),)})[0]
  _check_phase(ckpt.custom_metadata(6), other, 6)
  assert ("warning: the checkpoint of step 6 was trained with other precision settings (quant.recipe='fp8_current')"
          "; this run goes on with quant.recipe='bf16'") in capsys.readouterr().err
  ckpt.close()
