"""The quantized matmul: gradient fidelity per recipe, named residuals, delayed-scaling state."""

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember import remat
from ember.config import derive
from ember.layers.decoder import DecoderLayer
from ember.quant.dot import quantized_matmul
from ember.quant.recipe import WEIGHT, Recipe
from tests.helpers import config

QUANTIZED_RECIPES = ("fp8_current", "fp8_delayed", "mxfp8", "nvfp4")


def _cosine(a, b):
  a, b = np.ravel(a), np.ravel(b)
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _grads(recipe_name, x, w, g, history=None):
  recipe = Recipe(recipe_name, amax_history_len=4)
  if recipe.delayed and history is None:
    history = jnp.zeros((3, 4))
  f = lambda x, w, h: quantized_matmul(x, w, recipe=recipe, name="wi", history=h, key=jax.random.key(7),
                                       dtype=jnp.float32)
  y, vjp = jax.vjp(f, x, w, history)
  return y, vjp(g)


def _rel_error(a, b):
  return float(np.linalg.norm(np.ravel(a) - np.ravel(b)) / np.linalg.norm(np.ravel(b)))


# (min cosine, max relative error ||a - ref|| / ||ref||): the error bound holds magnitude too (a wrong
# global scale keeps the cosine at 1). Measured: FP8 ~0.06, MXFP8 ~0.04, NVFP4 ~0.17 on these shapes.
@pytest.mark.parametrize("recipe,threshold,max_error", [("fp8_current", 0.99, 0.1), ("fp8_delayed", 0.99, 0.1),
                                                        pytest.param("mxfp8", 0.99, 0.1, marks=pytest.mark.extended), ("nvfp4", 0.95, 0.25)])
@pytest.mark.variants
def test_gradients_close_to_bf16(recipe, threshold, max_error):
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (128, 96))
  w = jax.random.normal(kw, (96, 80))
  g = jax.random.normal(kg, (128, 80))
  y_ref, (dx_ref, dw_ref, _) = _grads("bf16", x, w, g)
  history = None
  if recipe == "fp8_delayed":  # Start from a history that has seen this data (as after step 1).
    history = jnp.stack([jnp.full(4, jnp.abs(x).max()), jnp.full(4, jnp.abs(w).max()), jnp.full(4, jnp.abs(g).max())])
  y, (dx, dw, _) = _grads(recipe, x, w, g, history)
  for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
    assert _cosine(got, ref) >= threshold, _cosine(got, ref)
    assert _rel_error(got, ref) <= max_error, _rel_error(got, ref)
    assert abs(np.linalg.norm(got) / np.linalg.norm(ref) - 1) <= max_error / 4


@pytest.mark.parametrize("recipe", ["bf16", *(pytest.param(r, marks=pytest.mark.extended) if r == "mxfp8" else r
                                             for r in QUANTIZED_RECIPES)])
@pytest.mark.variants
def test_wgrad_dtype_rounds_only_the_weight_gradient(recipe):
  """`wgrad_dtype=bfloat16` (train.grad_reduce_dtype): the weight gradient is the float32 one rounded to bf16 once
  (what then crosses the network); the output and dgrad do not change."""
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x, w, g = jax.random.normal(kx, (64, 96)), jax.random.normal(kw, (96, 80)), jax.random.normal(kg, (64, 80))
  history = jnp.ones((3, 4)) if recipe == "fp8_delayed" else None
  out = {}
  for dtype in ("float32", "bfloat16"):
    r = Recipe(recipe, amax_history_len=4, wgrad_dtype=dtype)
    f = lambda x, w: quantized_matmul(x, w, recipe=r, name="wi", history=history, key=jax.random.key(7),
                                      dtype=jnp.bfloat16)
    y, vjp = jax.vjp(f, x, w)
    out[dtype] = (y, *vjp(g.astype(y.dtype)))
  (y32, dx32, dw32), (y16, dx16, dw16) = out["float32"], out["bfloat16"]
  np.testing.assert_array_equal(y16, y32)
  np.testing.assert_array_equal(dx16, dx32)
  assert dw16.dtype == jnp.float32
  np.testing.assert_array_equal(dw16, dw32.astype(jnp.bfloat16).astype(jnp.float32))
  if recipe != "bf16":  # The bf16 recipe's GEMMs already round to their compute dtype.
    assert not np.array_equal(dw16, dw32)


