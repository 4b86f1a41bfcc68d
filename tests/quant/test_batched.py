"""The expert GEMMs over the capacity layout (ember/quant/batched.py) against the grouped GEMMs over sorted rows
(ember/quant/grouped.py) on the same rows, every recipe, forward and both gradients; and the layout itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from ember.layers.moe import capacity_layout
from ember.quant.batched import batched_matmul
from ember.quant.grouped import grouped_matmul
from ember.quant.recipe import Recipe

E, C, K, N = 4, 32, 64, 48
SIZES = np.array([5, 32, 0, 17])  # Uneven, a full slot, an empty expert.


def _rows(a_ExCxD):
  return np.concatenate([np.asarray(a_ExCxD)[e, :SIZES[e]] for e in range(E)])


@pytest.mark.parametrize("recipe", ["bf16", "fp8_current", "fp8_delayed", pytest.param("mxfp8", marks=pytest.mark.extended),
                                    pytest.param("nvfp4", marks=pytest.mark.extended)])
@pytest.mark.variants
def test_batched_equals_grouped_on_the_same_rows(recipe):
  rng = np.random.default_rng(0)
  live = (np.arange(C)[None, :] < SIZES[:, None])[..., None]
  x = jnp.asarray(rng.standard_normal((E, C, K)) * live, jnp.float32)
  g = jnp.asarray(rng.standard_normal((E, C, N)) * live, jnp.float32)
  w = jnp.asarray(rng.standard_normal((E, K, N)), jnp.float32)
  history = (jnp.full((4,), 3.0), jnp.full((E, 4), 2.0), jnp.full((4,), 1.0))
  kw = dict(recipe=Recipe(name=recipe, nvfp4_stochastic_rounding=False), name="moe_wi", dtype=jnp.float32,
            history=history if recipe == "fp8_delayed" else None)
  sizes = jnp.asarray(SIZES, jnp.int32)
  yb, vjp_b = jax.vjp(lambda x, w: batched_matmul(x, w, **kw), x, w)
  yg, vjp_g = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, **kw), jnp.asarray(_rows(x)), w)
  (dxb, dwb), (dxg, dwg) = vjp_b(g), vjp_g(jnp.asarray(_rows(g)))
  scale = lambda a: np.max(np.abs(a))
  # Per-tensor scales on the output instead of in the operands: equal up to float32 rounding.
  assert np.max(np.abs(_rows(yb) - yg)) <= 1e-6 * scale(yg)
  assert np.max(np.abs(_rows(dxb) - dxg)) <= 1e-6 * scale(dxg)
  assert np.max(np.abs(np.asarray(dwb) - dwg)) <= 1e-6 * scale(dwg)
  assert not np.any(np.asarray(yb)[~np.broadcast_to(live, (E, C, 1))[..., 0]])  # Empty slots give zero rows.


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
@pytest.mark.variants
def test_batched_equals_the_numpy_reference(recipe):
  """Forward, dgrad and wgrad against products of operands quantized by tests/quant/reference.py (written apart
  from ember): x and the gradient per tensor (fp8_current: E4M3 / E5M2 with the tensor's amax) or in blocks of 32
  along each GEMM's contraction (mxfp8), each expert's kernel on its own."""
  rng, n = np.random.default_rng(1), 64  # Whole blocks along every axis (the reference does not pad).
  x = rng.standard_normal((E, C, K)).astype(np.float32)
  g = rng.standard_normal((E, C, n)).astype(np.float32)
  w = rng.standard_normal((E, K, n)).astype(np.float32)
  kw = dict(recipe=Recipe(name=recipe), name="moe_wi", dtype=jnp.float32)
  y, vjp = jax.vjp(lambda x, w: batched_matmul(x, w, **kw), jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(g))
  if recipe == "fp8_current":
    xq, gq = ref.fp8_current(x, "e4m3")["deq"], ref.fp8_current(g, "e5m2")["deq"]
    wq = np.stack([ref.fp8_current(w[e], "e4m3")["deq"] for e in range(E)])
    want = (xq @ wq, gq @ wq.transpose(0, 2, 1), xq.transpose(0, 2, 1) @ gq)
  else:  # Every operand blocked along the contraction of the GEMM that reads it.
    last = lambda a: ref.mxfp8(a, axis=-1)["deq"]  # Blocks along the last axis of [..., rows, cols].
    rows = lambda a: np.swapaxes(last(np.swapaxes(a, -1, -2)), -1, -2)  # Blocks along the rows.
    per_expert = lambda f, a: np.stack([f(a[e]) for e in range(E)])
    want = (last(x) @ per_expert(rows, w), last(g) @ per_expert(last, w).transpose(0, 2, 1),
            rows(x).transpose(0, 2, 1) @ rows(g))
  for got, expected in zip((y, dx, dw), want):
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5 * np.max(np.abs(expected)))


def test_capacity_layout_places_each_row_in_its_experts_slot():
  sizes = jnp.asarray([3, 0, 5], jnp.int32)  # 8 sorted rows, 2 of padding; slots of 4: one row of expert 2 overflows.
  slot_of_row, row_of_slot = capacity_layout(sizes, 10, 4)
  assert slot_of_row.tolist() == [0, 1, 2, 8, 9, 10, 11, 12, 12, 12]
  assert row_of_slot.tolist() == [0, 1, 2, 10, 10, 10, 10, 10, 3, 4, 5, 6]
