"""The train step compiled for described GPUs (no GPU here): FP8 GEMMs, cuDNN attention, memory, exit codes.

Needs JAX's CUDA plugin (launch/install_compile_plugin.sh; .ci/run installs it in a venv of its own and
runs this file there). Without it every test here skips with that one reason."""

import collections
import json
import math
import os
import re
import subprocess
import sys

import jax
import matplotlib.image
import numpy as np
import pytest

from ember import remat
from ember.layers import glu, norm_kernel
from ember.program import cost, hlo
from ember.plan import target as target_lib
from ember.plan import compile as compile_plan
from ember.plan import step as step_plan
from ember.plan.compile import compile_report
from ember.names import EXPERT_GEMM_SCOPE, STACKED_ROW_SCOPE
from ember.quant import fused, fused_nvfp4
from ember.quant.gemm import CUDNN_BLOCK_SCALED_GEMM
from ember.trainer.optimizer import make_optimizer
from ember.trainer.perf import train_flops_per_step
from ember.tools import compile as tool
from tests.helpers import ROOT, loaded

pytestmark = pytest.mark.skipif(not target_lib.plugin_available(),
                                reason="JAX's CUDA plugin is not installed (launch/install_compile_plugin.sh)")

# These tests read what the compiled program does, not how it is scheduled: one compile each, not the second one that
# tells the scheduler ember's predicted times (tests/plan/test_schedule.py checks that one). Every compile here
# carries ONCE: a step that waits on its collectives would otherwise compile twice.
ONCE = "--config.train.schedule_by_prediction=false"
TINY = [f"--config={ROOT}/configs/default.py:tiny", "--config.data.source=synthetic", ONCE]
# The tiny model's scan body is one layer with 4 quantized projections (qkv, out, wi, wo); the LM head
# is excluded (bf16): its forward, dgrad and wgrad are the 3 bf16 GEMMs of every census below.
QUANTIZED_PROJECTIONS, HEAD_GEMMS = 4, 3
# llama3_8b unrolls its 32 layers (its preset's model.scan_layers); tests about something else compile the
# scanned program, which compiles in a fraction of the time.
SCANNED = ("--config.model.scan_layers=true",)
# The llama3_8b tests whose property holds for either program: scanned by default, and the preset's own unrolled
# program too with --extended.
BOTH_PROGRAMS = pytest.mark.parametrize("program", [pytest.param(SCANNED, id="scanned"),
                                                    pytest.param((), id="unrolled", marks=pytest.mark.extended)])


def census(**counts) -> dict:
  return {key: counts.get(key, 0) for key in ("fp8", "mxfp8", "nvfp4", "bf16", "f32", "emulated")}


def report(target, *flags):
  return compile_report(loaded(["compile", *TINY, *flags]), target_lib.parse(target))


def test_a_scheduled_config_fits_only_if_every_phase_fits():
  """The report's figures are phase 0's; its peak and fit are every phase's, each compiled as the run compiles it
  at its switch. Here the later phase (fp8_current, with its scales and quantization state) peaks higher than the
  first (bf16), and its peak, the phase compiled on its own, is the report's."""
  from ember.tools.compile import format_report
  r = report("h100x1", "--config.quant.recipe=bf16", "--config.quant.schedule=((0.5, {'recipe': 'fp8_current'}),)")
  alone = report("h100x1", "--config.quant.recipe=fp8_current")
  first, later = r["precision_phases"]
  assert r["recipe"] == "bf16" and r["gemms"]["fp8"] == 0
  assert (first["start"], first["recipe"], later["start"], later["recipe"]) == (0, "bf16", 100, "fp8_current")
  assert r["peak_bytes"] == later["peak_bytes"] == alone["peak_bytes"] > first["peak_bytes"]
  assert later["tokens_per_s_predicted"] == pytest.approx(alone["tokens_per_s_predicted"])
  text = format_report(r)
  assert "bf16 from step 0 (peak" in text and "fp8_current from step 100 (peak" in text


def test_a_peak_over_what_a_run_allocates_is_a_warning(monkeypatch):
  """A peak under the GPU's memory but over the share a run's allocator takes (90% under launch/xla_flags.sh)
  still fits by the contract's rule, and the report says the run will not."""
  from ember.tools.compile import format_report
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  r = report("h100x1")
  assert r["run_memory_bytes"] == int(r["device_memory_bytes"] * 0.5)
  assert "over the" not in format_report(r)
  r = dict(r, peak_bytes=int(r["device_memory_bytes"] * 0.75))
  assert r["fits"] and "but over the 39.6 GiB a run's allocator takes (50%" in format_report(r)


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])
def test_fp8_gemms_forward_dgrad_wgrad(recipe):
  r = report("h100x1", f"--config.quant.recipe={recipe}", "--config.remat.policy=none")
  assert r["gemms"] == census(fp8=3 * QUANTIZED_PROJECTIONS, bf16=HEAD_GEMMS), r["gemms"]


@pytest.mark.parametrize("policy", [p for p in remat.PRESETS if p != "none"])
def test_no_quantized_gemm_left_in_bf16_under_any_preset(policy):
  """Presets that recompute forward projections add FP8 GEMMs (recomputed from saved or re-quantized
  operands), never bf16 ones."""
  r = report("h100x1", "--config.quant.recipe=fp8_current", f"--config.remat.policy={policy}")
  assert r["gemms"]["bf16"] == HEAD_GEMMS and r["gemms"]["f32"] == 0, r["gemms"]
  assert 3 * QUANTIZED_PROJECTIONS <= r["gemms"]["fp8"] <= 4 * QUANTIZED_PROJECTIONS, r["gemms"]


def test_fsdp_keeps_dgrad_in_fp8():
  """With kernels sharded over 8 GPUs the dgrad GEMM still takes the FP8 kernel (gathered in 8 bits)."""
  for policy, fp8 in (("none", 12), ("save_quantized", 15), ("save_quantized_x_offloaded", 15)):
    r = report("h100x8", "--config.quant.recipe=fp8_delayed", "--config.mesh.fsdp=8", "--config.train.batch_size=16",
               f"--config.remat.policy={policy}")
    assert r["gemms"] == census(fp8=fp8, bf16=HEAD_GEMMS), (policy, r["gemms"])
    assert r["collectives"]["all-gather"] > 0 and r["collectives"]["reduce-scatter"] > 0


def _head_collectives(path, d_model: int, vocab: int, shards: int) -> collections.Counter:
  """Bytes a step each kind of collective moves of the head's weight [D, V] or its gradient (whole, or split
  `shards` ways along V), by (kind, dtype), read from the optimised program at `path`."""
  moved = collections.Counter()
  for c in hlo.collective_ops(path.read_text()):
    parts = re.findall(r"\w+\[[\d,]*\]", c.shape)  # A combined collective moves a tuple: each part apart.
    for part in parts:
      if part.split("[")[1] in (f"{d_model},{vocab}]", f"{d_model},{vocab // shards}]"):
        share = hlo.nbytes(part) / sum(hlo.nbytes(q) for q in parts)
        moved[c.kind, hlo.dtype_of(part)] += c.bytes_per_step * share
  return moved


def test_lm_head_gradient_is_reduced_once_a_step(tmp_path):
  """FSDP over 8 GPUs, the loss in 8 token chunks: the head's float32 gradient [64, 320] crosses the network once a
  step (each device's share summed over the chunks first), never once per chunk; its bf16 weight is gathered once
  (the loss runs the head in one pass: no backward recomputes its logits)."""
  path = tmp_path / "step.hlo"
  d_model, vocab = 64, 320  # A vocab no layer's shape shares: the head's collectives are found by shape.
  compile_report(loaded(["compile", *TINY, "--config.quant.recipe=fp8_current", "--config.mesh.fsdp=8",
                                   "--config.train.batch_size=16", f"--config.model.vocab_size={vocab}",
                                   "--config.train.loss_chunk_size=8"]),
                 target_lib.parse("h100x8"), hlo_out=str(path))
  moved = _head_collectives(path, d_model, vocab, 8)
  assert moved == {("reduce-scatter", "f32"): d_model * vocab * 4, ("all-gather", "bf16"): d_model * vocab * 2}, moved


def test_a_pipelined_step_reads_the_lm_head_once(tmp_path):
  """2 stages x FSDP 4, 1F1B over 4 micro-batches, each stage running the head on its share of each micro-batch:
  the head's float32 gradient is reduced once a step, as in a step without a pipeline, not once a micro-batch;
  bf16 [64, 320] is gathered twice a step, the head's weight and the embedding table [320, 64] that XLA gathers
  transposed for the lookups (both read once a step)."""
  path = tmp_path / "step.hlo"
  d_model, vocab = 64, 320
  compile_report(loaded(["compile", *TINY, "--config.quant.recipe=fp8_current", "--config.mesh.pipeline=2",
                         "--config.mesh.fsdp=4", "--config.mesh.data=1", "--config.train.batch_size=16",
                         "--config.train.grad_accum_steps=4", "--config.pipeline.schedule=1f1b",
                         f"--config.model.vocab_size={vocab}"]),
                 target_lib.parse("h100x8"), hlo_out=str(path))
  moved = _head_collectives(path, d_model, vocab, 4)
  assert moved == {("reduce-scatter", "f32"): d_model * vocab * 4, ("all-gather", "bf16"): 2 * d_model * vocab * 2}, \
      moved


