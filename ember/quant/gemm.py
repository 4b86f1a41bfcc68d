"""How a block-scaled GEMM (mxfp8, nvfp4) runs on the platform it is compiled for: one rule, beside the
recipe table (quant/recipe.py).

    native     GPUs of compute capability >= 10 (Blackwell): `jax.nn.scaled_matmul`, which XLA compiles to
               cuDNN's block-scaled GEMM (`__cudnn$blockScaledDot`) fed with the operands' own data (E4M3 /
               E2M1) and block scales (E8M0 per 32 / E4M3 per 16) on the tensor cores' native formats.
    scaled_dot CPU: `jax.lax.scaled_dot` on the same data and scales, the same product in float32: the
               reference the native path is tested against.
    emulated   other GPUs (Hopper has no block-scaled tensor cores): the block-dequantized operands (exact
               in bf16) and a bf16 GEMM, under the name scope `EMULATED_GEMM_SCOPE` so that the compile report
               counts these GEMMs as emulated, not as bf16 work of their own.

Output dtype (`output_dtype`, the one rule for every quantized GEMM, per-tensor ones included): on a GPU a GEMM
writes its consumer's dtype (bf16 for the next layer's math, float32 for a weight gradient): cuBLASLt and cuDNN
round their float32 accumulators in the epilogue, so no float32 result is written to memory and read back to be
cast. That is the same value as float32 out and a cast after. On the CPU, the reference, GEMMs write float32 and
the caller casts: the CPU's kernels for a bf16 result accumulate differently. A result that still has a float32
factor to take (a per-expert FP8 or NVFP4 scale vector) is written in float32 and cast after that product; NVFP4's
one tensor scale of a bf16 result is cuDNN's own (below).

Every path contracts the operands' own block layout: the contraction axis is the one they were quantized
along (NVFP4's 16x16 weight tiles serve either axis: each tile's scale is repeated along the other). NVFP4's
tensor scales multiply the *output* in every path (they factor out of the sum); folded into bf16 operands they
would round every element.

The tensor-scale rule (`_scale_rounds`, every path alike): the product of the operands' float32 tensor scales
multiplies the float32 accumulator. For a result rounded to bf16 for the next layer's math (the forward and dgrad
GEMMs of a dense projection) that product is first rounded to bf16, because that is how cuDNN's GEMM takes it:
as its global scale, which XLA's call accepts only in the result's dtype. Taken inside the GEMM, the scale costs
no pass of its own; taken after it, the GEMM wrote its whole result in float32 and a pass read it back to scale
and cast it (80 GB a step, llama3_8b on b200x8). The rounding is at most 2^-9 of the scale, the size of the
rounding every element of that bf16 result takes anyway, and one bias for the whole tensor. A weight gradient
(whatever dtype it is reduced in) and the capacity layout's per-expert scales (a vector, not cuDNN's scalar) take
the float32 product. Per-tensor FP8 recipes never come here: their dequantize-then-dot pattern is what XLA
rewrites into cuBLASLt's FP8 GEMM (quant/dot.py, quant/batched.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ember.names import BLOCK_SCALED_GEMM_SCOPE, EMULATED_GEMM_SCOPE
from ember.platform import target_compute_capability, target_platform
from ember.quant import partitioning
from ember.quant.recipe import SCHEMES
from ember.quant.tensor import QuantizedTensor, block_axes, block_broadcast
from ember.quant.varying import varying_as

NATIVE, SCALED_DOT, EMULATED = "native", "scaled_dot", "emulated"
BLACKWELL = (10, 0)  # The first compute capability with block-scaled tensor cores.
ADA = (8, 9)  # The first compute capability with FP8 tensor cores.
F32 = jnp.float32
# The library calls XLA compiles a GEMM on the low-precision tensor cores to (read by ember/program/hlo.py too).
CUBLAS_FP8_GEMM = "__cublas$lt$matmul$f8"  # cuBLASLt's FP8 GEMM: per-tensor FP8 (quant/dot.py's pattern).
CUDNN_BLOCK_SCALED_GEMM = "__cudnn$blockScaledDot"  # cuDNN's block-scaled GEMM: MXFP8 / NVFP4 on `NATIVE`.
BLOCK_SCALED_DOT_CALL = "__op$block_scaled_dot"  # XLA's call that its GPU compiler turns into cuDNN's.
GLOBAL_SCALE, PER_BATCH_SCALE = "global", "per_batch"  # How cuDNN's GEMM takes NVFP4's tensor scales.


def block_gemm_path(platform: str | None = None, compute_capability: tuple[int, int] | None = None) -> str:
  """The path of a block-scaled GEMM traced now (or for `platform` / `compute_capability`): see the module doc."""
  platform = platform or target_platform()
  if platform == "cpu":
    return SCALED_DOT
  cc = compute_capability if compute_capability is not None else target_compute_capability()
  return NATIVE if platform == "gpu" and cc is not None and tuple(cc) >= BLACKWELL else EMULATED


def tensor_core_gemm(recipe, compute_capability: tuple[int, int] | None) -> str | None:
  """The library call `recipe`'s GEMMs compile to on a GPU of `compute_capability` when they reach its
  low-precision tensor cores; None where they have none to reach (bf16, block-scaled before Blackwell, FP8
  before Ada). A compiled step of that recipe without one runs its GEMMs in another precision."""
  if not recipe.quantized or compute_capability is None:
    return None
  if recipe.scheme.block_size > 1:
    return CUDNN_BLOCK_SCALED_GEMM if tuple(compute_capability) >= BLACKWELL else None
  return CUBLAS_FP8_GEMM if tuple(compute_capability) >= ADA else None


def output_dtype(dtype, platform: str | None = None) -> jnp.dtype:
  """The dtype a quantized GEMM whose consumer wants `dtype` writes (see the module doc)."""
  return jnp.dtype(dtype) if (platform or target_platform()) == "gpu" else jnp.dtype(F32)


def block_scaled_dot(a: QuantizedTensor, b: QuantizedTensor, contracting: tuple[int, int], *, batched: bool,
                     dtype, out=F32, split: tuple[str, ...] = (), weight_gradient: bool = False) -> jax.Array:
  """a . b contracting a's axis `contracting[0]` with b's `contracting[1]` (each the axis it was quantized
  along): [batch?, a's free axis, b's free axis], as `jax.lax.dot_general` orders them, with the leading axis
  a batch axis when `batched` (experts in the capacity layout). `dtype`: the emulated GEMM's operand dtype;
  `out`: the dtype the consumer wants (the GEMM writes `output_dtype(out)`; where tensor scales are still to be
  taken, cuDNN's GEMM takes them as its alpha when it writes a narrower dtype, the others write float32 first).
  `split`: the mesh axes (the compiler's, inside a shard_map) the contraction is split over, in its order: cuDNN's
  GEMM then multiplies each device's part as a batch of its own and the parts are summed after it
  (`_split_contraction`), where its partition rule could not sum them (quant/partitioning.py).
  `weight_gradient`: the result is a weight's gradient, which takes NVFP4's tensor scales in float32 whatever its
  dtype (the module doc's tensor-scale rule)."""
  rounds = _scale_rounds(batched, out, weight_gradient)
  scaled = _has_tensor_scale(a) or _has_tensor_scale(b)
  path = block_gemm_path()
  if path == EMULATED:
    dims = ((contracting[:1], contracting[1:]), ((0,), (0,)) if batched else ((), ()))
    with jax.named_scope(EMULATED_GEMM_SCOPE):
      y = jax.lax.dot_general(_dequantize_blocks(a, dtype), _dequantize_blocks(b, dtype), dims,
                              preferred_element_type=F32 if scaled else output_dtype(out))
  else:
    (da, sa), (db, sb) = _rows_by_blocks(a, contracting[0], batched), _rows_by_blocks(b, contracting[1], batched)
    parts = _parts(split, da, sa) if path == NATIVE and not batched else 1
    if parts > 1:
      da, sa, db, sb = (_split_contraction(t, parts, split) for t in (da, sa, db, sb))
    if path == NATIVE:
      # NVFP4's tensor scales go inside cuDNN's call where its result is rounded to a narrower dtype (so
      # partial sums over a split contraction are added in that dtype), after it for a float32 result (a weight
      # gradient: the product then runs on the reduce-scattered shard, not over every device's whole result).
      written = jnp.dtype(output_dtype(out))
      inside = scaled and written != F32
      alpha = jnp.ones((da.shape[0],), F32)
      scaling = ""
      if inside:
        alpha = jnp.broadcast_to(_result_scale(a, b, batched, rounds).reshape(-1), alpha.shape)
        scaling = GLOBAL_SCALE if rounds else PER_BATCH_SCALE
      with jax.named_scope(BLOCK_SCALED_GEMM_SCOPE):  # Names the partitioned region's kernels in `memory_by_op`.
        y = _cudnn_block_scaled_matmul(_bytes(da), _bytes(db), _bytes(sa), _bytes(sb), alpha, da.dtype, sa.dtype,
                                       written, scaling)
      if parts > 1:
        y = jnp.sum(y, axis=0, keepdims=True, dtype=written)  # The parts' partial sums, in the dtype written.
      if scaled and not inside:
        y = y * _result_scale(a, b, batched, rounds)
      scaled = False  # Taken.
    else:
      y = jax.lax.scaled_dot(da, db, lhs_scale=sa, rhs_scale=sb, dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                             preferred_element_type=F32)
    y = varying_as(y, da, db)
    y = y if batched else y[0]
  if scaled:
    y = y * _result_scale(a, b, batched, rounds)
  return y.astype(out)


def _result_scale(a: QuantizedTensor, b: QuantizedTensor, batched: bool, rounds: bool) -> jax.Array:
  """The float32 factor a block-scaled GEMM's accumulator is multiplied by: the product of a's and b's tensor
  scales, rounded to bf16 first where `rounds` (`_scale_rounds`), as cuDNN's GEMM then takes it."""
  s = _tensor_scale(a, batched) * _tensor_scale(b, batched)
  return s.astype(jnp.bfloat16).astype(F32) if rounds else s


def _scale_rounds(batched: bool, out, weight_gradient: bool) -> bool:
  """The module doc's tensor-scale rule: a forward or dgrad result rounded to bf16 (one GEMM, not the capacity
  layout's batch of experts) takes its tensor scale in bf16."""
  return not batched and not weight_gradient and jnp.dtype(out) == jnp.bfloat16


def _parts(split: tuple[str, ...], data: jax.Array, scale: jax.Array) -> int:
  """How many parts of its contraction a [1, R, K] operand is multiplied in: the devices of the mesh axes `split`,
  where each holds whole blocks of it (else 1: the contraction is gathered)."""
  mesh = jax.sharding.get_abstract_mesh()
  parts = math.prod(mesh.shape[a] for a in split) if split and not mesh.empty else 1
  return parts if data.shape[-1] % parts == 0 and scale.shape[-1] % parts == 0 else 1


def _split_contraction(t: jax.Array, parts: int, split: tuple[str, ...]) -> jax.Array:
  """[1, R, K] -> [parts, R, K / parts], the parts split over the mesh axes `split` as K is: each device's own
  rows of the contraction as a batch entry of its own, moved nowhere where the rows are split over `split` in
  that order as whole parts (on its device the split axis has one)."""
  _, r, k = t.shape
  t = jnp.transpose(t.reshape(r, parts, k // parts), (1, 0, 2))
  free = P.UNCONSTRAINED  # R stays as the compiler has it (split over a tensor axis, say).
  return jax.lax.with_sharding_constraint(t, NamedSharding(jax.sharding.get_abstract_mesh(), P(split, free, free)))


def _bytes(t: jax.Array) -> jax.Array:
  """t's bits as uint8 along its last axis (E2M1 packed two to a byte: [..., K] -> [..., K / 2])."""
  if jnp.finfo(t.dtype).bits == 4:
    t = t.reshape(*t.shape[:-1], t.shape[-1] // 2, 2)
  return jax.lax.bitcast_convert_type(t, jnp.uint8)


def _from_bytes(t: jax.Array, dtype) -> jax.Array:
  """`_bytes`' inverse."""
  t = jax.lax.bitcast_convert_type(t, dtype)
  return t.reshape(*t.shape[:-2], -1) if jnp.finfo(dtype).bits == 4 else t


@functools.partial(custom_partitioning, static_argnums=(5, 6, 7, 8))
def _cudnn_block_scaled_matmul(a_bytes, b_bytes, a_scale_bytes, b_scale_bytes, alpha_B, data_dtype, scale_dtype,
                               out_dtype, scaling):
  """`jax.nn.scaled_matmul` ([B, M, K] x [B, N, K] -> [B, M, N]), times alpha (float32 [B]: NVFP4's tensor scales;
  `scaling`: "" none, GLOBAL_SCALE one for all B, PER_BATCH_SCALE one per batch entry), written in `out_dtype`,
  with the data and block scales handed over as bytes (`_bytes`).
  Why bytes: the GEMM's own partitioning moves the operands to its layout (an FSDP gather of a quantized weight,
  an all-to-all that resplits it), and NCCL has no E2M1, E4M3 or E8M0 type: XLA converted E2M1 data to float16 to
  move it, four times the bytes, and back. As uint8 the same collectives move the bits. Why alpha inside (for a result
  rounded to a narrower dtype; `block_scaled_dot` scales a float32 one after): the result leaves in `out_dtype`
  already scaled, so partial sums over a split contraction are added in that dtype. A global scale is cuDNN's, in
  `out_dtype` (exact: `_result_scale` rounded it so), where one GEMM runs on this device; per batch entry (the
  capacity layout's experts), or for several parts of a split contraction, alpha multiplies a float32 result."""
  a, b = _from_bytes(a_bytes, data_dtype), _from_bytes(b_bytes, data_dtype)
  a_scale, b_scale = _from_bytes(a_scale_bytes, scale_dtype), _from_bytes(b_scale_bytes, scale_dtype)
  if not scaling:
    return jax.nn.scaled_matmul(a, b, a_scale, b_scale, preferred_element_type=out_dtype)
  if scaling == GLOBAL_SCALE and alpha_B.shape[0] == 1:
    return _scaled_matmul_with_global_scale(a, b, a_scale, b_scale, alpha_B[0].astype(out_dtype))
  y = jax.nn.scaled_matmul(a, b, a_scale, b_scale, preferred_element_type=F32)
  return (y * alpha_B[:, None, None]).astype(out_dtype)


def _scaled_matmul_with_global_scale(a, b, a_scale, b_scale, global_scale):
  """`jax.nn.scaled_matmul` with cuDNN's global scale, which JAX's own call does not take: XLA's block-scaled dot
  call (`BLOCK_SCALED_DOT_CALL`, the one `jax.nn.scaled_matmul` lowers to) with the scalar as a fifth operand,
  its dtype the result's. XLA multiplies the float32 accumulator by it in cuDNN's epilogue (cuDNN >= 9.13;
  an older cuDNN gets the product after the call, in the result's dtype)."""
  result = jax.ShapeDtypeStruct((a.shape[0], a.shape[1], b.shape[1]), global_scale.dtype)
  return jax.ffi.ffi_call(BLOCK_SCALED_DOT_CALL, result)(a, b, a_scale, b_scale, global_scale)


def _overlap(x, y) -> bool:
  return bool(set(partitioning.entry_axes(x)) & set(partitioning.entry_axes(y)))


@partitioning.rule
def _partition(data_dtype, scale_dtype, out_dtype, scaling, mesh, arg_shapes, result_shape):
  """Each device multiplies its rows (M) by its columns (N) over the contraction (K) that both operands
  split alike, summed across it; anything else is gathered first. Scales share their data's layout. Inside a
  shard_map over part of the mesh no sum can be named (quant/partitioning.py): a split contraction is gathered
  there, and the weight gradients' GEMMs, which contract rows split across devices, take the split outside as
  a batch of their own (`block_scaled_dot`'s `split`).

  An operand gathered whole whose contraction is split and whose rows are not (an FSDP-sharded kernel read
  along its sharded axis: the forward GEMM's `wi`, the dgrad's `wo`) is gathered along its rows instead: its
  shard is resplit by rows first (an all-to-all of the shard) and the gather then concatenates whole rows. Along
  the contraction, the last axis, XLA gathered and then transposed the whole gathered operand (7 GB a step of
  NVFP4 weights, llama3_8b on b200x8)."""
  (batch, m, k_a), (_, n, k_b) = arg_shapes[0].sharding.spec, arg_shapes[1].sharding.spec
  n = None if _overlap(m, n) else n
  k = k_a if (k_a is not None and k_a == k_b and not _overlap(k_a, m) and not _overlap(k_a, n)
              and partitioning.collectives(mesh)) else None
  a_rows = _gathered_by_rows(m, k_a, k, mesh, arg_shapes[0], arg_shapes[2])
  b_rows = _gathered_by_rows(n, k_b, k, mesh, arg_shapes[1], arg_shapes[3])
  lhs, rhs = NamedSharding(mesh, P(batch, a_rows or m, k)), NamedSharding(mesh, P(batch, b_rows or n, k))

  def per_device(a, b, a_scale_bytes, b_scale_bytes, alpha_B):
    if a_rows:
      a, a_scale_bytes = (jax.lax.all_gather(t, a_rows, axis=1, tiled=True) for t in (a, a_scale_bytes))
    if b_rows:
      b, b_scale_bytes = (jax.lax.all_gather(t, b_rows, axis=1, tiled=True) for t in (b, b_scale_bytes))
    # Partial sums over a split contraction are added in the dtype the GEMM writes, as XLA adds those of any
    # other GEMM (a float32 weight gradient in float32, a bf16 one in bf16): the sum followed by the slice
    # of the result's sharding is then one reduce-scatter.
    y = _cudnn_block_scaled_matmul(a, b, a_scale_bytes, b_scale_bytes, alpha_B, data_dtype, scale_dtype, out_dtype,
                                   scaling)
    return y if k is None else jax.lax.psum(y, k)

  return mesh, per_device, NamedSharding(mesh, P(batch, m, n)), (lhs, rhs, lhs, rhs, NamedSharding(mesh, P(batch)))


def _gathered_by_rows(rows, contraction, summed, mesh, data, scale):
  """The mesh axes to gather an operand over along its rows (`_partition`'s doc): its contraction's, where the
  GEMM gathers that contraction (it sums none), the rows are whole and both data and scales split evenly by rows
  over those axes; else None."""
  if summed is not None or contraction is None or rows is not None or not partitioning.collectives(mesh):
    return None
  axes = partitioning.entry_axes(contraction)
  size = math.prod(mesh.shape[a] for a in axes)
  return axes if data.shape[1] % size == 0 and scale.shape[1] % size == 0 else None


@partitioning.rule
def _infer(data_dtype, scale_dtype, out_dtype, scaling, mesh, arg_shapes, result_shape):
  (batch, m, _), (_, n, _) = arg_shapes[0].sharding.spec, arg_shapes[1].sharding.spec
  return NamedSharding(mesh, P(batch, m, None if _overlap(m, n) else n))


_cudnn_block_scaled_matmul.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                                         sharding_rule="b m k, b n k, b m k, b n k, b -> b m n")


def _member_axes(q: QuantizedTensor) -> tuple[int, tuple[int, ...], int]:
  """(offset, blocked axes, contraction axis) of q in its full array: a per-expert kernel (leaves stacked
  over a leading E by vmap, its amax [E]) keeps its members' static axes, one to the right."""
  offset = 1 if q.amax.ndim else 0
  return offset, tuple(d + offset for d in block_axes(q.data.ndim - offset, q.axis, q.block)), q.axis + offset


def _rows_by_blocks(q: QuantizedTensor, axis: int, batched: bool) -> tuple[jax.Array, jax.Array]:
  """q's data [B, R, K] and block scales [B, R, K / block] with the contraction axis `axis` last (the layout
  both `jax.nn.scaled_matmul` and this module's `scaled_dot` call take); B = 1 unless `batched`."""
  _, blocked, quantized_axis = _member_axes(q)
  if axis not in blocked or (len(q.block) == 1 and axis != quantized_axis):
    raise ValueError(f"block-scaled GEMM: operand blocked along {blocked} cannot contract axis {axis}")
  scale = q.scale_inv
  for d, size in zip(blocked, q.block):
    if d != axis:  # A 16x16 tile's scale serves each of its rows along the contraction.
      scale = jnp.repeat(scale, size, axis=d)
  free = [d for d in range(q.data.ndim) if d != axis and not (batched and d == 0)]
  order = ([0] if batched else []) + free + [axis]
  data, scale = jnp.transpose(q.data, order), jnp.transpose(scale, order)
  return (data, scale) if batched else (data[None], scale[None])


def _dequantize_blocks(q: QuantizedTensor, dtype) -> jax.Array:
  """data x block scale in `dtype`, without the tensor scale: exact in bf16 for E4M3 x E8M0 and E2M1 x E4M3."""
  _, blocked, _ = _member_axes(q)
  s = block_broadcast(q.scale_inv.astype(F32), q.data.shape, blocked, q.block)
  return (q.data.astype(F32) * s).astype(dtype)


def _has_tensor_scale(q: QuantizedTensor) -> bool:
  """Whether q carries a float32 tensor scale beside its block scales (NVFP4; MXFP8's is always 1.0)."""
  return SCHEMES[q.recipe].tensor_scale


def _tensor_scale(q: QuantizedTensor, batched: bool) -> jax.Array:
  """NVFP4's float32 tensor scale (1.0 for MXFP8), each expert's along E for a per-expert kernel."""
  g = q.global_scale_inv.astype(F32)
  return g.reshape(-1, 1, 1) if (batched and g.ndim == 1) else g
