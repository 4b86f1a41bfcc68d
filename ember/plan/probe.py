"""Which projections to keep in bf16: each quantized projection's error under a recipe at a checkpoint, and the
`quant.exclude` that brings the whole model's gradient error under a target (ember.tools.precision_probe).

The reference is the same model at the same parameters in float32 without quantization. On the same
`batches` batches of the checkpoint's held-out split (stochastic rounding keyed by the batch's index, so a
rerun gives the same numbers):
  grad error     of projection (layer, kind): |g - g_ref| / |g_ref| of its kernel's gradient (averaged over
                 the batches), the recipe applied to every projection the exclude list leaves quantized;
  output error   |y - y_ref| / |y_ref| of its forward output over the batches, y_ref the float32 product of
                 the same input and kernel unquantized (quant/core.py): the projection's own forward error,
                 not what it inherits from the layers before it (the LM head's: its logits, chunk by chunk as
                 the loss computes them, on the model's own final hidden states);
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
from flax import nnx

from ember.config import Settings
from ember.data.pipeline import data_iterator
from ember.layers.decoder import rows_by_layer, stacked_like, tree_leaves, within_layer
from ember.names import INPUTS, LM_HEAD, POSITIONS, SEGMENT_IDS
from ember.quant import quantize
from ember.quant.recipe import UNQUANTIZED
from ember.trainer import optimizer
from ember.trainer.loss import num_chunks, strided_chunks
from ember.trainer.state import abstract_init, logical_axes, stats_inputs, step_key
from ember.trainer.step import forward_loss

# The projection kind of a kernel, by its path below the layer (the LM head: outside the layers).
KINDS = {("attn", "qkv", "kernel"): "qkv", ("attn", "out", "kernel"): "out", ("mlp", "wi", "kernel"): "wi",
         ("mlp", "wo", "kernel"): "wo", ("moe", "wi", "kernel"): "moe_wi", ("moe", "wo", "kernel"): "moe_wo",
         ("moe", "shared", "wi", "kernel"): "shared_wi", ("moe", "shared", "wo", "kernel"): "shared_wo",
         **{("attn", p, "kernel"): p for p in ("q_a", "q_b", "kv_a", "kv_b")},  # Latent attention's.
         ("lm_head", "kernel"): LM_HEAD}


@dataclasses.dataclass(frozen=True)
class Projection:
  layer: int | None  # None: the LM head.
  kind: str
  grad_error: float
  output_error: float
  weight_error: float

  @property
  def selector(self) -> str:
    """Its `quant.exclude` entry."""
    return self.kind if self.layer is None else f"layers[{self.layer}].{self.kind}"


class Probe:
  """Gradients of one checkpoint's parameters (`params`, `quant_state`: trees of the `trained` settings) under
  settings that differ in recipe and exclude list, on the same batches."""

  def __init__(self, trained: Settings, params: dict, quant_state: dict, batches: int, log=lambda msg: None):
    self.trained = trained
    self.log = log  # Progress, a line at a time: each pass compiles and runs the model's gradients.
    self.axes = kernel_axes(trained)
    self.rows = rows_by_layer(params, trained.model, trained.quant)
    self.quant_rows = rows_by_layer(quant_state, trained.model, trained.quant)
    it = data_iterator(trained, "eval")
    try:
      self.batches = [{k: jnp.asarray(v) for k, v in next(it).items()} for _ in range(batches)]
    finally:
      it.close()
    log(f"probe: the float32 reference gradients on {batches} held-out batch(es)")
    self.reference = self.gradients(trained.replace("quant.recipe", UNQUANTIZED).replace("model.dtype", "float32")
                                    .replace("quant.exclude", ()))

  def gradients(self, settings: Settings) -> dict:
    """{(layer, path below it): gradient row} of `settings`, averaged over the batches."""
    return self.measure(settings)[0]

  def measure(self, settings: Settings) -> tuple[dict, dict]:
    """({(layer, path): gradient row} averaged over the batches, {(layer, path to a projection): its output
    error}) of `settings` (output errors only for projections the recipe quantizes)."""
    settings = with_output_errors(settings)
    abstract_params, abstract_quant = abstract_init(settings)
    params = stacked_like(lambda key, _: self.rows[key], settings.model, settings.quant, abstract_params)
    quant_state = stacked_like(lambda key, _: self.quant_rows[key], settings.model, settings.quant,
                               abstract_quant)
    errors_in = stats_inputs(settings)
    grad, head = _gradient_fn(settings), _head_error_fn(settings)
    head_quantized = (settings.quant.for_projection(LM_HEAD, None, settings.model.num_layers).quantized
                      and not settings.model.tie_embeddings)
    total = None
    for i, batch in enumerate(self.batches):
      key = step_key(settings.seed, jnp.asarray(i, jnp.int32))
      g = grad(params, quant_state, errors_in, batch, key)
      if head_quantized:
        g = (*g, head(params, quant_state, errors_in, batch, key))
      total = g if total is None else jax.tree.map(jnp.add, total, g)
    total = jax.tree.map(lambda a: np.asarray(a, np.float64), total)
    grads = {k: v / len(self.batches) for k, v in rows_by_layer(total[0], settings.model, settings.quant).items()}
    by_layer = rows_by_layer(total[1], settings.model, settings.quant)
    errors = {(layer, path[:-1]): _ratio(sums) for (layer, path), sums in by_layer.items()}
    if head_quantized:
      errors[(None, ("lm_head",))] = _ratio(total[2])
    return grads, errors

  def whole_error(self, grads: dict) -> float:
    diff = sum(float(np.sum((grads[k] - ref) ** 2)) for k, ref in self.reference.items())
    return math.sqrt(diff / sum(float(np.sum(ref ** 2)) for ref in self.reference.values()))

  def projections(self, settings: Settings, grads: dict, errors: dict) -> list[Projection]:
    """Every projection the settings quantize, with its errors (`errors` from `measure`)."""
    recipe, out = settings.quant, []
    for (layer, path), ref in self.reference.items():
      kind = KINDS.get(path)
      if kind is None or not settings.quant.for_projection(kind, layer, settings.model.num_layers).quantized:
        continue
      g = np.linalg.norm(grads[(layer, path)] - ref) / max(np.linalg.norm(ref), 1e-30)
      out.append(Projection(layer, kind, float(g), errors[(layer, path[:-1])],
                            weight_error(self.rows[(layer, path)], self.axes[path], recipe.name)))
    return out


def _ratio(sums) -> float:
  """|y - y_ref| / |y_ref| from (sum of (y - y_ref)^2, sum of y_ref^2)."""
  return float(math.sqrt(sums[0] / max(sums[1], 1e-30)))


def with_output_errors(settings: Settings):
  """`settings` whose quantized projections report their forward output error (quant/core.py), and nothing
  else through their statistics inputs."""
  recipe = dataclasses.replace(settings.quant, output_error=True, stats=False)
  return dataclasses.replace(settings, quant=recipe)


@functools.lru_cache(maxsize=64)
def _gradient_fn(settings: Settings):
  """The jitted (parameter gradient, output-error sums) of settings' loss (one compile per settings, whichever
  probe asks)."""
  graphdef = logical_axes(settings)[0]
  loss = lambda p, q, e, b, key: forward_loss(p, q, b, e, graphdef=graphdef, cfg=settings, key=key)[0]
  return jax.jit(jax.grad(loss, argnums=(0, 2)))


@functools.lru_cache(maxsize=64)
def _head_error_fn(settings: Settings):
  """The jitted (sum of (y - y_ref)^2, sum of y_ref^2) of the LM head's logits, token chunk by token chunk as the
  loss computes them (ember/trainer/loss.py), on the model's own final hidden states."""
  graphdef = logical_axes(settings)[0]

  def sums(params, quant_state, errors_in, batch, key):
    model = nnx.merge(graphdef, params, quant_state, *([errors_in] if errors_in else []))
    hidden, _ = model(batch[INPUTS], batch[SEGMENT_IDS], batch[POSITIONS], key=key)
    head = model.head_parts()
    n = num_chunks(hidden.shape[1], settings.train.loss_chunk_size)
    chunks = jnp.moveaxis(strided_chunks(hidden, n), 2, 0)
    w32 = head.weight.astype(jnp.float32)

    def body(total, h):
      y = head.logits(h, head.weight, key)
      y_ref = jnp.einsum("bld,dv->blv", h.astype(jnp.float32), w32)
      return total + jnp.stack([jnp.sum(jnp.square(y - y_ref)), jnp.sum(jnp.square(y_ref))]), None

    return jax.lax.scan(body, jnp.zeros((2,), jnp.float32), chunks)[0]

  return jax.jit(sums)


