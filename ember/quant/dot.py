"""The quantized matmul every projection uses: y[M, N] = x[M, K] @ w[K, N].

The GEMMs, their quantized operands and their custom VJP are quant/core.py's, with `DenseLayout`: one kernel,
rows padded to the block (block-scaled wgrad copies are quantized along M). Per-tensor FP8 GEMMs dequantize as
`data.astype(bf16) * scale` and dot: the pattern XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM.
Block-scaled ones (MXFP8, NVFP4) go through quant/gemm.py, whose one rule picks the platform's way: cuDNN's
block-scaled GEMM on Blackwell, `jax.lax.scaled_dot` on CPU, an emulated bf16 GEMM elsewhere.

Delayed scaling: a projection's histories are one [3 (x, kernel, grad), H] array (its QuantState); its
"cotangent" is the updated history (quant/core.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ember.quant import one_pass
from ember.quant.core import SCOPE_WEIGHT, KernelRow, quantize_kernel, quantized_gemm
from ember.quant.gemm import block_scaled_dot, output_dtype
from ember.quant.quantizers import tensor_amax
from ember.quant.recipe import KERNEL, KERNEL_T, WEIGHT, Recipe, pad_to
from ember.quant.tensor import QuantizedTensor
from ember.quant.unquantized import unquantized_matmul
from ember.quant.varying import shard_axes, sum_to, vma_of


def quantized_matmul(x_MxK: jax.Array, w_KxN: jax.Array, *, recipe: Recipe, name: str,
                     history: jax.Array | None = None, key: jax.Array | None = None, dtype=jnp.bfloat16,
                     stats: jax.Array | None = None, error: jax.Array | None = None,
                     kernel_amax: jax.Array | None = None, wgrad_transposed: bool = False,
                     row_axes: tuple[str, ...] = (), kernel_row: KernelRow | None = None, kernel_sharding=None,
                     row_sharding=None, kernel_copies: dict | None = None, prologue=None):
  """x @ w in `recipe`'s format; x's rows may come in several axes ([B, L, K]) where `keeps_rows(recipe)`, and y's
  then do too. `name` is the projection (names its residuals); `history` the
  delayed-scaling amax histories (fp8_delayed only); `key` seeds stochastic rounding (nvfp4).
  `stats`: a [3 (x, kernel, grad), NUM_STATS] input whose "gradient" is the operands' health
  (ember/quant/health.py), or None: no statistics, and no trace of them in the program. `error`: a [2]
  input whose "gradient" is the forward output's error (quant/core.py), or None. `kernel_amax`: max|w| from
  `kernel_amax` (taken once for the micro-batches of a step: `takes_kernel_amax`), or None.
  `wgrad_transposed`: w's gradient is reduced across GPUs along its output axis (FSDP over an output axis):
  a block-scaled wgrad then writes it transposed, that axis major (`DenseLayout`). `row_axes`: the mesh axes
  x's rows are split over, in their order (layers/linear.py: the batch's and the sequence's). `kernel_row`: w
  where it lies in stacked kernels (quant/core.py), or None. `kernel_sharding`: where the GEMMs read w (its
  FSDP axes gathered, `tensor` kept; layers/linear.py): a per-tensor FP8 kernel's data is gathered there itself,
  or None. `row_sharding`: where the GEMMs read the rows of x and of its gradient, kept in several axes (their
  tokens whole over the sequence-parallel axes; layers/linear.py): their FP8 data is gathered there itself, or
  None. `kernel_copies`: w's quantized copies made once for a step's micro-batches (`kernel_copies`), or None.
  `prologue`: x is its source and the GEMMs read `prologue.forward(x)`; an unquantized GEMM makes it in its VJP
  (quant/unquantized.py), a quantized one first."""
  dtype = jnp.dtype(dtype)
  if prologue is not None and recipe.quantized:
    x_MxK, prologue = prologue.forward(x_MxK), None
  assert x_MxK.ndim == 2 or keeps_rows(recipe) or prologue is not None, (x_MxK.shape, recipe.name)
  if not recipe.quantized:
    # The kernel cast here, or read from the cast made ahead: its gradient is rounded to the compute dtype, as
    # autodiff of a bf16 dot rounds it.
    w = w_KxN.astype(dtype) if kernel_copies is None else _read_as(w_KxN.dtype, vma_of(w_KxN), w_KxN,
                                                                   kernel_copies[KERNEL])
    return unquantized_matmul(_contract, x_MxK, w, dtype=dtype, wgrad_dtype=recipe.wgrad_out(w_KxN.dtype),
                              prologue=prologue)
  # The [3, H] and [3, S] arrays as (x, kernel, grad) rows; autodiff stacks their cotangents back.
  triple = lambda a: None if a is None else (a[0], a[1], a[2])
  # Inside a step's data-parallel shard_map (trainer/step.py) x and its gradient hold one replica's rows: their
  # amaxes are reduced over the replicas, the one amax of the whole batch, as outside it.
  # There too a block-scaled wgrad sums its rows' parts on the compiler's axes outside its GEMM (`row_split`).
  manual = shard_axes()
  layout = DenseLayout(x_axis=x_MxK.ndim - 1, transposed=recipe.has_x_t,
                       wgrad_transposed=wgrad_transposed and recipe.has_x_t, reduce_axes=tuple(sorted(manual)),
                       row_split=_row_split(x_MxK, row_axes, manual, recipe), kernel_sharding=kernel_sharding,
                       row_sharding=row_sharding)
  return quantized_gemm(x_MxK, w_KxN, None, triple(history), key, triple(stats), layout=layout,
                        recipe=recipe, name=name, dtype=dtype, error=error, kernel_amax=kernel_amax,
                        kernel_row=kernel_row, kernel_copies=kernel_copies)


def kernel_copies(w_KxN: jax.Array, *, recipe: Recipe, history: jax.Array | None = None,
                  amax: jax.Array | None = None, dtype=jnp.bfloat16) -> dict:
  """The copies of kernel w [K, N] that `quantized_matmul`'s GEMMs read, made ahead: a step quantizes each kernel
  once for all its micro-batches and remat recomputations (the weights do not change within a step), where
  each GEMM would quantize it again, and XLA hoists no such pass out of a loop (llama3_70b, tensor 4 x 8 stages,
  128 micro-batches: 1.3 TB a device a step). The same values as the GEMM's own quantization, so a step's
  numbers do not change. `history`: the kernel's delayed-scaling history [3, H] (fp8_delayed), `amax` its
  max|w| (`kernel_amax`) or None.

  A per-tensor copy comes stored both ways: transposed, [N, K], for the forward GEMM and as it is, [K, N], for
  dgrad, each in the layout an FP8 GEMM reads (its contraction axis minor), so that neither is transposed after
  its FSDP gather, for every GEMM again (`DenseLayout.whole` gathers either). An unquantized recipe's one copy is
  the kernel cast to the compute `dtype`, [K, N], which all three GEMMs read (the float32 weights were cast for
  every pass again: llama3_70b in bf16, tensor 4 x 8 stages, 128 micro-batches: 1.7 TB a device a step)."""
  if not recipe.quantized:
    return {KERNEL: w_KxN.astype(dtype)}
  layout = DenseLayout(transposed=recipe.has_x_t)
  h_k = jnp.zeros((1,), jnp.float32) if history is None else history[1]
  copies = quantize_kernel(layout, recipe, layout.pad_kernel(w_KxN, recipe.block_size), h_k, amax=amax)
  if recipe.block_size == 1 and KERNEL_T not in copies:
    copies = {KERNEL: copies[KERNEL].T, KERNEL_T: copies[KERNEL]}
  return copies


def takes_kernel_copies(recipe: Recipe, stats: bool, loop: bool = True) -> bool:
  """Whether a step makes a dense kernel's copies ahead (`kernel_copies`): per-tensor recipes whose forward GEMM
  is quantized (under `quant.forward = "bf16"` it reads the kernel itself), without health statistics (which a
  GEMM measures on its own operands); unquantized ones (the cast to the compute dtype) where a `loop` of
  micro-batches reads them (a pipeline's ticks, gradient accumulation). A cast is a pass of its own only once a
  micro-batch: one micro-batch cast its kernels for the forward pass and again for the remat, and reading the
  copies costs as much where each layer slices its row out of the stacked ones (llama3_8b bf16, `full` scanned,
  h100x8: 611.1 ms floor with them, 611.0 without). Not yet the block-scaled recipes, whose kernel casts are the
  platform's one-pass kernels (quant/one_pass.py), not traced under the vmap over stacked layers."""
  if not recipe.quantized:
    return loop
  return recipe.forward_quantized and recipe.block_size == 1 and not stats


def kernel_copy_count(recipe: Recipe) -> int:
  """How many copies of a kernel `kernel_copies` makes: an unquantized recipe's one cast, a per-tensor recipe's
  two layouts."""
  return 1 if not recipe.quantized else 2


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _read_as(w_dtype, w_vma, w, copy):
  """`copy` (w cast ahead, `kernel_copies`) where the GEMM reads w: its cotangent goes to w, in w's dtype."""
  return copy


def _read_as_fwd(w_dtype, w_vma, w, copy):
  return copy, None


def _read_as_bwd(w_dtype, w_vma, _, g):
  return sum_to(g, w_vma).astype(w_dtype), None


_read_as.defvjp(_read_as_fwd, _read_as_bwd)


def keeps_rows(recipe: Recipe) -> bool:
  """Whether `quantized_matmul` takes x's rows in several axes ([B, L, K], not flattened): where a recipe scales
  per tensor, every GEMM reads x as it lies. Flattening [B, L] split over two mesh axes (the length over `tensor`:
  sequence parallelism) is no split XLA can keep: it gathers x whole before the reshape, in x's dtype, so the
  quantize runs on the gathered tensor and the `tensor` axis moves bf16 (or float32) where it could move FP8;
  a row-parallel GEMM's output is all-reduced instead of reduce-scattered. Not for bf16: there the gathered
  length lies major, and the transposes XLA adds around each GEMM cost what the reduce-scatters save (llama3_8b,
  fsdp 4 x tensor 2: +17 ms of memory kernels for -15 ms of collectives)."""
  return recipe.quantized and recipe.block_size == 1 and not recipe.has_x_t


def _row_split(x_MxK, row_axes: tuple[str, ...], manual, recipe: Recipe) -> tuple[str, ...]:
  """The compiler's axes of `row_axes` inside a shard_map (`DenseLayout.row_split`), where the rows are not padded
  to the block (padded, the parts would not be each device's own rows; whether they split into whole blocks a
  device, the GEMM sees: quant/gemm.py's `_parts`)."""
  unpadded = x_MxK.shape[0] % recipe.scheme.block_size == 0
  return tuple(a for a in row_axes if a not in manual) if manual and unpadded else ()


def kernel_amax(w: jax.Array) -> jax.Array:
  """max|w| as a kernel's quantizer takes it (`quantizers.tensor_amax`), in its name scope: a parameter, finite."""
  with jax.named_scope(SCOPE_WEIGHT):
    return tensor_amax(w, finite=True)


def takes_kernel_amax(recipe: Recipe, stats: bool) -> bool:
  """Whether quantizing a kernel reads it once just for max|w| (per-tensor recipes; NVFP4's tiles cast by
  quant/one_pass.py; with health statistics the pass reads w whole anyway): a caller that quantizes the same
  kernel many times then takes max|w| once (`kernel_amax`) and hands it in as `quantized_matmul`'s
  `kernel_amax`."""
  return (recipe.kernel_amax_pass or one_pass.casts_kernel_tiles(recipe)) and not stats


def reads_kernel_in_place(recipe: Recipe, stats: bool) -> bool:
  """Whether quantizing a kernel of `recipe` can read it where it lies in stacked kernels (`kernel_row`): NVFP4's
  tile cast (quant/one_pass.py), without health statistics."""
  return one_pass.casts_kernel_tiles(recipe) and not stats


def product(a, b, contracting: tuple[int, int], dtype, out, split: tuple[str, ...] = (), weight_gradient=False):
  """The GEMM of two quantized 2-d operands contracting a's axis `contracting[0]` with b's `contracting[1]`,
  for a consumer of dtype `out` (quant/gemm.py's `output_dtype` rule; see the module doc). `split`: the mesh axes
  a block-scaled GEMM's contraction is split over, summed outside it; `weight_gradient`: the product is one
  (both: `block_scaled_dot`)."""
  if a.block:
    return block_scaled_dot(a, b, contracting, batched=False, dtype=dtype, out=out, split=split,
                            weight_gradient=weight_gradient)
  dims = ((contracting[:1], contracting[1:]), ((), ()))
  y = jax.lax.dot_general(a.dequantize(dtype), b.dequantize(dtype), dims, preferred_element_type=output_dtype(out))
  return y.astype(out)


def head_matmul(x_MxK: jax.Array, w_KxN: jax.Array, *, dtype, wgrad_dtype, out_dtype=jnp.float32) -> jax.Array:
  """x @ w for an unquantized LM head (tied or not), from `dtype` operands, written in `out_dtype`: its backward
  runs on `dtype` operands like every other projection's, the logits' cotangent rounded to `dtype`
  (quant/unquantized.py). Autodiff of the plain dot runs dgrad and wgrad as float32 x float32 GEMMs instead: the
  1b preset's tied head did so on an H100, 4 of the step's GEMMs (17 of its 130 TFLOP) at TF32's rate on twice
  the bytes. `w` comes in its own dtype and its gradient leaves in it unrounded, as `wgrad_dtype`
  (Recipe.wgrad_out) wrote it: the loss sums the head's gradient over its token chunks (ember/trainer/loss.py),
  in float32 and in the GEMM itself (a cuBLAS GEMM accumulating into its output), which a rounding between
  would prevent."""
  return unquantized_matmul(_contract, x_MxK, w_KxN, dtype=dtype, wgrad_dtype=wgrad_dtype, out_dtype=out_dtype)


_DIMS = {"forward": ((1,), (0,)), "dgrad": ((1,), (1,)), "wgrad": ((0,), (0,))}


def _contract(a, b, groups, step, preferred):
  """The dense layout's three GEMMs (quant/unquantized.py), each one dot_general (no transpose before it, so
  that under FSDP the kernel is all-gathered as it is, not as a transposed copy)."""
  return jax.lax.dot_general(a, b, (_DIMS[step], ((), ())), preferred_element_type=preferred)


@dataclasses.dataclass(frozen=True)
class DenseLayout:
  """x [M, K] @ w [K, N] (quant/core.py's `Layout`): one kernel and its scales; rows padded to the block.

  `transposed` (block-scaled recipes): the copies quantized along a first axis (x and the gradient along M for
  wgrad, the kernel along K for the forward GEMM) are stored transposed, contraction axis last, as the GEMM
  reads them and as the one-pass kernel writes them (quant/fused.py): quantized exactly as before (stochastic
  rounding's noise drawn in the same layout), then transposed, so XLA writes them transposed from the kernel
  that quantizes them instead of transposing them apart for the GEMM. Every GEMM contracts a block-scaled copy
  along the axis it was quantized along, so it reads either layout.

  `wgrad_transposed` (block-scaled recipes): wgrad computes g.T @ x, [N, K], and returns its transpose. The
  block-scaled GEMM writes its output row-major only, and a gradient reduce-scattered along N (an FSDP-sharded
  output axis: `wo`, the attention output) wants N major: written [K, N], XLA transposed every such gradient
  in float32 before its reduce-scatter (22 GB a step for llama3_8b mxfp8 on b200x8). The same products,
  summed in another order (float32 rounding).

  `row_split` (inside a step's shard_map over its replicas): the mesh axes, left to the compiler, that the rows
  are split over; a block-scaled wgrad, which contracts the rows, multiplies each device's part on its own and
  sums the parts after the GEMM, as cuDNN's GEMM cannot sum them itself there (quant/gemm.py)."""
  x_axis: int = 1
  row_axis: int = 0
  per_expert: bool = False
  reduce_axes: tuple[str, ...] = ()
  transposed: bool = False
  wgrad_transposed: bool = False
  row_split: tuple[str, ...] = ()
  kernel_sharding: object = None  # Where the [K, N] kernel's GEMMs read it, over the compiler's axes (Linear).
  row_sharding: object = None  # Where the GEMMs read rows kept in several axes (`keeps_rows`), or None (Linear).

  def prepare(self, a, rows, block):
    return pad_to(a, (block, block))

  def pad_kernel(self, w, block):
    return pad_to(w, (block, block))

  def wgrad_rows(self, a, rows, block):
    return a

  def wgrad_copy(self, q: QuantizedTensor) -> QuantizedTensor:
    """A copy quantized along the rows, as wgrad reads it."""
    return q.T if self.transposed else q

  def quantize_kernel(self, recipe: Recipe, w, history, axis, stats, amax=None):
    if amax is None and recipe.kernel_amax_pass and not stats:
      amax = kernel_amax(w)  # A parameter's: finite, so no NaN test in the pass (`kernel_amax`).
    q = recipe.quantizer(WEIGHT, history).quantize(w, axis=axis, stats=stats, amax=amax)
    return q.T if self.transposed and axis == 0 and recipe.has_kernel_t else q

  def whole(self, a):
    # Gather the FP8 data itself. XLA's collective quantizer would otherwise have to move the gather of the
    # dequantized kernel ahead of its conversion, which it does only where it can prove the scale the same on
    # every device (not inside a shard_map, nor for every kernel of unrolled tensor-parallel layers).
    if isinstance(a, QuantizedTensor) and not a.block and a.axis == 1:  # Stored transposed (`kernel_copies`).
      return _data_at(a, _transposed(self.kernel_sharding))
    return _data_at(a, self.kernel_sharding)

  def gathered_rows(self, a):
    """A per-tensor copy of x or g with its rows where the GEMMs read them: its FP8 data gathered itself, as
    `whole` gathers a kernel's (left to XLA inside a shard_map, the gather is of the dequantized copy, and the
    GEMM runs in bf16)."""
    return _data_at(a, self.row_sharding)

  def forward(self, x, w, rows, dtype):
    if isinstance(x, QuantizedTensor):
      return product(self.gathered_rows(x), w, (self.x_axis, w.axis), dtype, dtype)
    return jnp.dot(x.astype(dtype), w, preferred_element_type=output_dtype(dtype)).astype(dtype)

  def dgrad(self, g, w, rows, dtype, out):
    return product(self.gathered_rows(g), w, (self.x_axis, 1), dtype, out)

  def wgrad(self, x, g, rows, block, dtype, out):
    """Per-tensor copies contract their rows (gathered, then flattened, where they come in several axes:
    `keeps_rows`); block-scaled ones the axis they were quantized along."""
    if block and self.wgrad_transposed:
      return product(g, x, (g.axis, x.axis), dtype, out, self.row_split, weight_gradient=True).T
    if not block:
      x, g = _flat_rows(self.gathered_rows(x)), _flat_rows(self.gathered_rows(g))
    return product(x, g, (x.axis, g.axis) if block else (0, 0), dtype, out, self.row_split, weight_gradient=True)

  def kernel_gradient(self, dw):
    return dw

  def whole_kernel_shape(self, w):
    return w.shape


def _data_at(a, sharding):
  """A per-tensor quantized copy with its data constrained to `sharding` (its scale is one scalar); anything else,
  or no sharding, as it is."""
  if sharding is None or not isinstance(a, QuantizedTensor) or a.block:
    return a
  return dataclasses.replace(a, data=jax.lax.with_sharding_constraint(a.data, sharding))


def _transposed(sharding):
  """A 2-d array's sharding for its transpose (or None)."""
  if sharding is None:
    return None
  spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[1], spec[0]))


def _flat_rows(q: QuantizedTensor) -> QuantizedTensor:
  """A per-tensor copy [..., K] as [rows, K] (its one scale holds for any shape)."""
  if q.data.ndim == 2:
    return q
  return dataclasses.replace(q, data=q.data.reshape(-1, q.data.shape[-1]), axis=1)