def test_uneven_stages_run_their_padding_as_layers():
  """3 layers in 2 stages x FSDP 4 run 4 rows: the step executes the FLOPs of 4 layers for the model FLOPs of 3, and
  the report says so (`padding_layers`, `executed_over_model`)."""
  def piped(layers: int) -> dict:
    return compile_report(loaded(["compile", *TINY, "--config.mesh.pipeline=2", "--config.mesh.fsdp=4",
                                  "--config.mesh.data=1", "--config.train.batch_size=16",
                                  "--config.train.grad_accum_steps=4", "--config.pipeline.schedule=1f1b",
                                  f"--config.model.num_layers={layers}"]), target_lib.parse("h100x8"))
  three, four = piped(3), piped(4)
  assert (three["pipeline"]["padding_layers"], four["pipeline"]["padding_layers"]) == (1, 0)
  assert three["executed_flops"] == pytest.approx(four["executed_flops"], rel=1e-6)
  assert three["model_flops"] < four["model_flops"] and three["executed_over_model"] > four["executed_over_model"]


@pytest.mark.parametrize("target,recipe,gemm", [("h100x8", "fp8_current", "fp8"),
                                                  pytest.param("b200x8", "nvfp4", "nvfp4", marks=pytest.mark.extended)])
def test_accumulated_step_takes_each_kernel_amax_once(target, recipe, gemm, tmp_path):
  """4 micro-batches, FSDP over 8: the kernels' amax pass runs once a step, before the micro-batches' loop (not
  per layer and micro-batch), and every projection GEMM stays in the recipe's format (the casts stay in the loop,
  before the gather): FP8's per-tensor scales, NVFP4's tiles cast by their kernel (width 256: 16 x 16 tiles
  that divide among 8 GPUs)."""
  path = tmp_path / "step.hlo"
  width = ["--config.model.d_model=256", "--config.model.d_ff=512"] if recipe == "nvfp4" else []
  r = compile_report(loaded(["compile", *TINY, f"--config.quant.recipe={recipe}", "--config.mesh.fsdp=8",
                                      "--config.train.batch_size=32", "--config.train.grad_accum_steps=4", *width]),
                     target_lib.parse(target), hlo_out=str(path))
  p = hlo.Program(path.read_text())
  names = {k.name: p.by_name[k.name].op_name for k in hlo.memory_kernels(p)}
  amax = [k for k in hlo.memory_kernels(p)
          if "quantize_weight" in names[k.name] and names[k.name].endswith("reduce_max")]
  assert amax and all(k.times == 1 for k in amax), [(k.name, k.times) for k in amax]
  assert r["gemms"]["bf16"] == HEAD_GEMMS and r["gemms"][gemm] >= 3 * QUANTIZED_PROJECTIONS, r["gemms"]


def test_accumulated_step_quantizes_each_kernel_once_and_gathers_it_as_its_gemms_read_it(tmp_path):
  """fp8_current, 4 micro-batches, FSDP over 8, remat `full`: each dense kernel is cast to FP8 once a step, before
  the micro-batches' loop (layers/linear.py's `once_a_step`), not in every micro-batch and remat recomputation
  again; and no GEMM transposes a kernel's gathered FP8 copy (the forward GEMM's copy is stored [N, K] and split
  along N: quant/dot.py's `kernel_copies`). Every projection's GEMMs (forward, its recomputation but the MLP
  output's, whose output the backward pass does not read, dgrad, wgrad) stay FP8."""
  path = tmp_path / "step.hlo"
  r = compile_report(loaded(["compile", *TINY, "--config.quant.recipe=fp8_current", "--config.mesh.fsdp=8",
                             "--config.train.batch_size=32", "--config.train.grad_accum_steps=4",
                             "--config.remat.policy=full", "--config.model.seq_len=32"]),  # No activation [64, 64].
                     target_lib.parse("h100x8"), hlo_out=str(path))
  p = hlo.Program(path.read_text())
  casts = [k for k in hlo.memory_kernels(p) if "quantize_weight" in p.by_name[k.name].op_name]
  assert casts and all(k.times == 1 for k in casts), [(k.name, k.times) for k in casts]
  kernels = {(64, 128), (64, 64), (64, 256), (128, 64)}  # tiny's qkv, out, wi, wo: [K, N].
  kernels |= {(n, k) for k, n in kernels}

  def fp8_kernel_transpose(instruction) -> bool:
    body = p.computations.get(instruction.attribute("calls") or "", [])
    return any(i.opcode == "transpose" and i.shape.startswith("f8e4m3fn[") and
               tuple(int(d) for d in i.shape.split("[")[1].split("]")[0].split(",")[-2:]) in kernels for i in body)

  looped = [k.name for k in hlo.memory_kernels(p) if k.times > 1 and fp8_kernel_transpose(p.by_name[k.name])]
  assert not looped, looped
  assert r["gemms"] == census(fp8=4 * QUANTIZED_PROJECTIONS - 1, bf16=HEAD_GEMMS), r["gemms"]


def test_unrolled_layers_take_their_rows_of_the_kernel_copies_once_a_step(tmp_path):
  """fp8_current, 3 unrolled layers, 4 micro-batches on FSDP 8: each layer's row of the kernels' amaxes, scales and
  FP8 shards made once a step is cut out of the stacked ones once, ahead of the micro-batches' loop
  (decoder.py's `rows_cut_ahead`): no kernel of the loop only cuts a row out of a stacked [layers, ...] value (the
  norms' rows are read where they lie, inside the kernels that read them)."""
  path, layers = tmp_path / "step.hlo", 3
  compile_report(loaded(["compile", *TINY, "--config.quant.recipe=fp8_current", "--config.mesh.fsdp=8",
                         "--config.train.batch_size=32", "--config.train.grad_accum_steps=4",
                         "--config.model.scan_layers=false", f"--config.model.num_layers={layers}"]),
                 target_lib.parse("h100x8"), hlo_out=str(path))
  p = hlo.Program(path.read_text())

  def copies(shape: str) -> bool:  # The layers' stacked FP8 kernel shards, or their amaxes or scales [layers].
    dims = hlo.dims_of(shape)
    return dims[:1] == [layers] and (len(dims) == 1 or hlo.dtype_of(shape).startswith("f8"))

  def cuts_a_row(kernel) -> bool:  # A kernel that only cuts rows out of such stacks.
    body = {i.name: i for i in p.computations.get(p.by_name[kernel.name].attribute("calls") or "", [])}
    rows = [i for i in body.values() if i.opcode == "slice" and i.operands[0] in body and
            copies(body[i.operands[0]].shape)]
    return bool(rows) and {i.opcode for i in body.values()} <= {"slice", "parameter", "tuple", "bitcast", "reshape"}

  rows = [k for k in hlo.memory_kernels(p) if cuts_a_row(k)]
  assert rows and all(k.times == 1 for k in rows), [(k.name, k.times) for k in rows if k.times > 1]


# `full` is the policy whose recomputed GEMMs XLA merged and cast apart (below); `minimal` an extended case.
@pytest.mark.parametrize("policy", ["full", pytest.param("minimal", marks=pytest.mark.extended)])
def test_pipelined_replicas_keep_every_projection_gemm_fp8(policy):
  """tiny fp8_current, data 2 x tensor 2 x 2 stages (1F1B) of 1 and of 2 layers, 4 micro-batches: every projection
  GEMM stays FP8 with the kernels quantized once a step. Under `full` a tick's forward GEMM and another
  micro-batch's recomputed one share their kernel copy, and XLA merged the two into one GEMM of two scales, in bf16
  (ember/xla_flags.py's dot-merger threshold); XLA sank the copies' cast into the ticks' loop, next to a GEMM it
  then ran in bf16 (the barrier in layers/linear.py's `once_a_step`); and moved a GEMM's dequantizing convert
  ahead of its layer's slice of the stage's stacked copies, the same (`Linear._layer_copies`)."""
  for layers in (2, 4):
    r = report("h100x8", "--config.quant.recipe=fp8_current", "--config.mesh.data=2", "--config.mesh.fsdp=1",
               "--config.mesh.tensor=2", "--config.mesh.pipeline=2", "--config.pipeline.schedule=1f1b",
               "--config.train.grad_accum_steps=4", "--config.train.batch_size=16",
               f"--config.model.num_layers={layers}", f"--config.remat.policy={policy}")
    assert r["gemms"]["bf16"] == HEAD_GEMMS and r["gemms"]["fp8"] >= 3 * layers * QUANTIZED_PROJECTIONS, r["gemms"]


def test_block_scaled_wgrad_is_written_as_its_reduce_scatter_reads_it(tmp_path):
  """mxfp8, FSDP over 8 B200s: a weight gradient reduce-scattered along its output axis (`wo`, the attention
  output) is written by the block-scaled GEMM with that axis major, so no float32 gradient is transposed after it
  (nvfp4's tensor-scale pass over the output writes the wanted layout either way)."""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", *TINY, "--config.quant.recipe=mxfp8", "--config.mesh.fsdp=8",
                                   "--config.train.batch_size=16"]), target_lib.parse("b200x8"), hlo_out=str(path))
  p = hlo.Program(path.read_text())
  transposed = [p.by_name[k.name].shape for k in hlo.memory_kernels(p) if "transpose" in k.name
                and "block_scaled_gemm" in p.by_name[k.name].op_name and "f32" in p.by_name[k.name].shape]
  assert not transposed, transposed


