"""RMSNorm over residual rows in one pass each way: Pallas kernels for the norm that reads the residual stream.

Written by XLA, a layer's norm of its residual rows [tokens, D] reads each row more often than its arithmetic needs:
the forward pass twice (the mean square, then the normalize and cast), and the backward pass twice more (the row
dot product of the gradient with x, then the gradient itself, the residual's own gradient added there): XLA does
not put a row reduction and the elementwise work that reads its result in one kernel. These kernels hold a row in
registers and do both:
  forward    read x, write y = x * rsqrt(mean(x**2) + eps) * scale (in the activation dtype);
  backward   read x, dy and dh, write dx = dh + the norm's gradient, and per program the scale's partial gradient.
The backward pass takes the mean square again from the x it reads (no saved statistics: nothing for a remat
policy to keep or recompute), and `rms_norm_rows` returns x beside y so that the gradient of the residual's other
reads (the add after the attention or the MLP) arrives with the norm's and joins it in the same kernel.
On llama3_8b (h100x8, bf16, `full`, scanned) that is 4 of 9 row-passes a norm, 64 norms a step (docs/performance.md).

Numerics: the reference's formula in float32 in the same order (`RMSNorm.__call__`); the sums run in the kernel's
order, so a result may differ from XLA's in the last bit (tests/layers/test_norm_kernel.py runs the kernels in
interpret mode on the CPU against a float64 derivative worked by hand, and in bf16 against autodiff of the
reference).

Where it runs (`runs`): on a GPU, 2-d rows whose width is a power of two (Triton's blocks) and whose rows divide
among the devices in whole programs. Lowered with Pallas' Triton backend (a `__gpu$xla.gpu.triton` custom call the
compile report counts by its bytes); `custom_partitioning` runs it on each device's rows, the width gathered
whole where it is split. A program holds one row of D at a time, D / 1024 warps (D / 128 float32 values a thread
an array). Not yet timed on a GPU: the backward pass runs rows / 32 programs, few where a device holds few rows
(1,024 rows are 32 programs on 132 SMs); more programs would write more of the scale's partial sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ember.platform import target_platform
from ember.quant import kernels, partitioning

CHUNK = 1  # Rows a kernel step holds in registers.
ROWS = 32  # Rows a backward program walks, summing the scale's gradient: its partials are f32[tokens / 32, D].
_MAX_WIDTH = 16384
SCOPE = "rms_norm_kernel"  # The kernels' name scope: their row in the compile report's `memory_by_op`.


def runs(x: jax.Array) -> bool:
  """Whether `rms_norm_rows` runs the kernels on `x` (see the module doc)."""
  return target_platform() == "gpu" and tiles(x.shape) and kernels.splits_evenly(x.shape[:1], ROWS)


def tiles(shape) -> bool:
  """Whether the kernels tile rows of `shape` on one device: 2-d, whole backward programs, a power-of-two width."""
  return len(shape) == 2 and shape[0] % ROWS == 0 and shape[1] & (shape[1] - 1) == 0 and shape[1] <= _MAX_WIDTH


def _check(x):
  if not tiles(x.shape):
    raise ValueError(f"rms_norm_rows: rows of a power-of-two width up to {_MAX_WIDTH}, a multiple of {ROWS} of them, "
                     f"got {x.shape}")


def _warps(width: int) -> int:
  return min(max(width // 1024, 4), 16)


def reference(x, scale, eps: float, dtype):
  """RMSNorm of x's last axis times `scale`, in float32, cast to `dtype`: the formula the kernels compute."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def rms_norm_rows(x, scale, eps: float, dtype, forward_kernel: bool = True, interpret: bool = False):
  """(x, RMSNorm of x's rows times `scale`, in `dtype`): x is handed back so that its gradient from later reads
  joins the norm's in one kernel (module doc). `forward_kernel`: the forward pass in its kernel; else XLA's,
  which fuses the norm into a quantizer that reads it (the kernel would write y for the quantizer to read back).
  `interpret`: run the Pallas kernels in interpret mode."""
  if not forward_kernel:
    return x, reference(x, scale, eps, dtype)
  with jax.named_scope(SCOPE):
    return x, _forward(x, scale, eps, jnp.dtype(dtype), interpret)


def _vjp_forward(x, scale, eps, dtype, forward_kernel, interpret):
  return rms_norm_rows(x, scale, eps, dtype, forward_kernel, interpret), (x, scale)


def _vjp_backward(eps, dtype, forward_kernel, interpret, residuals, cotangents):
  del forward_kernel
  x, scale = residuals
  dh, dy = cotangents
  with jax.named_scope(SCOPE):
    dx, partials = _backward(x, scale, dy.astype(jnp.dtype(dtype)), dh.astype(x.dtype), eps, interpret)
  return dx, partials.sum(axis=0).astype(scale.dtype)


rms_norm_rows.defvjp(_vjp_forward, _vjp_backward)


# --- The kernels -------------------------------------------------------------------------------------------


def _inverse_rms(x, eps):
  return jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)


def _forward_kernel(x_ref, scale_ref, y_ref, *, eps):
  x = x_ref[...].astype(jnp.float32)
  y_ref[...] = (x * _inverse_rms(x, eps) * scale_ref[...].astype(jnp.float32)[None, :]).astype(y_ref.dtype)


