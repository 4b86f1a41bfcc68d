"""The chunked cross-entropy equals the full-logits one, in value and gradient, on one device and sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ember.layers.decoder import Head
from ember.parallel.sharding import use_rules
from ember.trainer.loss import _logsumexp, cross_entropy, num_chunks


def _matmul_logits(h, w, key=None):
  return jnp.einsum("bld,dv->blv", h, w)


def _head(w, reduce_dtype=jnp.float32):
  return Head(_matmul_logits, w, read_dtype=w.dtype, reduce_dtype=reduce_dtype)


def _reference(h, w, targets, weights, z_weight):
  """Full [B, L, V] logits, autodiffed: the definition the chunked loss must reproduce."""
  logits = jnp.einsum("bld,dv->blv", h, w)
  lse = jax.nn.logsumexp(logits, axis=-1)
  nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  count = jnp.sum(weights)
  return jnp.sum(nll * weights) / count + z_weight * jnp.sum(lse * lse * weights) / count


def _case():
  kh, kw, kt = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(kh, (4, 40, 16))
  w = jax.random.normal(kw, (16, 50)) * 0.3
  targets = jax.random.randint(kt, (4, 40), 0, 50).at[0, :3].set(jnp.array([0, 49, 48]))  # Both ends of the vocab.
  weights = jnp.ones((4, 40)).at[1, 30:].set(0.0)  # Padding is masked.
  return hidden, w, targets, weights


def _loss(targets, weights, chunk_size, z_weight=0.1):
  return lambda h, w: cross_entropy(h, targets, weights, _head(w), chunk_size=chunk_size, z_loss_weight=z_weight)[0]


def test_one_pass_logsumexp_matches_float64():
  """The (running max, rescaled sum) reduction against log(sum(exp)) in float64, on rows that stress the rescaling:
  one logit far above the rest, all equal, a huge spread, large negative values, the maximum at either end."""
  rng = np.random.default_rng(0)
  rows = [rng.normal(0, 3, 1000), np.full(1000, 7.5), rng.normal(0, 3, 1000) + np.eye(1000)[417] * 80,
          rng.uniform(-3e4, 3e4, 1000), rng.normal(-500, 1, 1000), np.arange(1000.0) / 10, -np.arange(1000.0) / 10]
  x = np.stack(rows)[None].astype(np.float32)  # [1, 7, 1000]: a chunk's [batch, tokens, vocab]
  x64 = x.astype(np.float64)
  top = x64.max(-1, keepdims=True)
  expected = (top + np.log(np.exp(x64 - top).sum(-1, keepdims=True)))[..., 0]
  np.testing.assert_allclose(jax.jit(_logsumexp)(jnp.asarray(x)), expected, rtol=2e-7)


@pytest.mark.parametrize("chunk_size", [0, 10, 8, 6])  # 1, 4, 5 and 8 chunks of 40 positions.
@pytest.mark.variants
def test_chunked_matches_full_logits_value_and_gradient(chunk_size):
  hidden, w, targets, weights = _case()
  ref, ref_grads = jax.value_and_grad(_reference, argnums=(0, 1))(hidden, w, targets, weights, 0.1)
  val, grads = jax.value_and_grad(_loss(targets, weights, chunk_size), argnums=(0, 1))(hidden, w)
  np.testing.assert_allclose(val, ref, rtol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
  assert np.abs(grads[0][1, 30:]).max() == 0  # Masked tokens get no gradient.


def test_parts_are_the_mean_nll_and_z_loss_and_scale_with_the_cotangent():
  hidden, w, targets, weights = _case()
  loss, ce, z = cross_entropy(hidden, targets, weights, _head(w), chunk_size=8, z_loss_weight=0.25)
  np.testing.assert_allclose(ce, _reference(hidden, w, targets, weights, 0.0), rtol=1e-6)
  np.testing.assert_allclose(loss, ce + 0.25 * z, rtol=1e-6)
  # A cotangent of 3 (the loss of one micro-batch weighted in a larger sum) scales both gradients by 3.
  f = _loss(targets, weights, 8)
  g1 = jax.grad(f, argnums=(0, 1))(hidden, w)
  g3 = jax.grad(lambda h, w: 3.0 * f(h, w), argnums=(0, 1))(hidden, w)
  for a, b in zip(g1, g3):
    np.testing.assert_allclose(b, 3.0 * a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rules", [
    (("batch", ("data", "fsdp")), ("length", None), ("embed", "fsdp"), ("vocab", "tensor")),
    (("batch", "fsdp"), ("length", "data"), ("embed", ("fsdp", "data")), ("vocab", "tensor")),  # A split length.
])
def test_sharded_equals_one_device(rules):
  """Over 8 devices (the tokens split over 4, the vocab over 2), value and gradients equal one device's."""
  hidden, w, targets, weights = _case()
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  f = jax.value_and_grad(_loss(targets, weights, 10), argnums=(0, 1))
  want_val, want = jax.jit(f)(hidden, w)
  with use_rules(mesh, rules):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    tok = P(*rules[0][1:2], rules[1][1])
    got_val, got = jax.jit(f)(put(hidden, P(*tok, None)), put(w, P(rules[2][1], "tensor")))
  np.testing.assert_allclose(got_val, want_val, rtol=1e-6)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)



