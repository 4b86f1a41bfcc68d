"""The residual norm's kernels (ember/layers/norm_kernel.py), run in Pallas' interpret mode, against autodiff of the
reference formula computed in NumPy float64: the norm, its input's gradient with the residual's own gradient added,
and the scale's gradient; and inside a sharded jit, the same as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.layers import norm_kernel

EPS = 1e-5


def _inputs(rows, width, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = (jax.random.normal(k[0], (rows, width)) * jnp.exp(jax.random.normal(k[1], (rows, 1)))).astype(dtype)
  scale = 1.0 + 0.1 * jax.random.normal(k[2], (width,))
  dy, dh = (jax.random.normal(kk, (rows, width)).astype(dtype) for kk in jax.random.split(k[3]))
  return x, scale, dy, dh


def _by_hand(x, scale, dy, dh):
  """y, dx and dscale of y = x / rms(x) * scale with the residual's gradient dh added to dx: float64 NumPy,
  the derivative worked by hand (dx = (g - x mean(g x) / ms) / rms, g = dy scale)."""
  x, scale, dy, dh = (np.asarray(a, np.float64) for a in (x, scale, dy, dh))
  ms = np.mean(x * x, axis=1, keepdims=True) + EPS
  r = 1.0 / np.sqrt(ms)
  g = dy * scale
  dx = dh + r * (g - x * np.mean(g * x, axis=1, keepdims=True) / ms)
  return x * r * scale, dx, np.sum(dy * x * r, axis=0)


def _norm_and_grads(x, scale, dy, dh, forward_kernel=True):
  def f(x, scale):
    return norm_kernel.rms_norm_rows(x, scale, EPS, x.dtype, forward_kernel, True)
  (h, y), vjp = jax.vjp(f, x, scale)
  dx, dscale = vjp((dh, dy))
  return h, y, dx, dscale


@pytest.mark.parametrize("forward_kernel", [True, False])
def test_float32_norm_and_gradients_equal_the_worked_derivative(forward_kernel):
  x, scale, dy, dh = _inputs(64, 256, jnp.float32)
  h, y, dx, dscale = jax.jit(_norm_and_grads, static_argnums=4)(x, scale, dy, dh, forward_kernel)
  want_y, want_dx, want_dscale = _by_hand(x, scale, dy, dh)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(x))
  np.testing.assert_allclose(np.asarray(y), want_y, rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(dscale), want_dscale, rtol=2e-5, atol=2e-4)


def test_bfloat16_equals_autodiff_of_the_reference_within_a_rounding():
  """bf16 rows: the kernel's y and dx within one bf16 rounding of autodiff of the reference (which rounds dx to
  bf16 before adding dh, where the kernel adds in float32 and rounds once), dscale within float32 sums."""
  x, scale, dy, dh = _inputs(128, 512, jnp.bfloat16, seed=1)
  h, y, dx, dscale = jax.jit(_norm_and_grads)(x, scale, dy, dh)
  ref = lambda x, scale: norm_kernel.reference(x, scale, EPS, jnp.bfloat16)
  want_y, vjp = jax.vjp(ref, x, scale)
  want_dx, want_dscale = vjp(dy)
  f32 = lambda a: np.asarray(a, np.float32)
  np.testing.assert_allclose(f32(y), f32(want_y), rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(f32(dx), f32(want_dx) + f32(dh), rtol=2**-6, atol=2**-6)
  np.testing.assert_allclose(f32(dscale), f32(want_dscale), rtol=1e-4, atol=1e-3)
  assert y.dtype == dx.dtype == jnp.bfloat16 and dscale.dtype == scale.dtype


def test_sharded_rows_equal_one_device():
  """Rows split over 4 devices and the width over 2 (which the kernels gather): each device's rows normed on their
  own, the scale's gradient summed over the devices, the same as one device."""
  x, scale, dy, dh = _inputs(256, 128, jnp.float32, seed=2)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("rows", "cols"))
  split = NamedSharding(mesh, P("rows", "cols"))
  whole = jax.jit(_norm_and_grads)(x, scale, dy, dh)
  sharded = jax.jit(_norm_and_grads)(*(jax.device_put(a, split) for a in (x,)), scale,
                                     *(jax.device_put(a, split) for a in (dy, dh)))
  for got, want in zip(sharded, whole):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_runs_only_on_a_gpu_for_rows_it_tiles(monkeypatch):
  rows = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  assert not norm_kernel.runs(rows(64, 128))  # This machine's CPU.
  monkeypatch.setattr(norm_kernel, "target_platform", lambda: "gpu")
  assert norm_kernel.runs(rows(64, 128))
  assert not norm_kernel.runs(rows(48, 128))  # Not whole backward programs of 32 rows.
  assert not norm_kernel.runs(rows(64, 96))  # Not a power-of-two width.
  assert not norm_kernel.runs(rows(2, 32, 128))  # Not 2-d rows.
  with pytest.raises(ValueError, match=r"rms_norm_rows: .* got \(48, 128\)"):
    norm_kernel.rms_norm_rows(jnp.zeros((48, 128)), jnp.ones((128,)), EPS, jnp.float32, True, True)
