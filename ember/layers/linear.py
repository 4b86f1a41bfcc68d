"""The one projection module: every matmul with a weight goes through here.

It owns the kernel (logical axes for sharding) and, for delayed scaling, the amax histories of its
operands; the math is `ember.quant.dot.quantized_matmul`, so the recipe decides the format and
the names of the quantized residuals.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ember.names import BATCH, BLOCK, LENGTH, LM_HEAD, PROJECTIONS, RESIDUAL, RNG_STREAMS
from ember.parallel import sharding
from ember.quant import dot, health
from ember.quant.recipe import Recipe
from ember.quant.tensor import QuantizedTensor
from ember.quant.varying import manual_axes


class QuantStats(nnx.Variable):
  """A projection's health-statistics input [3 (x, kernel, grad), health.NUM_STATS] (zeros), present when
  the recipe collects statistics. Not train state: the train step makes it, and its "gradient" is the
  step's statistics (quant/dot.py), read by ember/trainer/quant_stats.py."""


class OutputError(QuantStats):
  """A projection's forward-error input [2] (zeros), present when the recipe asks for it (the precision probe,
  ember/plan/probe.py): its "gradient" is (sum of (y - y_ref)^2, sum of y_ref^2) of the projection's output
  against the float32 product of the same input and kernel (quant/core.py). A QuantStats: it travels with them."""


def output_error_input(recipe: Recipe) -> OutputError | None:
  return OutputError(jnp.zeros((2,), jnp.float32), out_sharding=(None,)) if recipe.quantized and \
      recipe.output_error else None


class QuantState(nnx.Variable):
  """Delayed-scaling amax histories [3 (x, kernel, grad), history_len].

  Part of the train state and of checkpoints. The quantized matmul's custom VJP returns each
  step's updated history as this variable's "gradient"; the train step stores it instead of
  handing it to the optimizer (trainer/step.py).
  """


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Taken:
  """What a projection is handed for one step besides its input and key (`Linear.__call__`'s `taken`): its
  kernel's max|kernel| and quantized copies, made once for the micro-batches of a step (`once_a_step`), so that
  its GEMMs quantize no kernel, nor read the float32 weights for it, in each micro-batch and each remat
  recomputation (quant/dot.py's `kernel_copies`); and in unrolled layers the stacked kernels [L, ...] its kernel is
  row `index` of (`stacked_kernels`), so that a kernel cast of its own reads the layer's kernel where it lies
  (quant/core.py's `KernelRow`). Each module hands its children their own (`handed`), keyed by their path below
  it; the scan over stacked layers hands each layer its row."""
  amax: jax.Array | None = None
  stacked: jax.Array | None = None
  index: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  copies: dict | None = None  # {operand: QuantizedTensor, or an unquantized recipe's cast}, `Linear.kernel_copies`.
  rows: tuple | None = None  # Stacked layers' rows cut apart ahead of a loop (`cut_rows`): each row's Taken.


@dataclasses.dataclass(frozen=True)
class _FlatOutputs:
  """A kernel's output axes as its N is flattened (Linear._flat_outputs): each split axis viewed as [shards, size /
  shards] (`shape`), the view's axes in N's order (`order`: the split axes' shards first), the split axes (`split`)."""
  shape: tuple[int, ...]
  order: tuple[int, ...]
  split: tuple[int, ...]