def weight_error(kernel, axes: tuple, recipe: str) -> float:
  """|Q(W) - W| / |W| for one layer's kernel with logical `axes`, quantized as a weight with blocks along its
  inputs (its matrices as Muon sees them: ember/trainer/optimizer.py)."""
  m = np.asarray(optimizer.MatrixLayout.of(axes).matrices(jnp.asarray(kernel, jnp.float32)))
  q = np.asarray(quantize(jnp.asarray(m), recipe, "weight", axis=1).dequantize(jnp.float32))
  return float(np.linalg.norm(q - m) / max(np.linalg.norm(m), 1e-30))


def kernel_axes(settings: Settings) -> dict:
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
  probe.log(f"probe: the gradients and output errors under {recipe}")
  grads, errors = probe.measure(settings)
  found = probe.projections(settings, grads, errors)
  first = error = probe.whole_error(grads)
  probe.log(f"probe: whole-model gradient error {first:.2%} (target {target_error:.2%})")
  exclude = tuple(settings.quant.exclude)
  for p in sorted(found, key=lambda p: -p.grad_error):
    if error < target_error:
      break
    exclude += (p.selector,)
    error = probe.whole_error(probe.gradients(settings.replace("quant.exclude", exclude)))
    probe.log(f"probe: {p.selector} in bf16 too: {error:.2%}")
  return found, first, exclude, error
