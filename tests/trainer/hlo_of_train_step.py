"""Prints the optimised HLO of the tiny model's train step on 2 CPU devices, without metadata or debug tables,
with canonical names.

  PYTHONPATH=<source tree> python hlo_of_train_step.py RECIPE NUM_EXPERTS

Run against two source trees (this one and an older commit's) by tests/trainer/test_quant_stats.py. Uses only
APIs both trees have."""
import os, re, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from configs import default
from ember import config as config_lib, remat
from ember.parallel.mesh import make_mesh
from ember.parallel.sharding import use_rules
from ember.trainer.optimizer import make_optimizer
from ember.trainer.state import state_shardings
from ember.trainer.step import batch_sharding, jit_train_step
cfg = default.get_config("tiny")
cfg.data.source = "synthetic"; cfg.quant.recipe = sys.argv[1]; cfg.model.num_experts = int(sys.argv[2])
config_lib.validate(cfg, jax.device_count(), 1)
cfg = config_lib.derive(cfg, jax.device_count())
mesh = make_mesh(cfg.mesh)
tx, schedule = make_optimizer(cfg.train)
policy = remat.preset(cfg.remat)
with use_rules(mesh, cfg.mesh.rules):
  graphdef, shardings, abstract = state_shardings(cfg, mesh, tx, policy)
  step = jit_train_step(cfg, mesh, graphdef, tx, schedule, shardings)
  b = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len), jax.numpy.int32, sharding=batch_sharding(cfg, mesh))
  batch = {k: b for k in ("inputs", "targets", "segment_ids", "positions")}
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  text = step.lower(state, batch).compile().as_text()

def without_debug_info(hlo: str) -> str:
  """Drops op metadata (source lines, names of scopes) and the file / stack-frame tables."""
  out, skipping = [], False
  for line in re.sub(r", metadata=\{[^}]*\}", "", hlo).splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      skipping = True
    elif skipping and line.startswith(("%", "ENTRY", "HloModule")):
      skipping = False
    if not skipping:
      out.append(line)
  return "\n".join(out)


def with_canonical_names(hlo: str) -> str:
  """Renames every instruction and computation by its first appearance (%0, %1, ...): XLA's name counters
  depend on how many names tracing made, not on the program."""
  names = {}
  return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%{len(names)}"), hlo)


print(with_canonical_names(without_debug_info(text)))