def once_a_step(model: nnx.Module, remat: bool = True, loop: bool = True) -> dict:
  """{path: Taken(max|kernel|, copies)} of every projection of `model` whose kernel a step quantizes (or, in an
  unquantized recipe under a `loop`, casts) once for all its GEMMs (`Linear.kernel_copies`) or whose recipe takes a
  kernel's amax in a pass of its own (one of each per layer where kernels are stacked). Made outside the gradient: the
  copies' only use is the GEMMs' operands, and each kernel's gradient is its GEMMs' (quant/core.py). `remat`: the
  layers run under a remat policy (the step's `policy.remat`); without, no copies: each GEMM quantizes its kernel once
  a micro-batch, and the forward's gathered copy serves dgrad too (XLA gathers it once for both), where copies made
  ahead are gathered once for each and read a layer's row out of the stacked ones (llama3_8b, 16 micro-batches,
  `none`, h100x8: 12,742 tokens/s/GPU predicted with them, 12,797 without). `loop`: a loop of micro-batches reads them
  (a pipeline's ticks, gradient accumulation)."""
  keep = jax.lax.optimization_barrier if loop else lambda taken: taken
  modules = [(tuple(path), m) for path, m in nnx.iter_graph(model)]
  # A projection whose GEMMs read a view of its kernel this step (attention's kv heads copied over more tensor
  # ranks than they number: layers/attention.py's `viewed_projections`) quantizes the view itself.
  viewed = {path + (name,) for path, m in modules if hasattr(m, "viewed_projections")
            for name in m.viewed_projections()}
  out = {}
  for path, m in modules:
    if isinstance(m, Linear) and m.name != LM_HEAD:  # The head's GEMMs are the loss's, which reads its weight itself.
      amax = m.kernel_amax()
      copies = m.kernel_copies(amax, loop) if remat and path not in viewed else None
      if copies is not None:
        # A barrier keeps the copies made here: XLA sinks a cast of a loop's invariant input into the loop's body
        # (a pipeline stage's ticks, where nothing gathers the kernel first), and quantized it each tick again.
        # Without a loop it would only keep XLA from making each copy where its layer needs it (llama3_8b,
        # unrolled `minimal`, h100x8: 12,740 tokens/s/GPU predicted with it, 12,877 without).
        out[path] = keep(jax.lax.stop_gradient(Taken(amax, copies=copies)))
      elif amax is not None:
        out[path] = Taken(amax)
  return out


def stacked_kernels(blocks: nnx.Module) -> dict:
  """{path: stacked kernel} of the projections of stacked `blocks` whose kernel cast can read a layer's kernel
  where it lies (quant/dot.py's `reads_kernel_in_place`)."""
  return {tuple(path): m.kernel[...] for path, m in nnx.iter_graph(blocks)
          if isinstance(m, Linear) and dot.reads_kernel_in_place(m.recipe, m.quant_stats is not None)}


def _for_the_compiler(spec, mesh) -> jax.sharding.NamedSharding:
  """`spec` (with no manual axis in it) over the axes the compiler places: inside a shard_map, on its abstract
  mesh."""
  return jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh() if manual_axes() else mesh, spec)


def cut_rows(taken: Taken) -> Taken:
  """`taken` of stacked layers with its amaxes and copies cut into each layer's row (`Taken.rows`), here: ahead of a
  loop of micro-batches, once a step rather than in every micro-batch (decoder.py's `rows_cut_ahead`)."""
  leaves = jax.tree.leaves((taken.amax, taken.copies))
  if not leaves:
    return taken
  return Taken(rows=tuple(_row(taken, index) for index in range(leaves[0].shape[0])))


def _row(taken: Taken, index: int) -> Taken:
  if taken.rows is not None:
    return taken.rows[index]
  row = lambda tree: None if tree is None else jax.tree.map(lambda a: a[index], tree)
  return Taken(row(taken.amax), copies=row(taken.copies))


def row_taken(taken: dict | None, stacked: dict, index: int) -> dict:
  """What each projection of stacked layer `index` is handed: its row of `taken`'s amaxes and copies (cut here, or
  ahead: `cut_rows`), and the stacked kernels (`stacked_kernels`) with the row's index."""
  taken = taken or {}
  return {path: dataclasses.replace(_row(taken.get(path, Taken()), index), stacked=stacked.get(path),
                                    index=index if path in stacked else None)
          for path in set(taken) | set(stacked)}


def handed(taken: dict | None, *names) -> dict | None:
  """The part of `taken` ({path: Taken}) for the child at `names` below the module that holds it, keyed by the
  path below that child; None where nothing is handed."""
  if not taken:
    return None
  n = len(names)
  return {path[n:]: t for path, t in taken.items() if path[:n] == names} or None


