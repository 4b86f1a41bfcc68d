"""The 16x16 random Hadamard transform (RHT) used before NVFP4 weight-gradient GEMMs.

Gradients have outliers that one E4M3 block scale per 16 values handles badly.
Mixing each block of 16 with an orthogonal matrix spreads an outlier over its
block (the result is closer to Gaussian), and because the matrix is
orthogonal, transforming *both* operands along their shared contraction axis
leaves the product unchanged:  (A M)(M^T B) = A B.

The matrix is M = D H, with H the Sylvester Hadamard matrix of order 16 scaled
by 1/4 (so H H^T = I) and D a diagonal of random signs. The signs are a fixed
function of `seed` (NumPy's PCG64 generator, stable across NumPy versions), a
static Python int: the transform is a compile-time constant, the same on every
host and every step. Applied to a block x (a row vector) it gives x M; along
any `axis` it acts on consecutive blocks of 16 of that axis.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ember.names import HADAMARD_SCOPE
from ember.quant.tensor import normalize_axis

BLOCK = 16


def hadamard_matrix(n: int = BLOCK) -> np.ndarray:
  """Sylvester's Hadamard matrix of order n (a power of two), / sqrt(n)."""
  if n < 1 or n & (n - 1):
    raise ValueError(f"Hadamard order must be a power of two, got {n}")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return (h / np.sqrt(n)).astype(np.float32)


def random_signs(seed: int, n: int = BLOCK) -> np.ndarray:
  """n fixed signs (+-1.0) derived from `seed`."""
  bits = np.random.default_rng(seed).integers(0, 2, size=n)
  return (1.0 - 2.0 * bits).astype(np.float32)


def rht_matrix(seed: int, n: int = BLOCK) -> np.ndarray:
  """M = diag(signs) @ H, orthogonal: M @ M.T == I exactly in float32."""
  return random_signs(seed, n)[:, None] * hadamard_matrix(n)


def _apply(x: jax.Array, axis: int, m: np.ndarray) -> jax.Array:
  axis = normalize_axis(axis, x.ndim)
  n = x.shape[axis]
  if n % BLOCK:
    raise ValueError(f"the Hadamard transform axis has length {n}, not a "
                     f"multiple of {BLOCK}; pad it first")
  x_NxK = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  lead = x_NxK.shape[:-1]
  x_NxBx16 = x_NxK.reshape(lead + (n // BLOCK, BLOCK))
  # HIGHEST: float32 on GPUs too (the default may use TF32 and lose bits).
  with jax.named_scope(HADAMARD_SCOPE):
    y_NxBx16 = jnp.einsum("...i,ij->...j", x_NxBx16, jnp.asarray(m), precision=jax.lax.Precision.HIGHEST)
  return jnp.moveaxis(y_NxBx16.reshape(lead + (n,)), -1, axis).astype(x.dtype)


def random_hadamard_transform(x: jax.Array, axis: int = -1,
                              seed: int = 0) -> jax.Array:
  """x with each block of 16 along `axis` multiplied by M (computed in float32).

  Apply it to both GEMM operands along their contraction axis (e.g. axis=-1
  of A[m, k] and axis=0 of B[k, n]) and A @ B is unchanged. Returns x's dtype.
  """
  return _apply(x, axis, rht_matrix(seed))


def inverse_random_hadamard_transform(x: jax.Array, axis: int = -1,
                                      seed: int = 0) -> jax.Array:
  """Undoes `random_hadamard_transform` (multiplies by M^T)."""
  return _apply(x, axis, rht_matrix(seed).T)
