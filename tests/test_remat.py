"""Remat presets: each gives the gradients of `none`; offloaded names reach host memory; config errors.

Gradients are those of a real decoder `Segment` (two blocks under `jax.lax.scan`, the preset's
`jax.checkpoint` around the body, the stochastic-rounding key folded from step and block), so
the backward pass really recomputes in its own loop rather than sharing the forward's values.
One compilation per recipe holds every preset's gradient function.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ember import config as config_lib
from ember import remat
from ember.layers.decoder import Segment
from ember.plan import layer as layer_plan
from ember.program import hlo as hlo_plan
from ember.plan import step as step_plan
from ember.trainer.state import step_key
from tests.helpers import ROOT, config, start
from tests.xla_cpu import recipe_options

RECIPES = ("bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4")
# Cheaper CPU code generation; the HLO passes (and so the numerics being compared) are unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
CUSTOM = remat.Preset(save=(remat.QKV_PROJ, remat.quantized_name("wi", "x")),
                      offload=(remat.MLP_WI, remat.quantized_name("qkv", "kernel")))


def _values(abstract_state, seed: int):
  """Deterministic values for a Segment's state: kernels ~ N(0, 0.05), norm scales ~ 1, amax histories
  in [0.5, 4) so delayed scaling's scales matter (built with NumPy: nothing to compile)."""
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    names = {getattr(p, "key", None) for p in path}
    if "amax_history" in names:
      return jnp.asarray(rng.uniform(0.5, 4.0, leaf.shape), leaf.dtype)
    if "scale" in names:
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
    return jnp.asarray(0.05 * rng.standard_normal(leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, abstract_state)


def segment_problem(recipe: str, batch: int = 2):
  cfg = config_lib.derive(config("tiny", **{"quant.recipe": recipe, "model.dtype": "float32"}), 1)
  make = lambda: Segment(cfg.model, cfg.quant, [0, 1], nnx.Rngs(params=jax.random.key(0)))
  with nnx.use_eager_sharding(False):
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
  rng = np.random.default_rng(1)
  length, d = cfg.model.seq_len, cfg.model.d_model
  x = jnp.asarray(rng.standard_normal((batch, length, d)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((batch, length, d)), jnp.float32)
  cut = length // 3  # Two packed documents per row.
  segment_ids = jnp.asarray(np.broadcast_to(np.where(np.arange(length) < cut, 1, 2), (batch, length)), jnp.int32)
  positions = jnp.asarray(np.broadcast_to(np.where(np.arange(length) < cut, np.arange(length),
                                                   np.arange(length) - cut), (batch, length)), jnp.int32)
  return graphdef, _values(abstract, 2), x, ct, segment_ids, positions, step_key(cfg.seed, jnp.int32(3))


# bf16 and fp8_current here; the other recipes' names follow the same rule (extended cases).
@pytest.mark.parametrize("recipe", [r if r in ("bf16", "fp8_current") else pytest.param(r, marks=pytest.mark.extended)
                                    for r in RECIPES])
@pytest.mark.variants
def test_every_preset_gives_the_gradients_of_none(recipe):
  graphdef, state, x, ct, segment_ids, positions, key = segment_problem(recipe)
  presets = dict(remat.PRESETS, custom=CUSTOM)

  def grads(x, state):
    def for_preset(p):
      def loss(x, state):
        y, aux, _ = nnx.merge(graphdef, state)(x, segment_ids, positions, key, p)
        return jnp.sum(y * ct) + sum(jnp.sum(a) for a in aux.values())
      return jax.grad(loss, argnums=(0, 1))(x, state)
    return {name: for_preset(p) for name, p in presets.items()}

  options = {**FAST_COMPILE, **recipe_options((recipe,))}
  out = jax.jit(grads).lower(x, state).compile(compiler_options=options)(x, state)
  ref = jax.tree_util.tree_flatten_with_path(out["none"])[0]
  for path, leaf in ref:
    assert np.all(np.isfinite(leaf)), (recipe, jax.tree_util.keystr(path))
  assert float(jnp.max(jnp.abs(out["none"][0]))) > 0
  for name in presets:
    for (path, want), got in zip(ref, jax.tree.leaves(out[name])):
      scale = float(jnp.max(jnp.abs(want))) or 1.0
      err = float(jnp.max(jnp.abs(got - want))) / scale
      assert err <= 1e-5, f"{recipe}/{name}: {jax.tree_util.keystr(path)} differs by {err:.2e} relative"


def _tiny_step(recipe="fp8_current"):
  s = start(config("tiny", **{"quant.recipe": recipe, "mesh.fsdp": 1}))
  return s.cfg, s.mesh, s.tx, s.schedule


@pytest.mark.long
def test_offloaded_presets_place_their_names_in_host_memory():
  """The train step lowered for a GPU moves exactly the offloaded residuals to pinned host memory.

  On the CPU backend nothing is offloaded, by construction of this JAX version: `device_put` to
  another memory kind lowers to nothing for CPU (the annotate_device_placement custom call is only
  emitted for GPU and TPU), and XLA:CPU's `strip-memory-placement-annotations` pass removes such
  annotations anyway. So the check is on the GPU lowering; the CPU step runs (and its gradients
  equal those of `none`, test above) with the residuals in ordinary memory.
  """
  cfg, mesh, tx, schedule = _tiny_step()
  problem = layer_plan.layer_problem(cfg)
  # Of the fused q/k/v projection's names, what attention reads (after RoPE); of the out projection's, the residual
  # sum its GEMM writes: what the backward pass reads, so nothing is rotated or added again.
  expected = {"minimal_offloaded": {remat.ATTENTION_INPUT, remat.ATTENTION_CONTEXT, remat.ATTENTION_RESIDUAL,
                                    remat.MLP_WI},
              # The activation copies: a per-tensor kernel's are made once a step, outside the layers' checkpoints
              # (layers/linear.py's `once_a_step`), no residual.
              "save_quantized_offloaded": {remat.quantized_name(p, "x") for p in ("qkv", "out", "wi", "wo")},
              "save_quantized_x_offloaded": {remat.quantized_name(p, "x") for p in ("qkv", "out", "wi", "wo")}}
  for name, names in expected.items():
    preset = remat.PRESETS[name]
    offloaded = [r for r in layer_plan.trace_layer(problem, preset).residuals if r.offloaded]
    assert {r.name for r in offloaded} == names
    traced = step_plan.trace_train_step(cfg, mesh, tx, schedule, preset)
    gpu_text = traced.lower(lowering_platforms=("cuda",)).as_text()
    # One annotation per offloaded array (data and scales), inside the forward layer scan.
    assert hlo_plan.host_placements(gpu_text) == len(offloaded), name
    assert hlo_plan.host_placements(traced.lower().as_text()) == 0  # CPU: see the docstring.
  kept = step_plan.trace_train_step(cfg, mesh, tx, schedule, remat.PRESETS["save_quantized"])
  assert hlo_plan.host_placements(kept.lower(lowering_platforms=("cuda",)).as_text()) == 0


def test_custom_lists_are_validated():
  cfg = config("tiny", **{"remat.policy": "custom", "remat.save_names": (remat.QUERY,),
                          "remat.offload_names": (remat.QUERY,)})
  with pytest.raises(config_lib.ConfigError, match="config.remat.offload_names: 'query_proj' is also in"):
    config_lib.validate(cfg, 8)
  cfg.remat.offload_names = (remat.quantized_name("wo", "x_t"),)
  config_lib.validate(cfg, 8)
  assert remat.preset(cfg.remat) == remat.Preset(save=(remat.QUERY,), offload=(remat.quantized_name("wo", "x_t"),))


def test_unknown_custom_name_exits_2_with_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "train.py", "--config=configs/default.py:tiny",
                         "--config.remat.policy=custom", "--config.remat.save_names=('query_proj','kv_cache')"],
                        cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith("error: config.remat.save_names: unknown checkpoint name 'kv_cache'; valid names: ")
  assert all(n in lines[0] for n in remat.ALL_NAMES)


def test_minimal_keeps_the_prediction_modules_projection():
  """`minimal` keeps every matmul's output, a multi-token-prediction module's projection too: the module adds one
  layer's recompute to the step, not that layer's and its [embedding; hidden] projection GEMM's."""
  recomputed = {}
  for depth in (0, 1):
    s = start(config(**{"quant.recipe": "bf16", "model.mtp_depth": depth, "train.batch_size": 4}))
    flops = {p: step_plan.step_figures(s.cfg, s.mesh, s.tx, s.schedule, remat.PRESETS[p], compile=False).flops
             for p in ("none", "minimal")}
    recomputed[depth] = flops["minimal"] - flops["none"]
  m, batch = s.cfg.model, s.cfg.train.batch_size
  per_layer = recomputed[0] / m.num_layers
  projection = 2 * batch * m.seq_len * (2 * m.d_model) * m.d_model
  assert per_layer <= recomputed[1] - recomputed[0] < per_layer + projection / 2, (recomputed, projection)
