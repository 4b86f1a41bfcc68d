"""Multi-head latent attention (DeepSeek-V2/V3): keys and values from a compressed latent.

Per token, one down-projection `kv_a` writes a latent of `kv_lora_rank` (RMS-normed) and a RoPE key of
`qk_rope_head_dim` that every head shares; `kv_b` expands the latent into each head's no-RoPE key
(`qk_nope_head_dim`) and value (`v_head_dim`). Queries come from their own latent (`q_a`, normed, then `q_b`;
`q_lora_rank` 0: one full projection `q_b`), each head's no-RoPE part and RoPE part. A head's score is
nope . nope + rope . rope, scaled by 1 / sqrt(nope + rope). Every projection is a `Linear`, quantized by the
recipe like any other, its quantized residuals named after it (q_a, q_b, kv_a, kv_b, out); the latents are
named `remat.MLA_Q_LATENT` and `remat.MLA_KV_LATENT`, queries, keys and values `QUERY`, `KEY`, `VALUE`.

Training attends with the decoder's attention (cuDNN's flash attention on GPUs): the values are zero-padded to the
query/key size, which that kernel's interface requires, and the context cut back. Sampling caches the latent and
the rotated RoPE key, (kv_lora_rank + qk_rope_head_dim) values a token a layer instead of 2 x heads x head dims,
and attends in the latent's space: `kv_b`'s key half is folded into the queries and its value half applied to
the context (the weights absorbed, as DeepSeek's inference does), so the cache is never expanded.

RoPE rotates the half-split layout (layers/rope.py). DeepSeek's checkpoints rotate interleaved pairs; the Hugging
Face layout (ember/hf/layout.py) permutes the RoPE columns of q_b and kv_a on the way in and out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.layers.attention import attend, attention_bias, write_cache
from ember.layers.linear import Linear, handed
from ember.layers.norm import RMSNorm
from ember.layers.rope import Rope, apply_rope
from ember.config.model import ModelConfig
from ember.quant.recipe import WEIGHT, Recipe
from ember.names import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, LENGTH
from ember.parallel import context
from ember.parallel.sharding import shard

F32 = jnp.float32
LATENT_NORM_EPS = 1e-6  # DeepSeek's latent norms keep their own epsilon, whatever the model's.


class LatentAttention(nnx.Module):
  def __init__(self, model: ModelConfig, *, recipe: Recipe, layer: int, rngs: nnx.Rngs):
    n, d = model.num_heads, model.d_model
    self.num_heads, self.nope, self.rope = n, model.qk_nope_head_dim, model.qk_rope_head_dim
    self.v_dim, self.kv_rank = model.v_head_dim, model.kv_lora_rank
    self.rotary, self.implementation = Rope.of(model), model.attention
    qk = self.nope + self.rope
    common = dict(dtype=model.dtype, param_dtype=model.param_dtype, rngs=rngs, init_std=model.init_std)
    linear = lambda name, ins, outs, axes, **kw: Linear(ins, outs, axes, name=name,
                                                        recipe=recipe.for_projection(name, layer, model.num_layers),
                                                        **{**common, **kw})
    norm = lambda dim: RMSNorm(dim, eps=LATENT_NORM_EPS, dtype=model.dtype, param_dtype=model.param_dtype)
    # The queries' own latent; None: queries straight from x.
    self.q_a, self.q_a_norm = (linear("q_a", (d,), (model.q_lora_rank,), (EMBED, None)), norm(model.q_lora_rank)) \
        if model.q_lora_rank else (None, None)
    q_in = model.q_lora_rank or d
    self.q_b = linear("q_b", (q_in,), (n, qk), (EMBED, HEADS, HEAD_DIM))
    self.kv_a = linear("kv_a", (d,), (self.kv_rank + self.rope,), (EMBED, None))
    self.kv_a_norm = norm(self.kv_rank)
    self.kv_b = linear("kv_b", (self.kv_rank,), (n, self.nope + self.v_dim), (EMBED, HEADS, HEAD_DIM))
    self.out = linear("out", (n, self.v_dim), (d,), (HEADS, HEAD_DIM, EMBED), init_std=model.out_init_std)

  def _queries(self, x_BxLxD, positions_BxL, key, taken=None):
    """Queries [B, L, N, nope + rope], the RoPE part rotated."""
    if self.q_a is not None:
      latent = self.q_a(x_BxLxD, key, handed(taken, "q_a"))
      latent = checkpoint_name(shard(latent, (BATCH, LENGTH, None)), remat.MLA_Q_LATENT)
      x_BxLxD = self.q_a_norm(latent)
    q = self.q_b(x_BxLxD, key, handed(taken, "q_b"))
    q = checkpoint_name(shard(q, (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.QUERY)
    return jnp.concatenate([q[..., :self.nope], apply_rope(q[..., self.nope:], positions_BxL, self.rotary)], -1)

  def _latent(self, x_BxLxD, positions_BxL, key, taken=None):
    """(the normed latent [B, L, kv_lora_rank], the rotated RoPE key [B, L, rope]): what sampling caches."""
    kv = self.kv_a(x_BxLxD, key, handed(taken, "kv_a"))
    kv = checkpoint_name(shard(kv, (BATCH, LENGTH, None)), remat.MLA_KV_LATENT)
    latent, k_rope = kv[..., :self.kv_rank], kv[..., self.kv_rank:]
    k_rope = apply_rope(k_rope[:, :, None, :], positions_BxL, self.rotary)[:, :, 0]
    return self.kv_a_norm(latent), k_rope

  def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL, key=None, bias=None, taken=None):
    """`bias`: `attention_bias(segment_ids_BxL)` if the caller made it already (the decoder does, once a step);
    `taken`: what the step hands the projections (layers/linear.py's `Taken`, by path), or None."""
    q_BxLxNxQ = self._queries(x_BxLxD, positions_BxL, key, taken)
    latent_BxLxC, k_rope_BxLxR = self._latent(x_BxLxD, positions_BxL, key, taken)
    kv = self.kv_b(latent_BxLxC, key, handed(taken, "kv_b"))  # [B, L, N, nope + v]
    k_nope = checkpoint_name(shard(kv[..., :self.nope], (BATCH, LENGTH, KV_HEADS, HEAD_DIM)), remat.KEY)
    v_BxLxNxV = checkpoint_name(shard(kv[..., self.nope:], (BATCH, LENGTH, KV_HEADS, HEAD_DIM)), remat.VALUE)
    k_rope = jnp.broadcast_to(k_rope_BxLxR[:, :, None, :], (*k_nope.shape[:3], self.rope))
    k_BxLxNxQ = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], -1)
    qk = self.nope + self.rope
    # The attention kernels take values of the query/key size: zeros past v_head_dim add zeros to the context.
    v_padded = jnp.pad(v_BxLxNxV, ((0, 0),) * 3 + ((0, qk - self.v_dim),))
    if bias is None:
      if context.context_axes():
        raise ValueError("under context parallelism attention runs in the decoder's balanced layout, with the "
                         "decoder's bias")
      bias = attention_bias(segment_ids_BxL, q_BxLxNxQ.dtype)
    ctx = attend(q_BxLxNxQ, k_BxLxNxQ, v_padded, bias, self.implementation)  # Named: attention.local_attention.
    ctx_BxLxNxV = shard(ctx[..., :self.v_dim], (BATCH, LENGTH, HEADS, HEAD_DIM))
    y_BxLxD = self.out(ctx_BxLxNxV, key, handed(taken, "out"))
    return checkpoint_name(shard(y_BxLxD, self.out.block_output()), remat.OUT_PROJ)

  def decode(self, x_BxTxD, positions_BxT, cache):
    """Attention of T new tokens per row (consecutive positions from `positions_BxT[:, 0]`) over the latent cache
    (latent [B, S, C], RoPE key [B, S, R]): theirs are written at their positions, and each query sees the cache up
    to its own position. Returns (y [B, T, D], cache)."""
    q_BxTxNxQ = self._queries(x_BxTxD, positions_BxT, None)
    latent, k_rope = self._latent(x_BxTxD, positions_BxT, None)
    cache = write_cache(cache, (latent, k_rope), positions_BxT)
    ctx_BxTxNxV = latent_attention(q_BxTxNxQ, *cache, self.kv_b_kernel(), positions_BxT, self.nope)
    return self.out(ctx_BxTxNxV.astype(x_BxTxD.dtype)), cache

  def kv_b_kernel(self) -> jax.Array:
    """kv_b's weights [C, N, nope + v] as its forward reads them (its recipe's rounding where it quantizes)."""
    kernel = self.kv_b.kernel[...]
    recipe = self.kv_b.recipe
    if not (recipe.quantized and recipe.forward_quantized):  # quant.forward=bf16 too: the GEMM reads it as it is.
      return kernel.astype(self.kv_b.dtype)
    c, n, e = kernel.shape
    if recipe.delayed:  # Per-tensor FP8 whose scales come from the histories: the kernel's own quantizer.
      weight = recipe.quantizer(WEIGHT, self.kv_b.amax_history[...][1])
      return weight.quantize(kernel.reshape(c, n * e), axis=0).dequantize(self.kv_b.dtype).reshape(c, n, e)
    # Elsewhere an identity's rows quantize exactly (their scale is their own amax's), so the product with one
    # is the kernel as the forward GEMM reads it, whatever the recipe's blocks and tensor scales.
    return self.kv_b(jnp.eye(c, dtype=self.kv_b.dtype)).reshape(c, n, e)


