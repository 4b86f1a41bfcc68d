"""What a compiled step costs (ember/program/cost.py, ember/program/hlo.py): programs whose work is known by hand,
compiled for the CPU and for described GPUs, and the report's executed, recompute and attention FLOPs and
time floor against the hand counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember import hardware
from ember.program import cost, hlo
from ember.plan import target as target_lib

needs_plugin = pytest.mark.skipif(not target_lib.plugin_available(),
                                  reason="JAX's CUDA plugin is not installed (launch/install_compile_plugin.sh)")
T, M, K, N = 3, 32, 64, 48  # Trip count and GEMM shapes of the scanned programs.


def compiled_text(fn, *shapes, target: str = "cpu") -> str:
  """The optimised HLO of `fn` on one device of `target` (a described GPU compiles without one)."""
  t = target_lib.parse(target)
  with target_lib.targeting(t):
    mesh = Mesh(np.array(t.devices()[:1]), ("x",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]
    options = dict(target_lib.COMPILER_OPTIONS) if t.is_gpu else None
    return jax.jit(fn).lower(*args).compile(compiler_options=options).as_text()


def report(text: str, target: str | None = None) -> dict:
  machine = None
  if target:
    t = target_lib.parse(target)
    machine = cost.Machine(t.facts, t.hbm_bytes_per_s, tuple(range(t.count)))
  return cost.step_cost(text, model_flops=1.0, tokens=1.0, machine=machine)


def scanned(x, w):
  """T layers of tanh(x @ w[t]) under a scan."""
  def body(c, w_t):
    return jnp.tanh(c @ w_t), None
  return jax.lax.scan(body, x, w)[0]


SCAN_SHAPES = [((M, K), jnp.float32), ((T, K, K), jnp.float32)]


def test_a_scanned_matmul_counts_every_trip():
  r = report(compiled_text(scanned, *SCAN_SHAPES))
  assert r["executed_flops"]["f32"] == T * 2 * M * K * K
  assert r["recompute_flops"] == 0 and r["attention_flops"] == 0


def test_a_checkpointed_matmul_recomputed_in_the_backward_is_kept_apart():
  """Per layer: forward, dgrad and wgrad in the first pass, the forward again in the recompute."""
  def loss(x, w):
    def body(c, w_t):
      return jax.checkpoint(lambda c, w_t: jnp.tanh(c @ w_t))(c, w_t), None
    return jax.lax.scan(body, x, w)[0].sum()
  r = report(compiled_text(jax.grad(loss, argnums=(0, 1)), *SCAN_SHAPES))
  assert r["executed_flops"]["f32"] == 3 * T * 2 * M * K * K
  assert r["recompute_flops"] == T * 2 * M * K * K


def test_a_ragged_dot_contracting_its_groups_counts_each_row_once():
  """`ragged_dot_general`'s wgrad form, as a backend that keeps `ragged-dot` prints it: 8 groups of the 32 rows."""
  text = """ENTRY %m () -> f32[8,64,48] {
  %x = f32[32,64]{1,0} parameter(0)
  %g = f32[32,48]{1,0} parameter(1)
  %s = s32[8]{0} parameter(2)
  ROOT %r = f32[8,64,48]{2,1,0} ragged-dot(%x, %g, %s), lhs_contracting_dims={0}, rhs_contracting_dims={0}, lhs_ragged_dims={0}
}"""
  assert hlo.gemms(text)[0].flops == 2 * 32 * 64 * 48


