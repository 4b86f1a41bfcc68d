"""Grouped-query causal self-attention over packed sequences.

Q, K and V come from one fused projection (kernel [embed, kv_heads, q_per_kv + 2, head_dim]) so a
quantized recipe quantizes the layer's normed input once, not three times, and tensor parallelism
shards whole kv groups. The softmax and its two batched matmuls stay in the compute dtype
(never quantized). Tokens attend only within their own segment (packed documents).

Under context parallelism (`mesh.context`) the decoder runs in ember/parallel/context.py's balanced layout and
attention is that module's: all-gathered keys and values, each device's queries attending to them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.config.model import ModelConfig
from ember.errors import one_line
from ember.layers.linear import Linear, handed
from ember.layers.norm import RMSNorm
from ember.layers.rope import Rope, apply_rope
from ember.names import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LENGTH, QKV
from ember.parallel import context
from ember.parallel import sharding
from ember.parallel.sharding import shard
from ember.platform import target_platform
from ember.quant.recipe import Recipe
from ember.quant.varying import manual_axes


def segment_mask(segment_ids_BxL: jax.Array) -> jax.Array:
  """[B, 1, L, L] True where query i and key j belong to the same segment (causality is separate)."""
  return (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]


# What a key of another segment adds to a logit: cuDNN's own stand-in for -inf in bf16 (-2**41), finite so that
# the kernel never subtracts two infinities; float32 logits around it still give those keys a weight of exactly 0.
MASKED = -float(2 << 40)


def attention_bias(segment_ids_BxL: jax.Array, dtype):
  """The additive attention bias, 0 where a query may see a key and MASKED elsewhere: [B, 1, L, L] for keys of the
  same segment (the kernel's causal mask does the rest); under context parallelism the pair of biases of
  `context.visibility` (causality included) for the balanced layout's `segment_ids_BxL`. The decoder makes it
  once a step (Transformer.__call__) for every layer: made inside a layer, the backward pass's recompute of each
  checkpointed layer would write it again, an L x L array a layer."""
  masked = max(MASKED, float(jnp.finfo(dtype).min))  # float16's range ends at -65504: -2**41 would be -inf.
  as_bias = lambda visible: shard(jnp.where(visible, jnp.asarray(0, dtype), jnp.asarray(masked, dtype)),
                                  (BATCH, None, LENGTH, None))
  if context.context_axes():
    return tuple(as_bias(v) for v in context.visibility(segment_ids_BxL))
  return as_bias(segment_mask(segment_ids_BxL))


def attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, bias, implementation: str):
  """Causal attention within segments (`bias`: `attention_bias`), whole or, under context parallelism, the
  balanced layout's (ember/parallel/context.py)."""
  if context.context_axes():
    local = lambda q, k, v, b: local_attention(q, k, v, b, implementation, causal=False)
    return context.attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, bias, local)
  if manual_axes() and target_platform() == "gpu" and implementation != "xla":  # cuDNN in a step's replicas.
    return _on_each_device(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, bias, implementation)
  return local_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, bias, implementation, causal=True)


def _on_each_device(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, bias_Bx1xLxL, implementation: str):
  """`local_attention` on each device's rows and heads. Why: where some mesh axes are already manual (a step's
  data-parallel replicas, trainer/step.py), cuDNN's attention cannot partition itself (its rule reads every
  operand's sharding as a NamedSharding, and there the compiler hands it others); on one device's shard there
  is nothing to partition."""
  mesh, rules = sharding.active_mesh(), sharding.active_rules()
  spec = lambda names: sharding.logical_to_spec(names, rules, mesh)
  q_spec, kv_spec = spec((BATCH, LENGTH, HEADS, HEAD_DIM)), spec((BATCH, LENGTH, KV_HEADS, HEAD_DIM))
  bias_spec = spec((BATCH, None, LENGTH, None))
  attention = lambda q, k, v, b: local_attention(q, k, v, b, implementation, causal=True)
  return sharding.shard_map(attention, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, bias_spec),
                            out_specs=q_spec)(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, bias_Bx1xLxL)


def local_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias_Bx1xTxS, implementation: str, *, causal: bool):
  """Attention on one device. `auto` takes cuDNN's flash attention when the target is a GPU and falls back to XLA
  for the shapes, dtypes or masks cuDNN does not take (it raises at trace time; the compile report says why:
  `cudnn_refusal`)."""
  def attention(impl):
    f = lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b, is_causal=causal, implementation=impl)
    if impl == "xla":
      return checkpoint_name(f(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias_Bx1xTxS), remat.ATTENTION_CONTEXT)
    return _keeping_residuals(f)(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias_Bx1xTxS)

  if implementation == "auto":
    if target_platform() == "gpu":
      try:
        return attention("cudnn")
      except Exception:  # Unsupported by cuDNN here: XLA below.
        pass
    return attention("xla")
  return attention(implementation)


