"""A short real run: metrics.jsonl holds every contract key, TensorBoard files exist, loss falls; MoE token
counts summed over a log interval."""

import glob
import json
import os

import numpy as np
import pytest

from ember.layers import moe_dispatch
from ember.trainer.loop import train
from ember.trainer.metrics import MoeCounts
from tests.helpers import checked, config

CONTRACT_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"}


def test_short_run_writes_metrics_and_tensorboard(tmp_path, capsys):
  keys = {"steps": 30, "log.every_steps": 10, "log.tensorboard": True, "train.eval_every_steps": 30,
          "train.eval_batches": 2, "train.warmup_steps": 5, "checkpoint.every_steps": 0, "quant.recipe": "fp8_current",
          "train.learning_rate": 3e-3}
  cfg = config("tiny", **{"workdir": str(tmp_path), **keys})
  summary = train(checked(cfg))
  records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  train_records = [r for r in records if "loss" in r]
  eval_records = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in train_records] == [10, 20, 30]
  for r in train_records:
    assert CONTRACT_KEYS <= set(r), set(r)
    assert r["mfu"] is None  # The CPU's peak is unknown.
    assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["tflops_per_device"] > 0
  assert train_records[-1]["loss"] < train_records[0]["loss"]
  assert [r["step"] for r in eval_records] == [30] and "loss" not in eval_records[0]
  assert glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*"))
  assert summary["step"] == 30
  # The console: a line per checkpoint (the last step's only here), and the end of the run with where things are.
  err = capsys.readouterr().err
  assert f"checkpoint: step 30 to {tmp_path}/checkpoints/30" in err
  finished = [line for line in err.splitlines() if "finished: 30 steps (1-30)" in line]
  assert len(finished) == 1 and f"{30 * 8 * 64:,} tokens" in finished[0], err
  assert f"loss {train_records[-1]['loss']:.4f}, eval_loss {eval_records[0]['eval_loss']:.4f}" in finished[0]
  assert f"metrics {tmp_path}/metrics.jsonl" in finished[0]
  # Run again, it says it has nothing to do, and does nothing.
  train(checked(cfg))
  err = capsys.readouterr().err
  assert f"finished already: the newest checkpoint in {tmp_path}/checkpoints is at step 30" in err, err
  assert "finished: " not in err and len(open(os.path.join(tmp_path, "metrics.jsonl")).readlines()) == len(records)
  # A new run in another workdir from this run's checkpoint, to a step it has passed: it names that checkpoint, not
  # its own (empty) checkpoint directory.
  train(checked(config("tiny", **{"workdir": f"{tmp_path}/other", "checkpoint.restore_from": f"{tmp_path}/checkpoints",
                                  **keys})))
  err = capsys.readouterr().err
  assert f"finished already: the checkpoint of checkpoint.restore_from ({tmp_path}/checkpoints) is at step 30" in err


def _moe_records(tmp_path, every: int) -> list[dict]:
  cfg = config("tiny_moe", **{"workdir": str(tmp_path / f"every_{every}"), "steps": 10, "log.every_steps": every,
                              "checkpoint.every_steps": 0, "model.capacity_factor": 0.5})
  train(checked(cfg))
  return [json.loads(line) for line in open(tmp_path / f"every_{every}" / "metrics.jsonl") if '"loss"' in line]


@pytest.mark.extended
def test_moe_token_counts_are_summed_over_every_step_of_a_log_interval(tmp_path):
  """Capacity 0.5 drops copies on every step; logged every 10 steps, step 10's record holds the drops and
  routed copies of steps 1-10, as the same run logged every step shows them."""
  every_step, every_ten = _moe_records(tmp_path, 1), _moe_records(tmp_path, 10)
  assert [r["step"] for r in every_ten] == [10] and len(every_step) == 10
  assert all(r["moe_dropped_tokens"] > 0 for r in every_step[:9])  # Steps the second run does not log.
  for key in ("moe_dropped_tokens", "moe_routed_tokens", "moe_overflow_tokens"):
    assert every_ten[0][key] == sum(r[key] for r in every_step), key
  assert [r["loss"] for r in every_step][-1] == every_ten[0]["loss"]


