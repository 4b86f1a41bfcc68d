"""Which projections to keep in bf16: each quantized projection's error under a recipe at a checkpoint, and the
`quant.exclude` that brings the whole model's gradient error under a target (ember.tools.precision_probe).

The reference is the same model at the same parameters in float32 without quantization. On the same
`batches` batches of the checkpoint's held-out split (stochastic rounding keyed by the batch's index, so a
rerun gives the same numbers):
  grad error     of projection (layer, kind): |g - g_ref| / |g_ref| of its kernel's gradient (averaged over
                 the batches), the recipe applied to every projection the exclude list leaves quantized;
  weight error   |Q(W) - W| / |W| of its kernel as the recipe's forward GEMM reads it (the weight role's
                 quantizer, blocks along the kernel's inputs): the part of the error the forward pass starts from;
  whole model    |g - g_ref| / |g_ref| over every parameter's gradient at once.
The recommendation starts from the checkpoint's own `quant.exclude` and adds `layers[i].kind` entries, worst
grad error first, re-measuring the whole model after each, until it is under `target_error`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ember.data.sharded import data_iterator
from ember.layers.decoder import rows_by_layer, stacked_like, tree_leaves, within_layer
from ember.names import LM_HEAD
from ember.quant import quantize
from ember.trainer import muon
from ember.trainer.state import abstract_init, logical_axes, step_key
from ember.trainer.step import forward_loss

# The projection kind of a kernel, by its path below the layer (the LM head: outside the layers).
KINDS = {("attn", "qkv", "kernel"): "qkv", ("attn", "out", "kernel"): "out", ("mlp", "wi", "kernel"): "wi",
         ("mlp", "wo", "kernel"): "wo", ("moe", "wi", "kernel"): "moe_wi", ("moe", "wo", "kernel"): "moe_wo",
         ("moe", "shared", "wi", "kernel"): "shared_wi", ("moe", "shared", "wo", "kernel"): "shared_wo",
         ("lm_head", "kernel"): LM_HEAD}


@dataclasses.dataclass(frozen=True)
class Projection:
  layer: int | None  # None: the LM head.
  kind: str
  grad_error: float
  weight_error: float

  @property
  def selector(self) -> str:
    """Its `quant.exclude` entry."""
    return self.kind if self.layer is None else f"layers[{self.layer}].{self.kind}"


class Probe:
  """Gradients of one checkpoint's parameters (`params`, `quant_state`: trees of the `trained` settings) under
  settings that differ in recipe and exclude list, on the same batches."""

  def __init__(self, trained, params: dict, quant_state: dict, batches: int):
    self.trained = trained
    self.axes = kernel_axes(trained)
    self.rows = rows_by_layer(params, trained.model)
    self.quant_rows = rows_by_layer(quant_state, trained.model)
    it = data_iterator(trained, "eval")
    try:
      self.batches = [{k: jnp.asarray(v) for k, v in next(it).items()} for _ in range(batches)]
    finally:
      it.close()
    self.reference = self.gradients(trained.replace("quant.recipe", "bf16").replace("model.dtype", "float32")
                                    .replace("quant.exclude", ()))

  def gradients(self, settings) -> dict:
    """{(layer, path below it): gradient row} of `settings`, averaged over the batches."""
    abstract_params, abstract_quant = abstract_init(settings)
    params = stacked_like(lambda key, _: self.rows[key], settings.model, abstract_params)
    quant_state = stacked_like(lambda key, _: self.quant_rows[key], settings.model, abstract_quant)
    grad = _gradient_fn(settings)
    total = None
    for i, batch in enumerate(self.batches):
      g = grad(params, quant_state, batch, step_key(settings.seed, jnp.asarray(i, jnp.int32)))
      total = g if total is None else jax.tree.map(jnp.add, total, g)
    mean = jax.tree.map(lambda a: np.asarray(a, np.float64) / len(self.batches), total)
    return rows_by_layer(mean, settings.model)

  def whole_error(self, grads: dict) -> float:
    diff = sum(float(np.sum((grads[k] - ref) ** 2)) for k, ref in self.reference.items())
    return math.sqrt(diff / sum(float(np.sum(ref ** 2)) for ref in self.reference.values()))

  def projections(self, settings, grads: dict) -> list[Projection]:
    """Every projection the settings quantize, with its errors."""
    recipe, out = settings.quant, []
    for (layer, path), ref in self.reference.items():
      kind = KINDS.get(path)
      if kind is None or not settings.model.recipe_for(kind, layer).quantized:
        continue
      g = np.linalg.norm(grads[(layer, path)] - ref) / max(np.linalg.norm(ref), 1e-30)
      out.append(Projection(layer, kind, float(g), weight_error(self.rows[(layer, path)], self.axes[path],
                                                                recipe.name)))
    return out


@functools.lru_cache(maxsize=64)
def _gradient_fn(settings):
  """The jitted parameter gradient of settings' loss (one compile per settings, whichever probe asks)."""
  graphdef = logical_axes(settings)[0]
  return jax.jit(jax.grad(lambda p, q, b, key: forward_loss(p, q, b, graphdef=graphdef, cfg=settings, key=key)[0]))


def weight_error(kernel, axes: tuple, recipe: str) -> float:
  """|Q(W) - W| / |W| for one layer's kernel with logical `axes`, quantized as a weight with blocks along its
  inputs (its matrices as Muon sees them: ember/trainer/muon.py)."""
  m = np.asarray(muon.MatrixLayout.of(axes).matrices(jnp.asarray(kernel, jnp.float32)))
  q = np.asarray(quantize(jnp.asarray(m), recipe, "weight", axis=1).dequantize(jnp.float32))
  return float(np.linalg.norm(q - m) / max(np.linalg.norm(m), 1e-30))


def kernel_axes(settings) -> dict:
  """{path below the layer (or from the root, outside the layers): logical axes of one layer's leaf}."""
  _, specs, _ = logical_axes(settings)
  out = {}
  for path, spec in tree_leaves(specs):
    if path[0] == "segments":
      out[within_layer(path)] = tuple(spec)[1:]  # The stacked layers axis off.
    else:
      out[path] = tuple(spec)
  return out


def recommend(probe: Probe, recipe: str, target_error: float):
  """(projections under the recipe with the checkpoint's exclude list, its whole-model error, the exclude list
  that brings it under `target_error`, that list's whole-model error)."""
  settings = probe.trained.replace("quant.recipe", recipe)
  grads = probe.gradients(settings)
  found = probe.projections(settings, grads)
  first = error = probe.whole_error(grads)
  exclude = tuple(settings.quant.exclude)
  for p in sorted(found, key=lambda p: -p.grad_error):
    if error < target_error:
      break
    exclude += (p.selector,)
    error = probe.whole_error(probe.gradients(settings.replace("quant.exclude", exclude)))
  return found, first, exclude, error