def _noisy_logits(h, w, key):
  """A stand-in for a quantized head's stochastic rounding: logits scaled by noise drawn from the chunk's key."""
  return jnp.einsum("bld,dv->blv", h, w) * (1.0 + jax.random.uniform(key, h.shape[:2] + (1,)))


def test_every_chunk_and_token_shard_rounds_with_noise_of_its_own():
  """Equal tokens in two chunks (positions 2i and 2i + 1: strided chunks of 2) or on two token shards get
  gradients that differ: the head's key is folded with the chunk and the shard (the same key everywhere made their
  rounding noise equal, its errors correlated)."""
  hidden, w, targets, weights = _case()
  hidden = jnp.repeat(hidden[:, :20], 2, axis=1)  # Positions 2i and 2i + 1 equal.
  targets, weights = jnp.repeat(targets[:, :20], 2, axis=1), jnp.ones((4, 40))
  hidden, targets = (jnp.concatenate([a[:2], a[:2]]) for a in (hidden, targets))  # Rows 2, 3 equal rows 0, 1.
  head = Head(_noisy_logits, w, read_dtype=w.dtype, reduce_dtype=jnp.float32)
  loss = lambda h: cross_entropy(h, targets, weights, head, key=jax.random.key(3), chunk_size=20)[0]
  dh = jax.grad(loss)(hidden)
  assert float(jnp.max(jnp.abs(dh[:, 0::2] - dh[:, 1::2]))) > 1e-3 * float(jnp.max(jnp.abs(dh)))
  mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
  with use_rules(mesh, (("batch", "fsdp"), ("length", None), ("embed", None), ("vocab", None))):
    dh = jax.jit(jax.grad(loss))(jax.device_put(hidden, NamedSharding(mesh, P("fsdp", None, None))))
  assert float(jnp.max(jnp.abs(dh[:2] - dh[2:]))) > 1e-3 * float(jnp.max(jnp.abs(dh)))

def test_the_head_runs_once_a_chunk():
  """One forward GEMM per chunk and its two backward GEMMs: no logits recomputed in the backward pass."""
  hidden, w, targets, weights = _case()
  jaxpr = jax.make_jaxpr(jax.grad(_loss(targets, weights, 8), argnums=(0, 1)))(hidden, w)
  dots = []

  def walk(j, trips):
    for e in j.eqns:
      if e.primitive.name == "dot_general":
        dots.append(trips)
      inner = trips * e.params["length"] if e.primitive.name == "scan" else trips
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        walk(sub, inner)

  walk(jaxpr.jaxpr, 1)
  assert sum(dots) == 3 * num_chunks(40, 8) == 15, dots


def test_chunks_follow_the_budget():
  assert num_chunks(8192, 1024) == 8  # A chunk's logits: as many as 1024 tokens' full vocab.
  assert num_chunks(8192, 0) == num_chunks(1024, 1024) == 1
  assert num_chunks(40, 6) == 8  # The first count of at least 7 that divides 40.
  assert num_chunks(7, 2) == 7


def test_loss_is_mean_nll_over_unmasked_tokens():
  logits = jnp.log(jnp.array([[0.5, 0.5], [0.9, 0.1]]))
  targets = jnp.array([[0, 1]])
  weights = jnp.array([[1.0, 0.0]])
  _, ce, _ = cross_entropy(jnp.eye(2)[None].astype(jnp.float32), targets, weights, _head(logits))
  np.testing.assert_allclose(ce, np.log(2.0), rtol=1e-6)


def test_chunked_loss_never_holds_full_logits():
  """The compiled chunked loss's temporaries stay well under one [B, L, V] float32 logits block."""
  b, length, d, v = 2, 512, 32, 4096
  hidden = jnp.zeros((b, length, d))
  w = jnp.zeros((d, v))
  targets = jnp.zeros((b, length), jnp.int32)
  weights = jnp.ones((b, length))
  grad = jax.jit(jax.grad(_loss(targets, weights, 32), argnums=(0, 1)))
  temp = grad.lower(hidden, w).compile().memory_analysis().temp_size_in_bytes
  assert temp < b * length * v * 4 / 2, temp


def test_the_step_logs_the_z_loss_where_it_is_in_effect():
  """A z-loss weight of 0 trains nothing toward it: the step logs neither `z_loss` nor a `total_loss` equal to
  `loss`; with a weight it logs both, total = loss + weight * z."""
  from tests.helpers import config, one_step, random_batch
  off = config("tiny", **{"model.dtype": "float32", "quant.recipe": "bf16"})
  metrics, _ = one_step(off, random_batch(off), 1)
  assert "z_loss" not in metrics and "total_loss" not in metrics
  on = config("tiny", **{"model.dtype": "float32", "quant.recipe": "bf16", "train.z_loss_weight": 0.5})
  metrics, _ = one_step(on, random_batch(on), 1)
  assert float(metrics["total_loss"]) == pytest.approx(float(metrics["loss"]) + 0.5 * float(metrics["z_loss"]),
                                                         rel=1e-6)