def test_nvfp4_gemms_take_their_scales_and_operands_without_passes_of_their_own(tmp_path):
  """nvfp4, FSDP over 8 B200s (width 256):
  - a weight gradient (float32) leaves cuDNN's GEMM unscaled and takes its tensor scales after it, on the
    reduce-scattered shard, so no kernel of the GEMM's region writes a float32 result;
  - every forward GEMM writes bf16 with the tensor scales as cuDNN's global scale (a fifth operand);
  - no collective moves E2M1 data converted to float16 (the operands enter the GEMM as bytes);
  - each layer's kernel is cast where it lies in the stacked kernels (layers unrolled, as llama3_8b's): no float32
    copy of a layer's kernel."""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", *TINY, "--config.quant.recipe=nvfp4", "--config.mesh.fsdp=8",
                                   "--config.train.batch_size=16", "--config.model.d_model=256",
                                   "--config.model.d_ff=512", "--config.model.scan_layers=false"]),
                 target_lib.parse("b200x8"), hlo_out=str(path))
  p = hlo.Program(path.read_text())
  kernels = [p.by_name[k.name] for k in hlo.memory_kernels(p)]
  region = [i for i in kernels if "block_scaled_gemm" in i.op_name]
  assert region and not [i.shape for i in region if hlo.dtype_of(i.shape) == "f32"], [i.shape for i in region]
  gemms = [i for i in p.by_name.values() if i.attribute("custom_call_target") == CUDNN_BLOCK_SCALED_GEMM]
  forward = [i for i in gemms if "transpose(" not in i.op_name]
  assert forward and all(hlo.dtype_of(i.shape) == "bf16" and len(i.operands) == 5 for i in forward), [
      (i.shape, len(i.operands)) for i in forward]
  assert not [c.shape for c in hlo.collective_ops(p) if hlo.dtype_of(c.shape) == "f16"]
  assert [i for i in kernels if STACKED_ROW_SCOPE.format("") in i.op_name]
  matrix = lambda shape: sum(d > 1 for d in hlo.dims_of(shape)) >= 2  # A kernel, not a norm's scale vector.
  copied = [i.shape for i in kernels if i.op_name.endswith("unstack") and hlo.dtype_of(i.shape) == "f32"
            and matrix(i.shape)]
  assert not copied, copied


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", pytest.param("nvfp4", marks=pytest.mark.extended)])
def test_data_parallel_replicas_reduce_gradients_once_a_step(recipe, tmp_path):
  """b200x8, 2 replicas x FSDP 4, 4 micro-batches, bf16 gradient reduction: the replicas' gradient reduction (a
  reduce-scatter: the optimizer state is split over them) runs once a step, in bf16, with cuDNN's attention (run per device there) and every projection GEMM in the recipe's
  format; the block-scaled recipes' kernels partition themselves inside the replicas' shard_map
  (quant/partitioning.py)."""
  path = tmp_path / "step.hlo"
  r = compile_report(loaded(["compile", *TINY, f"--config.quant.recipe={recipe}", "--config.mesh.data=2",
                                      "--config.mesh.fsdp=4", "--config.train.batch_size=32",
                                      "--config.train.grad_accum_steps=4", "--config.train.grad_reduce_dtype=bfloat16"]),
                     target_lib.parse("b200x8"), hlo_out=str(path))
  # Devices 4 apart differ along `data` alone (data-major ids); the tiny model's blocks also span pairs in fsdp.
  along_data = lambda c: c.groups and all(len(g) == 2 and g[1] - g[0] == 4 for g in c.groups)
  replicas = [c for c in hlo.collective_ops(path.read_text()) if c.kind in ("all-reduce", "reduce-scatter")
              and along_data(c) and c.bytes > 4]
  assert replicas and all(c.times == 1 for c in replicas), [(c.shape, c.times) for c in replicas]
  # The gradients' (the step's metrics are summed beside them in float32).
  assert hlo.dtype_of(max(replicas, key=lambda c: c.bytes).shape) == "bf16", replicas
  gemm = {"fp8_current": "fp8"}.get(recipe, recipe)
  assert r["attention"] == "cudnn" and r["gemms"][gemm] >= 3 * QUANTIZED_PROJECTIONS, (r["attention"], r["gemms"])


@pytest.mark.parametrize("mesh", [{"data": 2, "fsdp": 1, "expert": 4},
                                  pytest.param({"data": 1, "fsdp": 2, "tensor": 2, "expert": 2},
                                               marks=pytest.mark.extended)], ids=["replicas_only", "tensor"])
def test_block_scaled_replicas_compile(mesh, tmp_path):
  """tiny_moe mxfp8 on b200x8, 2 micro-batches. data 2 x expert 4: no axis is left to the compiler inside the
  replicas' shard_map, which is then manual over every axis (a group of one device cannot be handed to a kernel's
  partition rule), and the gradients cross the replicas once a step. fsdp 2 x tensor 2 x expert 2: a projection's
  features are split, whose sums the kernels' rules cannot take inside the shard_map, so the step runs as one
  program over the mesh (`replica_axes`; inside, XLA failed a check partitioning it): every projection but the
  bf16 head still runs on the block-scaled GEMM, and the row-parallel GEMMs' partial outputs are summed across
  the tensor pairs. (Each replica holds the whole optimizer state here: the sums are all-reduces.)"""
  path = tmp_path / "step.hlo"
  r = compile_report(loaded(["compile", f"--config={ROOT}/configs/default.py:tiny_moe",
                             "--config.data.source=synthetic", "--config.quant.recipe=mxfp8", ONCE,
                             *(f"--config.mesh.{k}={v}" for k, v in mesh.items()),
                             "--config.train.batch_size=16", "--config.train.grad_accum_steps=2",
                             "--config.train.shard_optimizer_state=False"]),
                     target_lib.parse("b200x8"), hlo_out=str(path))
  collectives = hlo.collective_ops(path.read_text())
  if "tensor" not in mesh:
    reduced = [c for c in collectives if c.kind == "all-reduce" and c.bytes > 1024]
    assert reduced and all(c.times == 1 for c in reduced), [(c.shape, c.times) for c in reduced]
  else:
    assert r["gemms"]["emulated"] == 0 and r["gemms"]["bf16"] == HEAD_GEMMS, r["gemms"]
    assert r["gemms"]["mxfp8"] >= 3 * QUANTIZED_PROJECTIONS, r["gemms"]
    # Devices 2 apart differ along `tensor` alone (expert-minor ids). Summed there: the bf16 head's dgrad and
    # the block-scaled row-parallel GEMMs' partial outputs; their quantized operands (bytes) are never gathered
    # there, as they would be where the kernels' partition rule gathered a split contraction instead of summing it.
    along_tensor = lambda c: c.groups and all(len(g) == 2 and g[1] - g[0] == 2 for g in c.groups)
    summed = [c for c in collectives if c.kind == "all-reduce" and along_tensor(c) and "bf16[" in c.shape]
    gathered = [c for c in collectives if c.kind == "all-gather" and along_tensor(c) and "u8[" in c.shape]
    assert len(summed) > 1 and not gathered, [(c.kind, c.shape) for c in summed + gathered]


def test_tensor_parallel_layers_move_fp8_activations_and_reduce_scatter_their_outputs(tmp_path):
  """tiny fp8_current on h100x8, fsdp 4 x tensor 2 (sequence parallel: the residual stream's length split over
  `tensor`). Along `tensor` the layers gather only FP8 (each column-parallel projection's input quantized on its
  share of the tokens, each gradient quantized before the row-parallel GEMMs read it), and the row-parallel
  projections' partial outputs (and the column-parallel dgrads) are reduce-scattered onto the split length, not
  all-reduced whole. Outside the layers, the bf16 LM head gathers its input in bf16, and the embedding its
  gradient."""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", *TINY, "--config.quant.recipe=fp8_current", "--config.mesh.fsdp=4",
                         "--config.mesh.tensor=2", "--config.remat.policy=full"]), target_lib.parse("h100x8"),
                 hlo_out=str(path))
  # Devices 1 apart differ along `tensor` alone (tensor is the minor axis of a data 1 x fsdp 4 x tensor 2 mesh).
  along_tensor = lambda c: c.groups and all(len(g) == 2 and g[1] - g[0] == 1 for g in c.groups)
  # The layers' activations: a tensor group's tokens (2 sequences of 64) by d_model (64), as [2, 64, 64] or
  # flattened [128, 64].
  tokens = lambda c: (dims := hlo.dims_of(c.shape)) and dims[-1] == 64 and math.prod(dims[:-1]) == 128
  outside = ("lm_head", "_take")  # The bf16 head's input, and the embedding's gradient on its way to the table.
  layers = [c for c in hlo.collective_ops(path.read_text()) if along_tensor(c) and tokens(c)
            and not any(o in c.op_name for o in outside)]
  gathered = [c for c in layers if c.kind == "all-gather"]
  assert gathered and all(re.fullmatch(r"\(?(f8e4m3fn|f8e5m2)\[.*", c.shape) for c in gathered), \
      [c.shape for c in gathered]
  assert not [c for c in layers if c.kind == "all-reduce"], [c.shape for c in layers if c.kind == "all-reduce"]
  scattered = [c for c in layers if c.kind == "reduce-scatter"]
  assert len(scattered) >= 4 and all("bf16[" in c.shape for c in scattered), [c.shape for c in scattered]


