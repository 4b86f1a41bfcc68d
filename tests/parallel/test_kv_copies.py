"""Fewer kv heads than tensor ranks (tiny: 2 kv heads over tensor 4): each rank computes a copy of its group's keys
and values (layers/attention.py `kv_view`). That such a step trains as one device does is
tests/trainer/test_mesh_equality.py's (`fsdp2_tensor4`); what it gathers, tests/plan/test_target_compile.py's."""

import pytest
from flax import nnx

from ember import config as config_lib
from ember.layers import linear
from ember.errors import ConfigError
from ember.tools.sample import sample
from ember.trainer.loop import train
from tests.helpers import checked, config, start


@pytest.mark.long
def test_sampling_from_a_checkpoint_whose_kv_heads_are_copied(tmp_path):
  """A run trained on fsdp 2 x tensor 4 samples on its own 8 devices (the cache holds the model's 2 kv heads, one
  of each head's copies) the text it samples on one device."""
  workdir = tmp_path / "run"
  train(checked(config("tiny", steps=2, workdir=str(workdir),
                       **{"mesh.fsdp": 2, "mesh.tensor": 4, "checkpoint.every_steps": 2})))
  prompts = ["def ", "import os\n"]
  sharded = sample(str(workdir), prompts, max_new_tokens=8)
  alone = sample(str(workdir), prompts, max_new_tokens=8, one_device=True)
  assert sharded == alone and all(sharded)


@pytest.mark.parametrize("tensor,reason", [
    (3, "mesh.tensor: 3 does not divide model.num_heads=4"),
    (8, "mesh.tensor: 8 does not divide model.num_heads=4"),
])
def test_a_tensor_split_the_heads_cannot_take_is_a_config_error(tensor, reason):
  with pytest.raises(ConfigError, match=reason):
    config_lib.validate(config("tiny", **{"mesh.tensor": tensor, "mesh.fsdp": 1}), tensor)


def test_kv_heads_are_copied_only_where_the_ranks_outnumber_them():
  m = config_lib.validate(config("tiny", **{"mesh.fsdp": 1}), 1).model  # 4 heads, 2 kv heads.
  assert [m.kv_copies(t) for t in (1, 2, 4)] == [1, 1, 2]
  m = config_lib.validate(config("tiny", **{"mesh.fsdp": 1, "model.num_heads": 12, "model.num_kv_heads": 4,
                                            "model.head_dim": 16, "model.d_ff": 192, "model.vocab_size": 384}),
                         1).model
  assert "model.num_kv_heads=4" in m.tensor_refusal(6)  # 6 splits the 12 heads, not the 4 kv heads: no copies.
  assert m.tensor_refusal(12) is None and m.kv_copies(12) == 3


@pytest.mark.parametrize("tensor,copied", [(2, False), (4, True)])
def test_a_step_makes_no_kernel_copies_of_a_viewed_qkv_kernel(tensor, copied):
  """fp8_current over fsdp x tensor: a step quantizes each dense kernel once (layers/linear.py's `once_a_step`),
  but not the qkv kernel where its kv heads are copied over the tensor ranks (tensor 4, 2 kv heads): its GEMMs
  read a view of it, which they quantize themselves (its copies would be made and held for nothing)."""
  s = start(config("tiny", **{"quant.recipe": "fp8_current", "mesh.fsdp": 8 // tensor, "mesh.tensor": tensor}), 8)
  with s.rules():
    taken = linear.once_a_step(nnx.merge(s.graphdef, s.state.params, s.state.quant_state))
  copied_paths = {path[-1] for path, t in taken.items() if t.copies}
  assert copied_paths == ({"out", "wi", "wo"} if copied else {"qkv", "out", "wi", "wo"}), copied_paths
