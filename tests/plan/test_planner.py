"""The layout planner (ember/plan/planner.py, ember.tools.plan): what it enumerates, what it compiles, what it picks."""

import json
import math
import os

import matplotlib.image
import pytest

from ember import config as config_lib
from ember.parallel import pipeline
from ember.plan import isolated, planner
from ember.plan import target as target_lib
from ember.plan.compile import compile_report
from ember.tools import plan as tool
from ember.xla_flags import REQUIRED_XLA_FLAGS, user_xla_flags
from tests.helpers import ROOT, loaded

needs_plugin = pytest.mark.skipif(not target_lib.plugin_available(),
                                  reason="JAX's CUDA plugin is not installed (launch/install_compile_plugin.sh)")


def _cfg(name, *flags):
  return loaded(["plan", f"--config={ROOT}/configs/default.py:{name}", "--config.data.source=synthetic", *flags])


def test_layouts_follow_the_model_and_the_cluster():
  """tiny_moe (4 heads, 2 kv heads, 4 experts), batch 16, on two nodes of 8: every layout fills each node and the
  node count, splits heads, experts and the batch evenly, and every split of each is there."""
  cfg = _cfg("tiny_moe", "--config.train.batch_size=16")
  target = target_lib.parse("h100x16")
  found = planner.layouts(cfg, target)
  assert len(set(found)) == len(found)
  seen = set()
  for lay in found:
    node, dcn, mesh = dict(lay.node), dict(lay.dcn), lay.mesh()
    assert math.prod(node.values()) == 8 and math.prod(dcn.values()) == 2 and math.prod(mesh.values()) == 16
    assert 4 % node["tensor"] == 0 and 4 % mesh["expert"] == 0  # Past 2, the kv heads are copied (tensor 4).
    shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    assert 16 % (shards * lay.grad_accum_steps) == 0
    seen.add((node["tensor"], node["expert"], tuple(sorted(dcn.items())), lay.grad_accum_steps, lay.remat))
  assert {t for t, *_ in seen} == {1, 2, 4} and {e for _, e, *_ in seen} == {1, 2, 4}
  assert {d for *_, d, _, _ in seen} == {(("data", 2), ("expert", 1), ("fsdp", 1), ("pipeline", 1)),
                                         (("data", 1), ("expert", 1), ("fsdp", 2), ("pipeline", 1)),
                                         (("data", 1), ("expert", 2), ("fsdp", 1), ("pipeline", 1)),
                                         (("data", 1), ("expert", 1), ("fsdp", 1), ("pipeline", 2))}
  # Two stages (one per node) split the 2 layers, under each schedule; GPipe's micro-batches divide over them.
  piped = [lay for lay in found if dict(lay.dcn)["pipeline"] == 2]
  assert {lay.schedule for lay in piped} == {"gpipe", "1f1b"}
  assert all(lay.grad_accum_steps % 2 == 0 for lay in piped if lay.schedule == "gpipe")
  assert {lay.schedule for lay in found if lay not in piped} == {"gpipe"}
  presets = planner.presets(cfg)
  assert {r for *_, r in seen} == set(presets) and "save_quantized_offloaded" not in presets
  # The flags say the whole layout, and read back as it.
  lay = found[-1]
  back = config_lib.load(["plan", f"--config={ROOT}/configs/default.py:tiny_moe", *lay.flags()])
  assert {a: back.mesh[a] for a in planner.MESH} == {"data": 1, **dict(lay.node)}
  assert {a: back.mesh[f"dcn_{a}"] for a in ("pipeline", "data", "fsdp", "expert")} == dict(lay.dcn)
  assert (back.train.grad_accum_steps, back.remat.policy) == (lay.grad_accum_steps, lay.remat)