def _keeping_residuals(attention):
  """`attention(q, k, v, bias)`, its output named `remat.ATTENTION_CONTEXT`, with a VJP whose residuals other than
  its inputs are named so too: the output and the softmax statistics a fused kernel's backward reads. A remat
  policy that keeps the context then keeps what the backward needs, and the backward pass never runs the forward
  attention again (a name on the output alone keeps the output: the statistics, which only the forward kernel
  writes, send the recompute back to it). The output is one residual, named once: every name is a buffer of its
  own in a scan's saved stacks. Not for XLA's attention, whose residuals are the [L, L] probabilities."""
  structure = []

  @jax.custom_vjp
  def kept(q, k, v, bias):
    return checkpoint_name(attention(q, k, v, bias), remat.ATTENTION_CONTEXT)

  def forward(q, k, v, bias):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, bias), q, k, v)
    leaves, treedef = jax.tree.flatten(vjp)
    structure[:] = [treedef]
    named_out = checkpoint_name(out, remat.ATTENTION_CONTEXT)
    inputs = (q, k, v, bias)
    named = [named_out if r is out else r if any(r is a for a in inputs)
             else checkpoint_name(r, remat.ATTENTION_CONTEXT) for r in leaves]
    return named_out, named

  def backward(residuals, g):
    return (*jax.tree.unflatten(structure[0], residuals)(g), None)

  kept.defvjp(forward, backward)
  return kept


def cudnn_refusal(batch: int, length: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype,
                  shards: int = 1) -> str | None:
  """Why cuDNN attention refuses these shapes (its one-line reason), or None if it takes them; `shards`: the
  devices a sequence is split over (context parallelism: each attends a chunk of length / 2 shards queries to the
  whole sequence under a bias, the larger of its two attentions)."""
  queries = length if shards == 1 else length // (2 * shards)
  q = jax.ShapeDtypeStruct((batch, queries, num_heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, length, num_kv_heads, head_dim), dtype)
  bias = jax.ShapeDtypeStruct((batch, 1, queries, length), dtype)
  try:
    jax.eval_shape(lambda q, k, v, b: local_attention(q, k, v, b, "cudnn", causal=shards == 1), q, kv, kv, bias)
  except Exception as e:  # cuDNN's checks raise NotImplementedError, ValueError, RuntimeError...
    return one_line(e)
  return None