def _backward_kernel(x_ref, scale_ref, dy_ref, dh_ref, dx_ref, partial_ref, *, eps):
  scale = scale_ref[...].astype(jnp.float32)[None, :]
  width = x_ref.shape[1]

  def step(i, partial):
    rows = pl.ds(i * CHUNK, CHUNK)
    x = x_ref[rows, :].astype(jnp.float32)
    dy = dy_ref[rows, :].astype(jnp.float32)
    inverse = _inverse_rms(x, eps)
    g = dy * scale
    # y = x r with r = (mean(x^2) + eps)^-1/2: dx = g r - x r^3 sum(g x) / D.
    through_r = jnp.sum(g * x, axis=1, keepdims=True) * (inverse * inverse * inverse) / width
    dx_ref[rows, :] = (dh_ref[rows, :].astype(jnp.float32) + (g * inverse - x * through_r)).astype(dx_ref.dtype)
    return partial + jnp.sum(dy * (x * inverse), axis=0)

  partial_ref[...] = jax.lax.fori_loop(0, ROWS // CHUNK, step, jnp.zeros((width,), jnp.float32))[None, :]


def _forward_call(x, scale, eps, dtype, interpret):
  _check(x)
  rows, width = x.shape
  return kernels.pallas(
      functools.partial(_forward_kernel, eps=eps), (rows // CHUNK,),
      [pl.BlockSpec((CHUNK, width), lambda i: (i, 0)), pl.BlockSpec((width,), lambda i: (0,))],
      pl.BlockSpec((CHUNK, width), lambda i: (i, 0)), jax.ShapeDtypeStruct((rows, width), dtype),
      interpret, _warps(width))(x, scale)


def _backward_call(x, scale, dy, dh, eps, interpret):
  _check(x)
  rows, width = x.shape
  row_block = pl.BlockSpec((ROWS, width), lambda i: (i, 0))
  return kernels.pallas(
      functools.partial(_backward_kernel, eps=eps), (rows // ROWS,),
      [row_block, pl.BlockSpec((width,), lambda i: (0,)), row_block, row_block],
      [row_block, pl.BlockSpec((1, width), lambda i: (i, 0))],
      [jax.ShapeDtypeStruct((rows, width), x.dtype), jax.ShapeDtypeStruct((rows // ROWS, width), jnp.float32)],
      interpret, _warps(width))(x, scale, dy, dh)


# --- Each device its rows (custom_partitioning) ------------------------------------------------------------


def _row_spec(mesh, shape, rows_per_program: int):
  """The rows' mesh axes where each device's rows are whole programs, else none; the width is never split."""
  rows_axes, _ = kernels.block_sharded_axes(mesh, shape, rows_per_program)
  return P(rows_axes, None)


@functools.partial(custom_partitioning, static_argnums=(2, 3, 4))
def _forward(x, scale, eps, dtype, interpret):
  return _forward_call(x, scale, eps, dtype, interpret)


@partitioning.rule
def _forward_partition(eps, dtype, interpret, mesh, arg_shapes, result_shape):
  rows = NamedSharding(mesh, _row_spec(mesh, arg_shapes[0], CHUNK))
  return (mesh, lambda x, scale: _forward_call(x, scale, eps, dtype, interpret), rows,
          (rows, NamedSharding(mesh, P(None))))


@partitioning.rule
def _forward_infer(eps, dtype, interpret, mesh, arg_shapes, result_shape):
  return NamedSharding(mesh, _row_spec(mesh, arg_shapes[0], CHUNK))


def _forward_rule(eps, dtype, interpret, mesh, operand_types, result_types):
  del eps, dtype, interpret, mesh, operand_types, result_types
  return "r d, d -> r d", dict(need_replication_factors=("d",))


_forward.def_partition(partition=_forward_partition, infer_sharding_from_operands=_forward_infer,
                       sharding_rule=_forward_rule)


@functools.partial(custom_partitioning, static_argnums=(4, 5))
def _backward(x, scale, dy, dh, eps, interpret):
  return _backward_call(x, scale, dy, dh, eps, interpret)


@partitioning.rule
def _backward_partition(eps, interpret, mesh, arg_shapes, result_shape):
  rows = NamedSharding(mesh, _row_spec(mesh, arg_shapes[0], ROWS))
  return (mesh, lambda x, scale, dy, dh: _backward_call(x, scale, dy, dh, eps, interpret), (rows, rows),
          (rows, NamedSharding(mesh, P(None)), rows, rows))


@partitioning.rule
def _backward_infer(eps, interpret, mesh, arg_shapes, result_shape):
  rows = NamedSharding(mesh, _row_spec(mesh, arg_shapes[0], ROWS))
  return rows, rows


def _backward_rule(eps, interpret, mesh, operand_types, result_types):
  del eps, interpret, mesh, operand_types, result_types
  return ("(r i) d, d, (r i) d, (r i) d -> (r i) d, r d",
          dict(need_replication_factors=("i", "d"), i=ROWS))


_backward.def_partition(partition=_backward_partition, infer_sharding_from_operands=_backward_infer,
                        sharding_rule=_backward_rule)