def latent_attention(q_BxTxNxQ, latent_BxSxC, k_rope_BxSxR, kv_b_CxNxE, positions_BxT, nope: int):
  """Attention in the latent's space (float32): scores q_nope . (latent W_k) + q_rope . k_rope as
  (q_nope W_k^T) . latent + q_rope . k_rope; the context (probabilities . latent) W_v. Slot s is visible to a
  query at position p when s <= p. [B, T, N, v]."""
  q = q_BxTxNxQ.astype(F32)
  w = kv_b_CxNxE.astype(F32)
  w_k, w_v = w[..., :nope], w[..., nope:]
  q_latent = jnp.einsum("btnh,cnh->btnc", q[..., :nope], w_k)
  scores = (jnp.einsum("btnc,bsc->bnts", q_latent, latent_BxSxC.astype(F32)) +
            jnp.einsum("btnr,bsr->bnts", q[..., nope:], k_rope_BxSxR.astype(F32))) * q.shape[-1] ** -0.5
  visible = jnp.arange(latent_BxSxC.shape[1])[None, None, None, :] <= positions_BxT[:, None, :, None]
  probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
  ctx_latent = jnp.einsum("bnts,bsc->btnc", probs, latent_BxSxC.astype(F32))
  return jnp.einsum("btnc,cnv->btnv", ctx_latent, w_v)