def kv_view(kernel_DxKxGxH: jax.Array, copies: int) -> jax.Array:
  """The fused qkv kernel [embed, K, G + 2, head_dim] (G query heads, then a key and a value, per kv head) as
  [embed, K x copies, G / copies + 2, head_dim]: each kv head's query heads dealt out to `copies` groups, each group
  with its own copy of the head's key and value. Heads keep their order, so attention over the copies is the
  model's; a tensor rank that holds one such group computes its keys and values itself where the kv heads are fewer
  than the ranks (`ModelConfig.kv_copies`), and the copies' gradients add up on the one kernel."""
  d, kv, g2, h = kernel_DxKxGxH.shape
  g = g2 - 2
  q = kernel_DxKxGxH[:, :, :g].reshape(d, kv, copies, g // copies, h)
  k_and_v = jnp.broadcast_to(kernel_DxKxGxH[:, :, None, g:], (d, kv, copies, 2, h))
  return jnp.concatenate([q, k_and_v], axis=3).reshape(d, kv * copies, g // copies + 2, h)


class Attention(nnx.Module):
  def __init__(self, model: ModelConfig, *, recipe: Recipe, layer: int, rngs: nnx.Rngs):
    self.model = model  # Its kv_copies, under the active mesh (`_kv_copies`).
    self.num_heads, self.num_kv_heads, self.head_dim = model.num_heads, model.num_kv_heads, model.head_dim
    self.groups = model.q_per_kv
    self.rope, self.implementation = Rope.of(model), model.attention
    common = dict(dtype=model.dtype, param_dtype=model.param_dtype, rngs=rngs)
    recipe_of = lambda name: recipe.for_projection(name, layer, model.num_layers)  # `quant.exclude` applied.
    self.qkv = Linear((model.d_model,), (model.num_kv_heads, self.groups + 2, model.head_dim),
                      (EMBED, KV_HEADS, QKV, HEAD_DIM), name="qkv", recipe=recipe_of("qkv"), init_std=model.init_std,
                      **common)
    self.out = Linear((model.num_heads, model.head_dim), (model.d_model,), (HEADS, HEAD_DIM, EMBED), name="out",
                      recipe=recipe_of("out"), init_std=model.out_init_std, **common)
    # One scale over head_dim shared by all heads, for queries and for keys (Qwen3); None without.
    norm = lambda: RMSNorm(model.head_dim, eps=model.norm_eps, dtype=model.dtype, param_dtype=model.param_dtype)
    self.q_norm, self.k_norm = (norm(), norm()) if model.qk_norm else (None, None)

  def _qkv(self, x_BxLxD, positions_BxL, key, taken=None):
    """Q, K, V of the fused projection, then rotated. Its output is named whole for remat (`qkv_proj`, before
    RoPE: saved apart, Q, K and V would each be a copy of a slice of it), and Q, K, V as attention reads them
    (`attention_input`, after RoPE: kept, the backward pass rotates nothing again)."""
    b, l, _ = x_BxLxD.shape
    copies = self._kv_copies()
    view = None if copies == 1 else lambda kernel: kv_view(kernel, copies)
    groups = self.groups // copies  # Query heads a kv head (or a copy of one) serves.
    qkv = checkpoint_name(self.qkv(x_BxLxD, key, handed(taken, "qkv"), view), remat.QKV_PROJ)  # [B, L, K, G+2, H]
    q_BxLxNxH = shard(qkv[:, :, :, :groups].reshape(b, l, self.num_heads, self.head_dim),
                      (BATCH, LENGTH, HEADS, HEAD_DIM))
    k_BxLxKxH = shard(qkv[:, :, :, groups], (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    v_BxLxKxH = shard(qkv[:, :, :, groups + 1], (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    if self.q_norm is not None:
      q_BxLxNxH, k_BxLxKxH = self.q_norm(q_BxLxNxH), self.k_norm(k_BxLxKxH)
    q_BxLxNxH = apply_rope(q_BxLxNxH, positions_BxL, self.rope)
    k_BxLxKxH = apply_rope(k_BxLxKxH, positions_BxL, self.rope)
    return tuple(checkpoint_name(a, remat.ATTENTION_INPUT) for a in (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH))

  def viewed_projections(self) -> tuple[str, ...]:
    """The projections whose GEMMs read a view of the kernel under the active rules (`qkv` where kv heads are
    copied: `kv_view`), so that a step makes no copies of the kernel itself for them (layers/linear.py's
    `once_a_step`)."""
    return ("qkv",) if self._kv_copies() > 1 else ()

  def _kv_copies(self) -> int:
    """Copies of each kv head the qkv GEMM writes: `ModelConfig.kv_copies` of the ranks the active rules split the
    kv heads over (1 outside them, and in sampling)."""
    rules, mesh = sharding.active_rules(), sharding.active_mesh()
    if rules is None or mesh is None:
      return 1
    return self.model.kv_copies(sharding.shards(set(rules.get(KV_HEADS, ())) - manual_axes(), mesh.shape))

  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL, key=None, bias=None, taken=None):
    """`bias`: `attention_bias(segment_ids_BxL)` if the caller made it already (the decoder does, once a step);
    `taken`: what the step hands the projections (layers/linear.py's `Taken`, by path), or None."""
    q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self._qkv(x_BxLxD, positions_BxL, key, taken)
    if bias is None:
      if context.context_axes():
        raise ValueError("under context parallelism attention runs in the decoder's balanced layout, with the "
                         "decoder's bias")
      bias = attention_bias(segment_ids_BxL, q_BxLxNxH.dtype)
    ctx_BxLxNxH = attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, bias, self.implementation)  # Named: local_attention.
    ctx_BxLxNxH = shard(ctx_BxLxNxH, (BATCH, LENGTH, HEADS, HEAD_DIM))
    y_BxLxD = self.out(ctx_BxLxNxH, key, handed(taken, "out"))
    return checkpoint_name(shard(y_BxLxD, self.out.block_output()), remat.OUT_PROJ)

  def decode(self, x_BxTxD, positions_BxT, cache):
    """Attention of T new tokens per row (consecutive positions from `positions_BxT[:, 0]`) over a KV cache
    (k, v) [B, S, K, H]: their keys and values are written at their positions, and each query sees the
    cache up to its own position. Returns (y [B, T, D], cache)."""
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = self._qkv(x_BxTxD, positions_BxT, None)
    copies = self._kv_copies()  # The cache holds the model's kv heads: one of each head's copies.
    k_BxTxKxH, v_BxTxKxH = k_BxTxKxH[:, :, ::copies], v_BxTxKxH[:, :, ::copies]
    cache_k, cache_v = write_cache(cache, (k_BxTxKxH, v_BxTxKxH), positions_BxT)
    ctx_BxTxNxH = cached_attention(q_BxTxNxH, cache_k, cache_v, positions_BxT)
    return self.out(ctx_BxTxNxH), (cache_k, cache_v)


def write_cache(cache, new, positions_BxT) -> tuple:
  """Each cache array [B, S, ...] with the T new tokens' rows of `new` [B, T, ...] written at their positions
  (consecutive from `positions_BxT[:, 0]`), in the cache's dtype."""
  write = jax.vmap(lambda c, u, start: jax.lax.dynamic_update_slice_in_dim(c, u.astype(c.dtype), start, axis=0))
  return tuple(write(c, u, positions_BxT[:, 0]) for c, u in zip(cache, new))


def cached_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, positions_BxT):
  """Grouped-query attention of queries at `positions_BxT` over cache slots 0..S-1, slot s visible to a
  query at position p when s <= p (softmax in float32)."""
  b, t, n, h = q_BxTxNxH.shape
  kv = k_BxSxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kv, n // kv, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32) * h**-0.5
  visible = jnp.arange(k_BxSxKxH.shape[1])[None, None, None, None, :] <= positions_BxT[:, None, None, :, None]
  probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(v_BxSxKxH.dtype)
  ctx = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH, preferred_element_type=jnp.float32)
  return ctx.reshape(b, t, n, h).astype(q_BxTxNxH.dtype)
