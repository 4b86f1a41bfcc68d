"""Context parallelism: a step with each sequence split over `mesh.context` devices equals the step on one device
(float32, packed documents crossing the shards' boundaries), and a checkpoint it trained samples as any other."""

import jax
import pytest

from ember import config as config_lib
from ember.errors import ConfigError
from ember.tools.sample import sample
from ember.trainer.loop import train
from tests.helpers import config, one_step, random_batch, rel_error

MESHES = {"context4": {"mesh.context": 4, "mesh.fsdp": 2},
          "context2_fsdp4": {"mesh.context": 2, "mesh.fsdp": 4},
          "context2_expert4": {"mesh.context": 2, "mesh.expert": 4, "mesh.fsdp": 1}}


def _cfg(preset, recipe, **overrides):
  return config(preset, **{"model.dtype": "float32", "quant.recipe": recipe, "train.batch_size": 4,
                           "train.warmup_steps": 1, **overrides})


@pytest.mark.parametrize("preset,recipe,mesh", [pytest.param("tiny", "bf16", "context4", marks=pytest.mark.long),
                                                ("tiny", "bf16", "context2_fsdp4"),
                                                pytest.param("tiny", "fp8_current", "context4", marks=pytest.mark.long),
                                                ("tiny", "fp8_current", "context2_fsdp4"),
                                                pytest.param("tiny_moe", "bf16", "context2_expert4", marks=pytest.mark.long),
                                                pytest.param("tiny_moe", "fp8_current", "context2_expert4", marks=pytest.mark.long)])
def test_step_equals_one_device(preset, recipe, mesh):
  """Loss, gradient norm, the gradients (the optimizer's moments) and the updated parameters equal one device's
  within 1e-5. The rows pack three documents and padding; with the 64 tokens split 4 or 2 ways the first two
  documents cross a shard boundary, so attention reaches keys on other devices, causally and within documents.
  tiny_moe in FP8: the loss, and the gradient norm within 1e-3. The two programs sum in different orders, and a
  float32 difference of 1e-7 can carry one FP8 value across a rounding boundary (an E5M2 gradient's ulp is 25%);
  the gradients that flow through it then differ by up to a few percent, while every amax and scale agrees (the
  health statistics within 1e-4). The bf16 case checks every gradient of the same model within 1e-5."""
  batch = random_batch(_cfg(preset, recipe), segments=3)
  segments = batch["segment_ids"][0]
  assert segments[15] == segments[16] and segments[31] == segments[32] != segments[0]  # Across boundaries.
  one, state_one = one_step(_cfg(preset, recipe, **{"mesh.fsdp": 1}), batch, 1)
  split, state_split = one_step(_cfg(preset, recipe, **MESHES[mesh]), batch, 8)
  rounding_flips = preset == "tiny_moe" and recipe != "bf16"
  assert rel_error(split["loss"], one["loss"]) < 1e-5, (split["loss"], one["loss"])
  assert rel_error(split["grad_norm"], one["grad_norm"]) < (1e-3 if rounding_flips else 1e-5)
  if rounding_flips:
    return
  flat_one = jax.tree_util.tree_flatten_with_path(state_one)[0]
  flat_split = jax.tree.leaves(state_split)
  assert len(flat_one) == len(flat_split)
  for (path, a), b in zip(flat_one, flat_split):
    assert rel_error(b, a) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.long
def test_sampling_from_a_context_parallel_checkpoint(tmp_path):
  """A run trained with context=4 samples on its own 8 devices (the context devices shard the parameters as
  fsdp then) the text it samples on one device."""
  workdir = tmp_path / "run"
  train(config("tiny", steps=2, workdir=str(workdir), **{"mesh.context": 4, "checkpoint.every_steps": 2}))
  prompts = ["def ", "import os\n"]
  sharded = sample(str(workdir), prompts, max_new_tokens=8)
  alone = sample(str(workdir), prompts, max_new_tokens=8, one_device=True)
  assert sharded == alone and all(sharded)


def test_a_context_that_does_not_divide_the_sequence_is_a_config_error():
  cfg = config("tiny", **{"mesh.context": 3, "mesh.fsdp": 2, "model.seq_len": 64})
  reason = r"mesh.context: the 2 x 3 chunks of a sequence split over 3 devices do not divide model.seq_len=64"
  with pytest.raises(ConfigError, match=reason):
    config_lib.validate(cfg, 6, 1)
