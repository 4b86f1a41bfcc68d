"""The recipe table: what every quantization recipe means, in one place.

A recipe decides, for every projection matmul (dense and grouped alike):
  * the quantizer of each role (activation, weight, gradient): format and scaling;
  * which quantized operand copies exist: `x` and `kernel` for the forward GEMM; block-scaled
    recipes also quantize `x` along M (`x_t`, for wgrad) and the kernel along N (`kernel_t`, for
    dgrad) unless NVFP4's 16x16 weight tiles let one copy serve both GEMMs. Per-tensor scales
    make one copy of each serve every GEMM;
  * the block size along a contraction axis (operands are zero-padded to a multiple of it);
  * whether the wgrad operands go through the random Hadamard transform (NVFP4).
`SCHEMES` is that table; `Recipe` is a config's choice of one row plus its options (frozen,
hashable: it is a static argument of the custom VJPs), and answers every question above. Nothing
else in ember compares recipe names.

Per-step state (delayed-scaling amax histories) is not here: it lives in the train state and is
handed to `Recipe.quantizer`. Where an amax is reduced is decided where a tensor is quantized.

    fp8_current   E4M3 x, w; E5M2 gradients; per-tensor scales from this tensor's amax.
    fp8_delayed   the same formats; scales from an amax history of earlier steps.
    mxfp8         E4M3 everywhere, one E8M0 power-of-two scale per 32 elements.
    nvfp4         E2M1 with E4M3 scales per 16 elements (16x16 tiles for weights) and a float32
                  tensor scale; stochastic rounding of gradients; RHT on the wgrad operands.
    bf16          no quantization.

`quant.exclude` (`parse_exclude`, `excluded`): which projections stay in bf16 under a quantized recipe. An entry
selects projections by layer, by kind, or both:

  lm_head             the LM head
  wo                  every projection of that kind (qkv, out, wi, wo, moe_wi, moe_wo, shared_wi,
                      shared_wo) in every layer
  layers[0]           every projection of layer 0
  layers[-2:]         every projection of the last two layers
  layers[0:4].wo      the `wo` projection of layers 0, 1, 2 and 3
  layers[-1].qkv      the last layer's `qkv`
  mtp                 every projection of the multi-token-prediction modules (ember/layers/mtp.py)
  mtp.wo              their `wo` projections

Layer ranges are Python slices over `range(num_layers)` (negative indices count from the end, as
Megatron's "first/last N layers in bf16" does), so `layers[1]` never also means layer 10, as the
glob `layers.1*` did. They select decoder layers only: the prediction modules after them (the model's
layers num_layers, num_layers + 1, ...) are `mtp`'s. A malformed entry is an error naming it, never a
pattern that matches nothing.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import jax.numpy as jnp

from ember.errors import ConfigError
from ember.keys import check_fields, key
from ember.names import LAYER_PROJECTIONS, PROJECTIONS
from ember.quant import hadamard
from ember.quant.formats import E2M1, E4M3, E5M2, Format
from ember.quant.quantizers import (AMAX_ALGOS, CurrentScaling, DelayedScaling, MXFP8Scaling, NVFP4Scaling,
                                    Quantizer)
from ember.quant.tensor import QuantizedTensor
from ember.remat import QUANTIZED_OPERANDS


ACTIVATION, WEIGHT, GRADIENT = "activation", "weight", "gradient"
ROLES = (WEIGHT, ACTIVATION, GRADIENT)
# The operand copies a quantized matmul may hold (see the module doc); remat names each.
X, KERNEL, X_T, KERNEL_T = QUANTIZED_OPERANDS


def _fp8_format(role: str):
  return E5M2 if role == GRADIENT else E4M3


# The tensor-core precisions a GEMM runs in, as hardware/facts.toml rates them and the HLO reader
# (ember/program/hlo.py) tells them apart: a scheme's `precision`, bf16 (unquantized GEMMs, attention) and f32
# (TF32, XLA's default for float32 GEMMs).
FP8, MXFP8, NVFP4, BF16, F32 = "fp8", "mxfp8", "nvfp4", "bf16", "f32"


@dataclasses.dataclass(frozen=True)
class Scheme:
  """One row of the recipe table. `make(recipe, role, history)` builds a role's quantizer."""
  name: str
  make: Callable[["Recipe", str, jax.Array | None], Quantizer] | None  # None: not quantized.
  precision: str  # The tensor-core precision its GEMMs run in (one of GEMM_PRECISIONS).
  # Bytes per element of a projection kernel as FSDP gathers it: the data and its scales.
  weight_bytes: float
  data_format: Format | None = None  # The quantized data's element format (E4M3 x and weights for FP8).
  block_size: int = 1  # Elements per scaling block along a contraction axis; 1 = per-tensor.
  delayed: bool = False  # Scales come from amax histories in the train state.
  stateless: str | None = None  # A delayed scheme's twin where no state can be kept (`Recipe.stateless`).
  transposed_copies: bool = False  # Block-scaled: x_t for wgrad, kernel_t for dgrad (see module doc).
  hadamard: bool = False  # The wgrad operands may go through the random Hadamard transform.
  tensor_scale: bool = False  # Block-scaled data also carries a float32 per-tensor scale (NVFP4).
  # On a GPU a dense operand's two copies come from one kernel that reads it once (quant/fused.py).
  one_pass_kernel: bool = False
  # MoE token copies cross the expert exchange quantized (`Recipe.exchange_quantizer`): true where the expert GEMMs'
  # quantizers, applied again on arrival, give back the very values sent (per-tensor current scaling).
  exchange_quantized: bool = False
  # (statistic, limit) pairs replacing quant/health.py's default warning thresholds for this format.
  health_limits: tuple[tuple[str, float], ...] = ()
  # The projections the format's published training recipe keeps in bf16 (`quant.exclude` syntax), where it
  # keeps some: the convergence comparison (ember/tools/convergence.py) runs the format with and without them.
  published_exclude: tuple[str, ...] | None = None
  # The `Recipe` options (the `quant` keys) its quantizers read; the others are the other schemes'.
  options: tuple[str, ...] = ()


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("bf16", None, BF16, 2.0),
    Scheme("fp8_delayed", lambda r, role, h: DelayedScaling(h, _fp8_format(role), r.margin, r.amax_compute_algo),
           FP8, 1.0, E4M3, delayed=True, stateless="fp8_current",
           options=("amax_history_len", "amax_compute_algo", "margin")),
    Scheme("fp8_current", lambda r, role, h: CurrentScaling(_fp8_format(role)), FP8, 1.0, E4M3,
           exchange_quantized=True),
    Scheme("mxfp8", lambda r, role, h: MXFP8Scaling(), MXFP8, 1 + 1 / 32, E4M3, block_size=32,
           transposed_copies=True, one_pass_kernel=True),
    Scheme("nvfp4", lambda r, role, h: NVFP4Scaling(tile_2d=role == WEIGHT and r.nvfp4_2d_weights,
                                                    stochastic_rounding=role == GRADIENT and r.nvfp4_stochastic_rounding),
           NVFP4, 0.5 + 1 / 16, E2M1, block_size=16, transposed_copies=True, hadamard=True, tensor_scale=True,
           # 4-bit blocks underflow a few percent of a Gaussian tensor (elements under 1/12 of their block's
           # amax) and clip a few percent where an E4M3 block scale rounds down, by design.
           health_limits=(("underflow", 0.25), ("saturated", 0.10)),
           # NVIDIA's NVFP4 pretraining recipe: the LM head and the last layers in higher precision.
           published_exclude=("lm_head", "layers[-1:]"),
           options=("nvfp4_rht", "nvfp4_stochastic_rounding", "nvfp4_2d_weights", "rht_seed")),
)}
RECIPES = tuple(SCHEMES)  # Every `quant.recipe` value.
UNQUANTIZED = next(n for n, s in SCHEMES.items() if s.make is None)  # The recipe that quantizes nothing.
GEMM_PRECISIONS = tuple(dict.fromkeys(s.precision for s in SCHEMES.values() if s.make is not None)) + (BF16, F32)
FORWARDS = ("recipe", "bf16")  # `quant.forward`: the forward GEMMs in the recipe, or in bf16.
WGRAD_DTYPES = ("float32", "bfloat16")
AMAX_HISTORY_LEN = 1024  # A recipe built in code (ember/config/defaults.py's quant.amax_history_len is the same).
QUANTIZED_RECIPES = tuple(n for n, s in SCHEMES.items() if s.make is not None)
SCHEME_OPTIONS = tuple(dict.fromkeys(o for s in SCHEMES.values() for o in s.options))  # Options some schemes read.


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A config's recipe: a row of `SCHEMES` and its options (see ember/config/defaults.py, `quant`)."""
  name: str = key("str", choices=RECIPES, name="recipe", default="bf16")
  amax_history_len: int = key("int", ">=1", default=AMAX_HISTORY_LEN)
  amax_compute_algo: str = key("str", choices=AMAX_ALGOS, default="max")
  margin: int = key("int", ">=0", default=0)
  nvfp4_rht: bool = key("bool", default=True)
  nvfp4_stochastic_rounding: bool = key("bool", default=True)
  nvfp4_2d_weights: bool = key("bool", default=True)
  rht_seed: int = key("int", ">=0", default=0)
  exclude: tuple[str, ...] = key("strs", default=())
  # "bf16": the forward GEMM on unquantized operands, the backward GEMMs in the recipe.
  forward: str = key("str", choices=FORWARDS, default="recipe")
  stats: bool = False  # Projections collect health statistics (quant/health.py; log.quant_stats_every > 0).
  # Projections report their forward output's error (quant/core.py; the precision probe, ember/plan/probe.py).
  output_error: bool = False
  # The dtype the weight-gradient GEMMs write (train.grad_reduce_dtype): under FSDP or data parallelism XLA
  # reduces each projection's gradient across devices in it, so "bfloat16" halves those bytes (Megatron's
  # `grad_reduce_in_fp32=False`); the sum stays float32 inside each GEMM, and accumulation over micro-batches
  # and the optimizer see float32.
  wgrad_dtype: str = "float32"
  # `exclude` parsed, once (`parse_exclude`); not a field of its own: it follows `exclude`.
  selectors: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())

  def __post_init__(self):
    check_fields(self, "quant")  # The keys' declared kinds and choices (ember/keys.py), before any conversion.
    object.__setattr__(self, "exclude", tuple(self.exclude))
    try:
      object.__setattr__(self, "selectors", tuple(parse_exclude(entry) for entry in self.exclude))
    except ValueError as e:
      raise ConfigError(f"config.quant.exclude: {e}") from None

  def wgrad_out(self, param_dtype) -> jnp.dtype:
    """The dtype a weight-gradient GEMM writes for a parameter of `param_dtype` (see `wgrad_dtype`)."""
    return jnp.dtype(jnp.bfloat16) if self.wgrad_dtype == "bfloat16" else jnp.dtype(param_dtype)

  # --- The table's answers ----------------------------------------------------------------------

  @property
  def scheme(self) -> Scheme:
    return SCHEMES[self.name]

  @property
  def quantized(self) -> bool:
    return self.scheme.make is not None

  @property
  def forward_quantized(self) -> bool:
    """The forward GEMM reads the quantized operands (`quant.forward = "recipe"`); with "bf16" it reads x and
    the kernel in the compute dtype, while dgrad and wgrad keep the recipe's operands."""
    return self.forward == "recipe"

  @property
  def precision(self) -> str:
    """The tensor-core precision its GEMMs run in (one of GEMM_PRECISIONS)."""
    return self.scheme.precision

  @property
  def delayed(self) -> bool:
    return self.scheme.delayed

  @property
  def block_size(self) -> int:
    """Elements per scaling block along a contraction axis (1 = per-tensor scaling)."""
    return self.scheme.block_size

  @property
  def has_x_t(self) -> bool:
    """wgrad reads `x` quantized again along M (block scales along K do not serve a contraction over M)."""
    return self.scheme.transposed_copies

  @property
  def has_kernel_t(self) -> bool:
    """dgrad reads the kernel quantized again along N; NVFP4's 16x16 weight tiles serve both GEMMs."""
    return self.scheme.transposed_copies and not (self.scheme.hadamard and self.nvfp4_2d_weights)

  @property
  def kernel_amax_pass(self) -> bool:
    """Quantizing a kernel takes its tensor amax in a pass of its own (per-tensor scaling; quantizers.py)."""
    return self.quantized and self.quantizer(WEIGHT, jnp.zeros((1,), jnp.float32)).reads_tensor_amax

  def custom_partitioned(self, platform: str) -> bool:
    """Whether this recipe traced for `platform` runs kernels that partition themselves (`custom_partitioning`:
    the Pallas quantize kernels and cuDNN's block-scaled GEMM of the block-scaled recipes on a GPU), whose rules
    cannot sum over the mesh inside a shard_map over part of it (quant/partitioning.py)."""
    return self.quantized and self.scheme.block_size > 1 and platform == "gpu"

  @property
  def operands(self) -> tuple[str, ...]:
    """The quantized operand copies one matmul holds (and names for remat)."""
    return (X, KERNEL) + ((X_T,) if self.has_x_t else ()) + ((KERNEL_T,) if self.has_kernel_t else ())

  def quantizer(self, role: str, history: jax.Array | None = None) -> Quantizer:
    """The quantizer of `role`. `history`: that operand's amax history (fp8_delayed only)."""
    if role not in ROLES:
      raise ValueError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
    if not self.quantized:
      raise ValueError(f"recipe {self.name!r} does not quantize; quantized recipes: {', '.join(QUANTIZED_RECIPES)}")
    if self.delayed and history is None:
      _needs_history()
    return self.scheme.make(self, role, history)

  def exchange_quantizer(self, role: str) -> Quantizer | None:
    """The quantizer MoE token copies cross the expert exchange in (layers/moe_dispatch.py), or None: in the
    compute dtype. ACTIVATION: the copies on their way to the experts (E4M3 under FP8), where the forward GEMM
    reads them quantized; GRADIENT: the gradients of the experts' outputs, the same way in the backward pass (E5M2).
    Sent with the amax of every token shard's copies, the expert GEMM's own, they quantize again on arrival to
    the same values: half the bytes of bf16, and the GEMMs' operands unchanged. Delayed scaling would quantize
    them twice at two scales; block scales along the rows would not serve wgrad's copy along the columns."""
    if not (self.quantized and self.scheme.exchange_quantized) or (role == ACTIVATION and not self.forward_quantized):
      return None
    return self.quantizer(role)

  @property
  def wgrad_rht_seed(self) -> int | None:
    """The seed of the RHT the wgrad operands go through, or None where the recipe uses none."""
    return self.rht_seed if self.scheme.hadamard and self.nvfp4_rht else None

  def wgrad_transform(self, a: jax.Array, axis: int) -> jax.Array:
    """The wgrad operands' transform along the contraction `axis`: the RHT where the recipe uses it
    (applied to both operands, so it cancels in the product), else nothing."""
    if self.wgrad_rht_seed is not None:
      return hadamard.random_hadamard_transform(a, axis=axis, seed=self.wgrad_rht_seed)
    return a

  # --- Variants -----------------------------------------------------------------------------------

  def stateless(self) -> "Recipe":
    """This recipe where no per-step state can be kept (a projection called several times a step, like
    the LM head, once per token chunk of the loss): delayed scaling becomes current scaling, and no health
    statistics or output error (each call's would add up); the rest is unchanged."""
    return dataclasses.replace(self, name=self.scheme.stateless or self.name, stats=False,
                               output_error=False)

  def for_projection(self, projection: str, layer: int | None, num_layers: int) -> "Recipe":
    """The recipe projection `projection` of `layer` (None: the LM head) runs in: bf16 if excluded."""
    if self.quantized and excluded(self.selectors, projection, layer, num_layers):
      return dataclasses.replace(self, name=UNQUANTIZED)
    return self