def test_kv_heads_fewer_than_tensor_ranks_gather_no_weight_gradient(tmp_path):
  """tiny fp8_current, fsdp 2 x tensor 4 on h100x8: 2 kv heads over 4 tensor ranks, each rank computing its copy of
  its group's keys and values (layers/attention.py `kv_view`). Every projection's three GEMMs run in FP8, and the
  backward pass gathers nothing but FP8 data (activations and gradients for the GEMMs, the weights again for the
  recompute): the copies' key and value gradients are summed across their ranks, no weight gradient is gathered."""
  path = tmp_path / "step.hlo"
  r = compile_report(loaded(["compile", *TINY, "--config.quant.recipe=fp8_current", "--config.mesh.fsdp=2",
                             "--config.mesh.tensor=4", "--config.remat.policy=full"]), target_lib.parse("h100x8"),
                     hlo_out=str(path))
  assert r["gemms"]["fp8"] >= 3 * QUANTIZED_PROJECTIONS and r["gemms"]["bf16"] == HEAD_GEMMS, r["gemms"]
  backward = [c for c in hlo.collective_ops(path.read_text()) if c.kind == "all-gather"
              and "transpose(" in c.op_name and "rematted_computation" not in c.op_name]
  assert backward and all(re.fullmatch(r"\(?(f8e4m3fn|f8e5m2)\[.*", c.shape) for c in backward), \
      [(c.shape, c.op_name) for c in backward]


def test_tensor_parallel_gemms_stay_fp8_inside_the_replicas_map():
  """tiny fp8_current, data 2 x fsdp 2 x tensor 2 in 2 micro-batches: the step runs inside a map manual over the
  data replicas, where XLA cannot prove a quantized input's scale the same on every device and would gather the
  dequantized copy, and run the GEMM in bf16; gathering the FP8 data itself (quant/dot.py's `gathered_rows`)
  keeps every projection's three GEMMs FP8."""
  r = report("h100x8", "--config.quant.recipe=fp8_current", "--config.mesh.data=2", "--config.mesh.fsdp=2",
             "--config.mesh.tensor=2", "--config.train.grad_accum_steps=2", "--config.remat.policy=full")
  assert r["gemms"]["fp8"] >= 3 * QUANTIZED_PROJECTIONS and r["gemms"]["bf16"] == HEAD_GEMMS, r["gemms"]


@pytest.mark.parametrize("target,recipe", [("h100x8", "fp8_current"), pytest.param("b200x8", "nvfp4", marks=pytest.mark.extended)])
def test_grad_reduce_dtype_is_the_dtype_gradients_are_reduced_in(target, recipe, tmp_path):
  """FSDP over 8 GPUs: every weight gradient is reduce-scattered in float32 by default and, with
  `train.grad_reduce_dtype=bfloat16`, the same gradients in bf16 at half the bytes (cuDNN's block-scaled GEMM
  included: NVFP4's tensor scales are taken inside it)."""
  moved = {}
  for dtype in ("float32", "bfloat16"):
    path = tmp_path / f"{dtype}.hlo"
    compile_report(loaded(["compile", *TINY, f"--config.quant.recipe={recipe}", "--config.mesh.fsdp=8",
                                     "--config.train.batch_size=16", f"--config.train.grad_reduce_dtype={dtype}"]),
                   target_lib.parse(target), hlo_out=str(path))
    moved[dtype] = collections.Counter()
    for c in hlo.collective_ops(path.read_text()):
      if c.kind == "reduce-scatter":
        for part in c.shape.split(" "):
          moved[dtype][hlo.dtype_of(part), tuple(hlo.dims_of(part))] += hlo.nbytes(part) * c.times
  assert moved["float32"] and {dtype for dtype, _ in moved["float32"]} == {"f32"}, moved
  assert moved["bfloat16"] == {("bf16", dims): b / 2 for (_, dims), b in moved["float32"].items()}, moved


def test_muon_orthogonalises_whole_matrices_and_keeps_the_gradient_reduce_scatter():
  """Muon under FSDP 8 (tiny with 8 layers: 8 matrices a kernel, one a GPU; batch 16): the kernels' gradients are
  still reduce-scattered (the same reduce-scatters as AdamW's step, no all-reduce in their place); the momentum
  goes to whole matrices and the update back by all-to-all; the Newton-Schulz GEMMs run in float32, or in bf16
  by `train.muon_ns_dtype`."""
  flags = ("--config.quant.recipe=fp8_current", "--config.mesh.fsdp=8", "--config.train.batch_size=16",
           "--config.model.num_layers=8")
  adamw = report("h100x8", *flags)
  fp32 = report("h100x8", *flags, "--config.train.optimizer=muon")
  bf16 = report("h100x8", *flags, "--config.train.optimizer=muon", "--config.train.muon_ns_dtype=bfloat16")
  for r in (fp32, bf16):
    assert r["collectives"]["reduce-scatter"] == adamw["collectives"]["reduce-scatter"]
    assert r["collectives"].get("all-reduce", 0) <= adamw["collectives"].get("all-reduce", 0)
    assert r["collectives"]["all-to-all"] > adamw["collectives"].get("all-to-all", 0)
  assert fp32["executed_flops"]["f32"] > 0 and bf16["executed_flops"]["f32"] == adamw["executed_flops"]["f32"] == 0
  assert bf16["executed_flops"]["bf16"] - adamw["executed_flops"]["bf16"] == pytest.approx(fp32["executed_flops"]["f32"])


@BOTH_PROGRAMS
def test_bfloat16_optimizer_state_lowers_llama3_8b_peak(program):
  """llama3_8b, fp8_current, h100x8: AdamW's two moments of 8B parameters in bf16 instead of float32 save 2 bytes
  a parameter a moment over 8 GPUs, about 3.7 GiB of the compiled peak."""
  flags = ["compile", f"--config={ROOT}/configs/default.py:llama3_8b", "--config.data.source=synthetic",
           "--config.quant.recipe=fp8_current", "--config.train.batch_size=8", ONCE, *program]
  peak = {d: compile_report(loaded([*flags, f"--config.train.optimizer_state_dtype={d}"]),
                            target_lib.parse("h100x8"))["peak_bytes"] for d in ("float32", "bfloat16")}
  assert peak["float32"] - peak["bfloat16"] >= 3.5 * 2**30, peak


def test_fsdp_expert_kernels_are_gathered_in_fp8(tmp_path):
  """tiny_moe with its experts sharded over FSDP 8 (no expert parallelism): the expert kernels cross the network
  as FP8 (quantized on their shard), never as float32; only the float32 router is gathered in float32."""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", f"--config={ROOT}/configs/default.py:tiny_moe", "--config.data.source=synthetic",
                         "--config.quant.recipe=fp8_current", "--config.mesh.fsdp=8", "--config.train.batch_size=8",
                         ONCE]),
                 target_lib.parse("h100x8"), hlo_out=str(path))
  gathered = collections.Counter()
  for c in hlo.collective_ops(path.read_text()):
    if c.kind == "all-gather":
      for part in c.shape.split(" "):
        gathered[hlo.dtype_of(part), tuple(hlo.dims_of(part))] += 1
  experts = [(dtype, dims) for dtype, dims in gathered if len(dims) == 3]  # [E, K, N] in some order: the experts.
  assert experts and {dtype for dtype, _ in experts} == {"f8e4m3fn"}, gathered
  assert {dims for dtype, dims in gathered if dtype == "f32"} <= {(64, 4)}, gathered  # The router's [D, E].


def test_bf16_recipe_has_no_fp8_gemm():
  """Every projection's forward, dgrad and wgrad, and the head's, in bf16; nothing else."""
  r = report("h100x1", "--config.quant.recipe=bf16", "--config.remat.policy=none")
  assert r["gemms"] == census(bf16=3 * QUANTIZED_PROJECTIONS + HEAD_GEMMS), r["gemms"]


@pytest.mark.parametrize("head_dim", [64, 256])
def test_cudnn_attention_forward_and_backward(head_dim):
  r = report("h100x1", "--config.remat.policy=none", f"--config.model.head_dim={head_dim}")
  assert r["attention"] == "cudnn", r.get("attention_note")
  assert r["attention_kernels"]["forward"] >= 1 and r["attention_kernels"]["backward"] >= 1


@pytest.mark.parametrize("policy,forward_calls", [("full", 2), ("minimal", 1), ("save_dot_except_mlp", 1)])
def test_a_policy_that_keeps_the_attention_context_runs_the_forward_attention_once(policy, forward_calls):
  """cuDNN's attention names its output and softmax statistics `attention_context` (layers/attention.py): a policy
  that keeps the context runs the forward kernel once a layer; `full` runs it again in the backward's recompute."""
  r = report("h100x1", f"--config.remat.policy={policy}")
  assert r["attention"] == "cudnn", r.get("attention_note")
  assert r["attention_kernels"] == {"forward": forward_calls, "backward": 1}, r["attention_kernels"]


def test_xla_attention_says_why():
  r = report("h100x1", "--config.model.attention=xla")
  assert r["attention"] == "xla" and r["attention_note"] == "model.attention=xla"


def test_offloaded_residuals_live_on_the_host():
  """Batch 32 x 512, 8 layers: the quantized activation copies are big enough for offloading to lower the device
  peak."""
  big = ["--config.quant.recipe=fp8_current", "--config.train.batch_size=32", "--config.model.seq_len=512",
         "--config.model.num_layers=8"]
  kept = report("h100x1", *big, "--config.remat.policy=save_quantized")
  moved = report("h100x1", *big, "--config.remat.policy=save_quantized_offloaded")
  assert kept["host_bytes"] == 0 and moved["host_bytes"] > 0
  assert moved["peak_bytes"] < kept["peak_bytes"], (moved["peak_bytes"], kept["peak_bytes"])


