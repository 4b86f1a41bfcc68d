"""The predicted step (ember/program/predict.py) against hand-computed schedules, and the H100's rates against ember's
own measured steps (ember/plan/calibrate.py, benchmarks/measured/h100/)."""

import math
import re

import jax
import numpy as np
import pytest

from ember import hardware
from ember.plan import calibrate
from ember.program import cost, hlo, predict
from ember.tools import fit_rates

H100 = hardware.gpu("h100")
RATES = hardware.rates("h100")
ONE_NODE = cost.Machine(H100.facts, H100.hbm_bytes_per_s, (0,) * 8, RATES)

_GEMM = ('  %{name} = (bf16[8192,8192]{{1,0}}, s8[0]{{0}}) custom-call(%{a}, %{b}), custom_call_target="__cublas$gemm", '
         'backend_config={{"gemm_backend_config":{{"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"]}}}}}}')
_GROUPS = "replica_groups={{0,1,2,3,4,5,6,7}}"


def _gemm_seconds(m: int, k: int, n: int) -> float:
  """A bf16 GEMM [m, k] x [k, n] by the module doc's rule, computed here from the rates."""
  tiles = math.ceil(m / RATES["tile_m"]) * math.ceil(n / RATES["tile_n"])
  waves = math.ceil(tiles / H100.sms)
  wave_efficiency = m * n / (waves * H100.sms * RATES["tile_m"] * RATES["tile_n"])
  compute = 2 * m * k * n / (H100.facts.peak_flops("bf16") * RATES["gemm_bf16"] * wave_efficiency)
  memory = 2 * (m * k + k * n + m * n) / (H100.hbm_bytes_per_s * RATES["hbm"])
  return max(compute, memory) + RATES["launch_s"]


def _collective_seconds(kind_factor: float, nbytes: float) -> float:
  """A collective over the 8 GPUs of a node: the bus-bandwidth convention's bytes at NVLink x the rate."""
  sent = nbytes * kind_factor * 7 / 8
  return RATES["collective_latency_s"] + sent / (H100.facts.nvlink_gb_s * 1e9 * RATES["nvlink"])


def _program(body: list[str], *, loop: int = 0) -> hlo.Program:
  """An entry computation of `body` lines over two bf16 [8192, 8192] parameters %x and %y (and, with `loop`, the
  same lines as a while loop's body run `loop` times instead)."""
  params = ["  %x = bf16[8192,8192]{1,0} parameter(0)", "  %y = bf16[8192,8192]{1,0} parameter(1)"]
  if not loop:
    return hlo.Program("\n".join(["ENTRY %main () -> bf16[8192,8192] {", *params, *body, "}"]))
  text = ["%body (p: (bf16[8192,8192], bf16[8192,8192])) -> (bf16[8192,8192], bf16[8192,8192]) {",
          "  %p = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) parameter(0)",
          "  %x = bf16[8192,8192]{1,0} get-tuple-element(%p), index=0",
          "  %y = bf16[8192,8192]{1,0} get-tuple-element(%p), index=1", *body,
          "  ROOT %t = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) tuple(%x, %y)", "}",
          "%cond (p: (bf16[8192,8192], bf16[8192,8192])) -> pred[] {",
          "  %p = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) parameter(0)",
          "  ROOT %c = pred[] constant(true)", "}",
          "ENTRY %main () -> bf16[8192,8192] {", *params,
          "  %init = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) tuple(%x, %y)",
          f'  ROOT %w = (bf16[8192,8192]{{1,0}}, bf16[8192,8192]{{1,0}}) while(%init), condition=%cond, body=%body, '
          f'backend_config={{"known_trip_count":{{"n":"{loop}"}}}}', "}"]
  return hlo.Program("\n".join(text))


