"""The one projection module: every matmul with a weight goes through here.

It owns the kernel (logical axes for sharding) and, for delayed scaling, the amax histories of its
operands; the math is `ember.quant.dot.quantized_matmul`, so the recipe decides the format and
the names of the quantized residuals.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ember.quant import dot
from ember.quant.recipe import Recipe
from ember.remat import PROJECTIONS


class QuantState(nnx.Variable):
  """Delayed-scaling amax histories [3 (x, kernel, grad), history_len].

  Part of the train state and of checkpoints. The quantized matmul's custom VJP returns each
  step's updated history as this variable's "gradient"; the train step stores it instead of
  handing it to the optimizer (trainer/step.py).
  """


class Linear(nnx.Module):
  """y[..., out] = x[..., in] @ kernel[in, out], with `in`/`out` possibly multi-dimensional.

  `name` is the projection's kind (one of remat.PROJECTIONS: it names the quantized residuals and
  seeds stochastic rounding); `path` locates this instance (`layers.3.mlp.wo`) for
  `quant.exclude` patterns.
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], axes: Sequence[str | None], *,
               name: str, path: str, recipe: Recipe, init_std: float, dtype, param_dtype, rngs: nnx.Rngs):
    assert name in PROJECTIONS, name
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    shape = self.in_shape + self.out_shape
    assert len(axes) == len(shape), (axes, shape)
    kernel = jax.random.normal(rngs.params(), shape, param_dtype) * init_std
    self.kernel = nnx.Param(kernel, out_sharding=tuple(axes))
    self.name, self.path, self.dtype = name, path, dtype
    self.recipe = recipe.for_path(path)
    if self.recipe.delayed:
      self.amax_history = QuantState(jnp.zeros((3, self.recipe.amax_history_len), jnp.float32),
                                     out_sharding=(None, None))

  def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    k, n = math.prod(self.in_shape), math.prod(self.out_shape)
    lead = x.shape[: x.ndim - len(self.in_shape)]
    if key is not None:
      key = jax.random.fold_in(key, PROJECTIONS.index(self.name))
    history = self.amax_history[...] if self.recipe.delayed else None
    y = dot.quantized_matmul(x.reshape(-1, k), self.kernel[...].reshape(k, n), recipe=self.recipe, name=self.name,
                             history=history, key=key, dtype=self.dtype)
    return y.reshape(lead + self.out_shape)