@BOTH_PROGRAMS
def test_compile_tool_exit_codes(program, tmp_path, capsys):
  llama = [f"--config={ROOT}/configs/default.py:llama3_8b", "--config.data.source=synthetic",
           "--config.quant.recipe=fp8_current", "--target=h100x8", ONCE, *program]
  out = tmp_path / "fits.json"
  assert tool.main(["compile", *llama, "--config.train.batch_size=8", "--config.remat.policy=save_quantized",
                    f"--out={out}", f"--plot={out.with_suffix('.png')}"]) == 0
  r = json.loads(out.read_text())
  assert matplotlib.image.imread(str(out.with_suffix(".png"))).shape[0] > 100
  assert r["fits"] and r["peak_bytes"] < 80 * 2**30 and r["num_devices"] == 8 and r["target"] == "h100x8"
  for key in ("device_kind", "device_memory_bytes", "argument_bytes", "output_bytes", "temp_bytes", "host_bytes",
              "gemms", "attention", "collectives", "remat_policy", "recipe", "compile_s", "xla_flags"):
    assert key in r, key
  assert r["gemms"]["fp8"] > 0 and r["attention"] == "cudnn"
  # What the step costs: GEMMs and attention near the model's FLOPs, FP8 most of the GEMM work, a floor.
  assert 0.9 <= r["executed_over_model"] <= 1.4, r["executed_over_model"]
  assert r["executed_flops"]["fp8"] > 0.8 * sum(r["executed_flops"].values()), r["executed_flops"]
  # MFU is quoted against the bf16 peak; FP8 GEMMs run at twice it, so a ceiling may pass 1 (the unrolled
  # program's does: 1.02), never the FP8 peak's 2.
  assert 0 < r["mfu_ceiling"] <= 1979 / 989 and 0 < r["time_floor_s"] <= r["time_serial_s"]
  assert r["tokens_per_s_ceiling"] == pytest.approx(8 * 8192 / 8 / r["time_floor_s"])
  # The figures agree with each other and with their sources: the roofline's parts, the model's FLOPs, the
  # H100's dense bf16 peak, the spec's memory, the buffer sizes.
  parts = r["time_floor_parts_s"]
  assert r["time_floor_s"] == max(parts["compute"] + parts["memory"], parts["collectives"])
  assert r["time_serial_s"] == pytest.approx(sum(parts.values()))
  cfg = loaded(["compile", *llama[:3], "--config.train.batch_size=8"])
  assert r["model_flops"] == pytest.approx(train_flops_per_step(cfg) / 8)
  assert r["mfu_ceiling"] == pytest.approx(r["model_flops"] / r["time_floor_s"] / 989e12)
  assert r["device_memory_bytes"] == target_lib.parse("h100x8").device_memory_bytes
  assert r["peak_bytes"] >= r["temp_bytes"]
  assert 0 <= r["output_bytes"] - r["alias_bytes"] < 2**20  # The new state reuses the donated one; metrics aside.
  assert len(r["largest_values"]) == 5 and len(r["largest_collectives"]) == 5
  assert {"shape", "dtype", "bytes", "op_name"} <= set(r["largest_values"][0])
  assert {"kind", "shape", "dtype", "bytes", "op_name"} <= set(r["largest_collectives"][0])
  # The predicted step: slower than the floor, the MFU and tokens/s its own, and where its time goes.
  assert r["time_floor_s"] < r["predicted_step_s"] < 3 * r["time_floor_s"]
  assert r["tokens_per_s_predicted"] == pytest.approx(8 * 8192 / 8 / r["predicted_step_s"])
  assert r["mfu_predicted"] == pytest.approx(r["model_flops"] / r["predicted_step_s"] / 989e12)
  times = r["time_by_op"]
  assert sum(t["seconds"] for t in times if t["exposed"]) == pytest.approx(r["predicted_step_s"])
  assert {"op", "pass", "seconds", "exposed"} <= set(times[0])
  assert {t["kind"] for t in times} >= {"gemm", "attention", "memory", "collective"}
  printed = capsys.readouterr().out
  assert "predicted:" in printed and f"{times[0]['op']} ({times[0]['pass']}" in printed
  # Four sequences a GPU with no remat: over the budget in either program (unrolled, XLA fits two: 76.7 GiB).
  assert tool.main(["compile", *llama, "--config.train.batch_size=32", "--config.remat.policy=none"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: needs ") and "GiB per device on h100x8" in err[-1]


@pytest.mark.parametrize("program", [
    pytest.param(SCANNED, id="scanned"),
    pytest.param((), id="unrolled", marks=[pytest.mark.extended, pytest.mark.xfail(
        strict=True, reason="unrolled, the step needs 92.1 GiB a GPU at 131,072 tokens even over 8 context devices "
                            "(among its values: 15 float32 [4096, 128256] LM-head gradient chunks): docs/long_context.md "
                            "scans the layers at this length")])])
def test_long_context_fits_only_with_context_parallelism(program, tmp_path, capsys):
  """llama3_8b at 131,072 tokens a sequence, fp8_current, h100x8, remat full. With the sequence split over the 8
  GPUs (mesh.context=8, one sequence) the step fits; attention is cuDNN's, two calls per shard (the balanced
  layout's early and late chunks) forward, again in the recompute, and backward; keys and values are
  all-gathered whole ([131072, 8 kv heads, 128] a layer) and the layout moved by collective permutes; and the
  step executes at most 1.6x the model's FLOPs (2.0x if every query met every key). Without it (a sequence a
  GPU, batch 8) the tool says the step does not fit and exits 1."""
  llama = [f"--config={ROOT}/configs/default.py:llama3_8b", "--config.data.source=synthetic",
           "--config.quant.recipe=fp8_current", "--config.model.seq_len=131072", "--config.remat.policy=full",
           "--target=h100x8", ONCE, *program]
  out = tmp_path / "context.json"
  assert tool.main(["compile", *llama, "--config.mesh.context=8", "--config.train.batch_size=1",
                    f"--out={out}"]) == 0
  r = json.loads(out.read_text())
  assert r["fits"] and r["peak_bytes"] < 80 * 2**30 and r["mesh"]["context"] == 8, r["peak_bytes"]
  assert r["attention"] == "cudnn" and r["attention_kernels"] == {"forward": 4, "backward": 2}
  assert r["collectives"]["collective-permute"] > 0
  assert any(c["kind"] == "all-gather" and c["shape"].startswith("bf16[131072,8,128]") for c in r["largest_collectives"])
  assert r["executed_over_model"] <= 1.6, r["executed_over_model"]
  capsys.readouterr()
  assert tool.main(["compile", *llama, "--config.train.batch_size=8"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: needs ") and "GiB per device on h100x8" in err[-1]


def test_unrolled_layers_copy_no_saved_activation():
  """tiny, 4 layers, fp8_current, h100x8, under its remat preset. Scanned, the forward pass copies each layer's
  saved activations into the scan's stacked buffers (dynamic_update_slice kernels); unrolled
  (model.scan_layers=false) each is a buffer of its own, written where it is made: no such copy, and less memory
  traffic a step."""
  flags = ("--config.model.num_layers=4", "--config.train.batch_size=8", "--config.quant.recipe=fp8_current")
  r = {scan: report("h100x8", *flags, f"--config.model.scan_layers={scan}") for scan in ("true", "false")}
  copies = lambda rep: sum(x["bytes"] for x in rep["memory_by_op"] if x["op"] == "dynamic_update_slice"
                           and x["pass"] == "fwd")
  assert copies(r["true"]) > 0 and copies(r["false"]) == 0
  assert r["false"]["time_floor_parts_s"]["memory"] < r["true"]["time_floor_parts_s"]["memory"]


def test_unrolled_layers_read_their_parameters_where_they_lie():
  """tiny, 4 layers, unrolled, `minimal`, h100x8. Each layer's checkpoint holds its inputs behind an optimization
  barrier, and a parameter row handed in as an input was a copy of that row (an `unstack` kernel per layer and
  parameter, in float32): the layers read theirs from the stacked parameters instead (layers/decoder.py)."""
  r = report("h100x8", "--config.model.num_layers=4", "--config.model.scan_layers=false",
             "--config.remat.policy=minimal", "--config.train.batch_size=8")
  assert not [x for x in r["memory_by_op"] if x["op"] == "unstack"], r["memory_by_op"]


@pytest.fixture(scope="module")
def preset_like_program(tmp_path_factory):
  """tiny, 4 layers unrolled, fp8_current under llama3_8b's `minimal_quantized`, batch 8, compiled for h100x8: the
  optimised program (hlo.Program) and its tokens x d_model activation shape."""
  path = tmp_path_factory.mktemp("preset_like") / "step.hlo"
  cfg = loaded(["compile", *TINY, "--config.model.num_layers=4", "--config.model.scan_layers=false",
                "--config.quant.recipe=fp8_current", "--config.remat.policy=minimal_quantized",
                "--config.train.batch_size=8"])
  compile_report(cfg, target_lib.parse("h100x8"), hlo_out=str(path))
  tokens = cfg.train.batch_size * cfg.model.seq_len // 8
  return hlo.Program(path.read_text()), f"bf16[{tokens},{cfg.model.d_model}]"


@pytest.mark.xdist_group("preset_like_program")
def test_a_current_scaling_amax_reads_the_tensor_where_it_lies(preset_like_program):
  """An amax taken over the whole tensor at once had XLA write |x| out (a `select_n`, NaN as Inf) for each
  activation the backward pass recomputes, and reduce that copy; taken row by row first (quant/quantizers.py,
  `tensor_amax`) the reduction reads the tensor itself. No kernel under `quantize_activation` writes a
  tensor-sized |x|."""
  p, _ = preset_like_program
  kernels = [p.by_name[k.name] for k in hlo.memory_kernels(p)]
  assert [i for i in kernels if "quantize_activation" in i.op_name]  # The census sees the amax passes at all.
  magnitudes = [i.shape for i in kernels if "quantize_activation" in i.op_name and i.op_name.endswith("select_n")
                and not re.match(r"\w+\[\]", i.shape)]
  assert not magnitudes, magnitudes


@pytest.mark.xdist_group("preset_like_program")
def test_the_residual_adds_copy_no_residual(preset_like_program):
  """The residual adds run in the epilogues of the GEMMs that make the other summand; the residual itself is still
  read after (the backward pass keeps it). Given the residual as a bitcast made for the GEMM, XLA wrote the sum over
  it in place and copied the residual first, every add; given one [tokens, D] value with two readers
  (layers/decoder.py, `_residual_rows`), the GEMM writes the sum out of place: no activation-sized copy."""
  p, activation = preset_like_program
  copies = [k.name for k in hlo.memory_kernels(p)
            if p.by_name[k.name].opcode == "copy" and p.by_name[k.name].shape.startswith(activation + "{")]
  assert not copies, copies


@pytest.mark.xdist_group("preset_like_program")
def test_the_residual_norms_take_their_gradient_in_one_pass(preset_like_program):
  """Each layer's two residual norms take their backward pass in one kernel (layers/norm_kernel.py), the gradient of
  the residual's other reads added there: it reads x, dy and dh and writes dx, four activations' bytes and the
  scale's partial sums. Left to XLA the backward pass read the rows twice more (a row reduction, then the
  gradient). Under fp8_current quantizers read the norms, so their forward pass stays XLA's (no kernel there)."""
  p, activation = preset_like_program
  norms = [p.by_name[k.name] for k in hlo.memory_kernels(p) if norm_kernel.SCOPE in p.by_name[k.name].op_name]
  assert norms and all("transpose(" in i.op_name for i in norms), [i.op_name for i in norms]
  assert len(norms) == 2 * 4, len(norms)
  for i in norms:
    assert 4 * hlo.nbytes(activation) <= hlo.kernel_traffic(p, i).device <= 4.25 * hlo.nbytes(activation)


def test_a_delayed_scaling_gradient_is_cast_once_and_transposed_in_fp8(tmp_path):
  """fp8_delayed: a gradient is quantized once, row-major for dgrad, the amax taken in the same kernel; wgrad's copy,
  contracting the rows, is that E5M2 data transposed (quant/core.py). Left to itself XLA casts the bf16 gradient
  twice in one kernel, one copy in each layout, and takes the amax in a second pass over the bf16 gradient."""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", *TINY, "--config.quant.recipe=fp8_delayed", "--config.remat.policy=minimal"]),
                 target_lib.parse("h100x1"), hlo_out=str(path))
  p = hlo.Program(path.read_text())
  twice = [p.by_name[k.name].shape for k in hlo.memory_kernels(p) if p.by_name[k.name].shape.count("f8e5m2[") > 1]
  assert not twice, twice
  transposed = [k for k in hlo.memory_kernels(p)
                if re.fullmatch(r"f8e5m2\[[\d,]+\]\{[\d,]+\}", p.by_name[k.name].shape)
                and all(p.type_of(o).startswith("f8e5m2") for o in p.by_name[k.name].operands)]
  assert len(transposed) == QUANTIZED_PROJECTIONS, [p.by_name[k.name].shape for k in transposed]


def test_unknown_target_is_one_line_exit_2(capsys):
  with pytest.raises(SystemExit) as e:
    tool.main(["compile", *TINY, "--target=a100x3"])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip() == ("error: --target: unknown target 'a100x3'; choose cpu or <gpu>x<count> "
                                             "with gpu in b200, h100, h200 (e.g. h100x8)")


def test_auto_chooses_under_the_target_memory(capsys):
  """`auto` with no budget takes what a run allocates of the target's 79.1 GiB (90%, 71.2 GiB): llama3_8b's `none`
  (79.4 GiB) is out, `full` in; each
  candidate's step is predicted for the target's GPUs (what `auto` ranks by)."""
  cfg = loaded(["compile", f"--config={ROOT}/configs/default.py:llama3_8b", "--config.data.source=synthetic",
                         "--config.quant.recipe=fp8_current", "--config.train.batch_size=8",
                         "--config.remat.policy=auto", "--config.remat.auto_candidates=('none', 'full')", ONCE,
                         *SCANNED])
  r = compile_report(cfg, target_lib.parse("h100x8"))
  assert r["remat_policy"] == "full" and r["fits"]
  lines = [line for line in capsys.readouterr().err.splitlines() if "remat auto: " in line and "/step" in line]
  assert len(lines) == 2 and all("predicted" in line for line in lines), lines


def test_a_target_mesh_is_its_gpus_in_nodes():
  """The machine a mesh of a target's devices runs on (what `auto` predicts steps for): the GPU's facts and rates,
  its devices in nodes of 8."""
  target = target_lib.parse("h100x16")
  mesh = jax.sharding.Mesh(np.array(target.devices()).reshape(2, 8), ("data", "fsdp"))
  machine = cost.Machine.of_mesh(mesh)
  assert machine.facts.name == "h100" and machine.rates.gpu == "h100"
  assert machine.node_of_partition == (0,) * 8 + (1,) * 8


# moe_64x6 with expert parallelism over 8 GPUs, batch 8 x 2048, fp8_current; the GPU defaults (ragged exchange,
# capacity layout) or another dispatcher. The ragged program serves both tests below (one compile, not two).
MOE_EP8 = [f"--config={ROOT}/configs/default.py:moe_64x6", "--config.data.source=synthetic",
           "--config.train.batch_size=8", "--config.model.seq_len=2048", "--config.mesh.fsdp=1",
           "--config.mesh.expert=8", "--config.quant.recipe=fp8_current", ONCE]


@pytest.fixture(scope="module")
def moe_ep8_ragged() -> dict:
  return compile_report(loaded(["compile", *MOE_EP8]), target_lib.parse("h100x8"))


@pytest.mark.xdist_group("moe_ep8_ragged")
def test_ragged_dispatch_compiles_for_eight_gpus_and_moves_less(moe_ep8_ragged):
  """moe_64x6 with expert parallelism over 8 GPUs: `ragged` compiles to XLA's ragged-all-to-all and
  exchanges fewer bytes than `allgather`."""
  ag = compile_report(loaded(["compile", *MOE_EP8, "--config.model.moe_dispatch=allgather"]),
                      target_lib.parse("h100x8"))
  rg = moe_ep8_ragged
  assert rg["moe"]["dispatch"] == "ragged" and rg["collectives"].get("ragged-all-to-all", 0) > 0
  assert "ragged-all-to-all" not in ag["collectives"]
  moved = lambda r: sum(v for k, v in r["collectives"].items() if k in ("all-gather", "reduce-scatter",
                                                                         "ragged-all-to-all", "all-to-all"))
  assert moved(rg) < moved(ag), (rg["collectives"], ag["collectives"])
  # The expert GEMMs' slots are sized by the balanced load, whatever brings the copies.
  assert rg["moe"]["expert_gemm"] == ag["moe"]["expert_gemm"] == "capacity"
  assert rg["moe"]["gemm_rows_per_rank"] == ag["moe"]["gemm_rows_per_rank"]
  assert rg["gemms"]["fp8"] > 0


@pytest.mark.parametrize("recipe,policy", [pytest.param(r, p, marks=pytest.mark.extended) if (r, p) == ("nvfp4", "none") else (r, p)
                                           for r in ("mxfp8", "nvfp4") for p in ("none", "save_quantized")])
def test_block_scaled_projections_run_on_blackwells_block_scaled_gemm(recipe, policy):
  """On a B200, forward, dgrad and wgrad of every quantized projection are cuDNN block-scaled GEMMs in the
  recipe's format (a policy that recomputes a forward GEMM adds block-scaled ones); none is bf16."""
  r = report("b200x1", f"--config.quant.recipe={recipe}", f"--config.remat.policy={policy}")
  block_scaled = r["gemms"][recipe]
  assert block_scaled == 3 * QUANTIZED_PROJECTIONS if policy == "none" else \
      3 * QUANTIZED_PROJECTIONS <= block_scaled <= 4 * QUANTIZED_PROJECTIONS, r["gemms"]
  assert r["gemms"]["bf16"] == HEAD_GEMMS and r["gemms"]["emulated"] == 0 and r["gemms"]["fp8"] == 0, r["gemms"]


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed", "bf16"])
def test_fp8_projections_run_on_fp8_gemms_on_b200(recipe):
  """On a B200, FP8 recipes put forward, dgrad and wgrad of every quantized projection on cuBLASLt's FP8
  GEMM; bf16 has neither FP8 nor block-scaled GEMMs."""
  r = report("b200x1", f"--config.quant.recipe={recipe}", "--config.remat.policy=none")
  projections = 3 * QUANTIZED_PROJECTIONS
  expected = census(bf16=projections + HEAD_GEMMS) if recipe == "bf16" else census(fp8=projections, bf16=HEAD_GEMMS)
  assert r["gemms"] == expected, r["gemms"]


def test_block_scaled_gemms_are_emulated_on_hopper():
  """No block-scaled tensor cores on an H100: the report says the 12 projection GEMMs are emulated in bf16."""
  r = report("h100x1", "--config.quant.recipe=nvfp4", "--config.remat.policy=none")
  assert r["gemms"]["nvfp4"] == 0 and r["gemms"]["emulated"] == 3 * QUANTIZED_PROJECTIONS, r["gemms"]
  assert r["emulated_flops"] > 0


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_llama3_8b_block_scaled_compiles_for_eight_b200s(recipe, tmp_path):
  """The full model through the tool: exit 0; its 4 projections a layer in block-scaled GEMMs (with its
  preset's recomputes), only the LM head's GEMMs in bf16: forward, dgrad and wgrad, each written twice (the loss's
  first token chunk, then its loop), none recomputed."""
  out = tmp_path / "llama.json"
  assert tool.main(["compile", f"--config={ROOT}/configs/default.py:llama3_8b", "--config.data.source=synthetic",
                    "--config.train.batch_size=8", f"--config.quant.recipe={recipe}", "--target=b200x8",
                    ONCE, *SCANNED, f"--out={out}"]) == 0
  gemms = json.loads(out.read_text())["gemms"]
  assert gemms[recipe] >= 3 * QUANTIZED_PROJECTIONS and gemms["bf16"] == 6 and gemms["emulated"] == 0, gemms


@pytest.mark.parametrize("recipe", [pytest.param("mxfp8", marks=pytest.mark.extended), "nvfp4"])
def test_moe_expert_gemms_are_block_scaled_on_b200(recipe):
  """moe_64x6 (2 layers), EP 8 on B200s, the capacity layout: the expert GEMMs' work is the recipe's
  block-scaled GEMMs, no bf16 and nothing emulated; the slot rows as for any recipe (the Hadamard
  transforms' f32 GEMMs on the wgrad operands are not expert GEMMs)."""
  flags = [f"--config={ROOT}/configs/default.py:moe_64x6", "--config.data.source=synthetic",
           "--config.model.num_layers=2", "--config.train.batch_size=8", "--config.mesh.fsdp=1",
           "--config.mesh.expert=8", "--config.remat.policy=save_quantized", f"--config.quant.recipe={recipe}",
           ONCE]
  r = compile_report(loaded(["compile", *flags]), target_lib.parse("b200x8"))
  flops = r["moe"]["expert_gemm_flops"]
  assert r["moe"]["expert_gemm"] == "capacity" and r["gemms"]["emulated"] == 0, r["gemms"]
  assert flops[recipe] > 0 and flops["bf16"] == 0 and flops[recipe] >= 0.99 * sum(flops.values()), flops
  slot_rows = r["moe"]["tokens_per_shard"] * 6 * 1.25
  assert slot_rows <= r["moe"]["gemm_rows_per_rank"] <= slot_rows + 8 * 32, r["moe"]["gemm_rows_per_rank"]


# The block-scaled recipes on eight B200s are compiled, and their GEMMs checked, by the llama3_8b test above: here
# they are extended cases.
@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed", "fp8_current",
                                    *(pytest.param(r, marks=pytest.mark.extended) for r in ("mxfp8", "nvfp4"))])
def test_every_recipe_compiles_for_eight_b200s(recipe):
  r = report("b200x8", f"--config.quant.recipe={recipe}", "--config.train.batch_size=8")
  assert r["fits"] and r["device_kind"] == "NVIDIA B200" and r["num_devices"] == 8
  assert r["time_floor_s"] > 0 and 0 < r["mfu_ceiling"] <= 1


@pytest.mark.xdist_group("moe_ep8_ragged")
def test_moe_expert_gemms_do_the_routed_work_in_fp8(moe_ep8_ragged):
  """moe_64x6, EP 8, batch 8 x 2048, fp8_current, the GPU defaults (ragged exchange, capacity layout): the
  step executes at most 1.3x the model's FLOPs, the expert GEMMs run in FP8, no value holds a copy of the
  token rows per local expert, the peak stays under the 56.5 GiB of the ragged_dot layout, and the copies
  cross the exchange in E4M3 and their outputs' gradients in E5M2."""
  r = moe_ep8_ragged
  moe = r["moe"]
  assert (moe["dispatch"], moe["expert_gemm"]) == ("ragged", "capacity")
  assert r["executed_over_model"] <= 1.3, r["executed_over_model"]
  assert moe["expert_gemm_flops"]["fp8"] >= 0.9 * sum(moe["expert_gemm_flops"].values()), moe["expert_gemm_flops"]
  assert r["peak_bytes"] <= 56.5 * 2**30, r["peak_bytes"] / 2**30
  copy = moe["largest_expert_copy"]
  assert copy is None or copy["bytes"] <= 2**30, copy
  sent = moe["exchange_bytes_by_type"]
  assert set(sent) == {"bf16", "f8e4m3fn", "f8e5m2"}, sent
  # Each FP8 way once; each bf16 way (the outputs back, the copies' gradients back) at twice its bytes, the
  # outputs again where the backward pass recomputes them (the router weights' gradient reads them).
  assert sent["f8e4m3fn"] == sent["f8e5m2"] > 0 and sent["bf16"] >= 4 * sent["f8e4m3fn"], sent


@pytest.mark.parametrize("target,recipe,forward,gemms", [
    ("h100x1", "fp8_current", "recipe", ("__cublas$lt$matmul$f8",)),
    ("b200x1", "mxfp8", "recipe", ("__cudnn$blockScaledDot",)),
    ("h100x1", "bf16", "recipe", ("__cublas$lt$matmul",)),
    # The forward GEMMs in bf16, dgrad and wgrad in FP8 (a precision schedule's last phase): all of them counted.
    ("h100x1", "fp8_current", "bf16", ("__cublas$lt$matmul", "__cublas$lt$matmul$f8"))])
def test_quantized_gemms_write_the_dtype_their_consumer_reads(target, recipe, forward, gemms, tmp_path):
  """Forward and dgrad GEMMs feed bf16 math and write bf16, quantized or not; wgrad GEMMs write the float32 weight
  gradient. None writes a float32 result for another kernel to read back and cast."""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", *TINY, f"--config.quant.recipe={recipe}", f"--config.quant.forward={forward}",
                         "--config.remat.policy=none"]), target_lib.parse(target), hlo_out=str(path))
  written = collections.Counter(hlo.dtype_of(i.shape) for i in hlo.Program(path.read_text()).instructions
                                if i.opcode == "custom-call" and i.attribute("custom_call_target") in gemms)
  projections = QUANTIZED_PROJECTIONS + (len(gemms) > 1 or recipe == "bf16")  # With the LM head's bf16 GEMMs.
  assert written == {"bf16": 2 * projections, "f32": projections}, written


