"""The model's pieces against independent references: RoPE, RMSNorm, causality inside a document,
tied embeddings, the LM head's recipe under delayed scaling."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ember.config import derive
from ember.layers.decoder import Transformer
from ember.layers.norm import RMSNorm
from ember.layers.rope import Rope, apply_rope
from ember.trainer.state import build_model, split_model
from tests.helpers import config


def _model(preset="tiny", **overrides):
  cfg = derive(config(preset, **{"model.dtype": "float32", "quant.recipe": "bf16", **overrides}), 1)
  with nnx.use_eager_sharding(False):
    return Transformer(cfg.model, cfg.quant, nnx.Rngs(params=0)), cfg


def test_rope_matches_complex_rotation():
  """Llama's half-split RoPE: pair (x_i, x_{i+H/2}) rotates by position * theta^(-2i/H), as a complex
  number would; computed here in float64 with numpy."""
  rng = np.random.default_rng(0)
  b, l, n, h, theta = 2, 7, 3, 8, 500.0
  x = rng.standard_normal((b, l, n, h)).astype(np.float32)
  pos = rng.integers(0, 50, (b, l))
  z = x[..., : h // 2] + 1j * x[..., h // 2:]
  freq = theta ** (-np.arange(0, h, 2) / h)
  z = z * np.exp(1j * pos[:, :, None, None] * freq)
  expected = np.concatenate([z.real, z.imag], axis=-1)
  got = apply_rope(jnp.asarray(x), jnp.asarray(pos), Rope(theta))
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
  # Position 0 is the identity, and a rotation keeps norms.
  np.testing.assert_allclose(apply_rope(jnp.asarray(x), jnp.zeros((b, l), jnp.int32), Rope(theta)), x, atol=0)
  np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_llama31_rope_scaling_is_meta_llamas_rule():
  """Llama 3.1's frequencies, in float64 from the rule as its reference code writes it (each frequency by its
  wavelength: kept below original / high_freq_factor, divided by the factor past original / low_freq_factor, a smooth
  mix between), for Llama 3.1's own head, base and factors: every band holds some of the 64 frequencies."""
  h, theta, factor, low, high, original = 128, 500000.0, 8.0, 1.0, 4.0, 8192
  rope = Rope(theta, factor, low, high, original)
  want = []
  for f in theta ** (-np.arange(0, h, 2) / h):
    wavelength = 2 * np.pi / f
    if wavelength < original / high:
      want.append(f)
    elif wavelength > original / low:
      want.append(f / factor)
    else:
      smooth = (original / wavelength - low) / (high - low)
      want.append((1 - smooth) * f / factor + smooth * f)
  got = np.asarray(rope.frequencies(h))
  np.testing.assert_allclose(got, want, rtol=2e-6)
  base = np.asarray(Rope(theta).frequencies(h))
  assert (got == base).any() and (got == base / factor).any() and ((got != base) & (got != base / factor)).any()