def projection_key(key: jax.Array | None, name: str) -> jax.Array | None:
  """The stochastic-rounding key of projection kind `name` within a layer's key (see names.RNG_STREAMS)."""
  return None if key is None else jax.random.fold_in(key, RNG_STREAMS[name])


class Linear(nnx.Module):
  """y[..., out] = x[..., in] @ kernel[in, out], with `in`/`out` possibly multi-dimensional.

  `name` is the projection's kind (one of names.PROJECTIONS: it names the quantized residuals and
  picks the stochastic-rounding stream); `recipe` is this instance's recipe, `quant.exclude`
  already applied (Recipe.for_projection).
  """

  def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], axes: Sequence[str | None], *,
               name: str, recipe: Recipe, init_std: float, dtype, param_dtype, rngs: nnx.Rngs):
    assert name in PROJECTIONS, name
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    shape = self.in_shape + self.out_shape
    assert len(axes) == len(shape), (axes, shape)
    kernel = jax.random.normal(rngs.params(), shape, param_dtype) * init_std
    self.kernel = nnx.Param(kernel, out_sharding=tuple(axes))
    self.name, self.dtype, self.recipe, self.axes = name, dtype, recipe, tuple(axes)
    if recipe.delayed:
      self.amax_history = QuantState(jnp.zeros((3, recipe.amax_history_len), jnp.float32), out_sharding=(None, None))
    self.quant_stats = QuantStats(jnp.zeros((3, health.NUM_STATS), jnp.float32), out_sharding=(None, None)) \
        if recipe.quantized and recipe.stats else None
    self.output_error = output_error_input(recipe)

  def __call__(self, x: jax.Array, key: jax.Array | None = None, taken: dict | None = None, view=None,
               prologue=None) -> jax.Array:
    """`taken`: what the step hands this projection ({(): Taken}, `handed` by its module), or None. `view`: a
    function of the kernel giving the one the GEMMs read instead, of the same rank and logical axes and of other
    output sizes (attention's replicated kv heads, layers/attention.py `kv_view`), laid out by those axes; or None.
    `prologue`: x is the source of what the GEMMs read, `prologue.forward(x)` (quant/dot.py; the MLP's SwiGLU on
    its gate/up pair, layers/glu.py), made here first under sequence parallelism (where x's rows are placed before
    they are flattened); or None."""
    mine = (taken or {}).get((), Taken())
    kernel = self.kernel[...]
    if view is not None:
      kernel = sharding.shard(view(kernel), self.axes)
    out_shape = kernel.shape[len(self.in_shape):]
    k, n = math.prod(self.in_shape), math.prod(out_shape)
    read = x.shape if prologue is None else jax.eval_shape(prologue.forward, x).shape
    lead = read[: len(read) - len(self.in_shape)]
    history = self.amax_history[...] if self.recipe.delayed else None
    stats = None if self.quant_stats is None else self.quant_stats[...]
    error = None if self.output_error is None else self.output_error[...]
    row = None
    kernel, flat = self._gemm_kernel(kernel)
    if mine.stacked is not None and flat is None and view is None:
      row = dot.KernelRow(mine.stacked.reshape(-1, k, n), mine.index)
    parallel = self._sequence_parallel_axes(lead)
    if prologue is not None and parallel:
      x, prologue = prologue.forward(x), None
    if parallel and not dot.keeps_rows(self.recipe):
      # Flattened rows: the tokens gathered first, in x's dtype, where the block's input lies (a device's share of
      # several sequences is no block of the flattened rows).
      rules, mesh = sharding.active_rules(), sharding.active_mesh()
      x = sharding.place(x, sharding.logical_to_spec((BATCH, LENGTH) + self.axes[: len(self.in_shape)], rules, mesh))
      parallel = set()
    rows = lead if parallel else (-1,)
    x = x.reshape(rows + ((k,) if prologue is None else x.shape[len(lead):]))
    y = dot.quantized_matmul(x, kernel, recipe=self.recipe, name=self.name,
                             history=history, key=projection_key(key, self.name), dtype=self.dtype, stats=stats,
                             error=error, kernel_amax=mine.amax, wgrad_transposed=self._reduced_along_output(),
                             row_axes=self._row_axes() if len(lead) == 2 else (), kernel_row=row,
                             kernel_sharding=self._gemm_kernel_sharding(flat),
                             row_sharding=self._gemm_row_sharding(parallel),
                             kernel_copies=self._layer_copies(mine.copies) if view is None else None,
                             prologue=prologue)
    if flat is None:
      return self._placed(y.reshape(lead + out_shape), parallel)
    y = self._placed(y.reshape(lead + tuple(flat.shape[i] for i in flat.order)), parallel, flat)
    back = tuple(len(lead) + flat.order.index(i) for i in range(len(flat.order)))
    return jnp.transpose(y, tuple(range(len(lead))) + back).reshape(lead + out_shape)

  @staticmethod
  def _layer_copies(copies: dict | None) -> dict | None:
    """This layer's kernel copies made ahead (`Taken.copies`; of the kernel unviewed), as its GEMMs take them:
    behind a barrier. Read out of the stacked copies (a scan's slice, a pipeline chunk's rows), XLA moved the GEMM's
    dequantizing convert ahead of the slice onto the stacked FP8 copies, where its FP8 GEMM rewrite no longer
    matched it and ran the GEMM in bf16 (tiny, data 2 x tensor 2 x 2 stages of 2 layers: 32 of 48 GEMMs)."""
    return None if copies is None else jax.lax.optimization_barrier(copies)

  def _gemm_kernel(self, kernel: jax.Array) -> "tuple[jax.Array, _FlatOutputs | None]":
    """(the kernel [K, N] as the GEMMs read it, how its output axes were flattened: `_flat_outputs`)."""
    out_shape = kernel.shape[len(self.in_shape):]
    flat = self._flat_outputs(out_shape)
    if flat is not None:
      n_in = len(self.in_shape)
      kernel = jnp.transpose(kernel.reshape(self.in_shape + flat.shape),
                             tuple(range(n_in)) + tuple(n_in + i for i in flat.order))
    return kernel.reshape(math.prod(self.in_shape), math.prod(out_shape)), flat

  def _gemm_kernel_sharding(self, flat: "_FlatOutputs | None"):
    """Where the flattened [K, N] kernel's GEMMs read it: the kernel's own split of its major input and output
    axes, less the axes the tokens are split over (the batch's and the sequence's, over which the kernel is split
    as FSDP splits it: gathered for the GEMM) and the axes already manual; None outside the rules."""
    rules, mesh = sharding.active_rules(), sharding.active_mesh()
    if rules is None or mesh is None:
      return None
    spec = sharding.without_axes(self._kernel_spec(flat), set(sharding.token_axes(rules, mesh)) | set(manual_axes()))
    return _for_the_compiler(spec, mesh)

  def _kernel_spec(self, flat: "_FlatOutputs | None") -> P:
    """The flattened [K, N] kernel's split under the active rules: its major input axis's and major split output
    axis's (`_flat_outputs`)."""
    axes = (self.axes[0], self.axes[len(self.in_shape) + (flat.split[0] if flat else 0)])
    return sharding.logical_to_spec(axes, sharding.active_rules(), sharding.active_mesh())

  def _flat_outputs(self, out_shape) -> "_FlatOutputs | None":
    """How the output axes are flattened into the kernel's N, where their split over the mesh makes a plain
    flattening wrong: N's split must be one run of columns a device, so each split output axis is read as
    [its shards, size / shards] and the shards go first; the rest keep their order. A device's run is then its
    share of every axis in the axes' own order (the [embed, 2, mlp] kernel with mlp split over `tensor` is read as
    [tensor, 2, mlp / tensor]), so a block of a block-scaled recipe along N lies in the gate or the up half, as on
    one device, and on each device the reordering moves nothing. None where only the first axis, or none, is split
    (the kernel is flattened as it is)."""
    rules, mesh, n_in = sharding.active_rules(), sharding.active_mesh(), len(self.in_shape)
    if rules is None or mesh is None or len(out_shape) < 2:
      return None
    spec = sharding.without_axes(sharding.logical_to_spec(self.axes, rules, mesh), manual_axes())[n_in:]
    shards = [math.prod(mesh.shape[a] for a in sharding.entry_axes(e)) for e in spec]
    if all(n == 1 for n in shards[1:]):
      return None
    shape, firsts, rests, split = [], [], [], []
    for i, (size, n) in enumerate(zip(out_shape, shards)):
      if n > 1:
        firsts.append(len(shape))
        shape.append(n)
        split.append(i)
      rests.append(len(shape))
      shape.append(size // n)
    return _FlatOutputs(tuple(shape), tuple(firsts + rests), tuple(split))

  def block_output(self) -> tuple[str, ...]:
    """The logical axes of a block's output that this (row-parallel) projection writes: the residual stream's where
    it keeps its rows (`_sequence_parallel_axes`: its partial sums reduce-scattered onto the split length), else
    the block's, tokens whole (XLA reduces a flattened output whole, and a split there would be a pass more)."""
    return RESIDUAL if dot.keeps_rows(self.recipe) else BLOCK

  def _sequence_parallel_axes(self, lead) -> set[str]:
    """The mesh axes the residual stream's length is split over and the GEMM's tokens are whole on (sequence
    parallelism: `tensor`). Under a per-tensor recipe x [batch, length, ...] then goes to its GEMMs with its rows
    unflattened (quant/dot.py's `keeps_rows`): it is quantized on its share of the tokens, and those axes gather the
    FP8 copy; a row-parallel output is reduce-scattered onto the split length. Empty elsewhere."""
    rules, mesh = sharding.active_rules(), sharding.active_mesh()
    if rules is None or mesh is None or len(lead) != 2:
      return set()
    return sharding.sequence_parallel_axes(rules, mesh) - set(manual_axes())

  def _gemm_row_sharding(self, parallel: set[str]):
    """Where the GEMMs read the rows of x and of its gradient, kept as [batch, length, features]: their tokens whole
    over the sequence-parallel axes, the features left to the compiler; None where the rows are flattened."""
    if not parallel:
      return None
    mesh = sharding.active_mesh()
    batch, length = sharding.without_axes(sharding.token_spec(sharding.active_rules(), mesh), set(manual_axes()))
    return _for_the_compiler(P(batch, length, P.UNCONSTRAINED), mesh)

  def _placed(self, y, parallel: set[str], flat: "_FlatOutputs | None" = None):
    """A column-parallel output (its kernel's output split over the sequence-parallel axes) with its tokens whole
    and its output split as the kernel's: so XLA gathers x for the GEMM, not the kernel (whose output would then
    lie on the tokens' split, and be moved onto the heads' by an all-to-all). `flat`: y's output axes are those of
    the flattened kernel's N (`_flat_outputs`), the split axes' shards first."""
    if not parallel:
      return y
    rules, mesh, n_in = sharding.active_rules(), sharding.active_mesh(), len(self.in_shape)
    out = sharding.only_axes(sharding.logical_to_spec(self.axes[n_in:], rules, mesh), parallel)
    if flat is not None:
      out = P(*(out[i] for i in flat.split), *(None,) * (len(flat.order) - len(flat.split)))
    if all(e is None for e in out):
      return y
    return sharding.place(y, P(*sharding.token_spec(rules, mesh), *out))

  def _row_axes(self) -> tuple[str, ...]:
    """The mesh axes the rows of x [batch, length, ...] are split over under the active rules, in their order;
    none where the length is split too (a device's rows are then no one run of the flattened rows)."""
    rules, mesh = sharding.active_rules(), sharding.active_mesh()
    if rules is None:
      return ()
    batch, length = sharding.logical_to_spec((BATCH, LENGTH), rules, mesh)
    return () if length is not None else sharding.entry_axes(batch)

  def _reduced_along_output(self) -> bool:
    """Whether the kernel's gradient is reduce-scattered along its output axes: under the active rules it is
    sharded along them over a mesh axis the batch is split over (FSDP), and not along its input axes."""
    rules, mesh = sharding.active_rules(), sharding.active_mesh()
    if rules is None:
      return False
    spec = sharding.logical_to_spec(self.axes, rules, mesh)
    batch = set(rules.get(BATCH, ()))
    over = lambda entries: {a for e in entries for a in sharding.entry_axes(e)} & batch
    n_in = len(self.in_shape)
    return bool(over(spec[n_in:])) and not over(spec[:n_in])

  def kernel_copies(self, amax: jax.Array | None, loop: bool = True) -> dict | None:
    """The kernel's quantized copies as `__call__`'s GEMMs read them (quant/dot.py's `kernel_copies`; one per layer
    of a stacked kernel), made from `amax` (`kernel_amax`), or None where the recipe makes none ahead (`loop`: a
    loop of micro-batches reads them, `once_a_step`)."""
    if not dot.takes_kernel_copies(self.recipe, self.quant_stats is not None, loop):
      return None
    history = self.amax_history[...] if self.recipe.delayed else None
    copies = lambda kernel, amax, history: dot.kernel_copies(self._gemm_kernel(kernel)[0], recipe=self.recipe,
                                                             history=history, amax=amax, dtype=self.dtype)
    kernel = self.kernel[...]
    lead = kernel.ndim - len(self.in_shape) - len(self.out_shape)
    for _ in range(lead):
      copies = jax.vmap(copies, in_axes=(0, None if amax is None else 0, None if history is None else 0))
    copies = copies(kernel, amax, history)
    flat = self._flat_outputs(self.out_shape)
    for name, q in copies.items():
      quantized = isinstance(q, QuantizedTensor)  # Else an unquantized recipe's cast, [K, N].
      data = q.data if quantized else q
      spec = None if quantized and q.block else self._copy_spec(flat, data.shape[lead:],
                                                                transposed=quantized and q.axis == 1)
      if spec is not None:
        placed = sharding.place(data, P(*(P.UNCONSTRAINED,) * lead, *spec))
        copies[name] = dataclasses.replace(q, data=placed) if quantized else placed
    return copies

  def _copy_spec(self, flat: "_FlatOutputs | None", shape: tuple[int, int], transposed: bool) -> P | None:
    """Where a copy made ahead (`kernel_copies`: [K, N], or [N, K] `transposed`) lies: split as the
    kernel over its two axes, but over the axes its GEMMs gather it along (FSDP's: the tokens' axes) on its
    major axis, the last split there. An FP8 GEMM reads both operands contraction axis minor, so the forward
    GEMM's copy is [N, K]; gathered along that minor K for every GEMM, XLA gathers along the major axis and
    transposes after, a pass over the whole kernel each time (llama3_70b, tensor 4 x 8 stages: 1 TB a device a
    step). None outside the rules, or where the major axis does not divide."""
    rules, mesh = sharding.active_rules(), sharding.active_mesh()
    if rules is None or mesh is None:
      return None
    k, n = (sharding.entry_axes(e) for e in sharding.without_axes(self._kernel_spec(flat), manual_axes()))
    major, minor = (n, k) if transposed else (k, n)
    gathered = set(sharding.token_axes(rules, mesh))
    major = tuple(major) + tuple(a for a in minor if a in gathered)
    minor = tuple(a for a in minor if a not in gathered)
    if shape[0] % math.prod(mesh.shape[a] for a in major) or shape[1] % math.prod(mesh.shape[a] for a in minor):
      return None
    return sharding.spec_entry(major), sharding.spec_entry(minor)

  def kernel_amax(self) -> jax.Array | None:
    """max|kernel| as `__call__`'s quantizer takes it (one per layer of a stacked kernel), or None where that is
    no pass of its own (quant/dot.py's `takes_kernel_amax`)."""
    if not dot.takes_kernel_amax(self.recipe, self.quant_stats is not None):
      return None
    kernel = self.kernel[...]
    amax = dot.kernel_amax
    for _ in range(kernel.ndim - len(self.in_shape) - len(self.out_shape)):
      amax = jax.vmap(amax)
    return amax(kernel)
