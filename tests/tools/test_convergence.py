"""`python -m ember.tools.convergence`: every variant x seed a real train.py process; each variant's late loss gap
to bf16 paired by seed, with its standard error, checked against the runs' own metrics and against hand-worked
values."""

import json
import math
import os
import re
import statistics

import matplotlib.image
import pytest

from ember.errors import ConfigError
from ember.tools import convergence, sweep
from ember.trainer.metrics import read_records
from tests.helpers import ROOT
from tests.xla_cpu import FAST_CPU_CODEGEN



def test_gaps_are_paired_by_seed_with_their_standard_error():
  late = {"bf16": {0: 2.0, 1: 4.0, 2: 3.0}, "fp8": {0: 2.02, 1: 4.0, 2: 3.03}, "broken": {0: 2.2, 1: None, 2: None}}
  g = convergence.gaps(late)
  # fp8: gaps +1%, 0%, +1% -> mean 2/3 %, sample sd 0.5774 %, over sqrt(3).
  assert g["fp8"]["gap"] == pytest.approx(0.02 / 3) and g["fp8"]["seeds"] == 3
  assert g["fp8"]["standard_error"] == pytest.approx(0.005773503 / math.sqrt(3))
  assert g["bf16"]["gap"] == 0 and g["fp8"]["late_loss"] == pytest.approx(3.0166667)
  assert g["broken"] == {"gap": pytest.approx(0.1), "standard_error": None, "seeds": 1, "late_loss": 2.2}


def test_late_loss_is_the_mean_over_the_last_steps():
  records = [{"step": s, "loss": float(s)} for s in range(1, 21)] + [{"step": 20, "eval_loss": 0.0}]
  assert convergence.late_loss(records, 20, 0.1) == 19.5  # Steps 19 and 20.
  assert convergence.late_loss(records, 20, 1.0) == 10.5


def test_bad_variants_are_one_line(tmp_path):
  with pytest.raises(ConfigError, match="--variant=nvfp4: expected NAME:KEY=VALUE"):
    convergence.parse_variant("nvfp4")
  assert convergence.parse_variant("x:quant.recipe=nvfp4;config.quant.exclude=(\"lm_head\", \"layers[0]\")") == (
      "x", {"quant.recipe": "nvfp4", "quant.exclude": '("lm_head", "layers[0]")'})
  with pytest.raises(ConfigError, match="--variants: unknown 'fp7'"):
    convergence._parse([f"--config={ROOT}/configs/default.py:tiny", "--steps=2", "--out=/tmp/x", "--variants=fp7"])
  # Overrides of what each run sets itself were overwritten without a word.
  for flag, says in (("--config.quant.recipe=mxfp8", "(every variant)"), ("--config.seed=3", "(--seeds)"),
                     ("--config.steps=9", "(--steps)")):
    key = flag.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}: the comparison sets it for each run {re.escape(says)}"):
      convergence._parse([f"--config={ROOT}/configs/default.py:tiny", "--steps=2", "--out=/tmp/x", flag])
  # A key some variants set stays the user's in the others (nvfp4_paper's exclude; fp8_current keeps this one).
  convergence._parse([f"--config={ROOT}/configs/default.py:tiny", "--steps=2", f"--out={tmp_path}",
                      "--config.quant.exclude=('lm_head', 'layers[0]')"])


@pytest.mark.extended
def test_a_convergence_run_reports_each_variants_gap(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", FAST_CPU_CODEGEN)
  out = tmp_path / "conv"
  assert convergence.main(["convergence", f"--config={ROOT}/configs/default.py:tiny", "--steps=6", "--seeds=2",
                           "--variants=fp8_current", "--variant=fp8_lm_head:quant.recipe=fp8_current;quant.exclude=()",
                           "--late=0.5", f"--out={out}", "--config.data.source=synthetic"]) == 0
  report = json.loads((out / "convergence.json").read_text())
  assert list(report["variants"]) == ["bf16", "fp8_current", "fp8_lm_head"]
  assert [(r["variant"], r["seed"], r["status"]) for r in report["runs"]] == [
      (v, s, "ok") for s in (0, 1) for v in ("bf16", "fp8_current", "fp8_lm_head")]
  late = {}
  for r in report["runs"]:  # Recomputed from each run's metrics.jsonl: the mean of steps 4-6.
    losses = [x["loss"] for x in read_records(f"{r['workdir']}/metrics.jsonl") if x.get("step", 0) > 3 and "loss" in x]
    assert len(losses) == 3
    late[r["variant"], r["seed"]] = statistics.fmean(losses)
    assert r["late_loss"] == pytest.approx(late[r["variant"], r["seed"]])
  assert late["bf16", 0] != late["bf16", 1]  # The seeds differ.
  for name in ("fp8_current", "fp8_lm_head"):
    paired = [late[name, s] / late["bf16", s] - 1 for s in (0, 1)]
    assert report["variants"][name]["gap"] == pytest.approx(statistics.fmean(paired))
    assert report["variants"][name]["standard_error"] == pytest.approx(statistics.stdev(paired) / math.sqrt(2))
  table = (out / "convergence.md").read_text()
  assert "| fp8_lm_head |" in table and "(reference)" in table and table in capsys.readouterr().out
  assert matplotlib.image.imread(str(out / "convergence.png")).shape[0] > 100


def test_a_finished_run_is_kept_and_an_unfinished_one_runs_again(tmp_path):
  def write(name: str, last: int) -> None:
    (tmp_path / name).mkdir(parents=True)
    (tmp_path / name / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, last + 1)))
  write("bf16/seed0", 10)
  write("bf16/seed1", 7)  # Stopped at step 7 of 10.
  kept = convergence._finished(str(tmp_path), "bf16/seed0", 10)
  assert kept["status"] == "ok" and kept["workdir"] == str(tmp_path / "bf16/seed0")
  assert convergence._finished(str(tmp_path), "bf16/seed1", 10) is None
  assert convergence._finished(str(tmp_path), "bf16/seed2", 10) is None  # Never started.
  assert convergence._finished(str(tmp_path), "bf16/seed0", 20) is None  # Asked for more steps.


def test_runs_of_another_command_in_the_directory_are_refused(tmp_path, monkeypatch):
  """A directory holding a comparison of another config (or override, or step count) is not read as this one's;
  the same command spelled otherwise (the config's path, --out's, the overrides' order) is the same run."""
  monkeypatch.chdir(ROOT)
  variants, fixed = {"bf16": {"quant.recipe": "bf16"}}, {"data.source": "synthetic", "log.every_steps": "1"}
  (planned,) = convergence._runs("configs/default.py:tiny", variants, [0], 10, str(tmp_path), fixed)
  (tmp_path / "logs" / "bf16").mkdir(parents=True)
  ran = sweep.command("configs/default.py:tiny", fixed, planned[3], 10, str(tmp_path / "bf16" / "seed0"))
  (tmp_path / "logs" / "bf16" / "seed0.json").write_text(json.dumps(sweep.run_settings(ran)))
  monkeypatch.chdir(tmp_path)
  respelled = {"log.every_steps": "1", "data.source": "synthetic"}
  assert convergence._runs(f"{ROOT}/configs/default.py:tiny", variants, [0], 10, ".", respelled) == [
      ("bf16", 0, "bf16/seed0", planned[3])]
  with pytest.raises(ConfigError, match=r"^--out: \./bf16/seed0 holds a run of another command \(config=.*:tiny\)"):
    convergence._runs(f"{ROOT}/configs/default.py:small", variants, [0], 10, ".", respelled)