def test_rmsnorm_matches_formula():
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((3, 5, 16)) * 4).astype(np.float32)
  with nnx.use_eager_sharding(False):
    norm = RMSNorm(16, eps=1e-5, dtype=jnp.float32, param_dtype=jnp.float32)
    bf16 = RMSNorm(16, eps=1e-5, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  scale = rng.standard_normal(16).astype(np.float32)
  norm.scale[...] = jnp.asarray(scale)
  x64 = x.astype(np.float64)
  expected = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-5) * scale
  np.testing.assert_allclose(norm(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-6)
  assert bf16(jnp.asarray(x)).dtype == jnp.bfloat16


def test_causal_within_one_document():
  """Changing token t of a document changes no logit before t, and changes the logits of t and of every
  later position: each of them attends to t (a mask that hid earlier tokens would leave them equal)."""
  model, cfg = _model(**{"model.seq_len": 24})
  length = cfg.model.seq_len
  tokens = jax.random.randint(jax.random.key(4), (1, length), 0, 256)
  changed = tokens.at[0, 15].set((tokens[0, 15] + 1) % 256)
  seg = jnp.ones((1, length), jnp.int32)
  pos = jnp.arange(length)[None]

  def logits(t):
    h, _ = model(t, seg, pos)
    return np.asarray(model.head(h))

  a, b = logits(tokens), logits(changed)
  np.testing.assert_array_equal(a[0, :15], b[0, :15])
  unchanged = [p for p in range(15, length) if np.allclose(a[0, p], b[0, p], rtol=1e-6, atol=1e-6)]
  assert not unchanged, f"positions {unchanged} do not see token 15"


def test_tied_embeddings_share_one_table():
  """With tie_embeddings the LM head is the embedding table: no separate kernel, logits = h @ E.T, and
  the table's gradient gets both uses."""
  model, cfg = _model(**{"model.tie_embeddings": True})
  assert not hasattr(model, "lm_head")
  table = np.asarray(model.embed.embedding[...])
  h = jax.random.normal(jax.random.key(1), (2, 3, cfg.model.d_model))
  np.testing.assert_allclose(model.head(h), np.einsum("bcd,vd->bcv", np.asarray(h), table), rtol=1e-5, atol=1e-5)
  _, untied_cfg = _model()
  count = lambda c: sum(x.size for x in jax.tree.leaves(split_model(build_model(c, jax.random.key(0)))[1]))
  assert count(untied_cfg) - count(cfg) == cfg.model.vocab_size * cfg.model.d_model

  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jnp.array([[3, 4, 5, 6]])
  ones = jnp.ones_like(tokens)

  def loss(p, head_only):
    m = nnx.merge(graphdef, p)
    if head_only:  # Logits from a fixed hidden state: only the head's use of the table.
      return jnp.sum(m.head(jnp.ones((1, 4, cfg.model.d_model))))
    h, _ = m(tokens, ones, jnp.arange(4)[None])
    return jnp.sum(m.head(h))

  g_head = np.asarray(jax.grad(loss)(params, True)["embed"]["embedding"][...])
  g_full = np.asarray(jax.grad(loss)(params, False)["embed"]["embedding"][...])
  # The head alone: d sum(h @ E.T) / dE[v] = sum of the 4 hidden states, the same for every row v.
  np.testing.assert_allclose(g_head, np.full_like(g_head, 4.0), atol=0)
  # Both uses: rows of tokens the lookup read differ from the rows only the head touched.
  np.testing.assert_allclose(g_full[100], g_full[200], rtol=1e-6)
  assert not np.allclose(g_full[3], g_full[100])


def test_a_tied_heads_backward_gemms_take_bf16_operands():
  """The tied head's float32 logits come from a bf16 GEMM, and its dgrad and wgrad are bf16 GEMMs too (the
  logits' cotangent rounded to bf16), where plain autodiff pairs the float32 cotangent with a bf16 operand
  (XLA then runs float32 x float32 GEMMs)."""
  model, cfg = _model(**{"model.tie_embeddings": True, "model.dtype": "bfloat16"})
  h = jax.random.normal(jax.random.key(1), (2, 3, cfg.model.d_model), jnp.bfloat16)
  table = model.embed.embedding[...]
  g = jax.random.normal(jax.random.key(2), (2, 3, cfg.model.vocab_size))

  def dots(head):
    jaxpr = jax.make_jaxpr(lambda h, w: jax.vjp(head, h, w)[1](g))(h, table)
    found = []
    def walk(j):
      for e in j.eqns:
        if e.primitive.name == "dot_general":
          found.append(tuple(str(v.aval.dtype) for v in e.invars))
        for sub in jax.extend.core.jaxprs_in_params(e.params):
          walk(sub)
    walk(jaxpr.jaxpr)
    return found

  logits = model.head_parts().logits
  assert dots(lambda h, w: logits(h, w.T)) == [("bfloat16", "bfloat16")] * 3
  plain = lambda h, w: jnp.einsum("bcd,vd->bcv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
  assert all("float32" in d for d in dots(plain)[1:])  # What the custom VJP avoids: XLA runs these in float32.
  out, vjp = jax.vjp(lambda h, w: logits(h, w.T), h, table)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out, plain(h, table))  # The forward is the plain product, float32 out.
  dh, dw = vjp(g)
  want_dh, want_dw = jax.vjp(plain, h, table)[1](g.astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(dh, np.float32), np.asarray(want_dh, np.float32), rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(want_dw, np.float32), rtol=1e-2, atol=1e-2)


def test_delayed_scaling_lm_head_falls_back_to_current_scaling():
  """The loss calls the head once per vocab slice, so an amax history cannot be kept for it: under
  fp8_delayed (head not excluded) the head runs fp8_current and owns no history; layers keep theirs."""
  model, cfg = _model(**{"quant.recipe": "fp8_delayed", "quant.exclude": (), "quant.amax_history_len": 4})
  assert model.lm_head.recipe.name == "fp8_current"
  _, _, quant_state, _ = split_model(model)
  state = nnx.to_pure_dict(quant_state)
  assert "lm_head" not in state
  histories = jax.tree.leaves(state)
  assert histories and all(h.shape[-1] == 4 for h in histories)
  # Excluding it keeps it in bf16, as any excluded projection.
  excluded, _ = _model(**{"quant.recipe": "fp8_delayed", "quant.exclude": ("lm_head",)})
  assert excluded.lm_head.recipe.name == "bf16"
  assert dataclasses.replace(excluded.lm_head.recipe, name="fp8_delayed").stateless().name == "fp8_current"


def _rope64(x, pos, theta):
  """RoPE in float64 numpy (the half-split rotation `test_rope_matches_complex_rotation` checks)."""
  h = x.shape[-1]
  z = (x[..., : h // 2] + 1j * x[..., h // 2:]) * np.exp(1j * pos[:, :, None, None] * theta ** (-np.arange(0, h, 2) / h))
  return np.concatenate([z.real, z.imag], axis=-1)


def test_qk_norm_attention_matches_numpy():
  """model.qk_norm (Qwen3): each query and key head is RMS-normalised over its dims with one learned scale for
  queries and one for keys, before RoPE; the layer equals that computed in float64 numpy from its own weights."""
  from ember.layers.attention import Attention
  cfg = derive(config("tiny", **{"model.dtype": "float32", "quant.recipe": "bf16", "model.qk_norm": True}), 1)
  m = cfg.model
  with nnx.use_eager_sharding(False):
    attn = Attention(m, recipe=cfg.quant, layer=0, rngs=nnx.Rngs(params=0))
  rng = np.random.default_rng(3)
  attn.q_norm.scale[...] = jnp.asarray(rng.uniform(0.5, 2.0, m.head_dim), jnp.float32)
  attn.k_norm.scale[...] = jnp.asarray(rng.uniform(0.5, 2.0, m.head_dim), jnp.float32)
  b, l = 2, 16
  x = rng.standard_normal((b, l, m.d_model)).astype(np.float32)
  pos = np.tile(np.arange(l), (b, 1))
  got = attn(jnp.asarray(x), jnp.ones((b, l), jnp.int32), jnp.asarray(pos))

  f64 = lambda a: np.asarray(a, np.float64)
  qkv = np.einsum("bld,dkgh->blkgh", f64(x), f64(attn.qkv.kernel[...]))
  g = m.num_heads // m.num_kv_heads
  q, k, v = qkv[:, :, :, :g].reshape(b, l, m.num_heads, m.head_dim), qkv[:, :, :, g], qkv[:, :, :, g + 1]
  rms = lambda a, s: a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + m.norm_eps) * f64(s)
  q = _rope64(rms(q, attn.q_norm.scale[...]), pos, m.rope_theta)
  k = _rope64(rms(k, attn.k_norm.scale[...]), pos, m.rope_theta)
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # Query head n reads kv head n // g.
  scores = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(m.head_dim)
  scores = np.where(np.tril(np.ones((l, l), bool)), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  ctx = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), v)
  expected = np.einsum("bqnh,nhd->bqd", ctx, f64(attn.out.kernel[...]))
  np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5)