def test_an_all_gather_is_hidden_behind_the_gemm_scheduled_between_its_start_and_done():
  # 1 GiB gathered over NVLink (about 2.6 ms) behind one 8192^3 GEMM (about 1.7 ms): partly exposed.
  gather = [f"  %ag = (bf16[8192,8192]{{1,0}}, bf16[65536,8192]{{1,0}}) all-gather-start(%x), {_GROUPS}, "
            'dimensions={0}, metadata={op_name="jit(step)/all_gather"}',
            _GEMM.format(name="g", a="x", b="y"),
            "  %agd = bf16[65536,8192]{1,0} all-gather-done(%ag)"]
  walk = predict.Walk(_program(gather))
  got = predict.predict(walk, ONE_NODE)
  gemm, gathered = _gemm_seconds(8192, 8192, 8192), _collective_seconds(1, 65536 * 8192 * 2)
  assert got.step_s == pytest.approx(max(gemm, gathered))
  assert got.exposed_s[0] == pytest.approx(max(gathered - gemm, 0))
  # Its done before the GEMM: nothing to hide behind, the whole gather is exposed.
  walk = predict.Walk(_program([gather[0], gather[2], gather[1]]))
  assert predict.predict(walk, ONE_NODE).step_s == pytest.approx(gathered + gemm)
  # A synchronous all-reduce is exposed whole, and waits for the network.
  reduce = [f"  %ar = bf16[8192,8192]{{1,0}} all-reduce(%x), {_GROUPS}, to_apply=%add", _GEMM.format(name="g", a="x", b="y")]
  assert predict.predict(predict.Walk(_program(reduce)), ONE_NODE).step_s == pytest.approx(
      _collective_seconds(2, 8192 * 8192 * 2) + gemm)



def test_the_latency_profile_gives_each_kernel_and_collective_its_predicted_time():
  # XLA reads costs by instruction name, in microseconds; an asynchronous collective's under its start.
  gather = [f"  %ag = (bf16[8192,8192]{{1,0}}, bf16[65536,8192]{{1,0}}) all-gather-start(%x), {_GROUPS}, "
            'dimensions={0}', _GEMM.format(name="g", a="x", b="y"), "  %agd = bf16[65536,8192]{1,0} all-gather-done(%ag)",
            f"  %ar = bf16[8192,8192]{{1,0}} all-reduce(%x), {_GROUPS}, to_apply=%add"]
  profile = predict.latency_profile(predict.Walk(_program(gather, loop=3)), ONE_NODE)
  costs = dict(re.findall(r'costs \{ name: "([^"]+)" cost_us: ([0-9.]+) \}', profile))
  assert set(costs) == {"g", "ag", "ar"}, profile
  assert float(costs["g"]) == pytest.approx(_gemm_seconds(8192, 8192, 8192) * 1e6, abs=1e-3)  # Once, not 3 times.
  assert float(costs["ag"]) == pytest.approx(_collective_seconds(1, 65536 * 8192 * 2) * 1e6, abs=1e-3)
  assert float(costs["ar"]) == pytest.approx(_collective_seconds(2, 8192 * 8192 * 2) * 1e6, abs=1e-3)


def test_a_wait_is_charged_to_the_collective_that_holds_the_network():
  """A tiny all-reduce issued while a 1 GiB all-gather is on the network waits for it: the step's wait is the
  gather's (time_by_op shows the gather exposed), the all-reduce is exposed for its own few microseconds only."""
  program = [f"  %ag = (bf16[8192,8192]{{1,0}}, bf16[65536,8192]{{1,0}}) all-gather-start(%x), {_GROUPS}, "
             'dimensions={0}, metadata={op_name="jit(step)/all_gather"}',
             f"  %ar = f32[] all-reduce(%s), {_GROUPS}, to_apply=%add, metadata={{op_name=\"jit(step)/pmax\"}}",
             _GEMM.format(name="g", a="x", b="y"),
             "  %agd = bf16[65536,8192]{1,0} all-gather-done(%ag)"]
  walk = predict.Walk(_program(["  %s = f32[] parameter(2)", *program]))
  got = predict.predict(walk, ONE_NODE)
  gathered, reduced = _collective_seconds(1, 65536 * 8192 * 2), _collective_seconds(2, 4)
  assert got.step_s == pytest.approx(gathered + reduced + _gemm_seconds(8192, 8192, 8192))
  assert got.exposed_s == pytest.approx([gathered, reduced])  # Before: [0, gathered + reduced].
  rows = {r["op"]: r["seconds"] for r in predict.time_by_op(walk, got) if r["exposed"] and r["kind"] == "collective"}
  assert rows == pytest.approx({"all-gather": gathered, "all-reduce": reduced})
  assert sum(r["seconds"] for r in predict.time_by_op(walk, got) if r["exposed"]) == pytest.approx(got.step_s)

