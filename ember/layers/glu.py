"""SwiGLU, the MLP's activation, as a prologue of the down projection's GEMM: its backward pass in one kernel.

The backward pass of a layer's MLP reads the gate/up pair twice: once to make silu(gate) * up again (what the down
projection's weight gradient reads, which no policy but `none` keeps: `minimal` keeps the pair), and
once more for the pair's gradient from the activation's. XLA runs them as two kernels (one writes [rows, F], the
other [rows, 2, F]: no shared loop). `SwiGLU` is handed to the down projection's bf16 GEMM
(quant/unquantized.py's `prologue`), whose backward pass computes the activation's gradient first (dgrad needs only
the output's gradient and the weight), then calls `backward`: one kernel reading the pair and that gradient once
and writing both the activation (for wgrad) and the pair's gradient. On llama3_8b (h100x8, bf16) that is one read
of [rows, 2, F] less per layer a step: 15 GB (docs/performance.md).

Numerics: the kernel computes in float32 and rounds each output once to the activation dtype; the derivative of
silu(g) = g sigmoid(g) is sigmoid(g) (1 + g (1 - sigmoid(g))). `forward` is XLA's, which may round silu(g) before
the multiply: the product wgrad reads may then be a bf16 step from the one the forward GEMM read. Off a GPU, or
where the kernel does not tile the shapes, `backward` is autodiff of `forward` (tests/layers/test_glu.py runs the
kernel in interpret mode on the CPU against a float64 derivative).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ember.platform import target_platform
from ember.quant import kernels, partitioning

_ROW_TILES = (8,)
_COLUMN_TILES = (256, 128)  # Powers of two (Triton's blocks); F = 14336 is 7 x 2048.
SCOPE = "swiglu_backward"  # The kernel's name scope: its row in the compile report's `memory_by_op`.


@dataclasses.dataclass(frozen=True)
class SwiGLU:
  """silu(gate) * up of a [rows, 2, F] gate/up pair, and its backward pass given the product's gradient.
  `interpret`: run the kernel in interpret mode (tests); None: the kernel on a GPU, autodiff elsewhere."""
  interpret: bool | None = None

  def forward(self, pair: jax.Array) -> jax.Array:
    return jax.nn.silu(pair[..., 0, :]) * pair[..., 1, :]

  def backward(self, pair: jax.Array, d_product: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the product again, the pair's gradient) from one read of the pair and of the product's gradient."""
    if self.interpret or (self.interpret is None and target_platform() == "gpu" and _runs(pair)):
      with jax.named_scope(SCOPE):
        return _backward(pair, d_product.astype(pair.dtype), bool(self.interpret))
    product, vjp = jax.vjp(self.forward, pair)
    return product, vjp(d_product.astype(product.dtype))[0]


def _runs(pair: jax.Array) -> bool:
  """For a [rows, 2, F] pair whose rows divide among the devices in whole tiles, and F into whole tiles."""
  return _tiles(pair.shape) and kernels.splits_evenly(pair.shape[:1], _ROW_TILES[-1])


def _tiles(shape) -> bool:
  return len(shape) == 3 and shape[1] == 2 and shape[0] % _ROW_TILES[-1] == 0 and shape[2] % _COLUMN_TILES[-1] == 0


def _kernel(pair_ref, d_ref, product_ref, d_pair_ref):
  gate = pair_ref[:, 0, :].astype(jnp.float32)
  up = pair_ref[:, 1, :].astype(jnp.float32)
  d = d_ref[...].astype(jnp.float32)
  sigmoid = 1.0 / (1.0 + jnp.exp(-gate))
  silu = gate * sigmoid
  product_ref[...] = (silu * up).astype(product_ref.dtype)
  d_pair_ref[:, 0, :] = (d * up * (sigmoid * (1.0 + gate * (1.0 - sigmoid)))).astype(d_pair_ref.dtype)
  d_pair_ref[:, 1, :] = (d * silu).astype(d_pair_ref.dtype)


def _call(pair, d, interpret):
  if not _tiles(pair.shape):
    raise ValueError(f"SwiGLU's backward kernel: a [rows, 2, F] pair of whole ({_ROW_TILES[-1]}, 2, "
                     f"{_COLUMN_TILES[-1]}) tiles, got {pair.shape}")
  rows, _, width = pair.shape
  tr, tf = kernels.tile(rows, _ROW_TILES), kernels.tile(width, _COLUMN_TILES)
  pair_block = pl.BlockSpec((tr, 2, tf), lambda i, j: (i, 0, j))
  block = pl.BlockSpec((tr, tf), lambda i, j: (i, j))
  return kernels.pallas(
      _kernel, (rows // tr, width // tf), [pair_block, block], [block, pair_block],
      [jax.ShapeDtypeStruct((rows, width), pair.dtype), jax.ShapeDtypeStruct(pair.shape, pair.dtype)],
      interpret)(pair, d)


@functools.partial(custom_partitioning, static_argnums=(2,))
def _backward(pair, d, interpret):
  return _call(pair, d, interpret)


def _specs(mesh, pair_shape):
  """(the pair's split, the product's): rows and F each kept split where every shard holds whole tiles."""
  spec = tuple(pair_shape.sharding.spec) + (None,) * 3
  rows, width = ((spec[d] if kernels.whole_blocks(spec[d], pair_shape.shape[d], mesh, tile) else None)
                 for d, tile in ((0, _ROW_TILES[-1]), (2, _COLUMN_TILES[-1])))
  return P(rows, None, width), P(rows, width)


@partitioning.rule
def _partition(interpret, mesh, arg_shapes, result_shape):
  pair, product = (NamedSharding(mesh, s) for s in _specs(mesh, arg_shapes[0]))
  return mesh, lambda p, d: _call(p, d, interpret), (product, pair), (pair, product)


@partitioning.rule
def _infer(interpret, mesh, arg_shapes, result_shape):
  pair, product = (NamedSharding(mesh, s) for s in _specs(mesh, arg_shapes[0]))
  return product, pair


def _rule(interpret, mesh, operand_types, result_types):
  del interpret, mesh, operand_types, result_types
  return "r t f, r f -> r f, r t f", dict(need_replication_factors=("t",))


_backward.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)
