"""`quant.exclude`: which projections each entry keeps in bf16 (pinned, as torchtitan pins its filters)."""

import pytest

from ember.names import LAYER_PROJECTIONS
from ember.quant.recipe import Recipe, check_excluded_layers, parse_exclude

LAYERS = 12


def converted(*entries) -> set:
  """(layer, projection) pairs, and ('head',) for the LM head, that stay in bf16."""
  recipe = Recipe("fp8_current", exclude=entries)
  out = {(i, p) for i in range(LAYERS) for p in LAYER_PROJECTIONS if recipe.for_projection(p, i, LAYERS).name == "bf16"}
  return out | ({("head",)} if recipe.for_projection("lm_head", None, LAYERS).name == "bf16" else set())


ALL = {(i, p) for i in range(LAYERS) for p in LAYER_PROJECTIONS}


@pytest.mark.parametrize("entry,expected", [
    ("lm_head", {("head",)}),
    ("wo", {(i, "wo") for i in range(LAYERS)}),
    ("layers[1]", {(1, p) for p in LAYER_PROJECTIONS}),  # Not layers 10 and 11, as the glob `layers.1*` was.
    ("layers[-1]", {(11, p) for p in LAYER_PROJECTIONS}),
    ("layers[-2:]", {(i, p) for i in (10, 11) for p in LAYER_PROJECTIONS}),
    ("layers[:2]", {(i, p) for i in (0, 1) for p in LAYER_PROJECTIONS}),
    ("layers[3:5].qkv", {(3, "qkv"), (4, "qkv")}),
    ("layers[0].moe_wi", {(0, "moe_wi")}),
    ("layers[:]", ALL),
    ("layers[5:3]", set()),
])
def test_each_entry_converts_exactly(entry, expected):
  assert converted(entry) == expected


def test_entries_add_up():
  assert converted("lm_head", "layers[0]", "layers[-1]") == (
      {("head",)} | {(i, p) for i in (0, 11) for p in LAYER_PROJECTIONS})


def test_bf16_recipe_ignores_exclusions_and_others_keep_their_options():
  r = Recipe("bf16", exclude=("wo",))
  assert r.for_projection("wo", 0, LAYERS) is r
  nv = Recipe("nvfp4", nvfp4_rht=False, exclude=("wo",))
  assert nv.for_projection("wi", 3, LAYERS) is nv
  kept = nv.for_projection("wo", 3, LAYERS)
  assert kept.name == "bf16" and not kept.quantized


@pytest.mark.parametrize("entry,message", [
    ("layers.1*", "is not a projection"),
    ("layers.0.*", "is not a projection"),
    ("layers[1].mlp", "unknown projection 'mlp'"),
    ("layers[1].lm_head", "unknown projection 'lm_head'"),
    ("layers[x]", "is not a projection"),
    ("attn", "is not a projection"),
    ("mtp[0]", "is not a projection"),
    ("mtp.lm_head", "unknown projection 'lm_head'"),
])
def test_malformed_entries_are_errors(entry, message):
  with pytest.raises(ValueError, match=message):
    parse_exclude(entry)
  with pytest.raises(ValueError, match=message):
    Recipe("fp8_current", exclude=(entry,))


def test_single_layer_out_of_range():
  selectors = (parse_exclude("layers[12]"),)
  with pytest.raises(ValueError, match="layer 12 is outside a model of 12 layers"):
    check_excluded_layers(selectors, LAYERS)
  check_excluded_layers((parse_exclude("layers[-12]"), parse_exclude("layers[-20:]")), LAYERS)


def test_mtp_entries_select_the_prediction_modules_and_layer_ranges_do_not():
  """The prediction module after the decoder is the model's layer LAYERS: `mtp` selects it, `layers[...]` never."""
  bf16 = lambda entry, p, layer: Recipe("fp8_current", exclude=(entry,)).for_projection(p, layer, LAYERS).name == "bf16"
  assert all(bf16("mtp", p, LAYERS) for p in LAYER_PROJECTIONS) and not any(
      bf16("mtp", p, i) for i in range(LAYERS) for p in LAYER_PROJECTIONS) and not bf16("mtp", "lm_head", None)
  assert [p for p in LAYER_PROJECTIONS if bf16("mtp.wo", p, LAYERS)] == ["wo"] and not bf16("mtp.wo", "wo", 0)
  assert not any(bf16(e, p, LAYERS) for e in ("layers[-1:]", "layers[:]", "layers[-1]") for p in LAYER_PROJECTIONS)
  assert bf16("wo", "wo", LAYERS)  # A kind is every layer's, the module's too.
  check_excluded_layers((parse_exclude("mtp"),), LAYERS, mtp_depth=1)
  with pytest.raises(ValueError, match=r"'mtp.wo': the model has no multi-token-prediction modules"):
    check_excluded_layers((parse_exclude("mtp.wo"),), LAYERS)
