"""ember.tools.precision_probe on a trained tiny checkpoint: deterministic, its errors what they say, and its
recommended quant.exclude under the target it states when measured again."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ember.inference.checkpoint import load_model
from ember.plan import probe as probe_lib
from ember.tools import precision_probe
from ember.trainer.state import split_model
from flax import nnx
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  run = tmp_path_factory.mktemp("probe") / "run"
  p = subprocess.run([sys.executable, "train.py", "--config=configs/default.py:tiny", "--config.steps=20",
                      f"--config.workdir={run}", "--config.train.eval_every_steps=0", "--config.log.tensorboard=false"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  return str(run)


def test_the_probe_is_deterministic_and_its_exclude_meets_its_target(checkpoint, tmp_path):
  target = 0.03  # Under nvfp4's whole-model error at this checkpoint: the probe must exclude something.
  outs = [tmp_path / "a.json", tmp_path / "b.json"]
  for out in outs:
    assert precision_probe.main(["probe", f"--checkpoint={checkpoint}", "--recipe=nvfp4",
                                 f"--target_error={target}", f"--out={out}"]) == 0
  first, second = (json.loads(o.read_text()) for o in outs)
  assert first == second  # Bit for bit, not within a point.
  kinds = {(r["layer"], r["kind"]) for r in first["projections"]}
  assert kinds == {(layer, kind) for layer in (0, 1) for kind in ("qkv", "out", "wi", "wo")}  # The head is bf16.
  assert first["whole_model_grad_error"] > target and first["exclude_grad_error"] < target
  assert first["exclude"][0] == "lm_head" and len(first["exclude"]) > 1
  worst = max(first["projections"], key=lambda r: r["grad_error"])
  assert first["exclude"][1] == f"layers[{worst['layer']}].{worst['kind']}"  # Worst first.

  # Measured again, from scratch, with the recommended list.
  trained, _, model = load_model(checkpoint, what="test", recipe="bf16", one_device=True)
  _, params, quant_state, _ = split_model(model)
  probe = probe_lib.Probe(trained, nnx.to_pure_dict(params), nnx.to_pure_dict(quant_state), 2)
  settings = trained.replace("quant.recipe", "nvfp4").replace("quant.exclude", tuple(first["exclude"]))
  again = probe.whole_error(probe.gradients(settings))
  assert again == first["exclude_grad_error"] < target


def test_errors_against_their_definitions(checkpoint):
  """fp8_current's weight error of a kernel is |Q(W) - W| / |W| with W's per-tensor E4M3 scale, computed here in
  NumPy from the rounding rule; nvfp4's is several times larger."""
  import ml_dtypes
  trained, _, model = load_model(checkpoint, what="test", recipe="bf16", one_device=True)
  _, params, _, _ = split_model(model)
  w = np.asarray(nnx.to_pure_dict(params)["segments"][0]["blocks"]["layers"][0]["mlp"]["wo"]["kernel"][1],
                 np.float32)  # Layer 1's [mlp, embed] kernel.
  scale = 448.0 / np.max(np.abs(w))
  q = (w * scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / scale
  want = np.linalg.norm(q - w) / np.linalg.norm(w)
  got = probe_lib.weight_error(w, ("mlp", "embed"), "fp8_current")
  assert got == pytest.approx(want, rel=1e-5)
  assert probe_lib.weight_error(w, ("mlp", "embed"), "nvfp4") > 3 * got  # 4 bits against 8: ~4x.
