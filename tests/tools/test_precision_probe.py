"""ember.tools.precision_probe on a trained tiny checkpoint: deterministic, its errors what they say, and its
recommended quant.exclude under the target it states when measured again."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.data.pipeline import data_iterator
from ember.inference.checkpoint import load_model
from ember.layers.decoder import rows_by_layer, stacked_like
from ember.plan import probe as probe_lib
from ember.tools import precision_probe
from ember.trainer.objective import forward_loss
from ember.trainer.state import abstract_init, logical_axes, split_model, step_key
from flax import nnx
from tests.helpers import ROOT
from tests.quant import reference as quant_ref

# One worker runs this module (`--dist loadgroup`): its tests share module-scoped state.
pytestmark = pytest.mark.xdist_group("test_precision_probe")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  run = tmp_path_factory.mktemp("probe") / "run"
  p = subprocess.run([sys.executable, "train.py", "--config=configs/default.py:tiny", "--config.steps=20",
                      f"--config.workdir={run}", "--config.train.eval_every_steps=0", "--config.log.tensorboard=false"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  return str(run)


@pytest.mark.extended
def test_the_probe_is_deterministic_and_its_exclude_meets_its_target(checkpoint, tmp_path):
  target = 0.03  # Under nvfp4's whole-model error at this checkpoint: the probe must exclude something.
  out = tmp_path / "probe.json"
  assert precision_probe.main(["probe", f"--checkpoint={checkpoint}", "--recipe=nvfp4", "--batches=1",
                               f"--target_error={target}", f"--out={out}"]) == 0
  first = json.loads(out.read_text())
  kinds = {(r["layer"], r["kind"]) for r in first["projections"]}
  assert kinds == {(layer, kind) for layer in (0, 1) for kind in ("qkv", "out", "wi", "wo")}  # The head is bf16.
  assert first["whole_model_grad_error"] > target and first["exclude_grad_error"] < target
  assert first["exclude"][0] == "lm_head" and len(first["exclude"]) > 1
  worst = max(first["projections"], key=lambda r: r["grad_error"])
  assert first["exclude"][1] == f"layers[{worst['layer']}].{worst['kind']}"  # Worst first.

  # Measured again without the probe: the loss's gradient with respect to every parameter, at the recommended
  # exclude list and at the float32 unquantized reference, on the same held-out batch and stochastic-rounding
  # key, and the relative error of the whole gradient computed here in NumPy.
  # An exclude list of layers changes how the layers are stacked (scan segments): the checkpoint's rows are laid
  # out for each settings by the model's own stacking.
  trained, _, model = load_model(checkpoint, what="test", recipe="nvfp4", one_device=True)
  _, params, quant_state, _ = split_model(model)
  rows = rows_by_layer(nnx.to_pure_dict(params), trained.model, trained.quant)
  quant_rows = rows_by_layer(nnx.to_pure_dict(quant_state), trained.model, trained.quant)
  it = data_iterator(trained, "eval")
  batch = {k: jnp.asarray(v) for k, v in next(it).items()}
  it.close()
  key = step_key(trained.seed, jnp.asarray(0, jnp.int32))

  def gradient(settings):
    abstract_params, abstract_quant = abstract_init(settings)
    p = stacked_like(lambda k, _: rows[k], settings.model, settings.quant, abstract_params)
    q = stacked_like(lambda k, _: quant_rows[k], settings.model, settings.quant, abstract_quant)
    graphdef = logical_axes(settings)[0]
    loss = lambda p: forward_loss(p, q, batch, graphdef=graphdef, cfg=settings, key=key)[0]
    grads = rows_by_layer(jax.jit(jax.grad(loss))(p), settings.model, settings.quant)
    return {k: np.asarray(g, np.float64) for k, g in grads.items()}

  reference = gradient(trained.replace("quant.recipe", "bf16").replace("model.dtype", "float32")
                       .replace("quant.exclude", ()))
  got = gradient(trained.replace("quant.exclude", tuple(first["exclude"])))
  assert got.keys() == reference.keys()
  error = np.sqrt(sum(np.sum((got[k] - r) ** 2) for k, r in reference.items())
                  / sum(np.sum(r ** 2) for r in reference.values()))
  assert error == pytest.approx(first["exclude_grad_error"], rel=1e-4) and error < target

  # And the probe itself, measuring again from scratch with the recommended list: the same error bit for bit.
  trained, _, model = load_model(checkpoint, what="test", recipe="bf16", one_device=True)
  _, params, quant_state, _ = split_model(model)
  probe = probe_lib.Probe(trained, nnx.to_pure_dict(params), nnx.to_pure_dict(quant_state), 1)
  settings = trained.replace("quant.recipe", "nvfp4").replace("quant.exclude", tuple(first["exclude"]))
  assert probe.whole_error(probe.gradients(settings)) == first["exclude_grad_error"]


@pytest.mark.long
def test_errors_against_their_definitions(checkpoint):
  """fp8_current's weight error of a kernel is |Q(W) - W| / |W| with W's per-tensor E4M3 scale, computed here in
  NumPy from the rounding rule; nvfp4's is several times larger."""
  import ml_dtypes
  trained, _, model = load_model(checkpoint, what="test", recipe="bf16", one_device=True)
  _, params, _, _ = split_model(model)
  w = np.asarray(nnx.to_pure_dict(params)["segments"][0]["blocks"]["layers"][0]["mlp"]["wo"]["kernel"][1],
                 np.float32)  # Layer 1's [mlp, embed] kernel.
  scale_inv = quant_ref.per_tensor_scale_inv(448, np.max(np.abs(w)))
  q = (w * (np.float32(1) / scale_inv)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale_inv
  want = np.linalg.norm(q - w) / np.linalg.norm(w)
  got = probe_lib.weight_error(w, ("mlp", "embed"), "fp8_current")
  assert got == pytest.approx(want, rel=1e-5)
  assert probe_lib.weight_error(w, ("mlp", "embed"), "nvfp4") > 3 * got  # 4 bits against 8: ~4x.


@pytest.mark.long
def test_output_error_against_its_definition(checkpoint):
  """Layer 0's qkv reads the normed embeddings, whatever the recipe: its output error is |y - x W| / |x W| with
  y the fp8_current GEMM (per-tensor E4M3 scales, NumPy here) of that input. With the LM head quantized, the
  probe measures it too."""
  import ml_dtypes
  trained, _, model = load_model(checkpoint, what="test", recipe="bf16", one_device=True)
  _, params, quant_state, _ = split_model(model)
  params, quant_state = nnx.to_pure_dict(params), nnx.to_pure_dict(quant_state)
  probe = probe_lib.Probe(trained, params, quant_state, 1)
  settings = trained.replace("quant.recipe", "fp8_current").replace("quant.exclude", ())
  grads, errors = probe.measure(settings)
  found = {(p.layer, p.kind): p for p in probe.projections(settings, grads, errors)}
  assert set(found) == {(layer, kind) for layer in (0, 1) for kind in ("qkv", "out", "wi", "wo")} | {(None, "lm_head")}

  layer0 = params["segments"][0]["blocks"]["layers"][0]
  tokens = np.asarray(probe.batches[0]["inputs"])
  e = np.asarray(params["embed"]["embedding"], np.float32)[tokens].astype(ml_dtypes.bfloat16).astype(np.float32)
  normed = e / np.sqrt(np.mean(e * e, axis=-1, keepdims=True) + trained.model.norm_eps)
  x = (normed * np.asarray(layer0["attn_norm"]["scale"][0], np.float32)).astype(ml_dtypes.bfloat16)
  x = x.astype(np.float32).reshape(-1, e.shape[-1])
  w = np.asarray(layer0["attn"]["qkv"]["kernel"][0], np.float32).reshape(x.shape[1], -1)

  def e4m3(a):
    scale_inv = quant_ref.per_tensor_scale_inv(448, np.max(np.abs(a)))
    return (a * (np.float32(1) / scale_inv)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale_inv

  y = (e4m3(x).astype(np.float64) @ e4m3(w)).astype(ml_dtypes.bfloat16).astype(np.float64)
  ref = x.astype(np.float64) @ w
  want = np.linalg.norm(y - ref) / np.linalg.norm(ref)
  assert found[(0, "qkv")].output_error == pytest.approx(want, rel=0.02)
  assert 0 < found[(None, "lm_head")].output_error < 0.1


@pytest.mark.parametrize("mesh", [{"mesh.expert": 4, "mesh.data": 2}, pytest.param({"mesh.expert": 2, "mesh.fsdp": 4}, marks=pytest.mark.extended)])
@pytest.mark.long
def test_output_errors_are_the_same_under_expert_parallelism(mesh):
  """The expert GEMMs' output errors, summed over token shards inside the MoE layer's shard_map, equal one
  device's (the probe runs on one device; the layer's plumbing serves any mesh). Float32 compute: in bf16 the CPU
  rounds the dequantized operands differently on one device and on a mesh (about 1% of the error itself)."""
  import jax
  import jax.numpy as jnp
  from ember.trainer.state import logical_axes, stats_inputs
  from ember.trainer.step import forward_loss, moe_plan
  from tests import helpers

  def errors(num_devices, **over):
    overrides = {"quant.recipe": "fp8_current", "model.dtype": "float32", **over}
    s = helpers.start(helpers.config("tiny_moe", **overrides), num_devices)
    settings = probe_lib.with_output_errors(s.cfg)
    graphdef = logical_axes(settings)[0]
    batch = {k: jnp.asarray(v) for k, v in helpers.random_batch(s.cfg).items()}
    with s.rules():
      plan = moe_plan(settings, s.mesh, settings.train.batch_size)
      loss = lambda p, q, e: forward_loss(p, q, batch, e, graphdef=graphdef, cfg=settings, key=jax.random.key(0),
                                          moe_plan=plan)[0]
      sums = jax.jit(jax.grad(loss, argnums=2))(s.state.params, s.state.quant_state, stats_inputs(settings))
    return {jax.tree_util.keystr(p): np.sqrt(a[..., 0] / a[..., 1]) for p, a in
            jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, sums))[0]}

  one, many = errors(1), errors(8, **mesh)
  assert any("moe" in k for k in one) and one.keys() == many.keys()
  for k in one:
    np.testing.assert_allclose(many[k], one[k], rtol=1e-4, err_msg=k)
