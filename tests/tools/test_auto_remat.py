"""`remat.policy=auto`: the fastest preset whose compiled peak fits the budget (predicted where the GPU is known, else
the least recompute)."""

import jax
import pytest

from ember import config as config_lib
from ember.plan import auto_remat
from tests.helpers import config, start

CANDIDATES = ("none", "minimal_quantized", "save_quantized")


@pytest.mark.long
def test_auto_picks_the_least_recompute_preset_that_fits():
  cfg = config("tiny", **{"quant.recipe": "fp8_current", "mesh.fsdp": 1, "remat.policy": "auto",
                          "remat.memory_budget_gb": 1.0, "remat.auto_candidates": CANDIDATES})
  s = start(cfg)
  cfg, mesh, tx, schedule = s.cfg, s.mesh, s.tx, s.schedule
  found = {c.name: c for c in auto_remat.measure(cfg, mesh, tx, schedule, CANDIDATES)}  # Compiles each once.
  # Saving less costs recompute and buys memory, in this order.
  assert found["none"].flops < found["minimal_quantized"].flops < found["save_quantized"].flops
  assert found["none"].peak_bytes > found["minimal_quantized"].peak_bytes > found["save_quantized"].peak_bytes
  gib = auto_remat.GiB

  def budget_between(low, high):  # GiB, halfway between two peaks.
    return (found[low].peak_bytes + found[high].peak_bytes) / 2 / gib

  budgets = {found["none"].peak_bytes / gib: "none",  # Exactly the peak still fits.
             budget_between("minimal_quantized", "none"): "minimal_quantized",
             budget_between("save_quantized", "minimal_quantized"): "save_quantized"}
  for budget, expected in budgets.items():
    cfg = cfg.replace("remat.memory_budget_gb", budget)
    assert auto_remat.choose(cfg, mesh, tx, schedule) == expected, budget  # The real entry point (cached).
  cfg = cfg.replace("remat.memory_budget_gb", found["save_quantized"].peak_bytes * 0.9 / gib)
  with pytest.raises(config_lib.ConfigError) as err:
    auto_remat.choose(cfg, mesh, tx, schedule)
  message = str(err.value)
  assert message.startswith("config.remat.memory_budget_gb: no remat preset fits") and "\n" not in message
  assert f"smallest compiled peak is {found['save_quantized'].peak_bytes / gib:.4g} GiB (save_quantized)" in message


def test_pick_prefers_no_offloading_then_the_smaller_peak():
  c = auto_remat.Candidate
  found = [c("minimal_offloaded", 10.0, 100), c("minimal", 10.0, 300), c("full", 20.0, 50)]
  assert auto_remat.pick(found, 400 / auto_remat.GiB).name == "minimal"
  assert auto_remat.pick(found, 200 / auto_remat.GiB).name == "minimal_offloaded"
  assert auto_remat.pick(found, 60 / auto_remat.GiB).name == "full"


def test_pick_ranks_by_the_predicted_step_where_every_candidate_has_one():
  """Offloading recomputes nothing but waits for the host link: predicted slower than recomputing everything,
  it loses to `full` (llama3_8b on h100x8, scanned: 1.65 s against 1.06 s, docs/remat.md)."""
  c = auto_remat.Candidate
  found = [c("minimal_offloaded", 10.0, 100, 1.65), c("minimal", 10.0, 300, 0.92), c("full", 20.0, 50, 1.06)]
  assert auto_remat.pick(found, 400 / auto_remat.GiB).name == "minimal"
  assert auto_remat.pick(found, 200 / auto_remat.GiB).name == "full"
  found[2] = c("full", 20.0, 50)  # One without a prediction: the fewest FLOPs, as without a GPU.
  assert auto_remat.pick(found, 200 / auto_remat.GiB).name == "minimal_offloaded"


def test_default_candidates():
  cfg = config_lib.derive(config("tiny", **{"quant.recipe": "bf16"}), 1)
  names = auto_remat.candidates(cfg)
  assert "full" in names and "save_quantized" not in names  # Same as full without quantized matmuls.
  assert not any("offloaded" in n for n in names)  # The CPU backend cannot offload.
  assert "save_quantized" in auto_remat.candidates(cfg.replace("quant.recipe", "nvfp4"))


def test_a_budget_below_the_train_state_fails_before_compiling(capsys):
  """No preset can fit under the train state's own bytes: one line, before any compile or progress line."""
  s = start(config("tiny", **{"mesh.fsdp": 2, "remat.policy": "auto", "remat.memory_budget_gb": 1e-6}), 2)
  state = auto_remat.state_bytes_per_device(s.cfg, s.mesh, s.tx)
  assert state == sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(s.state))  # Exactly.
  capsys.readouterr()
  with pytest.raises(config_lib.ConfigError) as err:
    auto_remat.choose(s.cfg, s.mesh, s.tx, s.schedule)
  assert str(err.value) == (f"config.remat.memory_budget_gb: 1e-06 GiB per device is less than the train state alone "
                            f"({state / auto_remat.GiB:.4g} GiB per device: parameters, optimizer state); no remat "
                            "preset fits")
  assert not capsys.readouterr().err


def test_a_run_without_a_budget_fails_before_compiling():
  """`auto` needs a budget: the compile tools fill in the target's memory (tests/plan/test_target_compile.py), a run
  must say its own, and is told so in one line before any compile."""
  s = start(config("tiny", **{"remat.policy": "auto"}), 1)
  with pytest.raises(config_lib.ConfigError, match=r"^config\.remat\.memory_budget_gb: policy auto needs a budget > 0"):
    auto_remat.resolve(s.cfg, s.mesh)


@pytest.mark.long
def test_under_a_precision_schedule_each_preset_is_measured_in_every_phase():
  """fp8_current, then bf16 from half-way: a preset's peak is the larger of its two programs' (they keep different
  residuals: FP8 copies, or bf16 ones), its FLOPs the mean of theirs; a budget that only one phase's `none` fits
  does not choose it."""
  over = {"quant.recipe": "fp8_current", "quant.schedule": ((0.5, {"recipe": "bf16"}),), "mesh.fsdp": 1,
          "remat.policy": "auto", "remat.memory_budget_gb": 1.0, "remat.auto_candidates": ("none", "full")}
  s = start(config("tiny", **over))
  cfg, mesh, tx, schedule = s.cfg, s.mesh, s.tx, s.schedule
  phases = auto_remat.phase_weights(cfg)
  assert [(p.quant.name, w) for p, w in phases] == [("fp8_current", 0.5), ("bf16", 0.5)]
  each = [{c.name: c for c in auto_remat.measure(p, mesh, tx, schedule, ("none", "full"))} for p, _ in phases]
  both = {c.name: c for c in auto_remat.measure_phases(cfg, mesh, tx, schedule, ("none", "full"))}
  for name in ("none", "full"):
    assert both[name].peak_bytes == max(e[name].peak_bytes for e in each)
    assert both[name].flops == pytest.approx(sum(e[name].flops for e in each) / 2)
  low, high = sorted(e["none"].peak_bytes for e in each)
  assert low < high
  cfg = cfg.replace("remat.memory_budget_gb", (low + high) / 2 / auto_remat.GiB)
  assert auto_remat.choose(cfg, mesh, tx, schedule) == "full"
