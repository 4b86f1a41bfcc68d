"""A short real run: metrics.jsonl holds every contract key, TensorBoard files exist, loss falls."""

import glob
import json
import os

from ember.trainer.loop import train
from tests.helpers import config

CONTRACT_KEYS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"}


def test_short_run_writes_metrics_and_tensorboard(tmp_path):
  cfg = config("tiny", **{"workdir": str(tmp_path), "steps": 30, "log.every_steps": 10, "log.tensorboard": True,
                          "train.eval_every_steps": 30, "train.eval_batches": 2, "train.warmup_steps": 5,
                          "checkpoint.every_steps": 0, "quant.recipe": "fp8_current", "train.learning_rate": 3e-3})
  summary = train(cfg)
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