def test_interleaved_layouts_take_each_chunk_count_that_divides_a_stage():
  """tiny (4 layers) on two nodes: two stages of 2 layers, so interleaved 1F1B with 2 chunks a stage; its flags
  read back as it."""
  found = planner.layouts(_cfg("tiny", "--config.train.batch_size=16", "--config.model.num_layers=4"),
                          target_lib.parse("h100x16"))
  piped = [lay for lay in found if dict(lay.dcn)["pipeline"] == 2]
  assert {(lay.schedule, lay.virtual_stages) for lay in piped} == {("gpipe", 1), ("1f1b", 1),
                                                                   ("interleaved_1f1b", 2)}
  lay = next(lay for lay in piped if lay.virtual_stages == 2)
  back = config_lib.load(["plan", f"--config={ROOT}/configs/default.py:tiny", "--config.model.num_layers=4",
                          *lay.flags()])
  assert (back.pipeline.schedule, back.pipeline.virtual_stages) == ("interleaved_1f1b", 2)
  assert all(lay.grad_accum_steps % 2 == 0 for lay in piped if lay.virtual_stages == 2)
  # Each layout's flags, added to a command that asks for interleaving, lay the config out as `apply` does (a 1F1B
  # winner's flags said nothing of the chunks, and train.py refused the pair).
  base = ["--config.model.num_layers=4", "--config.train.batch_size=16", "--config.data.source=synthetic",
          "--config.pipeline.schedule=interleaved_1f1b", "--config.pipeline.virtual_stages=2"]
  cfg = _cfg("tiny", *base)
  for lay in piped:
    back = config_lib.validate(config_lib.load(["plan", f"--config={ROOT}/configs/default.py:tiny", *base,
                                                *lay.flags()]), None)
    assert back.pipeline == lay.apply(cfg).pipeline and back.mesh == lay.apply(cfg).mesh


def test_uneven_stages_are_planned_where_their_padding_is_small():
  """Stages that do not divide the blocks pad them (pipeline.padded_blocks); the planner takes the chunk counts whose
  padding is at most 5% of the blocks. Llama 3.1 405B's 126 layers in 8 stages: 128 rows with 1, 2, 4 or 8 chunks a
  stage, 144-168 with 3, 5, 6 or 7; Llama 3 70B's 80 divide by 8 x 2 and 8 x 5 alone; Qwen3-235B's 94: 96 rows
  with 1, 2, 3, 4 or 6."""
  assert [pipeline.padded_blocks(126, 8, v) for v in range(1, 9)] == [128, 128, 144, 128, 160, 144, 168, 128]
  contiguous = [("gpipe", 1), ("1f1b", 1)]
  interleaved = lambda *vs: [("interleaved_1f1b", v) for v in vs]
  assert planner._schedules(8, 126) == contiguous + interleaved(2, 4, 8)
  assert planner._schedules(8, 80) == contiguous + interleaved(2, 5)
  assert planner._schedules(8, 94) == contiguous + interleaved(2, 3, 4, 6)
  assert planner._schedules(16, 61) == contiguous + interleaved(2)  # 64 rows (4.9%); 3 x 16 chunks > 61.
  assert planner._schedules(16, 59) == []  # 64 rows: 8.5% padding.


def test_select_spans_the_splits_of_a_node():
  """Three splits of a node, estimated fastest first in split A: one of each before a second of any."""
  lay = lambda split, accum: planner.Layout((("fsdp", split),), (("data", 1), ("fsdp", 1), ("expert", 1)), accum, "full")
  est = lambda s: planner.Estimate(s, s, 0.0, 1.0)
  estimates = {lay(8, 1): est(1), lay(8, 2): est(2), lay(8, 4): est(3), lay(4, 1): est(5), lay(2, 1): est(4)}
  assert planner.select(list(estimates), estimates, 4) == [lay(8, 1), lay(2, 1), lay(4, 1), lay(8, 2)]
  assert planner._halved(lay(8, 1), list(estimates)) == lay(8, 2) and planner._halved(lay(4, 1), list(estimates)) is None


