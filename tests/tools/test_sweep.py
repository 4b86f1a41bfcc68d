"""`python -m ember.tools.sweep`: a grid of real train.py processes, failures recorded, three files."""

import csv
import json
import math

import matplotlib.image
import pytest

from ember.tools import sweep
from tests.helpers import ROOT
from tests.xla_cpu import FAST_CPU_CODEGEN

GRID = ["--grid=remat.policy=none,full,save_quantized", "--grid=quant.recipe=bf16,fp8_current"]
# One CPU device per run, cheaper code generation; synthetic data so no run reads files.


@pytest.mark.long
def test_sweep_runs_every_combination_and_records_a_failure(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", FAST_CPU_CODEGEN)
  out = tmp_path / "sweep"
  # The injected failure: this combination's workdir is taken by a file, so its train.py dies.
  broken = {"remat.policy": "full", "quant.recipe": "bf16"}
  out.mkdir()
  (out / sweep.combo_name(broken)).write_text("not a directory")
  assert sweep.main(["sweep", f"--config={ROOT}/configs/default.py:tiny", *GRID, "--steps=3", f"--out={out}",
                     "--config.data.source=synthetic", "--config.model.seq_len=16"]) == 0
  assert "5/6 runs finished" in capsys.readouterr().out

  results = json.loads((out / "results.json").read_text())["results"]
  assert [r["overrides"] for r in results] == [{"remat.policy": p, "quant.recipe": q}
                                               for p in ("none", "full", "save_quantized")
                                               for q in ("bf16", "fp8_current")]
  for r in results:
    if r["overrides"] == broken:
      assert r["status"] == "error" and r["returncode"] == 2 and "config.workdir" in r["error"]
      continue
    assert r["status"] == "ok", r
    assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and math.isfinite(r["final_loss"])
    assert r["peak_bytes"] > 0 and r["peak_source"] == "compiled"  # CPU devices keep no peak statistic.
  # Remat changes memory, not numbers: the same final loss under every policy of a recipe.
  for recipe in ("bf16", "fp8_current"):
    losses = [r["final_loss"] for r in results if r["status"] == "ok" and r["overrides"]["quant.recipe"] == recipe]
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-5), losses
  by_policy = {r["overrides"]["remat.policy"]: r for r in results
               if r["overrides"]["quant.recipe"] == "fp8_current"}
  assert by_policy["save_quantized"]["peak_bytes"] < by_policy["none"]["peak_bytes"]

  rows = list(csv.DictReader(open(out / "results.csv")))
  assert len(rows) == 6 and {"remat.policy", "quant.recipe", "status", "step_time_s", "tokens_per_s", "peak_bytes",
                             "peak_source", "final_loss"} <= set(rows[0])
  assert [r["status"] for r in rows].count("ok") == 5
  assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Each run saved no checkpoint (the sweep turns checkpointing off).
  for r in results:
    if r["status"] == "ok":
      assert not list((out / sweep.combo_name(r["overrides"]) / "checkpoints").iterdir())


def test_summary_skips_the_first_interval_and_classifies_out_of_memory():
  records = [{"step": 1, "loss": 5.0, "step_time_s": 9.0, "tokens_per_s": 100.0},
             {"step": 2, "loss": 4.0, "step_time_s": 2.0, "tokens_per_s": 450.0},
             {"step": 2, "eval_loss": 4.5},
             {"step": 3, "loss": 3.0, "step_time_s": 4.0, "tokens_per_s": 225.0, "peak_bytes": 7,
              "peak_source": "device"}]
  s = sweep.summarize(records)
  assert s["step_time_s"] == 3.0 and s["tokens_per_s"] == 300.0 and s["final_loss"] == 3.0
  assert s["peak_bytes"] == 7 and s["peak_source"] == "device"
  assert sweep.classify(1, "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
                           "trying to allocate 3.2GiB") == "oom"
  assert sweep.classify(1, "ValueError: bad shape") == "error" and sweep.classify(0, "") == "ok"
  # What the run printed, not its command: an --out named for an OOM study made every failed run `oom`.
  log = ("python train.py --config.workdir=/runs/OOM-study/a\n[10:00:00] ember: starting (--config.workdir="
         "/runs/OOM-study/a); loading JAX\nerror: config.mesh.data: mesh.data=3 (3) does not divide the 1 devices")
  assert sweep.classify(2, sweep._printed(log)) == "error"
  assert sweep.classify(1, sweep._printed(log)) == "error"