@pytest.mark.long
def test_block_recipes_pad_ragged_shapes():
  """Shapes that are not multiples of the block size are padded with zeros, not rejected."""
  x = jax.random.normal(jax.random.key(1), (37, 50))
  w = jax.random.normal(jax.random.key(2), (50, 23))
  g = jnp.ones((37, 23))
  for recipe in ("mxfp8", "nvfp4"):
    y, (dx, dw, _) = _grads(recipe, x, w, g)
    assert y.shape == (37, 23) and dx.shape == (37, 50) and dw.shape == (50, 23)
    assert _cosine(y, x @ w) > 0.95


@pytest.mark.parametrize("recipe", ["mxfp8", pytest.param("nvfp4", marks=pytest.mark.extended)])
@pytest.mark.long
def test_transposed_wgrad_is_the_same_gradient(recipe):
  """A block-scaled weight gradient written transposed (`wgrad_transposed`: g.T @ x, then transposed, for kernels
  reduce-scattered along their output axis) is the same gradient: the same products, summed in another order
  (float32 rounding, 1.4e-7 relative here); x's gradient is untouched, bit for bit. Rows and widths not multiples
  of the block: the padding is cut from the right axes."""
  x = jax.random.normal(jax.random.key(1), (70, 96)) * 3
  w = jax.random.normal(jax.random.key(2), (96, 40)) / 10
  g = jax.random.normal(jax.random.key(3), (70, 40))
  out = []
  for transposed in (False, True):
    f = lambda x, w: quantized_matmul(x, w, recipe=Recipe(recipe), name="wo", key=jax.random.key(7),
                                      dtype=jnp.float32, wgrad_transposed=transposed)
    out.append(jax.vjp(f, x, w)[1](g))
  (dx, dw), (dx_t, dw_t) = out
  np.testing.assert_array_equal(dx_t, dx)
  assert dw_t.shape == dw.shape and _rel_error(dw_t, dw) < 1e-6


def test_delayed_history_is_the_cotangent():
  """The VJP returns each operand's history with this step's amax rolled in at index 0."""
  x = jnp.full((32, 32), 3.0)
  w = jnp.full((32, 32), 0.5)
  g = jnp.full((32, 32), 2.0)
  history = jnp.array([[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
  _, (_, _, new) = _grads("fp8_delayed", x, w, g, history)
  np.testing.assert_array_equal(new, [[3.0, 1, 2, 3], [0.5, 5, 6, 7], [2.0, 9, 10, 11]])


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])
def test_kernel_copies_made_ahead_are_the_gemms_own(recipe):
  """A kernel quantized ahead (`kernel_copies`, once a step: the forward copy stored transposed) is the GEMM's own
  quantization bit for bit, and handed to the GEMM gives its output and every gradient as the GEMM quantizing the
  kernel itself, within float32 rounding (the forward GEMM reads the kernel transposed: another summation order);
  and the GEMM reads those copies: handed other ones, its output and its input's gradient change."""
  from ember.quant.dot import kernel_copies
  r = Recipe(recipe, amax_history_len=4)
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x, w, g = (jax.random.normal(k, s) for k, s in ((kx, (48, 64)), (kw, (64, 32)), (kg, (48, 32))))
  history = jnp.abs(jax.random.normal(jax.random.key(1), (3, 4))) * 3 if r.delayed else None

  def run(copies):
    f = lambda x, w, h: quantized_matmul(x, w, recipe=r, name="wi", history=h, dtype=jnp.float32,
                                         kernel_copies=copies)
    y, vjp = jax.vjp(f, x, w, history)
    return y, vjp(g)

  copies = kernel_copies(w, recipe=r, history=history)
  mine = r.quantizer(WEIGHT, None if history is None else history[1]).quantize(w, axis=0)
  assert set(copies) == {"kernel", "kernel_t"}
  np.testing.assert_array_equal(copies["kernel_t"].data, mine.data)
  np.testing.assert_array_equal(copies["kernel"].data, mine.data.T)
  np.testing.assert_array_equal(copies["kernel"].scale_inv, mine.scale_inv)
  own, ahead = run(None), run(copies)
  for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(own), strict=True):
    assert _rel_error(a, b) < 1e-6
  other = run(kernel_copies(2 * w, recipe=r, history=None if history is None else 2 * history))
  assert not np.array_equal(other[0], own[0]) and not np.array_equal(other[1][0], own[1][0])  # y and dx.


