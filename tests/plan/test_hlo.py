"""Reading compiled programs: GEMM precision, attention kernel, collective bytes with loop trip counts.
On a hand-written HLO text (no compiler needed) and on a real CPU compile."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.program import hlo

TEXT = """HloModule m

%body (p: (s32[], bf16[64,128])) -> (s32[], bf16[64,128]) {
  %p = (s32[], bf16[64,128]{1,0}) parameter(0)
  %a = f8e4m3fn[64,32]{1,0} parameter(1)
  %b = f8e4m3fn[32,128]{1,0} parameter(2)
  %s = f32[] parameter(3)
  %g = (f32[64,128]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s, %s), custom_call_target="__cublas$lt$matmul$f8"
  %w = f8e4m3fn[4,128]{1,0} parameter(4)
  %grads = f32[32,128]{1,0} parameter(5)
  %ag-start = (f8e4m3fn[4,128]{1,0}, f8e4m3fn[32,128]{1,0}) all-gather-start(%w), replica_groups={{0,1,2,3,4,5,6,7}}
  %ag-done = f8e4m3fn[32,128]{1,0} all-gather-done(%ag-start)
  %rs = f32[4,128]{1,0} reduce-scatter(%grads), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %t = (s32[], bf16[64,128]{1,0}) tuple(%i, %y)
}

