"""Quantization health: the statistics against a NumPy reference, forced underflow and saturation found and
named with a warning, the records in metrics.jsonl and TensorBoard, and a stats-off step that measures nothing."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ember.parallel.sharding import batch_sharding
from ember.quant import health
from ember.quant.quantizers import CurrentScaling, DelayedScaling
from ember.trainer import quant_stats
from ember.trainer.loop import train
from ember.trainer.phase import QuantHealth
from ember.trainer.step import jit_train_step
from tests import helpers
from tests.trainer.test_metrics import _events


def test_per_tensor_statistics_match_a_numpy_reference():
  """fp8_current on x with one outlier: the rest underflows; counts as NumPy's E4M3 cast says."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((64, 48)) * 1e-3).astype(np.float32)
  x[3, 5] = 1e3  # An outlier sets the per-tensor scale: small values fall under E4M3's smallest subnormal.
  x[0, :4] = 0.0
  q = CurrentScaling().quantize(jnp.asarray(x), stats=True)
  got = dict(zip(health.STATS, np.asarray(q.health)))
  scale_inv = np.float32(q.scale_inv)  # 1e3 / 448 rounded up to a bfloat16 (ember/quant/quantizers.py).
  assert scale_inv == np.float32(ml_dtypes.bfloat16(scale_inv)) and 0 <= scale_inv - np.float32(1e3 / 448) < 2**-8
  scale = np.float32(1) / scale_inv
  scaled = x * scale
  ref_data = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  assert got["amax"] == np.float32(1e3) and got["scale"] == pytest.approx(scale)
  assert got["nonzero"] == np.count_nonzero(x)
  assert got["underflow"] == np.count_nonzero((x != 0) & (ref_data == 0)) > 100
  assert got["saturated"] == 0 and got["staleness"] == pytest.approx(1.0)
  # Delayed scaling with a history 100x below the tensor: it saturates and is 100x stale.
  d = DelayedScaling(jnp.full((4,), 10.0, jnp.float32)).quantize(jnp.asarray(x), stats=True)
  got = dict(zip(health.STATS, np.asarray(d.health)))
  assert got["saturated"] == np.count_nonzero(np.abs(x * (np.float32(1) / np.float32(d.scale_inv))) > 448) >= 1
  # 100x the amax its scale covers (448 x scale_inv: the history's 10, its scale_inv rounded up to a bfloat16).
  assert got["staleness"] == pytest.approx(1e3 / (448 * float(d.scale_inv)), rel=1e-6) == pytest.approx(100, rel=2**-8)


def _forced_step(recipe: str = "fp8_delayed"):
  """One train step of the tiny model whose delayed-scaling state forces trouble into one projection each:
  layer 0's wi gradient scale from a huge old amax (its gradients underflow), layer 1's qkv activation
  scale from a tiny one (its activations saturate)."""

  s = helpers.one_device_start(**{"quant.recipe": recipe, "log.quant_stats_every": 1})
  cfg = s.cfg
  with s.rules():
    step = jit_train_step(cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings, donate=False)
    batch = jax.device_put(helpers.random_batch(cfg), batch_sharding(cfg.mesh.rules_dict, s.mesh))
    state, _ = step(s.state, batch)  # Histories of real amaxes.
    quant_state = jax.tree.map(lambda a: a, state.quant_state)
    layers = quant_state["segments"][0]["blocks"]["layers"][0]
    wi = layers["mlp"]["wi"]["amax_history"]  # [layers, 3 (x, kernel, grad), H]
    layers["mlp"]["wi"]["amax_history"] = wi.at[0, 2, :].set(1e12)
    layers["attn"]["qkv"]["amax_history"] = layers["attn"]["qkv"]["amax_history"].at[1, 0, :].set(1e-6)
    _, metrics = step(dataclasses.replace(state, quant_state=quant_state), batch)
  return cfg, metrics