def test_a_loop_body_counts_its_trips_and_time_by_op_sums_to_the_step():
  gather = [f"  %ag = (bf16[8192,8192]{{1,0}}, bf16[65536,8192]{{1,0}}) all-gather-start(%x), {_GROUPS}, "
            'dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/all_gather"}',
            _GEMM.format(name="g", a="x", b="y") + ', metadata={op_name="jit(step)/dot_general"}',
            "  %agd = bf16[65536,8192]{1,0} all-gather-done(%ag)"]
  once = predict.predict(predict.Walk(_program(gather)), ONE_NODE).step_s
  walk = predict.Walk(_program(gather, loop=4))
  got = predict.predict(walk, ONE_NODE)
  assert got.step_s == pytest.approx(4 * once)
  rows = predict.time_by_op(walk, got)
  assert sum(r["seconds"] for r in rows if r["exposed"]) == pytest.approx(got.step_s)
  assert rows[0] == {"op": "all-gather", "pass": "bwd", "kind": "collective", "exposed": True,
                     "seconds": pytest.approx(4 * got.exposed_s[0])}  # Exposed collectives first.
  gemm = next(r for r in rows if r["kind"] == "gemm")
  assert gemm["op"] == "dot_general" and gemm["seconds"] == pytest.approx(4 * _gemm_seconds(8192, 8192, 8192))


def test_a_conditional_named_with_its_runs_takes_its_branch_that_many_times():
  """A pipeline's segments off the stages (RUNS_OF_SCOPE: 4 of 10 runs) under a conditional in a loop of 10
  ticks: the step is 10 ticks' GEMMs and 4 of the branch's, and time_by_op says the same."""
  gemm = _GEMM.format(name="g", a="x", b="y")
  text = "\n".join([
      "%taken (a: bf16[8192,8192]) -> bf16[8192,8192] {", "  %x = bf16[8192,8192]{1,0} parameter(0)",
      "  %y = bf16[8192,8192]{1,0} parameter(1)", _GEMM.format(name="f", a="x", b="y"),
      "  ROOT %fo = bf16[8192,8192]{1,0} get-tuple-element(%f), index=0", "}",
      "%skipped (a: bf16[8192,8192]) -> bf16[8192,8192] {", "  ROOT %a = bf16[8192,8192]{1,0} parameter(0)", "}",
      "%body (p: (bf16[8192,8192], bf16[8192,8192])) -> (bf16[8192,8192], bf16[8192,8192]) {",
      "  %p = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) parameter(0)",
      "  %x = bf16[8192,8192]{1,0} get-tuple-element(%p), index=0",
      "  %y = bf16[8192,8192]{1,0} get-tuple-element(%p), index=1", "  %on = pred[] parameter(1)", gemm,
      "  %e = bf16[8192,8192]{1,0} conditional(%on, %x, %x), true_computation=%taken, false_computation=%skipped, "
      'metadata={op_name="jit(step)/branch_runs_4_of_10/cond"}',
      "  ROOT %t = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) tuple(%e, %y)", "}",
      "%cond (p: (bf16[8192,8192], bf16[8192,8192])) -> pred[] {",
      "  %p = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) parameter(0)", "  ROOT %c = pred[] constant(true)", "}",
      "ENTRY %main () -> bf16[8192,8192] {", "  %x = bf16[8192,8192]{1,0} parameter(0)",
      "  %y = bf16[8192,8192]{1,0} parameter(1)",
      "  %init = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) tuple(%x, %y)",
      "  ROOT %w = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) while(%init), condition=%cond, body=%body, "
      'backend_config={"known_trip_count":{"n":"10"}}', "}"])
  walk = predict.Walk(hlo.Program(text))
  got = predict.predict(walk, ONE_NODE)
  assert got.step_s == pytest.approx(14 * _gemm_seconds(8192, 8192, 8192))
  assert sum(r["seconds"] for r in predict.time_by_op(walk, got) if r["exposed"]) == pytest.approx(got.step_s)