def test_expert_gemms_in_the_ragged_layout_write_the_dtype_their_consumer_reads(tmp_path):
  """tiny_moe's experts with their rows sorted by expert (`ragged_dot`) on one H100, fp8_current: the forward and
  dgrad GEMMs of both expert kernels write bf16, as a dense projection's do; the wgrad GEMMs the float32 weight
  gradient. (They wrote float32 for a cast to read back: Mixtral in its hybrid layout, 912 -> 826 GB a step.)"""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", f"--config={ROOT}/configs/default.py:tiny_moe", "--config.data.source=synthetic",
                         "--config.quant.recipe=fp8_current", "--config.remat.policy=none",
                         "--config.model.moe_expert_gemm=ragged_dot"]), target_lib.parse("h100x1"), hlo_out=str(path))
  written = collections.Counter(hlo.dtype_of(i.shape) for i in hlo.Program(path.read_text()).instructions
                                if i.opcode == "custom-call" and EXPERT_GEMM_SCOPE in i.op_name
                                and (i.attribute("custom_call_target") or "").startswith("__cublas"))
  assert written == {"bf16": 4, "f32": 2}, written


def test_mxfp8_operands_are_quantized_in_one_pass(tmp_path):
  """Every MXFP8 operand of a dense projection (x, the kernel, the output gradient) is one kernel that reads it
  once and writes both copies (ember/quant/fused.py), on a GPU with block-scaled GEMMs and on one without."""
  for target in ("b200x1", "h100x1"):
    path = tmp_path / f"{target}.hlo"
    compile_report(loaded(["compile", *TINY, "--config.quant.recipe=mxfp8", "--config.remat.policy=none"]),
                   target_lib.parse(target), hlo_out=str(path))
    kernels = [i for i in hlo.Program(path.read_text()).instructions if i.opcode == "custom-call"
               and "triton" in (i.attribute("custom_call_target") or "") and fused.SCOPE in i.op_name]
    assert len(kernels) == 3 * QUANTIZED_PROJECTIONS, target


