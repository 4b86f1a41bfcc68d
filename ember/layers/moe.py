"""Mixture of experts: a float32 top-k router, dropless dispatch by sorting, grouped quantized SwiGLU
experts, an optional shared expert, and expert parallelism over the `expert` mesh axis.

Per token shard (the whole batch without a mesh):
  1. route: logits = x @ router in float32; top-k of the logits and a softmax over those k, or
     (`router_softmax_first`) a softmax over all experts, top-k, renormalised. Padding tokens
     (segment id 0) are not dispatched at all and count in no statistic. The choices are named
     `remat.MOE_ROUTING`, so a remat policy that keeps rows in routing order keeps them too;
  2. with `capacity_factor > 0`, each expert keeps at most ceil(factor * tokens * k / experts)
     copies per token shard, first choices of all tokens before second choices, earlier tokens
     first; the rest are dropped (counted in `moe_dropped_tokens`). 0 = dropless;
  3. dispatch: token copies are stably sorted by expert (so within an expert they keep token order),
     run through `quant/grouped.py`'s grouped matmuls with per-expert group sizes, gathered back and
     summed with their routing weights. The gathers are written so that both directions of autodiff
     are gathers (no scatter-add with colliding indices: deterministic on GPUs too).

Expert parallelism (a mesh whose `expert` axis has size n > 1): inside `jax.shard_map` every device
holds a slice of the tokens (batch -> data, fsdp, expert) and E/n experts. `model.moe_dispatch` picks
how copies reach their experts' devices: all-gather / reduce-scatter over the expert axis, fixed
all-to-all buffers, or `ragged_all_to_all` of the routed copies alone (ember/layers/moe_dispatch.py,
which says what each costs). Expert weights enter the shard_map sharded over `expert` and, when their
recipe quantizes them, over the axes of their `embed` dim (FSDP): each device quantizes its shard (amaxes
reduced over the shard axes), the GEMMs gather the quantized copies (FP8, or E2M1 with its scales: a
quarter or less of the float32 bytes), and the weight gradient is reduce-scattered back (quant/grouped.py,
`gathered`). Other shards (bf16 experts, a `tensor`-sharded `mlp` dim) are all-gathered in float32 at the
boundary and their gradients reduced there. Per-tensor amaxes of activations and gradients are pmax-ed over the token
axes (`reduce_axes`), so every shard quantizes with the global scale, as on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ember import remat
from ember.config.model import ModelConfig
from ember.layers import moe_dispatch
from ember.layers.linear import QuantState, QuantStats, handed, output_error_input, projection_key
from ember.layers.mlp import MLP
from ember.names import (BATCH, BLOCK, EMBED, EXPERT, GATE, LENGTH, MLP as MLP_AXIS, MOE_DROPPED_TOKENS,
                         MOE_EXPERT_LOADS, MOE_LOAD_BALANCE_LOSS, MOE_OVERFLOW_TOKENS, MOE_ROUTED_TOKENS, MOE_ROUTER_Z_LOSS,
                         MOE_SEQ_BALANCE_LOSS, PROJECTIONS)
from ember.parallel import sharding
from ember.quant import health
from ember.quant.batched import batched_matmul
from ember.quant.grouped import grouped_matmul, starts
from ember.quant.recipe import Recipe
from ember.quant.varying import cotangent_once, first_along, manual_axes

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Options:
  """The static facts of one MoE layer (hashable: closed over by shard_map and custom VJPs)."""
  num_experts: int
  k: int
  softmax_first: bool
  dtype: jnp.dtype
  wi_recipe: Recipe
  wo_recipe: Recipe
  score: str = "softmax"  # model.router_score: "softmax" or "sigmoid" (DeepSeek-V3).
  n_group: int = 1  # Group-limited routing: the k experts come from the best `topk_group` of `n_group` groups.
  topk_group: int = 1
  scale: float = 1.0  # model.routed_scaling_factor.
  seq_balance: bool = False  # Take the sequence-wise balance loss (model.seq_load_balance_weight > 0).
  norm_topk: bool = True  # model.norm_topk_prob: softmax-first or sigmoid weights renormalised over the top-k.


class ExpertKernel(nnx.Module):
  """The stacked kernels of one expert projection [experts, in..., out...] and, for delayed scaling,
  amax histories [experts + 2, H]: the input's, one per expert kernel, the gradient's (the dense
  layout [3, H] with one kernel row per expert)."""

  def __init__(self, shape, axes, *, name: str, recipe: Recipe, init_std: float, param_dtype, rngs: nnx.Rngs):
    assert name in PROJECTIONS, name
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), shape, param_dtype) * init_std, out_sharding=tuple(axes))
    self.name, self.recipe = name, recipe
    if self.recipe.delayed:
      self.amax_history = QuantState(jnp.zeros((shape[0] + 2, self.recipe.amax_history_len), F32),
                                     out_sharding=(None, None))
    # The histories' layout, one row of STATS each.
    self.quant_stats = QuantStats(jnp.zeros((shape[0] + 2, health.NUM_STATS), F32), out_sharding=(None, None)) \
        if self.recipe.quantized and self.recipe.stats else None
    self.output_error = output_error_input(self.recipe)

  def history(self):
    """(x [H], kernels [E, H], grad [H]) for `grouped_matmul`, or None."""
    if not self.recipe.delayed:
      return None
    h = self.amax_history[...]
    return h[0], h[1:-1], h[-1]

  def stats(self):
    """(x [S], kernels [E, S], grad [S]) health-statistics inputs for `grouped_matmul`, or None."""
    if self.quant_stats is None:
      return None
    s = self.quant_stats[...]
    return s[0], s[1:-1], s[-1]

  def error(self):
    """The forward-error input [2] for `grouped_matmul` (layers/linear.py's OutputError), or None."""
    return None if self.output_error is None else self.output_error[...]


ROUTER_BIAS = "router_bias"  # The MoE module's attribute that holds it: its leaves' key in the train state.
WI, WO = "moe_wi", "moe_wo"  # The expert projections' names (ember.names.LAYER_PROJECTIONS).


class RouterBias(QuantState):
  """The DeepSeek-V3 expert bias [experts] (`model.router_bias_update_rate` > 0): added to the routing scores for
  the top-k choice only, never to the combine weights. Not trained by gradients: the train step moves it once
  per optimizer step from the step's per-expert loads (trainer/step.py, `update_router_biases`). It is model
  state kept with the amax histories (a QuantState): in the train state, checkpointed and resumed exactly."""


class MoE(nnx.Module):
  def __init__(self, model: ModelConfig, *, recipe: Recipe, layer: int, rngs: nnx.Rngs):
    e, d, f = model.num_experts, model.d_model, model.d_ff
    # Replicated over experts: every token shard needs the whole router.
    self.router = nnx.Param(jax.random.normal(rngs.params(), (d, e), model.param_dtype) * model.init_std,
                            out_sharding=(EMBED, None))
    common = dict(param_dtype=model.param_dtype, rngs=rngs)
    recipe_of = lambda name: recipe.for_projection(name, layer, model.num_layers)  # `quant.exclude` applied.
    self.wi = ExpertKernel((e, d, 2, f), (EXPERT, EMBED, GATE, MLP_AXIS), name=WI, recipe=recipe_of(WI),
                           init_std=model.init_std, **common)
    self.wo = ExpertKernel((e, f, d), (EXPERT, MLP_AXIS, EMBED), name=WO, recipe=recipe_of(WO),
                           init_std=model.out_init_std, **common)
    self.shared = MLP(model, model.shared_d_ff, recipe=recipe, layer=layer, rngs=rngs,
                      names=("shared_wi", "shared_wo")) if model.shared_d_ff else None
    self.options = Options(e, model.experts_per_token, model.router_softmax_first, model.dtype, self.wi.recipe,
                           self.wo.recipe, model.router_score, model.n_group, model.topk_group,
                           model.routed_scaling_factor, model.seq_load_balance_weight > 0, model.norm_topk_prob)
    self.model = model  # What the MoE plan reads (layers/moe_dispatch.py: exchange, expert GEMMs, buffers).
    # Replicated like the router.
    self.router_bias = RouterBias(jnp.zeros((e,), F32), out_sharding=(None,)) if model.router_bias_update_rate \
        else None

  def __call__(self, x_BxLxD, segment_ids_BxL, key=None, plan: moe_dispatch.Plan | None = None, taken=None):
    """(y [B, L, D], aux): aux holds names.AUX_KEYS as float32 scalars and MOE_EXPERT_LOADS, the copies routed
    to each expert [experts]. `plan`: what the layer runs, as its step decided it (trainer/step.py's `moe_plan`);
    without one (sampling, a layer called alone) the plan of this batch on the active mesh, whose buffers hold every
    copy (`no_overflow`). `taken`: what the step hands the shared experts' projections (layers/linear.py's `Taken`,
    by path), or None."""
    keys = None if key is None else (projection_key(key, WI), projection_key(key, WO))
    histories = (self.wi.history(), self.wo.history())
    stats = (self.wi.stats(), self.wo.stats())
    errors = (self.wi.error(), self.wo.error())
    if plan is None:
      plan = moe_dispatch.plan(self.model, sharding.active_mesh(), sharding.active_rules(), batch=x_BxLxD.shape[:2],
                               no_overflow=True)
    bias = None if self.router_bias is None else self.router_bias[...]
    y_BxLxD, aux = moe_ffn(x_BxLxD, segment_ids_BxL, self.router[...], self.wi.kernel[...], self.wo.kernel[...],
                           histories, keys, self.options, plan, stats, bias, errors)
    if self.shared is not None:
      y_BxLxD = y_BxLxD + self.shared(x_BxLxD, key, handed(taken, "shared"))
    return sharding.shard(y_BxLxD, BLOCK), aux


# ----------------------------------------------------------------------------- sharding

def moe_ffn(x_BxLxD, segment_ids_BxL, router_DxE, wi_ExDx2xF, wo_ExFxD, histories, keys, opts: Options,
            plan: moe_dispatch.Plan, stats=(None, None), bias_E=None, errors=(None, None)):
  """The routed experts of one layer as `plan` says: locally without a mesh, else inside shard_map (see module
  doc). `bias_E`: the router bias (RouterBias), or None; `errors`: the expert projections' forward-error inputs
  (layers/linear.py's OutputError) or Nones."""
  mesh, rules = sharding.active_mesh(), sharding.active_rules()
  if mesh is None or mesh.size == 1:
    return _experts(x_BxLxD, segment_ids_BxL, router_DxE, wi_ExDx2xF, wo_ExFxD, histories, keys, stats, bias_E,
                    errors, opts=opts, plan=plan, token_axes=())
  x_spec = sharding.logical_to_spec((BATCH, LENGTH, None), rules, mesh)
  token_axes = sharding.token_axes(rules, mesh)
  e_spec = sharding.logical_to_spec((EXPERT,), rules, mesh)[0]
  expert_axes = plan.expert_axes
  if not set(expert_axes) <= set(token_axes):
    raise ValueError(f"expert parallelism over {expert_axes} needs the batch sharded over it too (mesh.rules "
                     f"'batch' -> ...{expert_axes}); tokens are sharded over {token_axes}")
  if opts.num_experts % plan.expert_parallel:
    raise ValueError(f"{opts.num_experts} experts do not split over an expert axis of {plan.expert_parallel} devices")
  # Histories and statistics: (x, kernels, grad); the kernels' rows go with their experts.
  specs_of = lambda trees: tuple(None if t is None else (P(), P(e_spec, None), P()) for t in trees)
  d_spec = _embed_shards(wi_ExDx2xF.shape[1], opts, mesh, rules, expert_axes)
  body = functools.partial(_experts, opts=opts, plan=plan, token_axes=token_axes,
                           embed_axes=sharding.entry_axes(d_spec),
                           sequence_axes=tuple(a for a in sharding.sequence_axes(rules) if mesh.shape[a] > 1))
  outer = manual_axes()
  if outer:  # Inside a step's shard_map over its replicas (trainer/step.py): this one does not check replication.
    body = _global_cotangents_once(body, tuple(a for a in mesh.axis_names if a not in outer),
                                   sharding.entry_axes(e_spec))
    split = tuple(a for a in expert_axes if a in outer)
    if split:  # The kernels came in as this device's experts alone: so do their histories' and statistics' rows.
      rows = opts.num_experts // math.prod(mesh.shape[a] for a in split)
      own = lambda trees: tuple(None if t is None else (t[0], _own_rows(t[1], split, rows), t[2]) for t in trees)
      histories, stats = own(histories), own(stats)
  fn = sharding.shard_map(body, mesh=mesh,
                          in_specs=(x_spec, P(*x_spec[:2]), P(), P(e_spec, d_spec), P(e_spec, None, d_spec),
                                    specs_of(histories), None if keys is None else (P(), P()), specs_of(stats),
                                    None if bias_E is None else P(), tuple(None if e is None else P() for e in errors)),
                          out_specs=(x_spec, P()))
  return fn(x_BxLxD, segment_ids_BxL, router_DxE, wi_ExDx2xF, wo_ExFxD, histories, keys, stats, bias_E, errors)


def _global_cotangents_once(body, axes: tuple[str, ...], expert_axes: tuple[str, ...]):
  """`body` with its histories' and statistics' cotangents passed back once along the shard_map's `axes`
  (`cotangent_once`: they are global values, not partial sums); a kernel's, split over `expert_axes`, once
  along the others."""
  kernel_axes = tuple(a for a in axes if a not in expert_axes)
  once = lambda trees: tuple(None if t is None else (cotangent_once(t[0], axes), cotangent_once(t[1], kernel_axes),
                                                     cotangent_once(t[2], axes)) for t in trees)

  def wrapped(x, segment_ids, router, wi, wo, histories, keys, stats, bias, errors):
    return body(x, segment_ids, router, wi, wo, once(histories), keys, once(stats), bias, errors)

  return wrapped


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _own_rows(a_ExS, axes: tuple[str, ...], rows: int):
  """The rows of this device's experts (`rows` of them, split over the shard_map `axes`) of a per-expert
  history or statistic. Its "cotangent" is the whole [E, S] on every device (all-gathered), the same value
  everywhere as the step takes it (trainer/step.py)."""
  return jax.lax.dynamic_slice_in_dim(a_ExS, jax.lax.axis_index(axes) * rows, rows)


def _own_rows_fwd(a_ExS, axes, rows):
  return _own_rows(a_ExS, axes, rows), None


def _own_rows_bwd(axes, rows, _, ct):
  return (jax.lax.all_gather(ct, axes, axis=0, tiled=True),)


_own_rows.defvjp(_own_rows_fwd, _own_rows_bwd)


def _embed_shards(d: int, opts: Options, mesh, rules, expert_axes):
  """The mesh axes the expert kernels' `embed` dim stays sharded over inside the shard_map (a PartitionSpec
  entry), or None: gathered whole at the boundary. Sharded when both kernels are quantized and a shard holds
  whole scaling blocks (every real model: d_model / fsdp is a multiple of 32)."""
  embed = sharding.entry_axes(sharding.logical_to_spec((EMBED,), rules, mesh)[0])
  axes = tuple(a for a in embed if a not in expert_axes)
  size = math.prod(mesh.shape[a] for a in axes)
  recipes = (opts.wi_recipe, opts.wo_recipe)
  if size == 1 or not all(r.quantized for r in recipes) or d % size or (d // size) % max(r.block_size for r in recipes):
    return None
  return axes[0] if len(axes) == 1 else axes


# ----------------------------------------------------------------------------- one token shard

def _experts(x_BxLxD, segment_ids_BxL, router_DxE, wi_ExDx2xF, wo_ExFxD, histories, keys, stats, bias_E, errors,
             *, opts: Options, plan: moe_dispatch.Plan, token_axes, embed_axes=(), sequence_axes=()):
  b, l, d = x_BxLxD.shape
  t = b * l
  assert t == plan.tokens, (t, plan)  # The token shard the plan was made for.
  expert_axes = plan.expert_axes
  x_TxD = x_BxLxD.reshape(t, d)
  valid_T = segment_ids_BxL.reshape(t) > 0
  logits_TxE, probs_TxE, weights_TxK, experts_TxK = route(x_TxD, router_DxE, opts, bias_E)
  keep_TxK = keep_mask(experts_TxK, valid_T, opts.num_experts, plan.capacity)
  aux = aux_losses(logits_TxE, probs_TxE, experts_TxK, keep_TxK, valid_T, opts.num_experts, token_axes)
  aux[MOE_SEQ_BALANCE_LOSS] = sequence_balance_loss(probs_TxE.reshape(b, l, -1), experts_TxK.reshape(b, l, -1),
                                                    valid_T.reshape(b, l), token_axes, sequence_axes) \
      if opts.seq_balance else jnp.zeros((), F32)

  if keys is not None and token_axes:  # Distinct stochastic-rounding noise on every token shard.
    keys = tuple(jax.random.fold_in(key, jax.lax.axis_index(token_axes)) for key in keys)
  assert wi_ExDx2xF.shape[0] == plan.num_local, (wi_ExDx2xF.shape, plan)
  ffn = functools.partial(_swiglu, wi_ExDx2xF=wi_ExDx2xF, wo_ExFxD=wo_ExFxD, histories=histories, keys=keys,
                          stats=stats, errors=errors, opts=opts, token_axes=token_axes, embed_axes=embed_axes,
                          slots=plan.slots if plan.expert_gemm == moe_dispatch.CAPACITY else None)
  dispatch = plan.exchange
  if dispatch in (moe_dispatch.LOCAL, moe_dispatch.ALLGATHER):
    y_TxKxD, overflow = _allgather_experts(x_TxD, experts_TxK, keep_TxK, ffn, plan)
    weights_TxK = jax.lax.all_gather(weights_TxK, expert_axes, axis=0, tiled=True) if expert_axes else weights_TxK
  else:
    wire = moe_dispatch.Wire.of(opts.wi_recipe, opts.wo_recipe, token_axes, WI)  # The expert GEMMs' amax axes.
    health, stats = _measured_on_the_wire(stats, wire)
    y_TxKxD, overflow = _exchanged_experts(x_TxD, experts_TxK, keep_TxK, functools.partial(ffn, stats=stats), plan,
                                           wire, health)
  aux[MOE_OVERFLOW_TOKENS] = jax.lax.psum(jnp.asarray(overflow, F32), token_axes) if token_axes else \
      jnp.asarray(overflow, F32)
  y_TxKxD = checkpoint_name(y_TxKxD, remat.MOE_COMBINE)
  out_TxD = jnp.einsum("tk,tkd->td", weights_TxK, y_TxKxD.astype(F32)).astype(opts.dtype)
  if dispatch == moe_dispatch.ALLGATHER:
    out_TxD = jax.lax.psum_scatter(out_TxD, expert_axes, scatter_dimension=0, tiled=True)
  return out_TxD.reshape(b, l, d), aux


def _allgather_experts(x_TxD, experts_TxK, keep_TxK, ffn, plan: moe_dispatch.Plan):
  """Each device gathers its expert group's tokens and computes the copies bound for its own experts:
  ([n * T, k, D] outputs (zero for copies computed elsewhere), reduce-scattered by the caller; the copies
  the expert GEMMs' slots did not hold)."""
  k, d = experts_TxK.shape[1], x_TxD.shape[1]
  first = 0
  if plan.expert_axes:
    gather = lambda a: jax.lax.all_gather(a, plan.expert_axes, axis=0, tiled=True)
    x_TxD, experts_TxK, keep_TxK = map(gather, (x_TxD, experts_TxK, keep_TxK))
    first = jax.lax.axis_index(plan.expert_axes) * plan.num_local
  sort = dispatch_plan(experts_TxK - first, keep_TxK, plan.num_local, plan.rows)
  xs_RxD = take_rows(x_TxD, sort.token_of_row, sort.row_of_copy)
  y_RxD, overflow = ffn(xs_RxD, sort.group_sizes)
  return take_rows(y_RxD, sort.row_of_copy.reshape(-1), sort.copy_of_row[:, None]).reshape(-1, k, d), overflow


def _measured_on_the_wire(stats, wire: moe_dispatch.Wire):
  """(the health inputs of the wire's (dispatch, combine): wi's activation row and wo's gradient row where the wire
  quantizes them, else None; the expert GEMMs' `stats` with a throwaway input in their place). Over a quantizing
  wire the GEMMs see only what arrives: a value flushed to zero on the way no longer counts as nonzero there, so its
  underflow went unmeasured; the wire measures what it quantizes, which is what the GEMM would."""
  wi, wo = stats if stats is not None else (None, None)
  x = wi[0] if wi is not None and wire.rows is not None else None
  grad = wo[-1] if wo is not None and wire.grads is not None else None
  wi = wi if x is None else (jnp.zeros_like(x), *wi[1:])
  wo = wo if grad is None else (*wo[:-1], jnp.zeros_like(grad))
  return (x, grad), (None if stats is None else (wi, wo))


def _exchanged_experts(x_TxD, experts_TxK, keep_TxK, ffn, plan: moe_dispatch.Plan, wire: moe_dispatch.Wire,
                       health=(None, None)):
  """The copies of this token shard sent to their experts' devices and back (alltoall or ragged) over `wire`
  (`health`: its (dispatch, combine) health inputs, `_measured_on_the_wire`): ([T, k, D] outputs, copies that
  overflowed the ragged receive buffer)."""
  t, k = experts_TxK.shape
  d = x_TxD.shape[1]
  num_experts = plan.expert_parallel * plan.num_local
  sort = dispatch_plan(experts_TxK, keep_TxK, num_experts, t * k)  # By global expert: destination-major.
  xs_CxD = take_rows(x_TxD, sort.token_of_row, sort.row_of_copy)
  if plan.exchange == moe_dispatch.ALLTOALL:
    expert_C = jnp.take(experts_TxK.reshape(-1), sort.copy_of_row, mode="fill", fill_value=num_experts)
    ys_CxD, overflow = moe_dispatch.alltoall(xs_CxD, expert_C, sort.group_sizes, num_local=plan.num_local,
                                             slots=plan.buffer, axes=plan.expert_axes, ffn=ffn, wire=wire,
                                             health=health)
  else:
    ys_CxD, overflow = moe_dispatch.ragged(xs_CxD, sort.group_sizes, num_local=plan.num_local,
                                           buffer_rows=plan.buffer, axes=plan.expert_axes, ffn=ffn, wire=wire,
                                           health=health)
  y_TxKxD = take_rows(ys_CxD, sort.row_of_copy.reshape(-1), sort.copy_of_row[:, None]).reshape(t, k, d)
  return y_TxKxD, overflow


def _swiglu(xs_RxD, group_sizes_E, *, wi_ExDx2xF, wo_ExFxD, histories, keys, stats, errors, opts: Options,
            token_axes, embed_axes=(), slots=None):
  """The local experts' SwiGLU on rows sorted by expert: (outputs [R, D], copies not computed). `slots`
  (C, the plan's rows per local expert) runs it in the capacity layout (layers/moe_dispatch.py), None with `ragged_dot`. `embed_axes`:
  the kernels hold this device's shard of D over them (`_embed_shards`)."""
  e, d_local, _, f = wi_ExDx2xF.shape
  d = xs_RxD.shape[1]
  key_wi, key_wo = (None, None) if keys is None else keys
  common = dict(dtype=opts.dtype, reduce_axes=token_axes)
  shards = lambda dim: (dim, embed_axes) if embed_axes else None  # D: wi's K (dim 1), wo's N (dim 2).
  wi = dict(recipe=opts.wi_recipe, name=WI, history=histories[0], key=key_wi, stats=stats[0],
            error=errors[0], kernel_shards=shards(1), **common)
  wo = dict(recipe=opts.wo_recipe, name=WO, history=histories[1], key=key_wo, stats=stats[1],
            error=errors[1], kernel_shards=shards(2), **common)
  if slots is None:
    h = grouped_matmul(xs_RxD, wi_ExDx2xF.reshape(e, d_local, 2 * f), group_sizes_E, **wi).reshape(-1, 2, f)
    gate, up = checkpoint_name(h[:, 0], remat.MOE_WI_0), checkpoint_name(h[:, 1], remat.MOE_WI_1)
    return checkpoint_name(grouped_matmul(jax.nn.silu(gate) * up, wo_ExFxD, group_sizes_E, **wo), remat.MOE_WO), 0
  c = slots
  slot_of_row, row_of_slot = capacity_layout(group_sizes_E, xs_RxD.shape[0], c)
  x_ExCxD = take_rows(xs_RxD, row_of_slot, slot_of_row[:, None]).reshape(e, c, d)
  h = batched_matmul(x_ExCxD, wi_ExDx2xF.reshape(e, d_local, 2 * f), **wi).reshape(e, c, 2, f)
  gate, up = checkpoint_name(h[:, :, 0], remat.MOE_WI_0), checkpoint_name(h[:, :, 1], remat.MOE_WI_1)
  y_ExCxD = checkpoint_name(batched_matmul(jax.nn.silu(gate) * up, wo_ExFxD, **wo), remat.MOE_WO)
  y_RxD = take_rows(y_ExCxD.reshape(e * c, d), slot_of_row, row_of_slot[:, None])
  return y_RxD, jnp.sum(jnp.maximum(group_sizes_E - c, 0))


def capacity_layout(group_sizes_E, rows: int, c: int):
  """(the slot of each sorted row: expert * C + its rank, or E * C when it is past its expert's C or past the
  last group; the sorted row of each slot, or `rows` when empty) for slots of C rows per expert."""
  e = group_sizes_E.shape[0]
  starts_E = starts(group_sizes_E)
  expert_R = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(rows, dtype=jnp.int32), side="right")
  rank_R = jnp.arange(rows) - starts_E[jnp.minimum(expert_R, e - 1)]
  slot_of_row = jnp.where((expert_R < e) & (rank_R < c), expert_R * c + rank_R, e * c)
  rank_ExC = jnp.arange(c)[None, :]
  row_of_slot = jnp.where(rank_ExC < group_sizes_E[:, None], starts_E[:, None] + rank_ExC, rows)
  return slot_of_row.astype(jnp.int32), row_of_slot.reshape(-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- routing

def route(x_TxD, router_DxE, opts: Options, bias_E=None):
  """(logits, probabilities over all experts, weights of the k chosen, their indices), float32. `bias_E` (the
  router bias) is added to the scores for the choice alone: the weights are the unbiased scores' at the
  choices.

  Scores: the logits (softmax over the k chosen), a softmax over all experts (`softmax_first`: top-k,
  renormalised) or, DeepSeek-V3's, sigmoids (top-k, renormalised); without `opts.norm_topk` the last two's top-k
  are the weights as they are; the weights times `opts.scale`. With groups
  (`opts.n_group` > 1) each group of consecutive experts is scored by the sum of its two best biased scores and
  the k experts are chosen within the best `opts.topk_group` groups alone. The probabilities the balance losses
  read are the softmax, or the sigmoids normalised over the experts.

  The choices are named `remat.MOE_ROUTING`: a policy that saves residuals laid out in routing
  order (the grouped GEMMs' quantized rows) saves them too, because the backward pass's recompute of
  the logits need not be bitwise the forward's (XLA may keep excess precision in a fusion), and a
  near tie would then reorder rows under saved operands. The weights are gathered from the
  (possibly recomputed) scores at the saved choices."""
  logits_TxE = jnp.dot(x_TxD.astype(F32), router_DxE.astype(F32), precision=jax.lax.Precision.HIGHEST)
  logits_TxE = checkpoint_name(logits_TxE, remat.ROUTER_LOGITS)
  if opts.score == "sigmoid":
    scores_TxE = jax.nn.sigmoid(logits_TxE)
    probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
  else:
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    scores_TxE = probs_TxE if opts.softmax_first else logits_TxE
  choice_TxE = jax.lax.stop_gradient(scores_TxE if bias_E is None else scores_TxE + bias_E)
  if opts.n_group > 1:
    choice_TxE = within_best_groups(choice_TxE, opts.n_group, opts.topk_group)
  experts_TxK = moe_dispatch.saved_routing(jax.lax.top_k(choice_TxE, opts.k)[1], opts.num_experts)
  top_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
  if (opts.score == "sigmoid" or opts.softmax_first) and not opts.norm_topk:
    weights_TxK = top_TxK  # The top-k probabilities (sigmoids) as they are: DeepSeekMoE's, Qwen2-MoE's.
  elif opts.score == "sigmoid":
    weights_TxK = top_TxK / (jnp.sum(top_TxK, axis=-1, keepdims=True) + 1e-20)
  elif opts.softmax_first:
    weights_TxK = top_TxK / jnp.sum(top_TxK, axis=-1, keepdims=True)
  else:
    weights_TxK = jax.nn.softmax(top_TxK, axis=-1)
  if opts.scale != 1.0:
    weights_TxK = weights_TxK * opts.scale
  return logits_TxE, probs_TxE, weights_TxK, experts_TxK


def within_best_groups(choice_TxE, n_group: int, topk_group: int):
  """The choice scores with every expert outside each token's best `topk_group` groups at -inf: `n_group` groups of
  consecutive experts, each scored by the sum of its two best scores (DeepSeek-V3's node-limited routing: with a
  group per expert-parallel node, a token's copies reach at most `topk_group` nodes)."""
  t, e = choice_TxE.shape
  grouped_TxGxS = choice_TxE.reshape(t, n_group, e // n_group)
  group_TxG = jnp.sum(jax.lax.top_k(grouped_TxGxS, 2)[0], axis=-1)
  chosen_TxG = jax.lax.top_k(group_TxG, topk_group)[1]
  keep_TxG = jnp.any(jnp.arange(n_group)[None, None, :] == chosen_TxG[:, :, None], axis=1)
  return jnp.where(keep_TxG[:, :, None], grouped_TxGxS, -jnp.inf).reshape(t, e)


def _rank_in_group(group_N: jax.Array, num_groups: int) -> jax.Array:
  """Position of each element among the earlier elements of its group (stable order)."""
  n = group_N.shape[0]
  order = jnp.argsort(group_N, stable=True)
  ranks_sorted = jnp.arange(n, dtype=jnp.int32) - starts(jnp.bincount(group_N, length=num_groups))[group_N[order]]
  return jnp.zeros((n,), jnp.int32).at[order].set(ranks_sorted, unique_indices=True)


def keep_mask(experts_TxK, valid_T, num_experts: int, capacity: int | None) -> jax.Array:
  """Which copies are computed: real tokens, and (with a capacity) the first `capacity` copies of each
  expert in priority order: all first choices, then all second choices, ..., each in token order."""
  valid_TxK = jnp.broadcast_to(valid_T[:, None], experts_TxK.shape)
  if capacity is None:
    return valid_TxK
  group_KT = jnp.where(valid_TxK, experts_TxK, num_experts).T.reshape(-1)
  rank_TxK = _rank_in_group(group_KT, num_experts + 1).reshape(experts_TxK.shape[::-1]).T
  return valid_TxK & (rank_TxK < capacity)


def sequence_balance_loss(probs_BxLxE, experts_BxLxK, valid_BxL, token_axes, sequence_axes):
  """DeepSeek-V3's sequence-wise balance loss: per sequence (row), E / K * sum_i f_i P_i with f_i the share of its
  real tokens' copies routed to expert i and P_i its mean normalised score; the mean over rows with tokens (1.0
  when a row is balanced). A row split over `sequence_axes` (context parallelism) sums its parts first."""
  e, k = probs_BxLxE.shape[-1], experts_BxLxK.shape[-1]
  v = valid_BxL.astype(F32)
  hits_BxE = jnp.sum(jax.nn.one_hot(experts_BxLxK, e, dtype=F32).sum(axis=2) * v[..., None], axis=1)
  row = {"count": hits_BxE, "prob": jnp.sum(probs_BxLxE * v[..., None], axis=1), "tokens": jnp.sum(v, axis=1)}
  if sequence_axes:
    row = jax.lax.psum(row, sequence_axes)
  n = jnp.maximum(row["tokens"], 1.0)[:, None]
  per_row = e / k * jnp.sum((row["count"] / n) * (row["prob"] / n), axis=-1)
  has = (row["tokens"] > 0).astype(F32)
  totals = jnp.stack([jnp.sum(per_row * has), jnp.sum(has)])
  if sequence_axes:  # The parts of a row hold the same value: count each row once.
    totals = totals * first_along(sequence_axes)
  if token_axes:
    totals = jax.lax.psum(totals, token_axes)
  return totals[0] / jnp.maximum(totals[1], 1.0)


def aux_losses(logits_TxE, probs_TxE, experts_TxK, keep_TxK, valid_T, num_experts: int, token_axes):
  """Switch load balancing E * sum_i f_i P_i (f_i: share of real token copies routed to expert i,
  before dropping; P_i: mean router probability of expert i over real tokens; 1.0 when balanced),
  router z-loss mean(logsumexp(logits)^2), and copy counts; over all token shards."""
  v_T = valid_T.astype(F32)
  k = experts_TxK.shape[1]
  routed_to_E = jnp.where(valid_T[:, None], experts_TxK, num_experts).reshape(-1)
  stats = {
      "count_E": jnp.bincount(routed_to_E, length=num_experts + 1)[:num_experts].astype(F32),
      "prob_E": jnp.sum(probs_TxE * v_T[:, None], axis=0),
      "z": jnp.sum(v_T * jax.nn.logsumexp(logits_TxE, axis=-1) ** 2),
      "tokens": jnp.sum(v_T),
      "kept": jnp.sum(keep_TxK.astype(F32)),
  }
  if token_axes:
    stats = jax.lax.psum(stats, token_axes)
  n = jnp.maximum(stats["tokens"], 1.0)
  f_E = stats["count_E"] / (n * k)
  p_E = stats["prob_E"] / n
  return {MOE_LOAD_BALANCE_LOSS: num_experts * jnp.sum(f_E * p_E), MOE_ROUTER_Z_LOSS: stats["z"] / n,
          MOE_DROPPED_TOKENS: stats["tokens"] * k - stats["kept"], MOE_ROUTED_TOKENS: stats["kept"],
          MOE_EXPERT_LOADS: stats["count_E"]}


# ----------------------------------------------------------------------------- dispatch

@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  group_sizes: jax.Array  # [E_local] rows of each local expert, in order.
  token_of_row: jax.Array  # [R] the token each sorted row copies (T = none: a zero row).
  row_of_copy: jax.Array  # [T, k] the sorted row of each token copy (R = not computed here).
  copy_of_row: jax.Array  # [R] the flat copy (t * k + j) of each sorted row (T * k = none).


def dispatch_plan(local_expert_TxK, keep_TxK, num_local: int, rows: int) -> DispatchPlan:
  """Stable sort of the kept copies bound for experts [0, num_local) by expert; `rows` is a static
  bound on their number (the grouped matmuls' row count)."""
  t, k = local_expert_TxK.shape
  here_TxK = keep_TxK & (local_expert_TxK >= 0) & (local_expert_TxK < num_local)
  group_C = jnp.where(here_TxK, local_expert_TxK, num_local).reshape(-1)
  order_C = jnp.argsort(group_C, stable=True)
  sizes = jnp.bincount(group_C, length=num_local + 1)[:num_local].astype(jnp.int32)
  live_R = jnp.arange(rows) < jnp.sum(sizes)
  copy_R = jnp.where(live_R, order_C[:rows], t * k)
  position_C = jnp.zeros((t * k,), jnp.int32).at[order_C].set(jnp.arange(t * k, dtype=jnp.int32),
                                                               unique_indices=True)
  row_of_copy = jnp.where(here_TxK.reshape(-1), position_C, rows).reshape(t, k)
  return DispatchPlan(sizes, jnp.where(live_R, copy_R // k, t), row_of_copy, copy_R)


@jax.custom_vjp
def take_rows(a_NxD, index_R, inverse_NxJ):
  """a[index] (out-of-range index: a zero row). `inverse[n]` lists every r with index[r] == n (padded
  with out-of-range values), so the backward pass is a gather-sum too, never a colliding scatter-add."""
  return jnp.take(a_NxD, index_R, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(a_NxD, index_R, inverse_NxJ):
  return take_rows(a_NxD, index_R, inverse_NxJ), inverse_NxJ


def _take_rows_bwd(inverse_NxJ, g_RxD):
  da = jnp.take(g_RxD, inverse_NxJ, axis=0, mode="fill", fill_value=0).astype(F32).sum(axis=1)
  return da.astype(g_RxD.dtype), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