@pytest.mark.long
def test_forced_underflow_and_saturation_are_found_named_and_warned(capsys):
  cfg, metrics = _forced_step()
  record = quant_stats.summarize(jax.device_get(metrics["quant_stats"]), cfg.model, cfg.quant)
  assert record["quant/wi/gradient/underflow_max"] > 0.9 and record["quant/wi/gradient/underflow_layer"] == 0
  assert record["quant/wi/gradient/underflow"] == pytest.approx(record["quant/wi/gradient/underflow_max"] / 2, rel=0.2)
  assert record["quant/qkv/activation/saturated_max"] > 0.9 and record["quant/qkv/activation/saturated_layer"] == 1
  assert record["quant/qkv/activation/staleness_max"] > 1e5
  # Projections with normal scales are clean (layer 1's attention output, fed by saturated Q, K and V, is not).
  for key in ("quant/wo/gradient/underflow_max", "quant/out/gradient/underflow_max", "quant/wi/activation/saturated_max",
              "quant/wo/activation/saturated_max", "quant/qkv/weight/underflow_max"):
    assert record[key] < 0.01, (key, record[key])

  health = QuantHealth(cfg)
  first = health.record(7, metrics["quant_stats"])
  err = capsys.readouterr().err
  assert "step 7: wi gradient in layer 0" in err and "quantized to zero" in err
  assert "step 7: qkv activation in layer 1" in err and "saturated" in err
  # Once per occurrence: the same trouble at the next statistics step says nothing new.
  second = health.record(8, metrics["quant_stats"])
  assert "warning" not in capsys.readouterr().err
  assert len(first["quant_warnings"]) >= 2 and second["quant_warnings"] == []  # The record carries them.


@pytest.mark.long
def test_a_run_writes_statistics_to_metrics_and_tensorboard(tmp_path):
  cfg = helpers.config(**{"workdir": str(tmp_path), "steps": 4, "log.every_steps": 4, "log.tensorboard": True,
                          "log.quant_stats_every": 2, "quant.recipe": "fp8_current", "checkpoint.every_steps": -1})
  train(helpers.checked(cfg))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  stats = [r for r in records if "quant_warnings" in r]
  assert [r["step"] for r in stats] == [2, 4] and all("loss" in r for r in stats)  # In the training records.
  for role in ("activation", "weight", "gradient"):
    assert 0 <= stats[-1][f"quant/wi/{role}/underflow"] <= 1 and stats[-1][f"quant/wi/{role}/amax_max"] > 0
  tags = {tag for step, tag in _events(str(tmp_path / "tensorboard")) if step == 4}
  assert "quant/qkv/gradient/underflow_max" in tags and "quant/wo/weight/scale" in tags


@pytest.mark.parametrize("recipe,experts", [("fp8_delayed", 0), ("nvfp4", 4)])
@pytest.mark.variants
def test_stats_off_traces_no_statistic(recipe, experts, monkeypatch):
  """With log.quant_stats_every = 0 the train step measures nothing: tracing it (dense and grouped matmuls)
  never reaches health.measure, the one place a statistic is computed, and the state holds no statistics
  inputs; with statistics on, the same probe sees every projection's operands measured."""

  measure, calls = health.measure, []
  monkeypatch.setattr(health, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
  counted = {}
  for every in (1, 0):
    calls.clear()
    s = helpers.one_device_start(
        **{"quant.recipe": recipe, "model.num_experts": experts, "log.quant_stats_every": every})
    with s.rules():
      step = jit_train_step(s.cfg, s.mesh, s.graphdef, s.tx, s.schedule, s.shardings, donate=False)
      batch = jax.device_put(helpers.random_batch(s.cfg), batch_sharding(s.cfg.mesh.rules_dict, s.mesh))
      _, metrics = jax.eval_shape(step, s.state, batch)
    state = s.state
    counted[every] = (len(calls), "quant_stats" in metrics,
                      any("quant_stats" in jax.tree_util.keystr(path) for path, _ in jax.tree.leaves_with_path(state)))
  assert counted[1][0] > 0 and counted[1][1], counted
  assert counted[0] == (0, False, False), counted


def test_the_prediction_modules_report_their_statistics_as_the_layers_after_the_decoders():
  """deepseek_tiny (3 layers, the first dense, and 1 multi-token-prediction module), fp8_current: a step's
  statistics name the module's projections as layer 3, its own `mtp_proj` and its attention and MoE projections
  beside the decoder's layers'."""
  cfg = helpers.config("deepseek_tiny", **{"quant.recipe": "fp8_current", "log.quant_stats_every": 1,
                                           "mesh.fsdp": 1, "train.batch_size": 2})
  metrics, _ = helpers.run_steps(cfg, [helpers.random_batch(cfg)], 1)
  settings = helpers.checked(cfg)
  layers = quant_stats.per_layer(metrics[0]["quant_stats"], settings.model, settings.quant)
  assert sorted(layers[("mtp_proj", "activation")]) == [3]
  assert sorted(layers[("kv_b", "weight")]) == [0, 1, 2, 3] and sorted(layers[("moe_wi", "gradient")]) == [1, 2, 3]
  assert layers[("mtp_proj", "activation")][3][quant_stats._I["nonzero"]] > 0  # Counted, not a zero row.
