"""The self-partitioning kernels (`custom_partitioning`) inside a shard_map over part of a mesh, as a step's
replicas run them (trainer/step.py): XLA hands their rules each replica group's shardings in the group's own
numbering (quant/partitioning.py). On a data 2 x a 2 x b 2 mesh, manual over `data`, with the operands split over
the other two axes in several orders: the quantize kernels (interpret mode) write the bytes the quantizers
write, and cuDNN's block-scaled GEMM (its partition rule and the weight gradient's split contraction, with
`jax.nn.scaled_matmul` replaced by a float32 reference, the CPU having no cuDNN) the product of the whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from ember.quant import fused, fused_nvfp4, gemm
from ember.quant.quantizers import MXFP8Scaling, NVFP4Scaling

pytestmark = pytest.mark.xdist_group("partitioning")
MESH_AXES = ("data", "a", "b")
# How the rows and columns of an operand are split over the axes a shard_map over `data` leaves to the compiler.
SPLITS = [P("a", "b"), P("b", "a"), P(("b", "a")), P(None, ("a", "b"))]


def _mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), MESH_AXES)


def _per_replica(fn, x, split: P, out_specs):
  """fn on each replica's rows of x (split over `data`), constrained to `split` over the other axes first."""
  mesh = _mesh()

  def body(a):
    return fn(jax.lax.with_sharding_constraint(a, split))

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out_specs, axis_names={"data"},
                               check_vma=False))  # As the step runs its replicas.
  with jax.set_mesh(mesh):
    return step(x), step.lower(x).compile().as_text()


def _tensor(seed, shape):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(k1, shape) * jnp.exp(2 * jax.random.normal(k2, shape))).astype(jnp.bfloat16)


def _bytes(a):
  four_bits = jnp.finfo(a.dtype).bits == 4
  return np.asarray(jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], -1, 2) if four_bits else a, jnp.uint8))


def _same_bytes(got, want):
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bytes(g), _bytes(w))


def _arrays(*copies):
  return tuple(a for q in copies for a in (q.data, q.scale_inv))


ROWS, COLUMNS = (P("data"), P("data")), (P(None, "data"), P(None, "data"))  # A copy along the rows, transposed.


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_mxfp8_copies_inside_a_shard_map(split):
  x = _tensor(0, (512, 256))
  got, _ = _per_replica(lambda a: _arrays(*fused.both(a, interpret=True)), x, split, ROWS + COLUMNS)
  q = MXFP8Scaling(fused.BLOCK)
  _same_bytes(got, _arrays(q.quantize(x, axis=1), q.quantize(x.T, axis=1)))


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_nvfp4_copies_inside_a_shard_map(split):
  """The tensor amaxes are taken over the replicas (`reduce_axes`), so each replica's rows are the whole's: the
  cast as the quantizer's, both copies (with the Hadamard transform) as the kernel's on the whole tensor (which
  tests/quant/test_fused_nvfp4.py holds to the quantizer)."""
  x = _tensor(1, (512, 256))
  got, _ = _per_replica(lambda a: _arrays(fused_nvfp4.quantize(a, reduce_axes=("data",), interpret=True)), x, split,
                     ROWS)
  _same_bytes(got, _arrays(NVFP4Scaling().quantize(x, axis=1)))
  got, _ = _per_replica(lambda a: _arrays(*fused_nvfp4.both(a, rht_seed=0, reduce_axes=("data",), interpret=True)),
                     x, split, ROWS + COLUMNS)
  _same_bytes(got, _arrays(*fused_nvfp4.both(x, rht_seed=0, interpret=True)))


def _scaled_matmul(a, b, a_scales, b_scales, preferred_element_type):
  """`jax.nn.scaled_matmul`'s product in float32: [B, M, K] x [B, N, K] -> [B, M, N]."""
  dequantized = lambda d, s: d.astype(jnp.float32) * jnp.repeat(s.astype(jnp.float32), d.shape[-1] // s.shape[-1],
                                                                 axis=-1)
  y = jnp.einsum("bmk,bnk->bmn", dequantized(a, a_scales), dequantized(b, b_scales),
                 precision=jax.lax.Precision.HIGHEST)
  return y.astype(preferred_element_type)


@pytest.mark.parametrize("summed_outside", [True, False], ids=["row_split", "gathered"])
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_block_scaled_weight_gradient_inside_a_shard_map(monkeypatch, split, summed_outside):
  """x.T @ g for x [M, K] and g [M, N] quantized along their rows M (a weight gradient's operands), M split over
  `data` by the shard_map and over the axes of `split`'s first entry: the GEMM's contraction is multiplied in one
  part per device of those axes and summed after it (`split`), or, not told, gathered by the GEMM's partition rule
  (which cannot sum there); summed over the replicas, either is the whole product."""
  monkeypatch.setattr(gemm, "block_gemm_path", lambda *_: gemm.NATIVE)
  monkeypatch.setattr(jax.nn, "scaled_matmul", _scaled_matmul)
  x, g = _tensor(2, (512, 128)), _tensor(3, (512, 64))
  q = MXFP8Scaling(fused.BLOCK)
  entry = split[0]
  rows = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

  def wgrad(xg):
    qa, qb = q.quantize(xg[:, :128].T, axis=1), q.quantize(xg[:, 128:].T, axis=1)  # Contraction (rows) last.
    y = gemm.block_scaled_dot(qa, qb, (1, 1), batched=False, dtype=jnp.bfloat16,
                              split=rows if summed_outside else ())
    return jax.lax.psum(y, "data")[None]

  got, hlo = _per_replica(wgrad, jnp.concatenate([x, g], axis=1), P(entry), P())
  got = got[0]
  if rows and summed_outside:  # Each device multiplies the rows it holds: nothing moves but the parts' sums.
    ops = ("all-gather", "all-to-all", "collective-permute")
    moved = {op for op in ops if f"{op}(" in hlo or f"{op}-start(" in hlo}
    assert not moved, moved
  qx, qg = q.quantize(x.T, axis=1), q.quantize(g.T, axis=1)
  want = _scaled_matmul(qx.data[None], qg.data[None], qx.scale_inv[None], qg.scale_inv[None], jnp.float32)[0]
  # Float32 sums in another order (by parts, then the parts): within rounding of the largest; a part lost or
  # counted twice would be off by the products themselves.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))
