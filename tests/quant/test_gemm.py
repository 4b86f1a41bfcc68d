"""The GEMMs of quantized operands on CPU (quant/gemm.py's `scaled_dot` path for block-scaled recipes, the
dequantize-then-dot of per-tensor ones) against a float64 product of the same dequantized operands, in the
three contraction layouts of a projection (forward, dgrad, wgrad) and the capacity layout's batched one, for
shapes that need padding; and the platform rule."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.quant import gemm
from ember.quant.dot import product
from ember.quant.batched import product as batched_product
from ember.quant.grouped import quantize_per_expert
from ember.quant.recipe import ACTIVATION, GRADIENT, QUANTIZED_RECIPES, WEIGHT, Recipe, pad_to
from tests.quant import reference as ref

M, K, N, E = 40, 72, 56, 3  # Neither 72 nor 56 a multiple of 32: every operand is padded.
# float32 accumulation over a padded K of at most 96 terms: a few ulps of the largest partial sums.
F32_ERROR = 1e-6
# How far the emulated path (NVFP4 operands dequantized to bf16 with the float32 tensor scale folded in,
# ember's only path before block-scaled GEMMs) is from the same float64 product, on these operands.
NVFP4_BF16_FOLDED_ERROR = 1.9e-3  # The new path: 6e-8.


def _f64(q):
  deq = jax.vmap(lambda t: t.dequantize(jnp.float32))(q) if q.amax.ndim else q.dequantize(jnp.float32)
  return np.asarray(deq, np.float64)


def _rel(y, ref):
  return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))


def _operands(recipe: Recipe):
  """x [M, K], w [K, N] and g [M, N] padded to the recipe's block and quantized as quant/dot.py quantizes them:
  (forward x along K, the kernel along K, dgrad g along N, the kernel along N, wgrad x and g along M)."""
  b = recipe.block_size
  keys = jax.random.split(jax.random.key(0), 3)
  x, w, g = (pad_to(jax.random.normal(k, s, jnp.float32) * 3, (b, b)) for k, s in zip(keys, ((M, K), (K, N), (M, N))))
  history = jnp.zeros((1,), jnp.float32)
  act, weight, grad = (recipe.quantizer(role, history) for role in (ACTIVATION, WEIGHT, GRADIENT))
  return {"forward": (act.quantize(x, axis=1), weight.quantize(w, axis=0), (1, 0)),
          "dgrad": (grad.quantize(g, axis=1), weight.quantize(w, axis=1), (1, 1)),
          "wgrad": (act.quantize(x, axis=0), grad.quantize(g, axis=0), (0, 0))}, {"x": x, "w": w, "g": g}


# Each operand's float tensor, role and quantization axis, as `_operands` quantizes it.
_SOURCES = {"forward": (("x", ACTIVATION, 1), ("w", WEIGHT, 0)), "dgrad": (("g", GRADIENT, 1), ("w", WEIGHT, 1)),
            "wgrad": (("x", ACTIVATION, 0), ("g", GRADIENT, 0))}


def _reference_f64(recipe: Recipe, t, role: str, axis: int):
  """The operand as tests/quant/reference.py quantizes and dequantizes it on its own (numpy, no ember code), or
  None for a recipe it does not cover here (nvfp4's tiles, transforms and stochastic rounding)."""
  fmt = "e5m2" if role == GRADIENT and recipe.name.startswith("fp8") else "e4m3"
  t = np.asarray(t, np.float32)
  if recipe.name == "fp8_delayed":  # A zero history: scale 1.
    return np.asarray(ref.fp8_delayed(t, [0.0], fmt)["deq"], np.float64)
  if recipe.name == "fp8_current":
    return np.asarray(ref.fp8_current(t, fmt)["deq"], np.float64)
  if recipe.name == "mxfp8":
    return np.asarray(ref.mxfp8(t, axis=axis)["deq"], np.float64)
  return None


# fp8_current first, the case run by default: fp8_delayed's zero history scales by 1, where a scale misapplied shows.
@pytest.mark.parametrize("recipe", sorted(QUANTIZED_RECIPES, key=lambda name: name != "fp8_current"))
@pytest.mark.variants
def test_each_gemm_equals_the_float64_product_of_its_dequantized_operands(recipe):
  """The reference operands come from tests/quant/reference.py where it covers the recipe: a product built on
  ember's own `dequantize` would agree with a GEMM that shares its mistakes (a scale applied twice passed)."""
  recipe = Recipe(recipe)
  operands, sources = _operands(recipe)
  for name, (a, b, (ca, cb)) in operands.items():
    y = product(a, b, (ca, cb), jnp.float32, jnp.float32)
    refs = [_reference_f64(recipe, sources[key], role, axis) for key, role, axis in _SOURCES[name]]
    ra, rb = (r if r is not None else _f64(q) for r, q in zip(refs, (a, b)))
    ref_y = np.tensordot(ra, rb, axes=(ca, cb))
    assert y.shape == ref_y.shape and _rel(y, ref_y) < F32_ERROR, (name, _rel(y, ref_y))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
@pytest.mark.long
def test_batched_block_scaled_gemms_with_per_expert_kernels(recipe):
  """The capacity layout: x [E, C, K] . w [E, K, N] with each expert's kernel quantized on its own (NVFP4: its
  own tensor scale, 16x16 tiles), forward and dgrad."""
  recipe = Recipe(recipe)
  b = recipe.block_size
  x = pad_to(jax.random.normal(jax.random.key(1), (E, M, K)) * jnp.arange(1, E + 1)[:, None, None], (1, b, b))
  w = pad_to(jax.random.normal(jax.random.key(2), (E, K, N)) * jnp.arange(E, 0, -1)[:, None, None], (1, b, b))
  h = jnp.zeros((E, 1), jnp.float32)
  qx = recipe.quantizer(ACTIVATION, h[0]).quantize(x, axis=2)
  qw = quantize_per_expert(recipe, w, h, axis=0)
  forward = batched_product(qx, qw, (((2,), (1,)), ((0,), (0,))), jnp.float32, jnp.float32)
  ref = np.einsum("eck,ekn->ecn", _f64(qx), _f64(qw))
  assert _rel(forward, ref) < F32_ERROR, _rel(forward, ref)
  qg = recipe.quantizer(GRADIENT, h[0]).quantize(jnp.einsum("eck,ekn->ecn", x, w), axis=2)
  kernel_n = quantize_per_expert(recipe, w, h, axis=1)
  dgrad = batched_product(qg, kernel_n, (((2,), (2,)), ((0,), (0,))), jnp.float32, jnp.float32)
  ref = np.einsum("ecn,ekn->eck", _f64(qg), _f64(kernel_n))
  assert _rel(dgrad, ref) < F32_ERROR, _rel(dgrad, ref)


def test_nvfp4_tensor_scales_on_the_output_remove_the_bf16_rounding():
  """The emulated path folded NVFP4's float32 tensor scale into bf16 operands, which rounds them; with the
  scale on the output the GEMM is exact to float32 accumulation."""
  a, b, dims = _operands(Recipe("nvfp4"))[0]["forward"]
  ref = np.tensordot(_f64(a), _f64(b), axes=dims)
  folded = jnp.dot(a.dequantize(jnp.bfloat16), b.dequantize(jnp.bfloat16), preferred_element_type=jnp.float32)
  new = product(a, b, dims, jnp.bfloat16, jnp.float32)
  assert _rel(new, ref) < F32_ERROR, _rel(new, ref)
  assert NVFP4_BF16_FOLDED_ERROR / 2 < _rel(folded, ref) < NVFP4_BF16_FOLDED_ERROR * 1.5, _rel(folded, ref)


def test_a_bf16_result_takes_the_tensor_scale_in_bf16_a_weight_gradient_in_float32():
  """quant/gemm.py's tensor-scale rule, on every path as cuDNN's GEMM takes it: the float32 accumulator of a
  forward or dgrad result rounded to bf16 is multiplied by the tensor scales' product rounded to bf16 (cuDNN's
  global scale has the result's dtype); a weight gradient's, even one reduced in bf16, by the float32 product.
  The accumulator is the same GEMM with unit tensor scales."""
  unit = lambda q: dataclasses.replace(q, global_scale_inv=jnp.ones_like(q.global_scale_inv))
  for name, (a, b, dims) in _operands(Recipe("nvfp4"))[0].items():
    s = a.global_scale_inv * b.global_scale_inv
    assert s.astype(jnp.bfloat16).astype(jnp.float32) != s  # These scales round: the test can tell.
    acc = product(unit(a), unit(b), dims, jnp.bfloat16, jnp.float32)
    f32_scale = (acc * s).astype(jnp.bfloat16)
    bf16_scale = (acc * s.astype(jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16)
    assert not np.array_equal(f32_scale, bf16_scale)
    wgrad = name == "wgrad"
    got = product(a, b, dims, jnp.bfloat16, jnp.bfloat16, weight_gradient=wgrad)
    np.testing.assert_array_equal(got, f32_scale if wgrad else bf16_scale, err_msg=name)
    np.testing.assert_array_equal(product(a, b, dims, jnp.bfloat16, jnp.float32, weight_gradient=wgrad), acc * s)


def test_the_platform_rule():
  assert gemm.block_gemm_path("cpu") == gemm.SCALED_DOT
  assert gemm.block_gemm_path("gpu", (9, 0)) == gemm.EMULATED  # Hopper: no block-scaled tensor cores.
  assert gemm.block_gemm_path("gpu", (10, 0)) == gemm.NATIVE
  assert gemm.block_gemm_path("gpu", (12, 0)) == gemm.NATIVE
  # A GEMM writes its consumer's dtype on a GPU (rounded in the epilogue), float32 on the CPU (the reference).
  assert gemm.output_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
  assert gemm.output_dtype(jnp.bfloat16, "cpu") == jnp.float32


def test_the_tensor_core_call_each_recipe_reaches_and_the_trainers_check_for_it():
  """Which library call a recipe's GEMMs become where the GPU has tensor cores for its format; the trainer's
  check (trainer/phase.py) names the call a compiled step lacks, as when XLA's Triton GEMMs took every FP8 GEMM
  of an H100's step."""
  from types import SimpleNamespace
  from ember.trainer.phase import missing_tensor_core_gemm

  hopper, blackwell, ampere = (9, 0), (10, 0), (8, 0)
  for name in ("fp8_current", "fp8_delayed"):
    assert gemm.tensor_core_gemm(Recipe(name), hopper) == gemm.tensor_core_gemm(Recipe(name), blackwell) == (
        gemm.CUBLAS_FP8_GEMM)
    assert gemm.tensor_core_gemm(Recipe(name), ampere) is None
  for name in ("mxfp8", "nvfp4"):
    assert gemm.tensor_core_gemm(Recipe(name), blackwell) == gemm.CUDNN_BLOCK_SCALED_GEMM
    assert gemm.tensor_core_gemm(Recipe(name), hopper) is None  # Emulated in bf16: nothing to reach.
  assert gemm.tensor_core_gemm(Recipe("bf16"), hopper) is None
  assert gemm.tensor_core_gemm(Recipe("fp8_current"), None) is None  # Not a GPU.

  cfg = SimpleNamespace(quant=Recipe("fp8_current"))
  call = lambda target: lambda: f'%g = (bf16[8,8]{{1,0}}, s8[0]{{0}}) custom-call(%a), custom_call_target="{target}"'
  with_fp8, bf16_only = call(gemm.CUBLAS_FP8_GEMM), call("__cublas$lt$matmul")
  assert missing_tensor_core_gemm(cfg, with_fp8, hopper) is None
  assert missing_tensor_core_gemm(cfg, bf16_only, hopper) == gemm.CUBLAS_FP8_GEMM
  assert missing_tensor_core_gemm(SimpleNamespace(quant=Recipe("mxfp8")), bf16_only, hopper) is None