@pytest.mark.parametrize("flags,expected", [
    (["--grid=remat.policy"], "error: --grid=remat.policy: expected KEY=V1,V2,..."),
    # What the sweep sets itself is no grid key or override (each run trained --steps steps, labelled otherwise).
    (["--grid=steps=3,6"], "error: --grid=steps=3,6: steps is the sweep's own (--steps)"),
    (["--grid=remat.policy=full", "--config.workdir=/tmp/w"],
     "error: --config.workdir: the sweep sets it for each run (each run's is OUT/<combination>)"),
    # An override of a grid key was overwritten by the grid's values without a word.
    (["--grid=remat.policy=full,minimal", "--config.remat.policy=none"],
     "error: --config.remat.policy: the sweep sets it for each run (--grid=remat.policy=...)")])
def test_bad_grid_exits_2(flags, expected, tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["sweep", f"--config={ROOT}/configs/default.py:tiny", *flags, "--steps=3", f"--out={tmp_path}"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip() == expected


def test_a_sweep_refuses_a_combination_run_before(tmp_path, capsys):
  """A combination's workdir holding a run (metrics, checkpoints) would resume: no compile timed, or finished."""
  (tmp_path / "remat.policy=full").mkdir()
  (tmp_path / "remat.policy=full" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["sweep", f"--config={ROOT}/configs/default.py:tiny", "--grid=remat.policy=none,full", "--steps=3",
                f"--out={tmp_path}"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().startswith(f"error: --out: {tmp_path}/remat.policy=full holds an earlier run")


def test_curves_plot_train_and_eval_loss_per_combination(tmp_path):
  """The fidelity figure: one train and one eval line per run, from each workdir's metrics.jsonl."""
  grid = [("quant.recipe", ["bf16", "nvfp4"])]
  results, want = [], {}
  for i, recipe in enumerate(("bf16", "nvfp4")):
    workdir = tmp_path / recipe
    workdir.mkdir()
    train = [(s, 3.0 - 0.1 * s + 0.05 * i) for s in range(1, 11)]
    evals = [(5, 2.7 + i), (10, 2.2 + i)]
    records = ([{"step": s, "loss": loss, "step_time_s": 0.1, "tokens_per_s": 100.0} for s, loss in train]
               + [{"step": s, "eval_loss": loss} for s, loss in evals])
    (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    results.append({"overrides": {"quant.recipe": recipe}, "status": "ok", "workdir": str(workdir),
                    **sweep.summarize(records)})
    want[recipe] = (train, evals)
  assert [r["final_eval_loss"] for r in results] == [2.2, 3.2]
  fig = sweep.plot_curves(str(tmp_path / "curves.png"), grid, results)
  train_ax, eval_ax = fig.axes
  for ax, which in ((train_ax, 0), (eval_ax, 1)):
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["bf16", "nvfp4"]
    for line in lines:
      steps, losses = zip(*want[line.get_label()][which])
      assert list(line.get_xdata()) == list(steps) and list(line.get_ydata()) == list(losses), line.get_label()
  # A run's eval line takes its train line's colour.
  assert [line.get_color() for line in eval_ax.get_lines()] == [line.get_color() for line in train_ax.get_lines()]
  assert train_ax.get_ylabel() == "train loss" and eval_ax.get_ylabel() == "eval loss"
  image = matplotlib.image.imread(str(tmp_path / "curves.png"))
  assert image.shape[1] > image.shape[0] > 300  # Two panels side by side.


@pytest.mark.long
def test_a_sweep_with_no_run_finished_exits_1(tmp_path, monkeypatch):
  """A script or CI job can tell a sweep of failures from one that measured something."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  out = tmp_path / "sweep"
  out.mkdir()
  for policy in ("none", "full"):  # Each run's workdir taken by a file: train.py stops on its config.
    (out / sweep.combo_name({"remat.policy": policy})).write_text("not a directory")
  assert sweep.main(["sweep", f"--config={ROOT}/configs/default.py:tiny", "--grid=remat.policy=none,full",
                     "--steps=1", f"--out={out}", "--config.data.source=synthetic"]) == 1
  assert {r["status"] for r in json.loads((out / "results.json").read_text())["results"]} == {"error"}


def test_the_sweeps_check_leaves_unread_keys_to_each_runs_log(tmp_path, capsys):
  """A key some combinations do not read (quant.margin beside non-delayed recipes) is each such run's warning, in
  its own log; the check before the runs printed it once per combination, naming none."""
  grid = [("quant.recipe", ["bf16", "fp8_current", "fp8_delayed"])]
  sweep.check(f"{ROOT}/configs/default.py:tiny", grid, {"quant.margin": "1"}, 2, str(tmp_path))
  assert "warning" not in capsys.readouterr().err