def _host_seconds(nbytes: float) -> float:
  """A copy to or from pinned host memory: its bytes at the host link x the rate."""
  return nbytes / (H100.facts.host_gb_s * 1e9 * RATES["host"])


def test_host_transfers_take_the_host_link_each_way_and_hide_behind_the_work_between_start_and_done():
  """An offloaded residual (128 MiB to host memory, about 2.6 ms) behind one 8192^3 GEMM (about 1.7 ms); a second
  one the same way waits for the link, one coming back takes the other direction's."""
  to_host = lambda name, src: (f"  %{name} = (bf16[8192,8192]{{1,0:S(5)}}, bf16[8192,8192]{{1,0}}, u32[]) "
                               f'copy-start(%{src}), metadata={{op_name="jit(step)/jvp()/device_put"}}')
  gemm, moved = _gemm_seconds(8192, 8192, 8192), _host_seconds(8192 * 8192 * 2)
  one = [to_host("c", "x"), _GEMM.format(name="g", a="x", b="y"), "  %cd = bf16[8192,8192]{1,0:S(5)} copy-done(%c)"]
  walk = predict.Walk(_program(one))
  got = predict.predict(walk, ONE_NODE)
  assert got.step_s == pytest.approx(max(gemm, moved))
  assert got.host_exposed_s[0] == pytest.approx(moved - gemm)
  rows = predict.time_by_op(walk, got)
  assert rows[0]["kind"] == "host" and rows[0]["op"] == "to host" and rows[0]["exposed"]
  assert sum(r["seconds"] for r in rows if r["kind"] == "host") == pytest.approx(moved)
  # Two the same way: one after the other on the link.
  two = [to_host("c", "x"), to_host("c2", "y"), _GEMM.format(name="g", a="x", b="y"),
         "  %cd = bf16[8192,8192]{1,0:S(5)} copy-done(%c)", "  %cd2 = bf16[8192,8192]{1,0:S(5)} copy-done(%c2)"]
  assert predict.predict(predict.Walk(_program(two)), ONE_NODE).step_s == pytest.approx(max(gemm, 2 * moved))
  # One each way: side by side.
  back = [to_host("c", "x"), "  %h = bf16[8192,8192]{1,0:S(5)} parameter(2)",
          "  %b = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0:S(5)}, u32[]) copy-start(%h)",
          _GEMM.format(name="g", a="x", b="y"), "  %cd = bf16[8192,8192]{1,0:S(5)} copy-done(%c)",
          "  %bd = bf16[8192,8192]{1,0} copy-done(%b)"]
  p = _program(back)
  assert predict.predict(predict.Walk(p), ONE_NODE).step_s == pytest.approx(max(gemm, moved))
  # The roofline: the larger direction at the link's full bandwidth, beside compute + memory; no memory kernel.
  assert hlo.host_transfers(p) == {"to_host": 8192 * 8192 * 2, "from_host": 8192 * 8192 * 2}
  assert not hlo.memory_kernels(p)
  parts = cost.roofline(p, hlo.gemms(p), [], model_flops=1.0, tokens=1.0, machine=ONE_NODE)["time_floor_parts_s"]
  assert parts["host"] == pytest.approx(8192 * 8192 * 2 / (H100.facts.host_gb_s * 1e9))
  # A copy inside device memory is a memory kernel as before, and no host transfer.
  device = predict.Walk(_program(["  %d = bf16[8192,8192]{1,0} copy(%x)"]))
  assert not device.host_transfers and len(device.kind) == 1
  # A kernel that reads a slice of a buffer in host memory itself: the slice over the link, its result through HBM.
  # (A buffer's allocation there moves nothing.)
  sliced = _program(["  %h = bf16[16,8192,8192]{2,1,0:S(5)} parameter(2)", "  %i = s32[] parameter(3)",
                     '  %a = bf16[16,8192,8192]{2,1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"',
                     "  %z = s32[] constant(0)",
                     "  %s = bf16[1,8192,8192]{2,1,0} dynamic-slice(%h, %i, %z, %z), dynamic_slice_sizes={1,8192,8192}"])
  [kernel] = hlo.memory_kernels(sliced)
  assert (kernel.bytes, kernel.to_host, kernel.from_host) == (8192 * 8192 * 2, 0, 8192 * 8192 * 2)
  assert predict.predict(predict.Walk(sliced), ONE_NODE).step_s == pytest.approx(
      _host_seconds(8192 * 8192 * 2) + RATES["launch_s"])