def test_overflow_warnings_name_the_layers_and_steps():
  counts = MoeCounts()
  zero = {"moe_dropped_tokens": 0.0, "moe_routed_tokens": 8.0, "moe_overflow_tokens": 0.0,
          "moe_dropped_tokens_by_layer": np.zeros(3), "moe_overflow_tokens_by_layer": np.zeros(3)}
  counts.add(10, zero)
  counts.add(11, {**zero, "moe_overflow_tokens": 5.0, "moe_overflow_tokens_by_layer": np.array([0.0, 2.0, 3.0])})
  ragged = moe_dispatch.Plan("ragged", "ragged_dot", ("expert",), 8, 1, 64, None, 96, 96, 0)
  record, warnings = counts.take(12, ragged)
  assert record == {"moe_dropped_tokens": 0.0, "moe_routed_tokens": 16.0, "moe_overflow_tokens": 5.0}
  assert warnings == ["steps 11-12: 5 MoE token copies did not fit the ragged exchange's receive buffer (raise "
                      "config.model.moe_ragged_buffer) (layer 1: 2, layer 2: 3); their expert outputs are zero"]
  assert counts.take(13) == ({}, [])
  # One device's several experts on a GPU: the capacity layout's slots overflow, sized by another setting.
  counts.add(19, {**zero, "moe_overflow_tokens": 1.0, "moe_overflow_tokens_by_layer": np.array([1.0, 0.0, 0.0])})
  slots = moe_dispatch.Plan("local", "capacity", (), 1, 8, 64, None, 0, 128, 32)
  assert counts.take(20, slots)[1] == ["step 20: 1 MoE token copies did not fit the capacity layout's slots (raise "
                                       "config.model.moe_expert_buffer, or set config.model.moe_expert_gemm="
                                       "ragged_dot) (layer 0: 1); their expert outputs are zero"]


@pytest.mark.extended
def test_qwen3_30b_a3b_shapes_at_reduced_size_train(tmp_path):
  """The qwen3_30b_a3b preset (QK-norm, head_dim apart from d_model / heads, top-8 of many experts, renormalised)
  shrunk to CPU size trains with 2 micro-batches a step, and its loss falls: the last three steps' mean below the
  first three's (about ln 256) by a clear margin. (Two single steps late in the run compare within the batches'
  noise: step 12's loss came out above step 6's.)"""
  small = {"model.num_layers": 2, "model.d_model": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
           "model.head_dim": 32, "model.d_ff": 32, "model.num_experts": 16, "model.vocab_size": 256,
           "model.seq_len": 32, "train.batch_size": 16, "train.grad_accum_steps": 2, "train.warmup_steps": 2,
           "train.learning_rate": 3e-3}
  cfg = config("qwen3_30b_a3b", **{"workdir": str(tmp_path), "steps": 12, "log.every_steps": 1,
                                   "checkpoint.every_steps": 0, "quant.recipe": "fp8_current", **small})
  assert cfg.model.qk_norm and cfg.model.experts_per_token == 8 and cfg.model.router_softmax_first
  train(checked(cfg))
  losses = [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
  assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses


def test_a_warm_up_longer_than_the_run_is_warned_about(capsys):
  """llama3_8b's 2,000 warm-up steps under configs/default.py's 200: the learning rate never reaches its peak."""
  from ember.trainer.loop import _warn_of_the_warm_up
  from tests.helpers import settings
  _warn_of_the_warm_up(settings("tiny", steps=200, **{"train.warmup_steps": 2000}))
  assert ("warning: train.warmup_steps=2000 is longer than the run (steps=200): the learning rate rises to 10% of "
          "train.learning_rate") in capsys.readouterr().err
  _warn_of_the_warm_up(settings("tiny", steps=200, **{"train.warmup_steps": 200}))
  assert "warning" not in capsys.readouterr().err