ENTRY %main (x: bf16[64,32]) -> f32[64,64] {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,64]{1,0} parameter(1)
  %d = (f32[64,64]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul"
  %f = f32[64,64]{1,0} parameter(2)
  %e = (f32[64,64]{1,0}, s8[0]{0}) custom-call(%f, %f), custom_call_target="__cublas$gemm"
  %att = (bf16[2,8,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"
  %attb = (bf16[2,8,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  %ar = f32[16]{0} all-reduce(%z), replica_groups={{0,1}}, to_apply=%add
  %loop = (s32[], bf16[64,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[64,64]{1,0} copy(%d)
}
"""


def test_gemm_precision_by_kernel_and_operands():
  assert hlo.gemm_census(TEXT) == {"fp8": 1, "mxfp8": 0, "nvfp4": 0, "bf16": 1, "f32": 1, "emulated": 0}
  kinds = {g.kind: g.operand_dtypes for g in hlo.gemms(TEXT)}
  assert kinds["__cublas$lt$matmul$f8"] == ("f8e4m3fn", "f8e4m3fn")


def test_attention_kernel():
  assert hlo.attention(TEXT) == {"kernel": "cudnn", "forward": 1, "backward": 1}
  assert hlo.attention("ENTRY %m () -> f32[] {\n  %d = f32[2,2]{1,0} dot(%a, %b)\n}")["kernel"] == "xla"


def test_collective_bytes_per_step_count_loop_trips():
  got = hlo.collectives(TEXT)
  assert got["all-gather"] == 3 * 32 * 128  # The gathered f8 result, 3 trips.
  assert got["reduce-scatter"] == 3 * 32 * 128 * 4  # Its f32 input, 3 trips (not its 4-row output).
  assert got["all-reduce"] == 16 * 4  # Outside the loop: once.


def test_nested_loops_multiply_their_trip_counts():
  """A loop inside a loop (micro-batches around layers) runs its body outer x inner times, whatever the order of
  the while's `condition=` and `body=` attributes."""
  text = """HloModule m

%layer (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %g = f32[8]{0} parameter(1)
  ROOT %rs = f32[1]{0} reduce-scatter(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%micro (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  ROOT %inner = (s32[], f32[8]{0}) while(%q), condition=%cond, body=%layer, backend_config={"known_trip_count":{"n":"5"}}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = (s32[], f32[8]{0}) parameter(0)
  ROOT %outer = (s32[], f32[8]{0}) while(%x), condition=%cond, body=%micro, backend_config={"known_trip_count":{"n":"3"}}
}
"""
  assert hlo.collectives(text)["reduce-scatter"] == 3 * 5 * 8 * 4


def test_a_conditional_named_with_its_runs_counts_its_branches_that_many_times():
  """A pipeline's segments off the stages run under a conditional in every tick of the loop, but their branch only
  on 4 of its 10 runs (RUNS_OF_SCOPE): the branch, and the loop inside it, count 4 runs a step, not 10; an
  unnamed conditional's branches run as often as it does."""
  text = """HloModule m

%inner (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %g = f32[8]{0} get-tuple-element(%p), index=1
  ROOT %rs = f32[1]{0} reduce-scatter(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%taken (a: f32[8]) -> f32[8] {
  %a = (s32[], f32[8]{0}) parameter(0)
  ROOT %layers = (s32[], f32[8]{0}) while(%a), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
}

%skipped (b: f32[8]) -> f32[8] {
  ROOT %b = f32[8]{0} parameter(0)
}

%tick (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  %on = pred[] parameter(1)
  %ag = f32[64]{0} all-gather(%q), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %edge = f32[8]{0} conditional(%on, %q, %q), true_computation=%taken, false_computation=%skipped, metadata={op_name="jit(step)/transpose(jvp(branch_runs_4_of_10))/cond"}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = (s32[], f32[8]{0}) parameter(0)
  ROOT %ticks = (s32[], f32[8]{0}) while(%x), condition=%cond, body=%tick, backend_config={"known_trip_count":{"n":"10"}}
}
"""
  got = hlo.collectives(text)
  assert got["reduce-scatter"] == 4 * 3 * 8 * 4  # 4 runs of the branch, its loop's 3 trips each.
  assert got["all-gather"] == 10 * 64 * 4  # Outside the branch: every tick.
  unnamed = text.replace("branch_runs_4_of_10", "stage")
  assert hlo.collectives(unnamed)["reduce-scatter"] == 10 * 3 * 8 * 4


def test_a_loop_without_a_recorded_trip_count_is_read_off_its_condition_and_body():
  """XLA's collective pipeliner peels loops and drops their `known_trip_count`: the count is then read from the
  induction variable's start (through copies), the fused compare's bound and the fused add's step."""
  text = """HloModule m

%fused_compare (a: s32[]) -> pred[] {
  %a = s32[] parameter(0)
  %bound = s32[] constant(38)
  ROOT %lt = pred[] compare(%a, %bound), direction=LT
}

%fused_add (b: s32[]) -> s32[] {
  %b = s32[] parameter(0)
  %step = s32[] constant(3)
  ROOT %next = s32[] add(%b, %step)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %go = pred[] fusion(%ci), kind=kLoop, calls=%fused_compare
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %g = f32[8]{0} get-tuple-element(%p), index=1
  %rs = f32[1]{0} reduce-scatter(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %i1 = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i1, %g)
}

ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
  %x = f32[8]{0} parameter(0)
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %init = (s32[], f32[8]{0}) tuple(%start, %x)
  ROOT %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
}
"""
  assert hlo.collectives(text)["reduce-scatter"] == 12 * 8 * 4  # i = 2, 5, ..., 35: 12 trips.
  unknown = text.replace("%bound = s32[] constant(38)", "%bound = s32[] parameter(1)")
  assert hlo.collectives(unknown)["reduce-scatter"] == 8 * 4  # Not a constant: counted once, as before.


def test_real_cpu_reduce_scatter_counts_its_input():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  f = jax.shard_map(lambda a: jax.lax.psum_scatter(a, "x", tiled=True), mesh=mesh, in_specs=P(), out_specs=P("x"),
                    check_vma=False)
  text = jax.jit(f).lower(jax.ShapeDtypeStruct((64, 32), jnp.float32)).compile().as_text()
  assert hlo.collectives(text)["reduce-scatter"] == 64 * 32 * 4


def test_real_cpu_program():
  """A CPU compile of a sharded matmul: its dot is found, its all-reduce has the operand's bytes."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
  a = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
  b = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
  text = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P())).lower(a, b).compile().as_text()
  assert hlo.gemm_census(text)["f32"] == 1
  assert hlo.collectives(text).get("all-reduce") == np.float32(16 * 32 * 4)


def test_ragged_all_to_all_counts_the_smaller_of_data_and_buffer():
  text = """ENTRY %m () -> bf16[8,4] {
  %data = bf16[6,4]{1,0} parameter(0)
  %buffer = bf16[12,4]{1,0} parameter(1)
  %o = s64[2]{0} parameter(2)
  %start = ((bf16[6,4]{1,0}, bf16[12,4]{1,0}, s64[2]{0}, s64[2]{0}, s64[2]{0}, s64[2]{0}), bf16[12,4]{1,0}) ragged-all-to-all-start(%data, %buffer, %o, %o, %o, %o), replica_groups={{0,1}}
  ROOT %done = bf16[12,4]{1,0} ragged-all-to-all-done(%start)
}"""
  assert hlo.collectives(text) == {"ragged-all-to-all": 6 * 4 * 2}