def test_memory_traffic_counts_slices_and_in_place_updates_only():
  text = """%fused_read (p0: f32[16,64,64], p1: s32[]) -> f32[64,64] {
  %p0 = f32[16,64,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = f32[1,64,64]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,64,64}
  ROOT %b = f32[64,64]{1,0} bitcast(%ds)
}

%fused_write (q0: f32[16,64,64], q1: f32[64,64], q2: s32[]) -> f32[16,64,64] {
  %q0 = f32[16,64,64]{2,1,0} parameter(0)
  %q1 = f32[64,64]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %c1 = s32[] constant(0)
  %u = f32[1,64,64]{2,1,0} bitcast(%q1)
  ROOT %dus = f32[16,64,64]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %c1, %c1)
}

ENTRY %main (a: f32[16,64,64], i: s32[]) -> f32[16,64,64] {
  %a = f32[16,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %read = f32[64,64]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_read
  %double = f32[64,64]{1,0} add(%read, %read)
  %write = f32[16,64,64]{2,1,0} fusion(%a, %double, %i), kind=kLoop, calls=%fused_write
  %read-start = ((f32[16,64,64]{2,1,0}, s32[]), f32[64,64]{1,0}, u32[]) fusion-start(%a, %i), kind=kLoop, calls=%fused_read
  %read-done = f32[64,64]{1,0} fusion-done(%read-start)
  %write-start = ((f32[16,64,64]{2,1,0}, f32[64,64]{1,0}, s32[]), f32[16,64,64]{2,1,0}, u32[]) fusion-start(%write, %read-done, %i), kind=kLoop, calls=%fused_write
  ROOT %write-done = f32[16,64,64]{2,1,0} fusion-done(%write-start)
}"""
  p = hlo.Program(text)
  traffic = {k.name: k.bytes for k in hlo.memory_kernels(p)}
  tile = 64 * 64 * 4
  assert traffic["read"] == tile + tile + 4  # The slice read, the result written, the index.
  assert traffic["double"] == 3 * tile
  assert traffic["write"] == tile + tile + 4  # The update read and written in place, the index.
  # The same fusions run asynchronously (XLA's GPU pipeline with while-loop double buffering): the same bytes,
  # and the done moves none.
  assert traffic["read-start"] == traffic["read"] and traffic["write-start"] == traffic["write"]
  assert "read-done" not in traffic and "write-done" not in traffic
  # A value the step computes: the async read's slice, never the buffer the async write updates in place.
  assert {(v.shape, v.op_name) for v in hlo.values(p) if v.shape == "f32[16,64,64]"} == set()
  assert sum(v.shape == "f32[64,64]" for v in hlo.values(p)) == 3  # read, double, read-done.


def test_a_scatter_add_reads_the_rows_it_writes_and_a_bitcast_update_is_in_place():
  """An embedding's gradient scattered with add into a [1000, 64] buffer in place: it reads and writes the 10
  updated rows (and reads the updates and indices), never the whole buffer; an overwriting scatter reads none of
  the buffer; a dynamic-update-slice behind a bitcast root is in place too (XLA's emitter follows the bitcast); one
  that adds to the slot it overwrites reads that slot too, read through a bitcast of the buffer or not (the
  pipelined step's gradient accumulators, laid out transposed)."""
  text = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%take (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  ROOT %y = f32[] parameter(1)
}

%fused_add (p0: f32[1000,64], p1: s32[10,1], p2: f32[10,64]) -> f32[1000,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[10,1]{1,0} parameter(1)
  %p2 = f32[10,64]{1,0} parameter(2)
  ROOT %sc = f32[1000,64]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%fused_set (p0: f32[1000,64], p1: s32[10,1], p2: f32[10,64]) -> f32[1000,64] {
  %p0 = f32[1000,64]{1,0} parameter(0)
  %p1 = s32[10,1]{1,0} parameter(1)
  %p2 = f32[10,64]{1,0} parameter(2)
  ROOT %sc = f32[1000,64]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%take
}

%fused_dus (q0: f32[16,64,64], q1: f32[1,64,64], q2: s32[]) -> f32[16,4096] {
  %q0 = f32[16,64,64]{2,1,0} parameter(0)
  %q1 = f32[1,64,64]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %dus = f32[16,64,64]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %c, %c)
  ROOT %b = f32[16,4096]{1,0} bitcast(%dus)
}

%fused_accumulate (q0: f32[16,64,64], q1: f32[1,64,64], q2: s32[]) -> f32[16,64,64] {
  %q0 = f32[16,64,64]{2,1,0} parameter(0)
  %q1 = f32[1,64,64]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %cur = f32[1,64,64]{2,1,0} dynamic-slice(%q0, %q2, %c, %c), dynamic_slice_sizes={1,64,64}
  %sum = f32[1,64,64]{2,1,0} add(%cur, %q1)
  ROOT %dus = f32[16,64,64]{2,1,0} dynamic-update-slice(%q0, %sum, %q2, %c, %c)
}