def test_the_winners_split_gets_its_next_layout_by_estimate():
  """After the rounds, the winner's split of a node gets one more compile: its fastest layout by estimate not yet
  compiled (split A's third here: its second was compiled as the first's retry), none where every layout of the
  split was compiled; other splits' layouts are not its."""
  lay = lambda split, accum, remat="full": planner.Layout((("fsdp", split),), (("data", 1), ("fsdp", 1), ("expert", 1)),
                                                         accum, remat)
  est = lambda s: planner.Estimate(s, s, 0.0, 1.0)
  estimates = {lay(8, 1, "save_qkv_proj"): est(1), lay(8, 1): est(2), lay(8, 2, "save_qkv_proj"): est(3),
               lay(8, 4): est(4), lay(4, 1): est(1.5)}
  best = lay(8, 1)
  compiled = {lay(8, 1, "save_qkv_proj"): {"fits": False}, best: {"fits": True}, lay(4, 1): {"fits": True}}
  assert planner._runner_up(best, compiled, list(estimates), estimates) == lay(8, 2, "save_qkv_proj")
  compiled.update({lay(8, 2, "save_qkv_proj"): {}, lay(8, 4): {}})
  assert planner._runner_up(best, compiled, list(estimates), estimates) is None


def test_select_takes_the_fewest_micro_batches_where_estimates_tie():
  """Layouts of one split bound by their GEMMs (the same estimated step): one micro-batch is compiled first though
  it peaks highest, then two; of two layouts with as many micro-batches, the lower peak first."""
  lay = lambda accum, data=1: planner.Layout((("fsdp", 8),), (("data", data), ("fsdp", 1), ("expert", 1)), accum,
                                             "full")
  estimates = {lay(1): planner.Estimate(1.0, 1.0, 0.2, 9.0), lay(4): planner.Estimate(1.0, 1.0, 0.4, 3.0),
               lay(2, data=2): planner.Estimate(1.0, 1.0, 0.1, 6.0), lay(2): planner.Estimate(1.0, 1.0, 0.4, 5.0)}
  assert planner.select(list(estimates), estimates, 4) == [lay(1), lay(2), lay(2, data=2), lay(4)]