def test_a_small_gemm_loses_to_wave_quantization():
  """133 tiles on 132 SMs take two waves: about half the second wave's SMs' time is lost."""
  assert predict.wave_efficiency((128 * 133, 256), 128, 256, 132) == pytest.approx(133 / 264)
  assert predict.wave_efficiency((4, 8192, 8192), 128, 256, 132) == pytest.approx(4 * 64 * 32 / (63 * 132))
  assert predict.wave_efficiency((100, 256), 128, 256, 132) == pytest.approx(100 / 128 / 132)  # A partial tile.


@pytest.fixture(scope="module")
def measured():
  return calibrate.load("h100")


def test_the_h100_rates_predict_each_measured_step_they_were_not_fit_on(measured):
  """Leave-one-out over ember's seven measured H100 steps: each within 15%, each fit rate within its source's
  range; rates.toml holds the fit on all seven."""
  m = calibrate.machine("h100")
  checks = calibrate.leave_one_out(measured, m)
  assert len(checks) == 7
  for c in checks:
    assert abs(c.ratio - 1) <= 0.15, (c.name, c.ratio, c.rates)
    assert not RATES.with_values(c.rates).outside_range()
  fitted = calibrate.fit(measured, m)
  for k, rate in RATES.table.items():
    if rate.fit:
      assert rate.value == pytest.approx(fitted[k], rel=0.02), k
  assert not any(r.outside_range() for r in map(hardware.rates, hardware.GPUS))


def test_fit_rates_prints_the_leave_one_out_check(capsys):
  assert fit_rates.main(["fit_rates", "--gpu=h100"]) == 0
  out = capsys.readouterr().out
  assert "left out" in out and out.count("1b_") == 14
  with pytest.raises(SystemExit) as e:
    fit_rates.main(["fit_rates", "--gpu=a100"])
  assert e.value.code == 2


def test_no_machine_for_cpu_devices():
  """A mesh of CPU devices has no GPU to predict for: `auto` ranks by FLOPs there."""
  assert cost.Machine.of_mesh(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))) is None


def test_a_gemm_of_small_depth_takes_its_bytes_time():
  """[8192, 64] x [64, 8192] in bf16: 8.6 GFLOP (about 13 us at the rate) but 136 MB through HBM (about 64 us): its
  time is its bytes', worked out here from the spec without the rule's formula (a walk that timed every GEMM by its
  FLOPs alone passed the square-GEMM tests)."""
  text = "\n".join([
      "ENTRY %main () -> bf16[8192,8192] {",
      "  %a = bf16[8192,64]{1,0} parameter(0)",
      "  %b = bf16[64,8192]{1,0} parameter(1)",
      '  ROOT %g = (bf16[8192,8192]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", '
      'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}',
      "}"])
  got = predict.predict(predict.Walk(hlo.Program(text)), ONE_NODE).step_s
  moved = 2 * (8192 * 64 + 64 * 8192 + 8192 * 8192)  # Both operands read, the output written, 2 bytes each.
  assert got == pytest.approx(moved / (3.35e12 * 0.633) + 8e-6, rel=0.02)  # H100 SXM's 3.35 TB/s at the fit 63%.
  assert got > 3 * 2 * 8192 * 64 * 8192 / (989e12 * 0.653)  # Far above its FLOPs' time.
