"""Quantization core: formats, quantizers, the recipe table, the quantized tensor, the RHT.

Pure JAX, no Flax: layers own parameters and call into this package.

  from ember.quant import quantize
  qt = quantize(x, "mxfp8", "activation", axis=-1)
  y = qt.dequantize(jnp.float32)
"""

from ember.quant.formats import E2M1, E4M3, E5M2, E8M0, FORMATS, Format, cast, get_format, stochastic_cast
from ember.quant.hadamard import inverse_random_hadamard_transform, random_hadamard_transform
from ember.quant.quantizers import (CurrentScaling, DelayedScaling, MXFP8Scaling, NVFP4Scaling, Quantizer,
                                    update_history)
from ember.quant.recipe import QUANTIZED_RECIPES, RECIPES, ROLES, Recipe, make_quantizer, quantize
from ember.quant.tensor import QuantizedTensor

__all__ = [
    "E2M1", "E4M3", "E5M2", "E8M0", "FORMATS", "Format", "cast", "get_format", "stochastic_cast",
    "random_hadamard_transform", "inverse_random_hadamard_transform", "QUANTIZED_RECIPES", "RECIPES", "ROLES",
    "Recipe", "CurrentScaling", "DelayedScaling", "MXFP8Scaling", "NVFP4Scaling", "Quantizer", "make_quantizer",
    "quantize", "update_history", "QuantizedTensor",
]
