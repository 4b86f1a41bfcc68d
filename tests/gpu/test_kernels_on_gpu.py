"""The Pallas quantize kernels compiled for a real GPU (Triton), against the quantizers run by XLA on the same GPU
and on the CPU: the same bytes (data, block scales, tensor scale and amax) for MXFP8's one- and two-copy kernels
and NVFP4's rows, tiles and two-copy kernels (round to nearest and stochastic, with and without the wgrad copy's
Hadamard transform). XLA's GPU quantizer equals its CPU one only with IEEE float32 division, which `import ember`
asks XLA for (ember/platform.py). On a CPU-only machine every test here is skipped: tests/quant runs the same
kernels in interpret mode.

    JAX_PLATFORMS=cuda,cpu python -m pytest -q tests/gpu
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.quant import fused, fused_nvfp4
from ember.quant.hadamard import random_hadamard_transform
from ember.quant.quantizers import MXFP8Scaling, NVFP4Scaling


def _devices(platform):
  try:
    return jax.devices(platform)
  except RuntimeError:
    return []


GPU, CPU = _devices("gpu"), _devices("cpu")
pytestmark = pytest.mark.skipif(not (GPU and CPU), reason="needs a GPU and the CPU backend (JAX_PLATFORMS=cuda,cpu)")
SHAPES = [(256, 512), (1024, 4096), (96, 160)]  # Tiles of 64, one large tensor, and 32 / 16-wide tiles.
KEYS = (jax.random.key(1), jax.random.key(2))


def _tensor(seed, shape, dtype=jnp.bfloat16):
  """Heavy-tailed blocks of very unlike scales, an all-zero block, saturating, tiny and signed-zero elements."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, shape) * jnp.exp(4 * jax.random.normal(k2, shape))
  x = x.at[:32, :32].set(0.0).at[3, 40].set(3e38).at[40, 3].set(-1e-30).at[7, 7].set(-500.0).at[20, 50].set(-0.0)
  return np.asarray(x.astype(dtype))


def _bytes(a):
  """Each element's bits as bytes (NumPy holds an E2M1 code in the low four bits of a byte)."""
  return np.asarray(a).reshape(-1).view(np.uint8)


def _differences(got, want) -> list[str]:
  """Each field of each copy that differs, with how many elements differ: empty when all bytes are equal."""
  out = []
  for i, (g, w) in enumerate(zip(got, want)):
    assert (g.data.shape, g.scale_inv.shape, g.axis, g.block) == (w.data.shape, w.scale_inv.shape, w.axis, w.block)
    for field in ("data", "scale_inv", "amax", "global_scale_inv"):
      x, y = getattr(g, field), getattr(w, field)
      if x is None and y is None:
        continue
      n = int(np.sum(_bytes(x) != _bytes(y)))
      if n:
        out.append(f"copy {i} {field}: {n} of {np.asarray(x).size} differ")
  return out


def _same(got, want):
  assert not (d := _differences(got, want)), "; ".join(d)


def _on(device, f, *args):
  """f jitted on `device` (its platform is the traced one, so the kernels compile for it), results fetched."""
  with jax.default_device(device):
    out = jax.jit(f)(*(jax.device_put(a, device) for a in args))
  return jax.tree.map(lambda a: jax.device_put(a, CPU[0]) if isinstance(a, jax.Array) else a, out)


def _reference(where):
  return {"gpu": GPU, "cpu": CPU}[where][0]


WHERE = pytest.mark.parametrize("where", ["gpu", "cpu"])  # Where XLA runs the quantizer the kernel is held to.


@WHERE
@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp8_kernels_equal_the_quantizer(shape, where):
  x = _tensor(0, shape)
  q = MXFP8Scaling(fused.BLOCK)
  ref = _reference(where)
  _same(_on(GPU[0], fused.both, x), _on(ref, lambda a: (q.quantize(a, axis=1), q.quantize(a.T, axis=1)), x))
  _same([_on(GPU[0], fused.rows, x)], [_on(ref, lambda a: q.quantize(a, axis=1), x)])


@WHERE
@pytest.mark.parametrize("tile_2d", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_quantize_equals_the_quantizer(shape, tile_2d, where):
  x = _tensor(1, shape, jnp.float32 if tile_2d else jnp.bfloat16)
  got = _on(GPU[0], lambda a: fused_nvfp4.quantize(a, tile_2d=tile_2d), x)
  _same([got], [_on(_reference(where), lambda a: NVFP4Scaling(tile_2d=tile_2d).quantize(a, axis=1), x)])


@WHERE
@pytest.mark.parametrize("rht_seed,stochastic", [(None, False), (0, False), (None, True), (0, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_both_equals_the_quantizer(shape, rht_seed, stochastic, where):
  """The in-kernel threefry draws and the in-kernel 16 x 16 transform against XLA's."""
  x = _tensor(2, shape)
  keys = KEYS if stochastic else None

  def reference(a):
    q = NVFP4Scaling(stochastic_rounding=stochastic)
    t = a if rht_seed is None else random_hadamard_transform(a, axis=0, seed=rht_seed)
    return q.quantize(a, axis=1, rng=keys and keys[0]), q.quantize(t, axis=0, rng=keys and keys[1]).T

  _same(_on(GPU[0], lambda a: fused_nvfp4.both(a, keys=keys, rht_seed=rht_seed), x),
        _on(_reference(where), reference, x))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_the_quantizer_on_the_gpu_equals_the_quantizer_on_the_cpu(recipe):
  """XLA's own GPU and CPU programs for the same quantizer (without exact division NVFP4's differed: 4% of the
  E2M1 codes on an H100)."""
  x = _tensor(3, (256, 512), jnp.float32)
  q = MXFP8Scaling(fused.BLOCK) if recipe == "mxfp8" else NVFP4Scaling(tile_2d=True)
  f = lambda a: q.quantize(a, axis=1)
  _same([_on(GPU[0], f, x)], [_on(CPU[0], f, x)])