def block_scaled_precision(element_types: tuple[str, ...]) -> str:
  """The precision of a block-scaled GEMM whose operands have these HLO element types ("f4e2m1fn", ...): the
  block-scaled scheme of the narrowest data format among them (an NVFP4 GEMM also reads E4M3 scales)."""
  block_scaled = sorted((s for s in SCHEMES.values() if s.block_size > 1), key=lambda s: s.data_format.bits)
  return next((s.precision for s in block_scaled if s.data_format.hlo_name in element_types),
              block_scaled[-1].precision)


def pad_to(a: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
  """Zero-pads each axis to a multiple (zeros change neither amaxes nor products)."""
  pads = [(0, -n % m) for n, m in zip(a.shape, multiples)]
  return jnp.pad(a, pads) if any(p for _, p in pads) else a


def make_quantizer(recipe: str, role: str, *, nvfp4_2d_weights: bool = True, nvfp4_stochastic_rounding: bool = True,
                   amax_history_len: int = AMAX_HISTORY_LEN, margin: int = 0, amax_compute_algo: str = "max") -> Quantizer:
  """The quantizer a (recipe, role) pair uses; fp8_delayed starts from a zero history of `amax_history_len`."""
  if recipe not in QUANTIZED_RECIPES:
    raise ValueError(f"unknown quantization recipe {recipe!r}; valid recipes: {', '.join(QUANTIZED_RECIPES)} "
                     "('bf16' means: do not quantize)")
  r = Recipe(name=recipe, nvfp4_2d_weights=nvfp4_2d_weights, nvfp4_stochastic_rounding=nvfp4_stochastic_rounding,
             amax_history_len=amax_history_len, margin=margin, amax_compute_algo=amax_compute_algo)
  history = jnp.zeros((amax_history_len,), jnp.float32) if r.delayed else None
  return r.quantizer(role, history)


def quantize(x: jax.Array, recipe: str, role: str, axis: int = -1, rng: jax.Array | None = None, *,
             reduce_axes: tuple[str, ...] = ()) -> QuantizedTensor:
  """Quantizes `x` with the quantizer of (recipe, role), blocks along `axis`.

  fp8_delayed carries state between steps, so it is refused here: build a `DelayedScaling` (or
  `make_quantizer`) and carry it instead.
  """
  if recipe in SCHEMES and SCHEMES[recipe].delayed:
    _needs_history()
  if role not in ROLES:
    raise ValueError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")
  return make_quantizer(recipe, role).quantize(x, axis, rng=rng, reduce_axes=reduce_axes)


def _needs_history():
  raise ValueError("fp8_delayed needs an amax history from earlier steps: use DelayedScaling (make_quantizer) "
                   "and carry it")


_INT = r"-?\d+"
_LAYERS = re.compile(rf"^layers\[(?:(?P<index>{_INT})|(?P<start>{_INT})?:(?P<stop>{_INT})?)\]"
                     rf"(?:\.(?P<projection>\w+))?$")
_MTP = re.compile(r"^mtp(?:\.(?P<projection>\w+))?$")
MTP_LAYERS = "mtp"  # `Selector.layers` of an `mtp` entry: every layer past the decoder's.


@dataclasses.dataclass(frozen=True)
class Selector:
  """One parsed `quant.exclude` entry. `layers` is None (any layer, or the head), an index or a slice of the
  decoder's layers, or `MTP_LAYERS`."""
  text: str
  layers: int | slice | str | None
  projection: str | None

  def matches(self, projection: str, layer: int | None, num_layers: int) -> bool:
    if self.projection is not None and projection != self.projection:
      return False
    if self.layers is None:
      return True
    if layer is None:  # The LM head belongs to no layer.
      return False
    if self.layers == MTP_LAYERS:
      return layer >= num_layers
    chosen = range(num_layers)[self.layers]
    return layer in (chosen if isinstance(chosen, range) else (chosen,))


def parse_exclude(entry: str) -> Selector:
  """The selector an entry spells; ValueError (naming the entry and the grammar) if malformed."""
  if not isinstance(entry, str):
    raise ValueError(f"entry {entry!r} is not a string")
  text = entry.strip()
  if text in PROJECTIONS:
    return Selector(text, None, text)
  m = _LAYERS.match(text) or _MTP.match(text)
  if m is None:
    raise ValueError(f"entry {entry!r} is not a projection ({', '.join(PROJECTIONS)}) nor "
                     "layers[I], layers[A:B], mtp or any of them followed by .PROJECTION")
  projection = m.group("projection")
  if projection is not None and projection not in LAYER_PROJECTIONS:
    raise ValueError(f"entry {entry!r}: unknown projection {projection!r}; layers hold {', '.join(LAYER_PROJECTIONS)}")
  if m.re is _MTP:
    layers: int | slice | str = MTP_LAYERS
  elif m.group("index") is not None:
    layers = int(m.group("index"))
  else:
    to_int = lambda s: None if s is None else int(s)
    layers = slice(to_int(m.group("start")), to_int(m.group("stop")))
  return Selector(text, layers, projection)


def check_excluded_layers(selectors: tuple[Selector, ...], num_layers: int, mtp_depth: int = 0) -> None:
  """ValueError for a single-layer index outside the model (a range may select nothing: `layers[-4:]`
  of a 2-layer model is both layers), or an `mtp` entry for a model without prediction modules."""
  for s in selectors:
    if isinstance(s.layers, int) and not -num_layers <= s.layers < num_layers:
      raise ValueError(f"entry {s.text!r}: layer {s.layers} is outside a model of {num_layers} layers")
    if s.layers == MTP_LAYERS and mtp_depth == 0:
      raise ValueError(f"entry {s.text!r}: the model has no multi-token-prediction modules (model.mtp_depth=0)")


def excluded(selectors: tuple[Selector, ...], projection: str, layer: int | None, num_layers: int) -> bool:
  """Whether any selector keeps the projection `projection` of `layer` (None: the LM head) in bf16."""
  return any(s.matches(projection, layer, num_layers) for s in selectors)