%fused_accumulate_viewed (q0: f32[16,64,64], q1: f32[1,64,64], q2: s32[]) -> f32[16,64,64] {
  %q0 = f32[16,64,64]{2,1,0} parameter(0)
  %q1 = f32[1,64,64]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %flat = f32[16,4096]{1,0} bitcast(%q0)
  %cur = f32[1,4096]{1,0} dynamic-slice(%flat, %q2, %c), dynamic_slice_sizes={1,4096}
  %tile = f32[1,64,64]{2,1,0} bitcast(%cur)
  %sum = f32[1,64,64]{2,1,0} add(%tile, %q1)
  ROOT %dus = f32[16,64,64]{2,1,0} dynamic-update-slice(%q0, %sum, %q2, %c, %c)
}

ENTRY %main (t: f32[1000,64], i: s32[10,1], u: f32[10,64], a: f32[16,64,64], v: f32[1,64,64], j: s32[]) -> f32[1000,64] {
  %t = f32[1000,64]{1,0} parameter(0)
  %i = s32[10,1]{1,0} parameter(1)
  %u = f32[10,64]{1,0} parameter(2)
  %a = f32[16,64,64]{2,1,0} parameter(3)
  %v = f32[1,64,64]{2,1,0} parameter(4)
  %j = s32[] parameter(5)
  %summed = f32[1000,64]{1,0} fusion(%t, %i, %u), kind=kLoop, calls=%fused_add
  %set = f32[1000,64]{1,0} fusion(%summed, %i, %u), kind=kLoop, calls=%fused_set
  %moved = f32[16,4096]{1,0} fusion(%a, %v, %j), kind=kLoop, calls=%fused_dus
  %accumulated = f32[16,64,64]{2,1,0} fusion(%a, %v, %j), kind=kLoop, calls=%fused_accumulate
  %viewed = f32[16,64,64]{2,1,0} fusion(%a, %v, %j), kind=kLoop, calls=%fused_accumulate_viewed
  ROOT %r = f32[1000,64]{1,0} copy(%set)
}"""
  traffic = {k.name: k.bytes for k in hlo.memory_kernels(hlo.Program(text))}
  rows, indices, tile = 10 * 64 * 4, 10 * 4, 64 * 64 * 4
  assert traffic["summed"] == rows + indices + rows + rows  # The rows read, indices, updates, the rows written.
  assert traffic["set"] == indices + rows + rows
  assert traffic["moved"] == tile + 4 + tile
  assert traffic["accumulated"] == tile + tile + 4 + tile  # The slot read back, the update, the slot written.
  assert traffic["viewed"] == traffic["accumulated"]  # The slot read back through a view of the buffer too.


def test_slices_read_through_elementwise_ops_and_a_stacked_row_count_only_what_is_read():
  """Two reductions fused over one stacked parameter, each reading a row through `abs` (XLA's horizontal fusion of
  two layers' amaxes): the two rows, not the parameter. A kernel under ember's STACKED_ROW_SCOPE (a cast reading a
  layer's kernel where it lies in stacked kernels): one row of its stacked operand."""
  text = """HloModule m

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%fused_amaxes (p0: f32[4,64,64]) -> (f32[], f32[]) {
  %p0 = f32[4,64,64]{2,1,0} parameter(0)
  %abs = f32[4,64,64]{2,1,0} abs(%p0)
  %s0 = f32[1,64,64]{2,1,0} slice(%abs), slice={[0:1], [0:64], [0:64]}
  %s3 = f32[1,64,64]{2,1,0} slice(%abs), slice={[3:4], [0:64], [0:64]}
  %c = f32[] constant(-inf)
  %r0 = f32[] reduce(%s0, %c), dimensions={0,1,2}, to_apply=%max
  %r3 = f32[] reduce(%s3, %c), dimensions={0,1,2}, to_apply=%max
  ROOT %t = (f32[], f32[]) tuple(%r0, %r3)
}

ENTRY %main (w: f32[4,64,64], g: f32[1,1]) -> (f32[], f32[]) {
  %w = f32[4,64,64]{2,1,0} parameter(0)
  %g = f32[1,1]{1,0} parameter(1)
  %amaxes = (f32[], f32[]) fusion(%w), kind=kInput, calls=%fused_amaxes
  %cast = (u8[64,32], u8[0]) custom-call(%g, %w), custom_call_target="c", metadata={op_name="reads_one_row_of_4/c"}
  ROOT %out = (f32[], f32[]) copy(%amaxes)
}"""
  traffic = {k.name: k.bytes for k in hlo.memory_kernels(hlo.Program(text))}
  row = 64 * 64 * 4
  assert traffic["amaxes"] == 2 * row + 2 * 4
  assert traffic["cast"] == 4 + row + 64 * 32  # The scale, one row of the 4, the result.


def test_replica_groups_and_the_links_they_use():
  assert hlo.replica_groups("x, replica_groups=[4,2]<=[2,4]T(1,0), y") == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert hlo.replica_groups("x, replica_groups=[2,8]<=[16], y") == (tuple(range(8)), tuple(range(8, 16)))
  assert hlo.replica_groups("replica_groups={{0,1},{2,3}}") == ((0, 1), (2, 3))
  # Over the axes of a device mesh, as an h100x16 program with fsdp 8 x dcn_data 2 writes them (devices node-major):
  # fsdp's groups are the nodes, data's pair each GPU with its peer on the other node.
  mesh = "replica_groups=mesh['axis_0'=8,'axis_1'=1,'axis_2'=2], device_ids=([2,8]T(1,0)) {'axis_%d'}, use"
  assert hlo.replica_groups(mesh % 0) == (tuple(range(8)), tuple(range(8, 16)))
  assert hlo.replica_groups(mesh % 2) == tuple((d, d + 8) for d in range(8))
  assert hlo.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0', 'axis_1'}") == (tuple(range(8)),)
  assert hlo.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == ((0, 4), (1, 5), (2, 6), (3, 7))
  facts = hardware.facts("h100")
  two_nodes = cost.Machine(facts, 3.35e12, tuple(d // 8 for d in range(16)))
  inside = hlo.Collective("all-reduce", "f32[1000]", 4e9, 1, (tuple(range(8)), tuple(range(8, 16))), "")
  across = hlo.Collective("all-reduce", "f32[1000]", 4e9, 1, ((0, 8), (1, 9)), "")
  assert cost.collective_seconds(inside, two_nodes) == pytest.approx(4e9 * 2 * 7 / 8 / (facts.nvlink_gb_s * 1e9))
  assert cost.collective_seconds(across, two_nodes) == pytest.approx(4e9 * 2 * 1 / 2 / (facts.nic_gb_s * 1e9))


@needs_plugin
def test_causal_cudnn_attention_flops_forward_and_backward_the_rescoring_recomputed():
  b, l, h, d = 2, 512, 4, 64

  def loss(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()
  shape = ((b, l, h, d), jnp.bfloat16)
  r = report(compiled_text(jax.grad(loss, argnums=(0, 1, 2)), shape, shape, shape, target="h100x1"))
  forward = 2 * b * h * l * l * (d + d) / 2
  backward = 2 * b * h * l * l * (3 * d + 2 * d) / 2
  rescored = 2 * b * h * l * l * d / 2  # The backward kernel's QK^T, the forward's scores computed again.
  assert r["attention_flops"] == forward + backward - rescored
  assert r["recompute_flops"] == rescored


@needs_plugin
def test_an_fp8_gemm_on_the_h100():
  def f(a, b):
    return jax.lax.dot(a, b, preferred_element_type=jnp.float32)
  text = compiled_text(f, ((256, 512), jnp.float8_e4m3fn), ((512, 128), jnp.float8_e4m3fn), target="h100x1")
  assert hlo.gemm_census(text)["fp8"] == 1
  assert report(text)["executed_flops"]["fp8"] == 2 * 256 * 512 * 128


@needs_plugin
@pytest.mark.parametrize("m,k,n", [(8192, 8192, 8192), (8192, 64, 8192)])
def test_the_time_floor_of_one_gemm_is_its_roofline(m, k, n):
  """Compute-bound (the square GEMM) and memory-bound (the thin one): the floor is the larger of the FLOPs at
  the bf16 peak and the operands' and result's bytes at HBM bandwidth."""
  def f(a, b):
    return jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16)
  text = compiled_text(f, ((m, k), jnp.bfloat16), ((k, n), jnp.bfloat16), target="h100x1")
  assert hlo.gemm_census(text)["bf16"] == 1 and not hlo.memory_kernels(hlo.Program(text))
  facts = hardware.facts("h100")
  hand = max(2 * m * k * n / (facts.tflops["bf16"] * 1e12), 2 * (m * k + k * n + m * n) / hardware.gpu("h100").hbm_bytes_per_s)
  assert report(text, "h100x1")["time_floor_s"] == pytest.approx(hand, rel=1e-12)


@needs_plugin
def test_ragged_dot_expanded_by_the_gpu_compiler_shows_as_eight_times_the_work():
  """XLA's GPU compiler has no grouped GEMM for ragged_dot: each of the 8 groups' GEMMs runs over every row."""
  groups, rows, k, n = 8, 4096, 1024, 512

  def f(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
  text = compiled_text(f, ((rows, k), jnp.bfloat16), ((groups, k, n), jnp.bfloat16), ((groups,), jnp.int32),
                       target="h100x1")
  useful = 2 * rows * k * n  # Every row belongs to one group, whatever the sizes.
  ratio = sum(report(text)["executed_flops"].values()) / useful
  assert 7.5 <= ratio <= 8.5, ratio
  copy = cost.largest_expert_copy(hlo.Program(text), local_experts=groups, rows=rows)
  assert copy is not None and copy["bytes"] >= groups * rows * k * 2, copy  # The masked bf16 copy of x per group.


def test_memory_by_op_groups_the_memory_term_by_op_and_pass():
  """A hand-written program: two forward kernels of one op, one backward, one recomputed, one of a pipeline tick's
  backward work outside autodiff (BACKWARD_SCOPE); the rows add up to the memory term, largest first, and name each
  op by its last part and its pass."""
  op = lambda name: f'metadata={{op_name="jit(f)/{name}"}}'
  text = f"""HloModule m

ENTRY %main (a: f32[1024], b: f32[256], d: f32[512]) -> (f32[1024], f32[1024], f32[256], f32[256]) {{
  %a = f32[1024]{{0}} parameter(0)
  %b = f32[256]{{0}} parameter(1)
  %d = f32[512]{{0}} parameter(2)
  %w = f32[512]{{0}} log(%d), {op("shard_map/while/body/backward_tick/dynamic_update_slice")}
  %x = f32[1024]{{0}} negate(%a), {op("jvp()/quantize/convert_element_type")}
  %y = f32[1024]{{0}} abs(%a), {op("jvp()/quantize/convert_element_type")}
  %z = f32[256]{{0}} exponential(%b), {op("transpose(jvp())/quantize/reduce_max")}
  %r = f32[256]{{0}} sine(%b), {op("transpose(jvp())/checkpoint/rematted_computation/sin")}
  %c = f32[256]{{0}} cosine(%b)
  ROOT %t = (f32[1024]{{0}}, f32[1024]{{0}}, f32[256]{{0}}, f32[256]{{0}}, f32[256]{{0}}, f32[512]{{0}}) tuple(%x, %y, %z, %r, %c, %w)
}}"""
  p = hlo.Program(text)
  rows = cost.memory_by_op(p)
  # A kernel with no op name (XLA's own: a combined gradient reduce-scatter, a copy) is of no pass it can name.
  assert rows == [{"op": "convert_element_type", "pass": "fwd", "bytes": 2 * 2 * 1024 * 4},
                  {"op": "dynamic_update_slice", "pass": "bwd", "bytes": 2 * 512 * 4},
                  {"op": "reduce_max", "pass": "bwd", "bytes": 2 * 256 * 4},
                  {"op": "sin", "pass": "remat", "bytes": 2 * 256 * 4},
                  {"op": "(cosine)", "pass": "unnamed", "bytes": 2 * 256 * 4}]
  assert sum(r["bytes"] for r in rows) == sum(k.bytes * k.times for k in hlo.memory_kernels(p))
