"""The layout planner: which mesh, micro-batch and remat preset to run a config with on a target.

A layout is the mesh inside a node (`pipeline`, `fsdp`, `context`, `tensor`, `expert`; their product is the node's
GPUs), the mesh across nodes (`dcn_pipeline`, `dcn_data`, `dcn_fsdp`, `dcn_expert`; their product is the node count),
the micro-batch (`train.grad_accum_steps`) and the remat preset. `layouts` lists every one that applies to the model:
tensor sizes that divide the heads, expert sizes that divide the experts, batch shards that divide the batch, every
micro-batch size, every preset without host offloading (offloading is for when no layout fits; name one in
the config to plan with it). `data` inside a node is never proposed: FSDP over NVLink moves the same bytes
and holds less. Context parallelism (each sequence split over `context` devices of a node, docs/long_context.md) is
planned where no layout of whole sequences compiles within the budget, or where the config sets `mesh.context`:
its layouts hold each device's share of a sequence and run 3/2 of causal attention's work, and each layer gathers
its keys and values over the context devices.

Compiling a layout takes seconds to a minute, so each is first *estimated* (`estimate`) from what can be counted
without compiling: the train state each device holds (its shardings, exact), the activations the preset keeps (one
decoder block traced; plan/layer.py) times the layers and the micro-batch, and the quantized kernel copies it keeps
for a device's share of the layers' kernels, the step's FLOPs with what the preset recomputes, and the bytes each
mesh axis moves per micro-batch (FSDP gathers of the weights in the recipe's format, gradient reductions in
`train.grad_reduce_dtype`, the MoE token exchange in its wire's formats, tensor-parallel activation reductions;
nothing for experts over the axes that split them), at NVLink or NIC bandwidth by whether the axis crosses nodes. Of
the layouts whose estimated peak is within the budget (with `ESTIMATE_SLACK`: the estimate is rough), `top` are
compiled for the target with the compile report's machinery (plan/compile.py), each in a child process
(plan/isolated.py: a compile that aborts its process is a failed candidate with its reason, and the search goes on):
the fastest by estimate of each split of a node in turn (`select`). One whose compiled peak is over the budget is
compiled again with a smaller micro-batch (where there is none, under remat `full`), up to `SMALLER_MICRO_BATCHES`
times. The winner so far is followed by the next fastest by estimate of its split (`_runner_up`), and the winner
then compiled once more with no remat (`none`), the preset whose estimate is least trustworthy (`_without_remat`).
The compiled layouts are ranked by their predicted step (`tokens_per_s_predicted`, ember/program/predict.py: the
scheduled program at the GPU's achievable rates, exposed collectives included) among those whose compiled peak is
within the budget: the winner is never a layout that does not fit, and never predicted slower than another layout
compiled. Each row keeps its roofline ceiling beside the prediction. A candidate is compiled a second time with the
scheduler told its predicted times (ember/program/schedule.py) only where that could still make it beat the best
fitting step so far: its kernels alone take longer than that step otherwise, and its row holds the prediction of XLA's
own schedule.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from ember import config as config_lib
from ember import remat
from ember.config import Settings
from ember.errors import ConfigError, EmberError, one_line
from ember.layers import moe_dispatch
from ember.parallel import pipeline, sharding
from ember.parallel.mesh import make_mesh
from ember.parallel.sharding import entry_axes
from ember.plan import auto_remat, layer
from ember.plan.isolated import compile_report_isolated
from ember.plan.target import Target, run_memory_fraction, targeting
from ember.plan.units import GiB
from ember.quant import dot
from ember.quant.recipe import BF16  # Attention and the LM head run in the compute dtype.
from ember.trainer.optimizer import make_optimizer
from ember.trainer.perf import attention_flops_per_token, forward_flops_per_token, head_flops_per_token
from ember.trainer.state import replica_axes, replica_splits, state_shardings
from ember.xla_flags import user_xla_flags

ESTIMATE_SLACK = 1.15  # A layout is compiled if its estimated peak is within the budget times this.
TOP = 6  # Layouts chosen for compiling by default.
SMALLER_MICRO_BATCHES = 2  # Retries of a chosen layout whose compiled peak is over the budget, micro-batch halved.
NODE_AXES = ("pipeline", "fsdp", "context", "tensor", "expert")  # Sized inside a node.
DCN_AXES = ("pipeline", "data", "fsdp", "expert")  # Sized across nodes.
MESH = ("pipeline", "data", "fsdp", "context", "tensor", "expert")  # The axes a layout sizes.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # The pipeline schedules planned over (ember/parallel/pipeline.py).
MAX_VIRTUAL_STAGES = 8  # The most chunks a stage interleaved 1F1B is planned with.


class NoLayoutFits(ConfigError):
  """Every compiled layout's peak exceeds the budget (the tool exits 1, as the compile tool for a step that does not
  fit). `result`: the plan's report with `best` None, where layouts were compiled (the tool still writes it: the
  compiles of a large model take many minutes)."""

  def __init__(self, message: str, result: dict | None = None):
    super().__init__(message)
    self.result = result


@dataclasses.dataclass(frozen=True)
class Layout:
  node: tuple[tuple[str, int], ...]  # Mesh sizes inside a node: (("pipeline", 1), ("fsdp", 4), ("tensor", 2), ...).
  dcn: tuple[tuple[str, int], ...]  # Node counts along (pipeline, data, fsdp, expert).
  grad_accum_steps: int
  remat: str
  schedule: str = "gpipe"  # pipeline.schedule, where the layout has a pipeline.
  virtual_stages: int = 1  # pipeline.virtual_stages: chunks a stage (interleaved 1F1B).

  def mesh(self) -> dict[str, int]:
    """The whole mesh: each axis's size inside a node times its node count."""
    inside, across = dict(self.node), dict(self.dcn)
    return {a: inside.get(a, 1) * across.get(a, 1) for a in MESH}

  def flags(self) -> list[str]:
    """The command-line flags that lay a config out this way: everything `apply` sets, whatever the config they are
    added to says (an interleaved schedule in it, say, with a layout that has none)."""
    inside, across = dict(self.node), dict(self.dcn)
    out = [f"--config.mesh.{a}={inside.get(a, 1)}" for a in MESH]
    out += [f"--config.mesh.dcn_{a}={across.get(a, 1)}" for a in DCN_AXES]
    out += [f"--config.train.grad_accum_steps={self.grad_accum_steps}", "--config.train.device_batch_size=0",
            f"--config.remat.policy={self.remat}"]
    return out + [f"--config.pipeline.schedule={self.schedule}",
                  f"--config.pipeline.virtual_stages={self.virtual_stages}"]

  def describe(self) -> str:
    """Short form for tables: "node fsdp=4 tensor=2 | nodes data=2 | accum 4 | full" (sizes of 1 left out)."""
    sizes = lambda pairs: " ".join(f"{a}={n}" for a, n in pairs if n > 1) or "-"
    schedule = f" | {self.schedule}" if self.mesh()["pipeline"] > 1 else ""
    schedule += f" x{self.virtual_stages}" if self.virtual_stages > 1 else ""
    return f"node {sizes(self.node)} | nodes {sizes(self.dcn)} | accum {self.grad_accum_steps} | {self.remat}{schedule}"

  def apply(self, cfg: Settings) -> Settings:
    """Validated settings laid out this way, their devices not yet resolved (`config.on_devices` does that)."""
    inside, across = dict(self.node), dict(self.dcn)
    mesh = dataclasses.replace(cfg.mesh, **{a: inside.get(a, 1) for a in MESH},
                               **{f"dcn_{a}": across.get(a, 1) for a in DCN_AXES})
    # The layout's micro-batches are its own, not derived from the mesh.
    train = dataclasses.replace(cfg.train, grad_accum_steps=self.grad_accum_steps, device_batch_size=0)
    return dataclasses.replace(cfg, mesh=mesh, train=train, remat=dataclasses.replace(cfg.remat, policy=self.remat),
                               pipeline=dataclasses.replace(cfg.pipeline, schedule=self.schedule,
                                                            virtual_stages=self.virtual_stages))


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
  """Ordered k-tuples of positive integers whose product is n."""
  if k == 1:
    return [(n,)]
  return [(d, *rest) for d in _divisors(n) for rest in _factorizations(n // d, k - 1)]


def presets(cfg: Settings) -> tuple[str, ...]:
  """The remat presets planned over: `remat.auto_candidates` if set, else every preset `auto` would try that
  moves nothing to host memory."""
  if cfg.remat.auto_candidates:
    return tuple(cfg.remat.auto_candidates)
  return tuple(n for n in auto_remat.candidates(cfg) if not remat.PRESETS[n].offload)


def layouts(settings: Settings, target: Target, context: bool = False) -> list[Layout]:
  """Every layout of the settings' model on the target (see the module doc); each passes config.on_devices. With
  `context`, only those that split each sequence over `context` devices inside a node (context parallelism,
  docs/long_context.md): `plan` asks for them where whole sequences do not fit."""
  m = settings.model
  batch_axes = sharding.batch_axes(settings.mesh.rules_dict)
  per_node, nodes = target.per_node, target.nodes
  out = []
  splits = [(p, t, e, c) for p, t, e, c, _ in _factorizations(per_node, 5) if (p == 1 or nodes == 1)
            and m.tensor_refusal(t) is None and (c > 1) == context
            and (e == 1 or (m.num_experts and m.num_experts % e == 0))]  # A pipeline inside a node on one node only.
  for pipe, tensor, expert, ctx in splits:
    node = (("pipeline", pipe), ("fsdp", per_node // pipe // tensor // expert // ctx), ("context", ctx),
            ("tensor", tensor), ("expert", expert))
    for dp, dd, df, de in _factorizations(nodes, 4):
      if de > 1 and (not m.num_experts or m.num_experts % (expert * de)):
        continue
      schedules = _schedules(pipe * dp, _staged_blocks(settings))
      if not schedules:  # Too much padding for these stages (uneven stages).
        continue
      dcn = (("pipeline", dp), ("data", dd), ("fsdp", df), ("expert", de))
      shards = sharding.shards(batch_axes, Layout(node, dcn, 1, "").mesh())
      if settings.train.batch_size % shards:
        continue
      for accum in _divisors(settings.train.batch_size // shards):
        for preset in presets(settings):
          for schedule, virtual in schedules:
            candidate = Layout(node, dcn, accum, preset, schedule, virtual)
            try:
              config_lib.on_devices(candidate.apply(settings), target.count)
            except ConfigError:
              continue
            out.append(candidate)
  return out


def _staged_blocks(settings: Settings) -> int:
  """The blocks a pipeline's stages run as rows of the staged segment (ModelConfig.staged_segment): its own and those
  stage 0 runs ahead of them in place of as many padding rows (pipeline.staged_rows)."""
  front, staged, _ = settings.model.pipeline_blocks(settings.quant)
  return front + staged


def _schedules(stages: int, blocks: int) -> list[tuple[str, int]]:
  """(schedule, chunks a stage) planned for `stages` pipeline stages of `blocks` blocks: those whose padding rows
  (pipeline.padded_blocks: uneven stages) are at most pipeline.MAX_PADDING of the blocks, as the config allows them."""
  if stages == 1:
    return [("gpipe", 1)]
  few = lambda v: (pipeline.padded_blocks(blocks, stages, v) - blocks <= pipeline.MAX_PADDING * blocks
                   and not pipeline.stage_without_layers(blocks, stages, v))
  chunks = [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if few(v)]
  contiguous = [(s, 1) for s in SCHEDULES if s != "interleaved_1f1b"] if few(1) else []
  return contiguous + [("interleaved_1f1b", v) for v in chunks]


# ----------------------------------------------------------------------------- the quick estimate

@dataclasses.dataclass(frozen=True)
class Estimate:
  seconds: float  # The step: the larger of its GEMM time and its collectives' time.
  compute_s: float
  network_s: float
  peak_bytes: float


@dataclasses.dataclass(frozen=True)
class _Block:
  """What one decoder block costs under a preset (traced once per preset, on one device): activations per sequence
  of the micro-batch, quantized kernel copies per layer whole (a device keeps its shard of them)."""
  residual_bytes: float  # Activations kept from the forward pass to the backward, per layer.
  working_bytes: float  # Every activation the block saves with no remat: live while its backward runs.
  residual_kernel_bytes: float  # Quantized kernel copies kept from the forward pass to the backward, per layer.
  working_kernel_bytes: float  # Every quantized kernel copy the block saves with no remat.
  recompute_fraction: float  # Of the step's GEMM FLOPs, run again in the backward pass.


def _blocks(cfg: Settings, names) -> dict[str, _Block]:
  report = layer.layer_report(cfg, {n: remat.PRESETS[n] for n in (*names, "none")}, batch=1)
  problem = layer.layer_problem(cfg, batch=1)
  forward_gemms = layer.trace_layer(problem, remat.PRESETS["none"]).backward.projection_gemms / 2
  forward_gemms /= problem.layers_per_block
  kernels = lambda n: report[n]["kernel_residual_bytes_per_layer"]
  activations = lambda n: report[n]["residual_bytes_per_layer"] - kernels(n)
  return {n: _Block(activations(n), activations("none"), kernels(n), kernels("none"),
                    report[n]["recomputed_gemms_per_layer"] / (3 * forward_gemms) if forward_gemms else 0.0)
          for n in names}


class Estimator:
  """Quick estimates of layouts of one config on one target (module doc); the train state is worked out once
  per mesh and the decoder block once per preset."""

  def __init__(self, settings: Settings, target: Target):
    self.target = target
    self.settings = settings  # Each layout is applied to them, then resolved on the target's devices.
    self.model = self.settings.model
    self.facts = target.facts
    self.blocks = _blocks(self.settings, presets(self.settings))
    self._state: dict[tuple, tuple[float, float, list, tuple[str, ...], float]] = {}

  def _leaves(self, layout: Layout) -> tuple[float, float, list, tuple[str, ...], float]:
    """(train state bytes per device, parameter bytes per device, [(elements per device, sharded axes, is a
    projection kernel, its optimizer state split over the replicas, a dense projection's kernel)] per parameter, the
    replica axes of a step of micro-batches, the share of the projection kernels' elements a device holds) on the
    layout's mesh."""
    key = (layout.node, layout.dcn, self._rows(layout))  # A pipeline's padding rows are state too.
    if key not in self._state:
      cfg = layout.apply(self.settings).for_devices(self.target.count)
      mesh = make_mesh(cfg.mesh, self.target.devices())
      tx, _ = make_optimizer(cfg)
      _, shardings, abstract = state_shardings(cfg, mesh, tx, platform="gpu")
      replicas = replica_axes(cfg, mesh, "gpu")
      splits = jax.tree.leaves(replica_splits(cfg, mesh, replicas), is_leaf=lambda x: x is None)
      size = lambda a, s: math.prod(s.shard_shape(a.shape))
      state = sum(size(a, s) * a.dtype.itemsize for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))
      leaves, whole_kernels = [], 0
      params_with_paths = jax.tree_util.tree_leaves_with_path(abstract.params)
      for (path, a), s, split in zip(params_with_paths, jax.tree.leaves(shardings.params), splits, strict=True):
        split_over = {x for entry in s.spec for x in entry_axes(entry)}
        projection = a.ndim >= 2 and self.model.vocab_size not in a.shape
        name = jax.tree_util.keystr(path)
        # A dense projection's kernel (layers/linear.py's `Linear`), not the routed experts' (`moe`, whose shared
        # experts are dense), a stacked norm's scale nor the LM head.
        dense = projection and name.endswith("kernel']") and ("moe" not in name or "shared" in name)
        leaves.append((size(a, s), split_over, projection, split is not None, dense))
        whole_kernels += a.size if projection else 0
      params = sum(leaf[0] * 4 for leaf in leaves)
      held = sum(n for n, _, projection, _, _ in leaves if projection) / max(whole_kernels, 1)
      self._state[key] = (state, params, leaves, replicas, held)
    return self._state[key]

  def _copies(self, leaves, layout: Layout) -> float:
    """Bytes a device holds for the kernel copies a step under a remat policy makes once (layers/linear.py's
    `once_a_step`): its share of the dense projections' kernels, once for the forward GEMM and once for dgrad
    (quant/dot.py's `kernel_copies`; one cast for an unquantized recipe), in the recipe's per-element bytes. The
    routed experts' kernels are quantized by their GEMMs; projections `quant.exclude` keeps in bf16 are counted
    as the recipe's (an over-estimate)."""
    recipe = self.settings.quant
    loop = layout.grad_accum_steps > 1 or layout.mesh()["pipeline"] > 1  # A loop of micro-batches reads them.
    if not dot.takes_kernel_copies(recipe, bool(self.settings.log.quant_stats_every), loop):
      return 0.0
    return dot.kernel_copy_count(recipe) * recipe.scheme.weight_bytes * sum(n for n, _, _, _, dense in leaves
                                                                           if dense)

  def _rows(self, layout: Layout) -> int:
    """The layers the busiest stage runs, times the stages: the model's blocks, the staged segment's rows padded to
    the layout's stages x chunks (pipeline.staged_rows; none without a pipeline, whose layouts have one stage of one
    chunk), stage 0 running the segments before them in place of as many padding rows, and the segments after
    them, which the last stage runs beside its rows and every stage waits for, as it waits for the
    multi-token-prediction modules' layers beside the LM head (ModelConfig.pipeline_blocks; trainer/pipelined.py)."""
    stages, m = layout.mesh()["pipeline"], self.model
    front, staged, back = m.pipeline_blocks(self.settings.quant)
    if stages == 1:
      return m.num_blocks * m.block_size
    rows = pipeline.staged_rows(front, staged, stages, layout.virtual_stages)
    return (rows + stages * (back + m.mtp_depth / m.block_size)) * m.block_size

  def _bandwidth(self, layout: Layout, axis: str) -> float:
    crosses = dict(layout.dcn).get(axis, 1) > 1
    return (self.facts.nic_gb_s if crosses else self.facts.nvlink_gb_s) * 1e9

  def estimate(self, layout: Layout) -> Estimate:
    cfg, m, block = self.settings, self.model, self.blocks[layout.remat]
    mesh = layout.mesh()
    n_devices = self.target.count
    batch_axes = sharding.batch_axes(cfg.mesh.rules_dict)
    micro = cfg.train.batch_size // sharding.shards(batch_axes, mesh) // layout.grad_accum_steps
    state, params, leaves, replicas, held = self._leaves(layout)
    # A pipeline (parallel/pipeline.py): each stage runs its share of the layers for every micro-batch and idles
    # its bubble, and keeps what the schedule's forward passes save until their backward passes.
    stages, accum, virtual = mesh["pipeline"], layout.grad_accum_steps, layout.virtual_stages
    if stages == 1:
      iterations, kept = accum, 1  # The micro-batch loop: one micro-batch's activations alive at a time.
    else:  # Micro-batches' worth of time and of kept activations: GPipe every iteration's, 1F1B its chunks in flight.
      iterations = accum / (1 - pipeline.bubble_fraction(accum, stages, layout.schedule, virtual))
      kept = (pipeline.iterations(accum, stages) if layout.schedule == "gpipe"
              else pipeline.ring_slots(accum, stages, virtual)) / virtual
    # Memory: the state, the float32 gradient (and the accumulator of a multi-micro-batch step), the kept
    # activations of every layer and one layer's whole working set, split over `tensor` where heads and MLP
    # units are and over `context` (each device's share of the sequence).
    tensor, context = mesh["tensor"], mesh["context"]
    layers = self._rows(layout)  # The layers run: a pipeline's padding rows run as layers do.
    # One micro-batch's hidden states on a device (context parallelism: its share of each sequence).
    hidden = micro * m.seq_len * m.d_model * m.dtype.itemsize / context
    activations = micro * (kept * layers / stages * block.residual_bytes + 2 * block.working_bytes) / tensor / context
    # The attention's segment bias, made once a micro-batch for every layer (layers/attention.py `attention_bias`) and
    # split over no axis of a sequence's tokens but `context`: [L, L] a sequence whole, the balanced layout's early
    # [L / 2c, L / 2] and late [L / 2c, L] halves a device under context parallelism (131,072 tokens: 32 GiB whole);
    # and its gradient, as large, which cuDNN's attention writes in each layer's backward pass (docs/long_context.md).
    pairs = m.seq_len ** 2 * (0.75 / context if context > 1 else 1.0)
    activations += 2 * micro * pairs * m.dtype.itemsize
    # Kernel copies: a device's share of the layers' parameters, whatever the micro-batch.
    activations += (kept * layers / stages * block.residual_kernel_bytes + block.working_kernel_bytes) * held
    activations += kept * hidden if stages > 1 and layout.schedule == "gpipe" else 0  # Outputs kept for the loss.
    peak = state + params * (2 if layout.grad_accum_steps > 1 else 1) + activations
    peak += self._copies(leaves, layout) if remat.PRESETS[layout.remat].remat else 0.0
    # Compute: the model's FLOPs and the recomputed share; projections at the recipe's GEMM peak, attention and
    # the LM head at bf16's.
    recipe = cfg.quant
    tokens_per_device = cfg.train.batch_size * m.seq_len / n_devices
    attention, head = attention_flops_per_token(m), head_flops_per_token(m)
    projections = forward_flops_per_token(m) - attention - head
    padded = layers / m.num_layers
    projections, attention = projections * padded, attention * padded
    if context > 1:  # The balanced layout's queries meet 3/2 of the keys causal attention needs (parallel/context.py).
      attention *= 1.5
    again = 1 + block.recompute_fraction
    compute = 3 * tokens_per_device * iterations / layout.grad_accum_steps * (
        projections * again / self.facts.peak_flops(recipe.precision)
        + (attention * again + head) / self.facts.peak_flops(BF16))
    # Collectives per micro-batch, and once a step: a step over data- or expert-parallel replicas reduces its
    # gradients across them once (trainer/state.py `replica_axes`; per micro-batch where the recipe's kernels
    # partition themselves).
    passes = 3 if block.recompute_fraction > 0 else 2  # Weight gathers: forward, backward, recompute.
    # The replicas' gradients reduce-scattered once a step by the step's own map (trainer/step.py's `_over_replicas`,
    # the 1F1B schedules); one micro-batch runs as one program over the mesh, and GPipe's transpose sums them whole.
    scatters = layout.grad_accum_steps > 1 if stages == 1 else layout.schedule != "gpipe"
    param_bytes = m.param_dtype.itemsize
    grad_bytes = 2.0 if recipe.wgrad_dtype == "bfloat16" else 4.0
    seconds = once = 0.0
    experts_over = set(sharding.expert_axes(cfg.mesh.rules_dict))
    sequence_axes = sharding.sequence_axes(cfg.mesh.rules_dict)  # Weights split over them are gathered as over FSDP's.
    for elements, split_over, projection, zero, _ in leaves:
      weight_bytes = recipe.scheme.weight_bytes if projection else 2.0
      for a in (*batch_axes, *sequence_axes):
        n = mesh[a]
        if n == 1 or a in split_over & experts_over:  # Each device runs its own experts: nothing moves.
          continue
        if a in split_over:  # Sharded over it: gathered for each pass, its gradient reduce-scattered.
          moved = elements * (n - 1) * (passes * weight_bytes + grad_bytes)
        else:  # Replicated over it: its gradient all-reduced; with its optimizer state split over the
          # replicas (ZeRO-1) the parameters updated in pieces are gathered back, and where the step reduces once
          # over the replicas itself the all-reduce is a reduce-scatter.
          moved = elements * (n - 1) / n * 2 * grad_bytes
          if zero and a in replicas:
            moved = elements * (n - 1) / n * ((grad_bytes if scatters else 2 * grad_bytes) + param_bytes)
          if a in replicas:
            once += moved / self._bandwidth(layout, a)
            continue
        seconds += moved / self._bandwidth(layout, a)
    tokens = micro * m.seq_len
    experts = mesh["expert"]
    if m.num_experts and experts > 1:  # Each routed row out and back, in each pass; the backward's the other way.
      moe_layers = layers // max(m.moe_every, 1)  # A padding row routes its tokens too.
      rows, grads = moe_dispatch.Wire.of(recipe, recipe, ()).bytes_per_element(m.dtype)
      back = m.dtype.itemsize  # The outputs, and the gradients of the copies, in the compute dtype.
      per_element = (passes - 1) * (rows + back) + (grads + back)
      moved = tokens * m.experts_per_token * m.d_model * per_element * (experts - 1) / experts * moe_layers
      seconds += moved / self._bandwidth(layout, "expert")
    if context > 1:  # Each layer gathers its keys and values over the context devices, and scatters their gradients.
      moved = (passes + 1) * micro * m.seq_len * _kv_per_token(m) * m.dtype.itemsize * (context - 1) / context
      seconds += moved * layers / tensor / self._bandwidth(layout, "context")
    if tensor > 1:  # Two activation all-reduces per layer and pass.
      moved = 2 * passes * 2 * tokens * m.d_model * 2 * (tensor - 1) / tensor * layers
      seconds += moved / (self.facts.nvlink_gb_s * 1e9)
    network = seconds * iterations + once
    if stages > 1:  # Hidden states to the next stage and their gradients back (and the LM head's shares).
      transfers = pipeline.stage_transfers(accum, stages, layout.schedule, virtual)
      network += transfers * hidden / self._bandwidth(layout, "pipeline")
    return Estimate(max(compute, network), compute, network, peak)


def _kv_per_token(m) -> int:
  """A token's key and value elements in one layer, as attention reads them (MLA's expanded per head)."""
  heads = m.num_heads if m.is_mla else m.num_kv_heads
  return heads * (m.qk_head_dim + (m.v_head_dim if m.is_mla else m.head_dim))


# ----------------------------------------------------------------------------- the plan

def budget_bytes(target: Target, budget_gb: float | None) -> float:
  if budget_gb:
    return budget_gb * GiB
  if not target.device_memory_bytes:
    raise ConfigError(f"--budget_gb: {target.name} has no known memory size; give a budget")
  return target.device_memory_bytes * run_memory_fraction()


def _row(layout: Layout, est: Estimate, tokens: float) -> dict:
  return {"layout": layout.describe(), "flags": layout.flags(), "mesh": layout.mesh(), "dcn": dict(layout.dcn),
          "grad_accum_steps": layout.grad_accum_steps, "remat_policy": layout.remat,
          "estimate": {"tokens_per_s": tokens / est.seconds, "compute_s": est.compute_s, "network_s": est.network_s,
                       "peak_bytes": int(est.peak_bytes)}}


def _halved(lay: Layout, found: list[Layout]) -> Layout | None:
  """`lay` with the next smaller micro-batch (more accumulation steps), if that is a layout; where there is none,
  `lay` under remat `full` (the least a preset keeps), if that is a layout."""
  same = lambda f: (f.node, f.dcn, f.remat, f.schedule, f.virtual_stages)
  smaller = [f for f in found if same(f) == same(lay) and f.grad_accum_steps > lay.grad_accum_steps]
  fewer = dataclasses.replace(lay, remat="full")
  return min(smaller, key=lambda f: f.grad_accum_steps, default=fewer if fewer in found and fewer != lay else None)


def _split(lay: Layout) -> tuple:
  """A layout's split of a node: its mesh inside a node, and whether it is pipelined across the nodes or not."""
  return lay.node, lay.mesh()["pipeline"] > 1


def _by_estimate(estimates: dict[Layout, Estimate]):
  """The order of layouts within a split (`select`): estimated step, then fewer micro-batches, then peak."""
  return lambda lay: (estimates[lay].seconds, lay.grad_accum_steps, estimates[lay].peak_bytes)


def select(promising: list[Layout], estimates: dict[Layout, Estimate], top: int) -> list[Layout]:
  """The `top` layouts to compile: in rounds, the next fastest by estimate of each split of a node (pipeline x fsdp x
  tensor x expert; pipelined across nodes or not), the splits in the order of their fastest. The estimate counts bytes and FLOPs but cannot see what the
  partitioner makes of a layout (a tensor-parallel split may gather more than it should), so the compiled few
  span the splits instead of being the one split the estimate likes best. Within a split, layouts whose estimates
  tie (a step bound by its GEMMs, whatever its micro-batches) go by their micro-batches, fewest first, then by
  their peak: fewer micro-batches gather the weights fewer times, and a GPU runs a larger micro-batch's kernels
  nearer their rates (llama3_8b on h100x8, FSDP 4 x tensor 2: 8,512 tokens/s/GPU predicted in 2 micro-batches,
  11,208 in one). The estimate's bytes are no tie-break: across nodes it ranks layouts its compiles do not."""
  by_split: dict[tuple, list[Layout]] = {}
  for lay in sorted(promising, key=_by_estimate(estimates)):
    by_split.setdefault(_split(lay), []).append(lay)
  chosen, rank = [], 0
  while len(chosen) < top and any(len(group) > rank for group in by_split.values()):
    chosen += [group[rank] for group in by_split.values() if len(group) > rank][:top - len(chosen)]
    rank += 1
  return chosen


def plan(cfg: Settings, target: Target, *, budget_gb: float | None = None, top: int = TOP,
         log=print) -> dict:
  """Estimates every layout, compiles the `top` most promising within the budget, ranks them (module doc): layouts
  of whole sequences (and context-parallel ones where the config sets `mesh.context`), then, where none of those
  compiled within the budget, context-parallel ones. Raises NoLayoutFits if no compiled layout fits."""
  if not target.is_gpu:
    raise ConfigError(f"--target: the planner needs a GPU target (e.g. h100x8), got {target.name}")
  budget = budget_bytes(target, budget_gb)
  tokens = cfg.train.batch_size * cfg.model.seq_len / target.count
  with targeting(target):
    estimator = Estimator(cfg, target)
  rounds = [(False, True)] if cfg.mesh.context > 1 else [(False,), (True,)]
  found, estimates, promising, compiled = [], {}, [], {}

  def compile_one(lay: Layout) -> dict:
    row = _row(lay, estimates[lay], tokens)
    # The best fitting step so far: a candidate no schedule of whose kernels could beat it is compiled once.
    best_s = min((r["predicted_step_s"] for r in compiled.values() if r.get("fits")), default=None)
    try:
      r = compile_report_isolated(lay.apply(cfg), target, beat_s=best_s)
    except EmberError as e:
      row.update(error=one_line(e))
      log(f"plan: {lay.describe()}: {one_line(e)}")
      return row
    row.update(tokens_per_s_predicted=r["tokens_per_s_predicted"], mfu_predicted=r["mfu_predicted"],
               predicted_step_s=r["predicted_step_s"], exposed_collectives_s=exposed_collectives(r["time_by_op"]),
               tokens_per_s_ceiling=r["tokens_per_s_ceiling"], mfu_ceiling=r["mfu_ceiling"],
               time_floor_s=r["time_floor_s"], time_floor_parts_s=r["time_floor_parts_s"],
               peak_bytes=int(r["peak_bytes"]), fits=r["peak_bytes"] <= budget)
    log(f"plan: {row['tokens_per_s_predicted']:10,.0f} tokens/s/GPU predicted ({row['tokens_per_s_ceiling']:,.0f} "
        f"ceiling), peak {row['peak_bytes'] / GiB:6.1f} GiB{'' if row['fits'] else ' (over budget)'}: {lay.describe()}")
    return row

  fitting = []
  for contexts in rounds:
    if fitting:
      break
    with targeting(target):
      more = [lay for context in contexts for lay in layouts(cfg, target, context)]
      estimates.update({lay: estimator.estimate(lay) for lay in more})
    found += more
    hopeful = [lay for lay in more if estimates[lay].peak_bytes <= budget * ESTIMATE_SLACK]
    promising += hopeful
    chosen = select(hopeful, estimates, top)
    kind = "context-parallel layouts" if contexts == (True,) else "layouts"
    log(f"plan: {len(more)} {kind} of {cfg.model.name} on {target.name}, {len(hopeful)} estimated within "
        f"{budget / GiB:.1f} GiB; compiling {len(chosen)}, the fastest by estimate of each split of a node")
    for lay in chosen:
      compiled[lay] = row = compile_one(lay)
      for _ in range(SMALLER_MICRO_BATCHES):  # Over the budget: half the micro-batch (or remat full).
        if row.get("fits", True) or (lay := _halved(lay, found)) is None or lay in compiled:
          break
        compiled[lay] = row = compile_one(lay)
    ranked = _ranked(compiled.values())
    fitting = [r for r in ranked if r["fits"]]
    # Two more compiles, each from the winner so far: its split's runner-up, then the winner with no remat.
    for follow_up in (lambda lay: _runner_up(lay, compiled, promising, estimates),
                      lambda lay: _without_remat(lay, compiled, found)):
      if not fitting:
        break
      if (extra := follow_up(next(lay for lay, row in compiled.items() if row is fitting[0]))) is not None:
        compiled[extra] = compile_one(extra)
        ranked = _ranked(compiled.values())
        fitting = [r for r in ranked if r["fits"]]
  if not found:
    raise ConfigError(f"--target: no layout of {cfg.model.name} divides batch {cfg.train.batch_size} over "
                      f"{target.count} GPUs")
  if not compiled:
    smallest = min(e.peak_bytes for e in estimates.values())
    raise NoLayoutFits(f"--budget_gb: no layout is estimated within {budget / GiB:.1f} GiB per device; the smallest "
                       f"estimate is {smallest / GiB:.1f} GiB")
  result = {"model": cfg.model.name, "target": target.name, "recipe": cfg.quant.name,
            "batch_size": cfg.train.batch_size, "seq_len": cfg.model.seq_len, "budget_bytes": int(budget),
            "layouts": len(found), "within_estimate": len(promising), "best": fitting[0] if fitting else None,
            "xla_flags": user_xla_flags(os.environ.get("XLA_FLAGS", "")),
            "candidates": ranked + [r for r in compiled.values() if "fits" not in r]}
  if not ranked:  # Not one compiled: the budget is not the reason.
    first = next(r["error"] for r in compiled.values())
    raise NoLayoutFits(f"--target: none of the {len(compiled)} layouts compiled; the first: {first}", result)
  if not fitting:
    smallest = min((r["peak_bytes"] for r in ranked), default=None)
    raise NoLayoutFits(f"--budget_gb: no layout compiled within {budget / GiB:.1f} GiB per device" +
                       (f"; the smallest compiled peak is {smallest / GiB:.1f} GiB" if smallest else ""), result)
  return result


def _ranked(rows) -> list[dict]:
  """The compiled rows, those within the budget first, each group by predicted tokens/s."""
  return sorted((r for r in rows if "fits" in r), key=lambda r: (not r["fits"], -r["tokens_per_s_predicted"]))


def exposed_collectives(time_by_op: list[dict]) -> float:
  """Seconds a step waits for its collectives (the prediction's exposed collective rows)."""
  return sum(t["seconds"] for t in time_by_op if t["kind"] == "collective" and t["exposed"])


def _runner_up(best: Layout, compiled: dict, promising: list[Layout], estimates: dict) -> Layout | None:
  """The fastest by estimate of the winning layout's split of a node (`select`) that was not compiled, if any.
  Within a split the estimate ranks close layouts the compiles do not, and a split's first pick over the budget
  spends its retries on its own mesh: llama3_70b on h100x64 picked FSDP 8 x 4 stages x data 2 across the nodes
  under `save_qkv_proj` (78.9 GiB compiled, 70.6 estimated) and fell back to it under `full` (1,284 tokens/s/GPU
  predicted), where the split's next, FSDP 8 x 8 stages under `save_qkv_proj`, fits at 67.5 GiB (1,379)."""
  rest = [f for f in promising if _split(f) == _split(best) and f not in compiled]
  return min(rest, key=_by_estimate(estimates), default=None)


def _without_remat(best: Layout, compiled: dict, found: list[Layout]) -> Layout | None:
  """The winning layout with no remat (`none`), if it is a layout and was not compiled. Its estimate is the one
  the planner trusts least: it counts every residual the traced step saves, and the compiled step keeps far fewer
  (XLA fuses the elementwise ones into the backward pass's kernels), so a step without checkpoints, the fastest
  when it fits, often fits where its estimate says it cannot (llama3_8b on h100x8 at one sequence per GPU:
  estimated 92 GiB, compiled 54.9). One more compile settles it."""
  bare = dataclasses.replace(best, remat="none")
  return bare if bare in found and bare not in compiled else None