def test_kernel_copies_are_made_ahead_where_every_gemm_reads_them():
  """bf16 (its cast, where a loop of micro-batches reads it), and per-tensor recipes, their forward GEMM
  quantized, without health statistics; not block-scaled recipes, `quant.forward = "bf16"` (the forward GEMM reads
  the kernel itself) nor statistics steps."""
  from ember.quant.dot import takes_kernel_copies
  made = {(name, forward, stats) for name in ("bf16", *QUANTIZED_RECIPES) for forward in ("recipe", "bf16")
          for stats in (False, True) if takes_kernel_copies(Recipe(name, forward=forward), stats)}
  bf16 = {("bf16", forward, stats) for forward in ("recipe", "bf16") for stats in (False, True)}
  assert made == bf16 | {("fp8_current", "recipe", False), ("fp8_delayed", "recipe", False)}
  # One micro-batch (no loop reads the copies): a cast made ahead saves nothing; a quantization still does.
  assert not takes_kernel_copies(Recipe("bf16"), False, loop=False)
  assert takes_kernel_copies(Recipe("fp8_current"), False, loop=False)


def test_a_bf16_kernel_cast_ahead_gives_the_gemms_own_output_and_gradients():
  """An unquantized recipe's copy (`kernel_copies`: the float32 kernel cast to the compute dtype once a step) gives
  the GEMM's output and both gradients bit for bit, the kernel's in its own dtype, rounded to the compute dtype as
  the cast's transpose rounds it; and the GEMM reads the copy: handed another one, its output and x's gradient
  change while the kernel's stays the same (it depends on x and the output's gradient only)."""
  from ember.quant.dot import kernel_copies
  r = Recipe("bf16")
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x, w = jax.random.normal(kx, (48, 64), jnp.bfloat16), jax.random.normal(kw, (64, 32))
  g = jax.random.normal(kg, (48, 32), jnp.bfloat16)

  def run(copies):
    f = lambda x, w: quantized_matmul(x, w, recipe=r, name="wi", dtype=jnp.bfloat16, kernel_copies=copies)
    y, vjp = jax.vjp(f, x, w)
    return y, vjp(g)

  copies = kernel_copies(w, recipe=r, dtype=jnp.bfloat16)
  assert set(copies) == {"kernel"} and copies["kernel"].dtype == jnp.bfloat16
  own, ahead = run(None), run(copies)
  assert ahead[1][1].dtype == w.dtype
  for a, b in zip(jax.tree.leaves(ahead), jax.tree.leaves(own), strict=True):
    np.testing.assert_array_equal(a, b)
  other = run(kernel_copies(2 * w, recipe=r, dtype=jnp.bfloat16))
  assert not np.array_equal(other[0], own[0]) and not np.array_equal(other[1][0], own[1][0])  # y and dx.
  np.testing.assert_array_equal(other[1][1], own[1][1])


def _count_quantized_names(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name" and eqn.params["name"].startswith(remat.QUANTIZED + "."):
      n += 1
    for sub in jex.core.jaxprs_in_params(eqn.params):
      n += _count_quantized_names(sub)
  return n


# Per projection: the operands a recipe names (x, kernel; + x_t, kernel_t for MXFP8; + x_t for
# NVFP4 with 16x16 weight tiles), each a QuantizedTensor of 4 arrays (data, scale_inv,
# global_scale_inv, amax). A dense layer has 4 projections: qkv, out, wi, wo.
EXPECTED_NAMES = {"bf16": 0, "fp8_current": 4 * 2 * 4, "fp8_delayed": 4 * 2 * 4, "mxfp8": 4 * 4 * 4,
                  "nvfp4": 4 * 3 * 4}


@pytest.mark.parametrize("recipe", list(EXPECTED_NAMES))
def test_decoder_layer_names_every_quantized_residual(recipe):
  cfg = derive(config("tiny", **{"quant.recipe": recipe}), 1)
  with nnx.use_eager_sharding(False):
    layer = DecoderLayer(cfg.model, cfg.quant, 0, nnx.Rngs(params=0))
  b, length, d = 2, cfg.model.seq_len, cfg.model.d_model
  x = jnp.zeros((b, length, d), jnp.bfloat16)
  seg = jnp.ones((b, length), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(length), (b, length))
  graphdef, state = nnx.split(layer)
  fn = lambda state, x: nnx.merge(graphdef, state)(x, seg, pos, jax.random.key(0))[0]
  jaxpr = jax.make_jaxpr(fn)(state, x).jaxpr
  assert _count_quantized_names(jaxpr) == EXPECTED_NAMES[recipe]