@needs_plugin
def test_the_layers_off_the_stages_count_on_the_busiest_stage():
  """deepseek_tiny with 5 layers, its first dense: two scan segments, the 4 MoE layers split into 2 stages and the
  dense one run beside stage 0's pair (ModelConfig.staged_segment). The estimate runs 3 layers a stage, 6 over the
  two stages; one stage of the whole 5 without a pipeline."""
  target = target_lib.parse("h100x2")
  node = lambda stages: (("pipeline", stages), ("fsdp", 2 // stages), ("tensor", 1), ("expert", 1))
  dcn = (("pipeline", 1), ("data", 1), ("fsdp", 1), ("expert", 1))
  with target_lib.targeting(target):
    estimator = planner.Estimator(_cfg("deepseek_tiny", "--config.model.mtp_depth=0", "--config.model.num_layers=5",
                                       "--config.train.batch_size=4"), target)
    assert estimator._rows(planner.Layout(node(2), dcn, 2, "full", "1f1b")) == 6
    assert estimator._rows(planner.Layout(node(1), dcn, 2, "full")) == 5


@needs_plugin
def test_experts_split_over_the_expert_axis_move_nothing_in_the_estimate():
  """tiny_moe on 4 GPUs, its batch split over `expert` alone: each device runs its own experts, so the estimate's
  collectives (the routed rows' exchange, the other weights' gradients) are the same whatever the experts' width.
  Before, the estimate gathered the experts over `expert` in every pass: deepseek_v3 with expert parallelism 64
  across nodes was estimated at 58 s of collectives a step, compiled at 32."""
  target = target_lib.parse("h100x4")
  lay = planner.Layout((("pipeline", 1), ("fsdp", 1), ("tensor", 1), ("expert", 4)),
                       (("pipeline", 1), ("data", 1), ("fsdp", 1), ("expert", 1)), 1, "full")
  with target_lib.targeting(target):
    network = {d_ff: planner.Estimator(_cfg("tiny_moe", "--config.train.batch_size=8", f"--config.model.d_ff={d_ff}"),
                                       target).estimate(lay).network_s for d_ff in (128, 512)}
  assert network[128] == network[512] > 0, network


@needs_plugin
def test_a_blocks_kernel_copies_are_counted_once_a_layer():
  """tiny under nvfp4: what `save_quantized` (and no remat) keeps of a layer's quantized kernels is one E2M1 copy of
  each projection kernel (half a byte an element, written out from the model's dimensions, and its 16 x 16 tiles'
  scales), and `full` keeps none; the estimate counts them for a device's share of the layers once, not per
  sequence of the micro-batch (deepseek_v3's 256 experts' copies, 10.5 GiB a layer, counted twice a sequence, had
  ruled out every layout with expert parallelism across nodes)."""
  cfg = _cfg("tiny", "--config.quant.recipe=nvfp4")
  with target_lib.targeting(target_lib.parse("h100x8")):
    blocks = planner._blocks(cfg, ("full", "save_quantized"))
  kernels = _kernel_elements(cfg.model)
  assert blocks["full"].residual_kernel_bytes == 0
  for copies in (blocks["save_quantized"].residual_kernel_bytes, blocks["full"].working_kernel_bytes):
    assert kernels / 2 <= copies < kernels / 2 + kernels / 256 + 64, (copies, kernels)
  assert blocks["save_quantized"].residual_bytes > 0


@needs_plugin
def test_kernels_quantized_once_a_step_are_counted_once_a_step():
  """tiny under fp8_current, whose kernels a step under a remat policy quantizes once (layers/linear.py's
  `once_a_step`): no layer keeps a kernel copy, and the estimate holds a device's share of two E4M3 copies of every
  projection kernel for the step (written out from the model's dimensions: its layers over FSDP 8); under bf16, one
  bf16 cast (two bytes an element) where micro-batches loop, none for one."""
  cfg = _cfg("tiny", "--config.quant.recipe=fp8_current")
  with target_lib.targeting(target_lib.parse("h100x8")):
    blocks = planner._blocks(cfg, ("full", "save_quantized"))
    estimator = planner.Estimator(cfg, target_lib.parse("h100x8"))
  assert blocks["full"].residual_kernel_bytes == blocks["save_quantized"].residual_kernel_bytes == 0
  lay = planner.Layout((("fsdp", 8),), (("data", 1), ("fsdp", 1), ("expert", 1)), 1, "full")
  copies = estimator._copies(estimator._leaves(lay)[2], lay)
  assert copies == 2 * _kernel_elements(cfg.model) * cfg.model.num_layers / 8
  # bf16 casts its kernels once a step where a loop of micro-batches reads them: one bf16 copy, and none without.
  cfg = _cfg("tiny", "--config.quant.recipe=bf16")
  estimator = planner.Estimator(cfg, target_lib.parse("h100x8"))
  looped = planner.Layout((("fsdp", 8),), (("data", 1), ("fsdp", 1), ("expert", 1)), 2, "full")
  assert estimator._copies(estimator._leaves(lay)[2], lay) == 0
  assert estimator._copies(estimator._leaves(looped)[2], looped) == (
      2 * _kernel_elements(cfg.model) * cfg.model.num_layers / 8)


def _kernel_elements(m) -> int:
  """A layer's projection kernels' elements (qkv, out, wi, wo), from the model's dimensions."""
  return (m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.num_heads * m.head_dim * m.d_model
          + 3 * m.d_model * m.d_ff)


@needs_plugin
@pytest.mark.extended
def test_plan_picks_the_fastest_compiled_layout_within_the_budget(tmp_path, capsys):
  out = tmp_path / "plan.json"
  args = ["plan", f"--config={ROOT}/configs/default.py:tiny", "--config.data.source=synthetic",
          "--config.quant.recipe=fp8_current", "--config.train.batch_size=16", "--target=h100x8", "--top=3",
          f"--out={out}", f"--plot={out.with_suffix('.png')}"]
  assert tool.main(args) == 0
  assert matplotlib.image.imread(str(out.with_suffix(".png"))).shape[0] > 100
  r = json.loads(out.read_text())
  best, fitting = r["best"], [c for c in r["candidates"] if c.get("fits")]
  assert len(r["candidates"]) >= 3 and best in fitting
  assert all(c["tokens_per_s_predicted"] <= c["tokens_per_s_ceiling"] for c in fitting)
  assert best["peak_bytes"] <= r["budget_bytes"] == int(0.9 * target_lib.parse("h100x8").device_memory_bytes)
  printed = capsys.readouterr().out
  assert "best on h100x8" in printed
  assert r["xla_flags"] == user_xla_flags(os.environ.get("XLA_FLAGS", ""))  # Ember's own flags are not listed.
  assert not any(f.split("=")[0] in REQUIRED_XLA_FLAGS for f in r["xla_flags"])
  assert f"compiled under XLA flags: {' '.join(r['xla_flags']) or 'none beyond'}" in printed
  # The winner's layout was compiled with no remat too (the estimate the planner trusts least).
  same = lambda c: (c["mesh"], c["dcn"], c["grad_accum_steps"]) == (best["mesh"], best["dcn"], best["grad_accum_steps"])
  assert any(same(c) and c["remat_policy"] == "none" for c in r["candidates"])
  # The winner's flags give the winner: the same compiled figures.
  again = compile_report(_cfg("tiny", "--config.quant.recipe=fp8_current", "--config.train.batch_size=16",
                              *best["flags"]), target_lib.parse("h100x8"))
  assert again["tokens_per_s_ceiling"] == pytest.approx(best["tokens_per_s_ceiling"])
  assert again["tokens_per_s_predicted"] == pytest.approx(best["tokens_per_s_predicted"])
  assert again["peak_bytes"] == best["peak_bytes"]


# tiny (2 layers), batch 2, remat full, on h100x2: every layout, written out by hand (node split, micro-batches,
# pipeline schedule). FSDP leaves one sequence a device (no accumulation); tensor and pipeline parallelism keep
# both sequences on each device (1 or 2 micro-batches); GPipe needs the micro-batches to fill the two stages.
EVERY_LAYOUT_OF_TINY_ON_TWO = {
    "fsdp 2": ("--config.mesh.fsdp=2",),
    "tensor 2": ("--config.mesh.tensor=2",),
    "tensor 2, 2 micro-batches": ("--config.mesh.tensor=2", "--config.train.grad_accum_steps=2"),
    "pipeline 2, 1f1b": ("--config.mesh.pipeline=2", "--config.pipeline.schedule=1f1b"),
    "pipeline 2, 1f1b, 2 micro-batches": ("--config.mesh.pipeline=2", "--config.pipeline.schedule=1f1b",
                                          "--config.train.grad_accum_steps=2"),
    "pipeline 2, gpipe, 2 micro-batches": ("--config.mesh.pipeline=2", "--config.pipeline.schedule=gpipe",
                                           "--config.train.grad_accum_steps=2"),
}


@needs_plugin
@pytest.mark.extended
def test_plan_names_the_winner_of_an_exhaustive_search(tmp_path):
  """Each layout of the hand-written list compiled here, on its own flags; the planner, given room to compile as
  many, finds exactly these layouts and names the fastest of them within the budget, with its figures."""
  target = target_lib.parse("h100x2")
  common = ("--config.quant.recipe=fp8_current", "--config.train.batch_size=2", "--config.remat.policy=full",
            "--config.remat.auto_candidates=('full',)")
  budget = planner.budget_bytes(target, None)
  reports = {name: compile_report(_cfg("tiny", *common, "--config.mesh.fsdp=1", *flags), target)
             for name, flags in EVERY_LAYOUT_OF_TINY_ON_TWO.items()}
  fitting = [name for name, r in reports.items() if r["peak_bytes"] <= budget]
  winner = max(fitting, key=lambda name: reports[name]["tokens_per_s_predicted"])
  out = tmp_path / "plan.json"
  assert tool.main(["plan", f"--config={ROOT}/configs/default.py:tiny", "--config.data.source=synthetic", *common,
                    "--target=h100x2", f"--top={len(reports)}", f"--out={out}"]) == 0
  r = json.loads(out.read_text())
  assert r["layouts"] == len(reports) and len([c for c in r["candidates"] if "fits" in c]) == len(reports)
  assert r["best"]["tokens_per_s_predicted"] == pytest.approx(reports[winner]["tokens_per_s_predicted"], rel=1e-9)
  # The planner's winner is the same layout: its flags read back as the hand-written one's.
  picked = loaded(["plan", f"--config={ROOT}/configs/default.py:tiny", *common, *r["best"]["flags"]])
  expected = _cfg("tiny", *common, "--config.mesh.fsdp=1", *EVERY_LAYOUT_OF_TINY_ON_TWO[winner])
  same = lambda s: (s.mesh.pipeline, s.mesh.fsdp, s.mesh.tensor, s.train.grad_accum_steps, s.pipeline.schedule)
  assert same(picked) == same(expected), (winner, r["best"]["layout"])


@needs_plugin
def test_a_compile_that_aborts_its_process_fails_alone():
  """A layout whose compile ends in an XLA check failure (the process aborts: tensor 4 x data 2 x fsdp 4 across
  nodes with 2 micro-batches, on jax 0.10) is a CompileFailed with XLA's line, and the caller goes on."""
  cfg = _cfg("tiny", "--config.model.num_kv_heads=4", "--config.train.batch_size=32", "--config.mesh.fsdp=2",
             "--config.mesh.tensor=4", "--config.mesh.dcn_data=2", "--config.mesh.dcn_fsdp=4",
             "--config.train.grad_accum_steps=2")
  try:
    isolated.compile_report_isolated(cfg, target_lib.parse("h100x64"))
  except isolated.CompileFailed as e:
    assert str(e).startswith("the compile was killed by SIGABRT: ") and "Check failed" in str(e), e
  else:
    pytest.skip("this XLA compiles the layout: nothing aborts")
  # A child's own error comes back as its one line.
  with pytest.raises(isolated.CompileFailed, match="config.mesh: mesh .* has 3 devices but 8 are available"):
    isolated.compile_report_isolated(_cfg("tiny", "--config.mesh.fsdp=3"), target_lib.parse("h100x8"))


@needs_plugin
def test_plan_exits_1_when_nothing_fits_the_budget(capsys):
  args = ["plan", f"--config={ROOT}/configs/default.py:tiny", "--config.data.source=synthetic", "--target=h100x8",
          "--budget_gb=0.0001"]
  assert tool.main(args) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: --budget_gb: no layout is estimated within 0.0 GiB per device"), err


@pytest.mark.parametrize("budget", ["inf", "nan", "-1"])
def test_a_budget_that_is_no_number_of_gib_is_one_line_exit_2(budget, capsys):
  """inf compiled every layout and then failed converting it to bytes; nan ran as a budget nothing fits."""
  with pytest.raises(SystemExit) as e:
    tool.main(["plan", f"--config={ROOT}/configs/default.py:tiny", "--target=h100x8", f"--budget_gb={budget}"])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().startswith("error: --budget_gb: must be a finite number of GiB >= 0")


def test_a_plan_that_fits_nothing_still_writes_what_it_compiled(tmp_path, monkeypatch, capsys):
  """Exit 1 when no compiled layout fits, and --out holds the compiled candidates (`best` null): a large model's
  compiles take many minutes, and the next attempt starts from their peaks."""
  compiled = {"best": None, "candidates": [{"layout": "node fsdp=8", "fits": False, "peak_bytes": 90 * 2**30}]}

  def nothing_fits(*args, **kwargs):
    raise planner.NoLayoutFits("--budget_gb: no layout compiled within 71.2 GiB per device", compiled)

  monkeypatch.setattr(planner, "plan", nothing_fits)
  out = tmp_path / "plan.json"
  assert tool.main(["plan", f"--config={ROOT}/configs/default.py:tiny", "--config.data.source=synthetic",
                    "--target=h100x8", f"--out={out}"]) == 1
  assert json.loads(out.read_text()) == compiled
  assert capsys.readouterr().err.strip().endswith("error: --budget_gb: no layout compiled within 71.2 GiB per device")


@needs_plugin
def test_plan_turns_to_context_parallelism_where_whole_sequences_do_not_fit(monkeypatch):
  """Where no layout of whole sequences compiles within the budget, the plan compiles context-parallel ones and picks
  among them; the compile here is a stand-in whose peak is over the budget for whole sequences alone (the
  planner's rounds are under test, not XLA)."""
  compiled = []

  def report(settings, target, beat_s=None):
    context = settings.mesh.context
    compiled.append(context)
    return dict(tokens_per_s_predicted=1000.0 * context, mfu_predicted=0.1, predicted_step_s=1.0 / context,
                time_by_op=[], tokens_per_s_ceiling=2000.0, mfu_ceiling=0.2, time_floor_s=0.5,
                time_floor_parts_s={}, peak_bytes=(90 if context == 1 else 10) * 2**30)

  monkeypatch.setattr(planner, "compile_report_isolated", report)
  result = planner.plan(_cfg("tiny", "--config.model.seq_len=4096"), target_lib.parse("h100x8"), budget_gb=50,
                        top=2, log=lambda *_: None)
  first = compiled.index(next(c for c in compiled if c > 1))
  assert first > 0 and set(compiled[:first]) == {1} and 1 not in compiled[first:]
  assert result["best"]["mesh"]["context"] > 1 and result["best"]["fits"]


def test_plan_refuses_a_cpu_target(capsys):
  with pytest.raises(SystemExit) as e:
    tool.main(["plan", f"--config={ROOT}/configs/default.py:tiny", "--target=cpu"])
  assert e.value.code == 2
  assert "--target: the planner needs a GPU target" in capsys.readouterr().err


@needs_plugin
def test_context_layouts_split_each_sequence_inside_a_node():
  """Context-parallel layouts (`layouts(context=True)`, which `plan` adds where whole sequences do not fit): each
  splits every sequence over 2 to 8 devices of a node, none splits it where `context=False`, and together they are
  every split of a node. A context layout's estimate holds each device's share of its sequences: FSDP 4 x context 2
  holds the activations of FSDP 8 (as many tokens a device) and the balanced layout's attention bias and its
  gradient, 3/4 of the whole sequences' for as many tokens ([L/4, L/2] + [L/4, L] for each of two half sequences
  against [L, L] for one whole: 3/4 L^2 against L^2), and runs more (parallel/context.py)."""
  cfg = _cfg("tiny", "--config.model.seq_len=4096")
  target = target_lib.parse("h100x8")
  whole, split = planner.layouts(cfg, target), planner.layouts(cfg, target, context=True)
  assert {lay.mesh()["context"] for lay in whole} == {1}
  assert {lay.mesh()["context"] for lay in split} == {2, 4, 8}
  node_splits = lambda found: {tuple(n for a, n in lay.node if a != "fsdp") for lay in found}
  assert not node_splits(whole) & node_splits(split)
  estimator = planner.Estimator(cfg, target)
  plain = next(lay for lay in whole if dict(lay.node)["fsdp"] == 8 and lay.remat == "full"
               and lay.grad_accum_steps == 1)
  context = planner.Layout((("pipeline", 1), ("fsdp", 4), ("context", 2), ("tensor", 1), ("expert", 1)), plain.dcn,
                           1, "full")
  assert context in split
  a, b = estimator.estimate(plain), estimator.estimate(context)
  sequences = cfg.train.batch_size // 8  # A device's whole sequences under FSDP 8.
  bias = sequences * cfg.model.seq_len**2 * cfg.model.dtype.itemsize
  assert a.peak_bytes - b.peak_bytes == pytest.approx(2 * bias / 4, rel=1e-6)
  assert b.compute_s > a.compute_s  # Attention's balanced layout: 3/2 of the causal work.
  assert b.network_s > a.network_s  # Its keys and values gathered in every layer.
