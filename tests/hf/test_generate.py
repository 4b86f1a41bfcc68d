"""The KV-cached decoder against the training forward pass, and batched generation against one prompt at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember.inference.generate import generate, pick
from ember.trainer.state import build_model
from tests import helpers


def _model(**overrides):
  cfg = helpers.settings(**{"model.dtype": "float32", "quant.recipe": "bf16", "model.num_layers": 3,
                            "model.init_std": 0.2, **overrides})
  return build_model(cfg, jax.random.key(0))


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="dense"), pytest.param({"model.num_experts": 4, "model.experts_per_token": 2}, id="moe"),
    pytest.param({"model.num_experts": 4, "model.moe_every": 2, "model.num_layers": 4}, id="interleaved",
                 marks=pytest.mark.extended)])
@pytest.mark.long
def test_cached_decoding_gives_the_forward_pass_logits(overrides):
  """A prefill of 5 tokens then one token at a time equals the training forward pass on the whole rows."""
  model = _model(**overrides)
  b, length = 2, 12
  tokens = jax.random.randint(jax.random.key(1), (b, length), 0, 256)
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  h, _ = model(tokens, jnp.ones((b, length), jnp.int32), positions)
  want = model.head(h)
  cache = model.init_cache(b, 16)
  h, cache = model.decode(tokens[:, :5], positions[:, :5], cache)
  got = [model.head(h)]
  for t in range(5, length):
    h, cache = model.decode(tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    got.append(model.head(h))
  got = jnp.concatenate(got, axis=1)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


def test_batched_prompts_of_different_lengths_decode_as_alone():
  model = _model()
  prompts = [np.arange(3, dtype=np.int32) + 40, np.arange(9, dtype=np.int32) + 60]
  together = generate(model, prompts, max_new_tokens=8)
  alone = [generate(model, [p], max_new_tokens=8)[0] for p in prompts]
  for t, a in zip(together, alone):
    np.testing.assert_array_equal(t, a)


def test_sampling_follows_temperature_and_top_p():
  """4,000 draws per setting against the distribution computed here: p^(1 / T) renormalised, then cut to the
  smallest top set whose mass reaches top_p (the top token always stays)."""
  p = np.asarray([0.5, 0.3, 0.15, 0.05])
  logits = jnp.log(jnp.asarray(p))[None]
  keys = jax.random.split(jax.random.key(0), 4000)

  def expected(temperature, top_p):
    q = p ** (1 / temperature)
    q /= q.sum()
    keep = (np.cumsum(q) - q) < top_p  # Sorted already: the mass ranked above each token.
    return np.where(keep, q, 0) / q[keep].sum()

  for temperature, top_p in ((1.0, 1.0), (1.0, 0.7), (0.5, 1.0), (2.0, 1.0), (0.5, 0.7)):
    draws = np.asarray(jax.vmap(lambda k: pick(logits, k, temperature, top_p))(keys))[:, 0]
    freq = np.bincount(draws, minlength=4) / len(draws)
    want = expected(temperature, top_p)
    assert np.all(freq[want == 0] == 0), (temperature, top_p, freq)  # Cut tokens are never drawn.
    np.testing.assert_allclose(freq, want, atol=0.03, err_msg=f"temperature {temperature}, top_p {top_p}")
  assert int(pick(logits, keys[0], 0.0, 1.0)[0]) == 0  # Greedy.
  assert int(pick(-logits, keys[0], 0.0, 1.0)[0]) == 3
  # A head padded past the tokenizer's vocabulary (here 2 ids): its extra rows are never a token, whatever
  # their logits (SentencePiece failed on them; other tokenizers dropped them from the text).
  assert int(pick(-logits, keys[0], 0.0, 1.0, vocab=2)[0]) == 1
  draws = np.asarray(jax.vmap(lambda k: pick(-logits, k, 1.0, 1.0, vocab=2))(keys[:500]))[:, 0]
  assert set(draws.tolist()) == {0, 1}


@pytest.mark.parametrize("dispatch", [pytest.param("allgather", marks=pytest.mark.extended), "ragged"])
@pytest.mark.long
def test_generation_under_expert_parallelism_equals_one_device(dispatch):
  """An MoE model sharded fsdp=2 x expert=4 generates the tokens it generates on one device."""

  cfg = helpers.config(**{"model.dtype": "float32", "quant.recipe": "bf16", "model.init_std": 0.2,
                          "model.num_experts": 4, "model.experts_per_token": 2, "mesh.expert": 4, "mesh.fsdp": 2,
                          "model.moe_dispatch": dispatch})
  s = helpers.start(cfg, 8)
  graphdef, state = s.graphdef, s.state
  prompts = [np.asarray([100, 101, 102, 32], np.int32), np.arange(7, dtype=np.int32) + 50]
  with s.rules():
    sharded = generate(nnx.merge(graphdef, state.params, state.quant_state), prompts, max_new_tokens=8,
                       batch_multiple=8)
  alone = nnx.merge(graphdef, jax.device_get(state.params), jax.device_get(state.quant_state))
  single = generate(alone, prompts, max_new_tokens=8)
  assert [t.tolist() for t in sharded] == [t.tolist() for t in single]
