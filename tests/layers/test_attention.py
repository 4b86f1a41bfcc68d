"""Packed sequences: a token never sees another segment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember.config import derive
from ember.layers.decoder import Transformer
from tests.helpers import config


def test_changing_one_segment_leaves_the_other_unchanged():
  # bf16: a per-tensor FP8 scale is shared by all tokens, so it would couple segments by design.
  cfg = config("tiny", **{"model.dtype": "float32", "model.seq_len": 32, "quant.recipe": "bf16"})
  cfg = derive(cfg, 1)
  with nnx.use_eager_sharding(False):
    model = Transformer(cfg.model, cfg.quant, nnx.Rngs(params=0))
  seg = jnp.array([[1] * 12 + [2] * 16 + [0] * 4])
  pos = jnp.array([list(range(12)) + list(range(16)) + [0] * 4])
  tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, 256)
  changed = tokens.at[0, 14:20].set((tokens[0, 14:20] + 7) % 256)  # Inside segment 2 only.

  def logits(t):
    h, _ = model(t, seg, pos)
    return model.head(h)

  a, b = logits(tokens), logits(changed)
  np.testing.assert_array_equal(a[0, :12], b[0, :12])  # Segment 1: bit-identical.
  np.testing.assert_array_equal(a[0, 12:14], b[0, 12:14])  # Segment 2 before the change (causal): identical.
  moved = [i for i in range(14, 28) if not np.allclose(a[0, i], b[0, i])]
  assert moved == list(range(14, 28)), moved  # Every position from the first changed token on.
  # The other way, which causality alone does not give: a change in segment 1 reaches no position of segment 2.
  earlier = tokens.at[0, 3:8].set((tokens[0, 3:8] + 7) % 256)
  c = logits(earlier)
  np.testing.assert_array_equal(a[0, 12:28], c[0, 12:28])
  assert not np.allclose(a[0, 3:12], c[0, 3:12])


def test_segment_positions_restart():
  """A document packed after another gives the same logits as the document alone."""
  cfg = config("tiny", **{"model.dtype": "float32", "model.seq_len": 16, "quant.recipe": "bf16"})
  cfg = derive(cfg, 1)
  with nnx.use_eager_sharding(False):
    model = Transformer(cfg.model, cfg.quant, nnx.Rngs(params=0))
  doc = jax.random.randint(jax.random.key(2), (8,), 0, 256)
  other = jax.random.randint(jax.random.key(3), (8,), 0, 256)
  packed = jnp.concatenate([other, doc])[None]
  seg = jnp.array([[1] * 8 + [2] * 8])
  pos = jnp.array([list(range(8)) * 2])
  alone = jnp.concatenate([doc, jnp.zeros(8, jnp.int32)])[None]
  seg_alone = jnp.array([[1] * 8 + [0] * 8])
  h_packed, _ = model(packed, seg, pos)
  h_alone, _ = model(alone, seg_alone, pos)
  np.testing.assert_allclose(h_packed[0, 8:], h_alone[0, :8], rtol=1e-5, atol=1e-5)


def test_a_fused_attentions_residuals_are_named_so_a_policy_can_keep_them():
  """`_keeping_residuals` (how a fused kernel's attention runs; here around XLA's, whose VJP is as good a stand-in):
  the same values and gradients, and under a policy that keeps `attention_context` the backward pass runs no
  forward attention again (its softmax's exp appears once in the step, against twice when nothing is kept)."""
  from ember import remat
  from ember.layers import attention as attention_lib

  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 8, 4, 16))
  k, v = (jax.random.normal(key, (2, 8, 2, 16)) for key in keys[1:3])
  bias = attention_lib.attention_bias(jnp.array([[1] * 5 + [2] * 3, [1] * 8]), jnp.float32)
  plain = lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b, is_causal=True, implementation="xla")
  kept = attention_lib._keeping_residuals(plain)
  cotangent = jax.random.normal(keys[3], q.shape)
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, bias) * cotangent)
  np.testing.assert_allclose(kept(q, k, v, bias), plain(q, k, v, bias), rtol=1e-6)
  for a, b in zip(jax.grad(loss(kept), argnums=(0, 1, 2))(q, k, v), jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def exps(policy):
    step = jax.checkpoint(loss(kept), policy=remat.jax_policy(remat.PRESETS[policy]))
    return str(jax.make_jaxpr(jax.grad(step, argnums=(0, 1, 2)))(q, k, v)).count(" exp ")

  assert exps("minimal") == 1 and exps("full") == 2



def test_kv_copies_attend_as_the_kv_heads_they_copy():
  """`kv_view` deals each kv head's query heads out to copies of the head (8 query heads, 2 kv heads, 2 copies: the
  layout of 2 kv heads over 4 tensor ranks): the fused projection through the view, attended with the copies as kv
  heads, gives the model's attention, checked against every query head attending over its own kv head."""
  from ember.layers.attention import kv_view, local_attention
  d, kv, g, h, b, l = 16, 2, 4, 8, 2, 12
  kernel = jax.random.normal(jax.random.key(0), (d, kv, g + 2, h))
  x = jax.random.normal(jax.random.key(1), (b, l, d))
  no_bias = jnp.zeros((b, 1, l, l))

  def attend(kernel):
    groups = kernel.shape[2] - 2
    qkv = jnp.einsum("bld,dkgh->blkgh", x, kernel)
    q = qkv[:, :, :, :groups].reshape(b, l, kv * g, h)
    return local_attention(q, qkv[:, :, :, groups], qkv[:, :, :, groups + 1], no_bias, "xla", causal=True)

  qkv = jnp.einsum("bld,dkgh->blkgh", x, kernel)
  visible = jnp.tril(jnp.ones((l, l), bool))
  heads = []
  for head in range(kv * g):
    k_head, q_head = divmod(head, g)
    s = jnp.einsum("bqh,bsh->bqs", qkv[:, :, k_head, q_head], qkv[:, :, k_head, g]) * h**-0.5
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    heads.append(jnp.einsum("bqs,bsh->bqh", p, qkv[:, :, k_head, g + 1]))
  reference = jnp.stack(heads, axis=2)
  viewed = kv_view(kernel, 2)
  assert viewed.shape == (d, 2 * kv, g // 2 + 2, h)
  np.testing.assert_allclose(attend(kernel), reference, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(attend(viewed), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_the_segment_bias_is_finite_in_every_compute_dtype(dtype):
  """Another segment's keys get a finite bias (a fused kernel's block of masked keys would subtract two infinities),
  and large enough that float32 logits give them no weight: float16 cannot hold cuDNN's -2**41 (it became -inf)."""
  from ember.layers import attention as attention_lib
  bias = attention_lib.attention_bias(jnp.array([[1, 1, 2, 2]]), dtype)
  assert bias.dtype == dtype and bool(jnp.all(jnp.isfinite(bias)))
  assert float(bias[0, 0, 2, 0]) <= -65504 and float(bias[0, 0, 0, 1]) == 0
