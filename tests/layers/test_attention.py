"""Packed sequences: a token never sees another segment."""

import jax
import jax.numpy as jnp
import numpy as np
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