@pytest.mark.parametrize("recipe,scope", [pytest.param("mxfp8", fused.SCOPE, marks=pytest.mark.extended), ("nvfp4", fused_nvfp4.SCOPE)])
def test_expert_rows_are_cast_by_the_kernels_on_one_gpu(recipe, scope, tmp_path):
  """tiny_moe on one B200 (its experts run without shard_map): the experts' x, quantized along its last axis
  only, is cast by the recipe's kernel (its `rows` / one-copy cast), not by the quantizer's passes."""
  path = tmp_path / "step.hlo"
  compile_report(loaded(["compile", f"--config={ROOT}/configs/default.py:tiny_moe",
                                   "--config.data.source=synthetic", f"--config.quant.recipe={recipe}"]),
                 target_lib.parse("b200x1"), hlo_out=str(path))
  kernels = [i.op_name for i in hlo.Program(path.read_text()).instructions
             if i.opcode == "custom-call" and "triton" in (i.attribute("custom_call_target") or "")]
  assert any("expert_gemm/quantize_activation/" + scope in name for name in kernels), kernels


def _copies(quantized):
  return [(q.data, q.scale_inv, q.global_scale_inv) for q in quantized]


ONE_PASS_CASES = {  # name: (the quantize, its ideal bytes for a bf16 [r, c]: reads of the source, copies written).
    "mxfp8 one layout": (lambda a: _copies([fused.rows(a)]), lambda r, c: 2 * r * c + r * c + r * c // 32),
    "mxfp8 both layouts": (lambda a: _copies(fused.both(a)), lambda r, c: 2 * r * c + 2 * (r * c + r * c // 32)),
    "nvfp4 one layout": (lambda a: _copies([fused_nvfp4.quantize(a)]),
                         lambda r, c: 2 * 2 * r * c + r * c // 2 + r * c // 16),
    "nvfp4 both layouts": (lambda a: _copies(fused_nvfp4.both(a, rht_seed=0)),
                           lambda r, c: 2 * 2 * r * c + 2 * (r * c // 2 + r * c // 16)),
    "nvfp4 both layouts, stochastic": (
        lambda a: _copies(fused_nvfp4.both(a, keys=(jax.random.key(1), jax.random.key(2)), rht_seed=0)),
        lambda r, c: 2 * 2 * r * c + 2 * (r * c // 2 + r * c // 16)),
}


@pytest.mark.parametrize("case", list(ONE_PASS_CASES))
def test_one_pass_moves_the_ideal_bytes(case):
  """The single-tensor measure: the quantize of a bf16[8192, 14336] activation, compiled alone for b200x1, moves
  within 1.1x of the ideal: MXFP8 reads the tensor once; NVFP4 reads it twice (its tensor scale first), and
  each copy (E4M3 / packed E2M1 data and block scales) is written once."""
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding
  r, c = 8192, 14336
  quantize, ideal = ONE_PASS_CASES[case]
  target = target_lib.parse("b200x1")
  with target_lib.targeting(target):
    device = SingleDeviceSharding(target.devices()[0])
    arg = jax.ShapeDtypeStruct((r, c), jnp.bfloat16, sharding=device)
    text = jax.jit(quantize).trace(arg).lower(lowering_platforms=("cuda",)).compile().as_text()
  moved = sum(k.bytes * k.times for k in hlo.memory_kernels(hlo.Program(text)))
  print(f"{case}: {moved / 1e6:.0f} MB, ideal {ideal(r, c) / 1e6:.0f} MB")
  assert moved <= 1.1 * ideal(r, c), (moved, ideal(r, c))


def test_mxfp8_one_pass_runs_where_each_device_quantizes_whole_blocks(tmp_path):
  """FSDP over 8 H100s: with d_model 256 (8 blocks of 32 a dimension, one a GPU) every dense operand still takes
  the one-pass kernel; tiny's d_model 64 (2 blocks) would be split over part of the 8-way axis, which the kernel's
  partitioning cannot take, so those operands take the per-copy quantizers and the step still compiles. Only the
  gradient of the gate-and-up projection's output (16 x 64 tokens by 2 x 128: 32 by 8 blocks) splits evenly."""
  for d_model, kernels_wanted in ((256, 3 * QUANTIZED_PROJECTIONS), (64, 1)):
    path = tmp_path / f"{d_model}.hlo"
    compile_report(loaded(["compile", *TINY, "--config.quant.recipe=mxfp8", "--config.mesh.fsdp=8",
                                     "--config.train.batch_size=16", f"--config.model.d_model={d_model}",
                                     f"--config.model.d_ff={2 * d_model}"]),
                   target_lib.parse("h100x8"), hlo_out=str(path))
    kernels = [i for i in hlo.Program(path.read_text()).instructions if i.opcode == "custom-call"
               and "triton" in (i.attribute("custom_call_target") or "") and fused.SCOPE in i.op_name]
    assert len(kernels) == kernels_wanted, (d_model, kernels)


def test_a_pipelined_all_gather_in_xla_flags_runs_no_forward_twice(tmp_path):
  """launch/xla_flags.sh's pipelined all-gather, on layers run one after another in a loop of micro-batches: XLA
  ran each micro-batch's forward GEMMs twice (tiny, 2 micro-batches, fp8_current, `minimal`: 1.19x the model's
  FLOPs). The step's compile switches it off (xla_flags.loop_pipelining_off) whatever XLA_FLAGS says, and the
  report lists the option. XLA reads XLA_FLAGS once a process: the compile runs in a process of its own."""
  out = tmp_path / "report.json"
  env = {**os.environ, "XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=true"}
  subprocess.run([sys.executable, "-m", "ember.tools.compile", *TINY, "--config.train.batch_size=16",
                  "--config.train.grad_accum_steps=2", "--config.model.scan_layers=false",
                  "--config.quant.recipe=fp8_current", "--config.remat.policy=minimal", "--target=h100x8",
                  f"--out={out}"], cwd=ROOT, env=env, check=True, capture_output=True)
  r = json.loads(out.read_text())
  assert r["executed_over_model"] == pytest.approx(1.0, abs=0.005), r["executed_over_model"]
  assert r["xla_flags"]["compiler_options"]["xla_gpu_enable_pipelined_all_gather"] is False


def test_a_compile_schedules_under_a_runs_memory_limit(monkeypatch):
  """XLA's scheduler may hold (its base - the step's live bytes) x slop / 100: a run's base is its allocator's
  limit (90% of the memory under launch/xla_flags.sh), a compile-only program's 80% of the spec's. The option that
  makes the two agree, worked out by hand for 100 GB, 20 GB live: 95 x (90 - 20) / (80 - 20) = 110.8; with
  XLA_FLAGS' own slop of 100, 116.7; with a run taking 75%, 95 x 55 / 60 = 87.1. And the live bytes ember counts
  are XLA's own arguments of the compiled step (the state and the batch)."""
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  g = 10**9
  assert target_lib.scheduler_memory_options(100 * g, 20 * g) == {"xla_gpu_memory_limit_slop_factor": 111}
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_memory_limit_slop_factor=100")
  assert target_lib.scheduler_memory_options(100 * g, 20 * g) == {"xla_gpu_memory_limit_slop_factor": 117}
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
  assert target_lib.scheduler_memory_options(100 * g, 20 * g) == {"xla_gpu_memory_limit_slop_factor": 87}
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
  assert target_lib.scheduler_memory_options(100 * g, 85 * g) == {}  # The state alone past XLA's base: no limit.

  target = target_lib.parse("h100x8")
  cfg = loaded(["compile", *TINY, "--config.quant.recipe=fp8_current", "--config.mesh.fsdp=4",
                "--config.mesh.tensor=2"])
  r = compile_report(cfg, target)
  with target_lib.targeting(target):
    cfg, mesh = compile_plan.prepare(cfg, target)
    live = step_plan.live_bytes(cfg, mesh, make_optimizer(cfg)[0])
  assert live == r["argument_bytes"], (live, r["argument_bytes"])
  assert r["xla_flags"]["compiler_options"]["xla_gpu_memory_limit_slop_factor"] == \
      target_lib.scheduler_memory_options(target.device_memory_bytes, live)["xla_gpu_memory_limit_slop_factor"]


@pytest.fixture(scope="module")
def bf16_full_program(tmp_path_factory):
  """tiny (bf16, scanned) under `full`, FSDP over h100x8: (its config, report, optimised program)."""
  path = tmp_path_factory.mktemp("bf16_full") / "step.hlo"
  cfg = loaded(["compile", *TINY, "--config.quant.recipe=bf16", "--config.remat.policy=full", "--config.mesh.fsdp=8"])
  r = compile_report(cfg, target_lib.parse("h100x8"), hlo_out=str(path))
  return cfg, r, hlo.Program(path.read_text())


@pytest.mark.xdist_group("bf16_full_program")
def test_a_scans_stacked_outputs_are_allocated_not_zeroed(bf16_full_program):
  """Scanned layers under `full` stack each layer's input for the backward pass, and each weight's gradient, a slot
  an iteration, every slot written before it is read. The step compiles with xla_flags.STEP_DEFAULTS, under which
  XLA allocates those buffers unwritten (an `AllocateBuffer`, no kernel) rather than zeroing them first; the report
  lists the option. (Compiled under bf16: the recipe does not change what the scan stacks.)"""
  cfg, r, p = bf16_full_program
  assert r["xla_flags"]["compiler_options"]["xla_gpu_enable_dus_accumulator_zero_init_elimination"] is True
  layers = cfg.model.num_layers
  allocated = [i.shape for i in p.instructions
               if i.opcode == "custom-call" and i.attribute("custom_call_target") == "AllocateBuffer"]
  assert any(s.startswith(f"bf16[{layers},") for s in allocated), allocated  # The layers' saved inputs.
  assert any(s.startswith(f"f32[{layers},") for s in allocated), allocated  # Their weights' gradients.


@pytest.mark.xdist_group("bf16_full_program")
def test_bf16_norms_and_swiglu_move_each_row_the_fewest_times(bf16_full_program):
  """Under bf16 the residual norms run in their kernels both ways (layers/norm_kernel.py: forward, recompute and
  backward, two a layer), and the MLP's backward pass makes silu(gate) * up again in the kernel that writes the
  gate/up pair's gradient (layers/glu.py): the recompute of `full` runs no multiply of its own."""
  cfg, _, p = bf16_full_program
  kernels = [(p.by_name[k.name].op_name, k.times) for k in hlo.memory_kernels(p)]
  runs = collections.Counter(scope for name, times in kernels for scope in (glu.SCOPE, norm_kernel.SCOPE)
                             if scope in name for _ in range(times))
  assert runs == {glu.SCOPE: cfg.model.num_layers, norm_kernel.SCOPE: 2 * 3 * cfg.model.num_layers}, runs
  recomputed = [name for name, _ in kernels if "rematted_computation" in name and name.endswith("/mul")]
  assert not recomputed, recomputed
