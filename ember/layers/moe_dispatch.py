"""Moving token copies to the devices of their experts and back, under expert parallelism.

Inside the MoE layer's shard_map each device holds T tokens (its token shard), their top-k choices,
and E_local = E / n experts of its expert group of n devices (the `expert` mesh axis). `ffn(rows,
group_sizes)` is the grouped SwiGLU of the local experts on rows sorted by local expert. Three ways
to get every kept copy to its expert and its output back (`model.moe_dispatch`):

  allgather  every device gathers the whole group's tokens and choices (n * T rows), computes the
             copies routed to its own experts and reduce-scatters the weighted sums back. Exact and
             simple; GEMM rows and gathered bytes grow with n * T * min(k, E_local).
  alltoall   each device sorts its copies by destination and sends a fixed [n, C] buffer of rows with
             `all_to_all` (C = T * min(k, E_local), or E_local * capacity with `capacity_factor`: the
             most that can be kept for one device, so nothing beyond the capacity rule is dropped).
             Runs on every backend.
  ragged     the copies alone, with `ragged_all_to_all` (the counts are exchanged first). The receive
             buffer holds `moe_ragged_buffer * T * k` rows (T * k arrive at a device when routing is
             balanced); copies that would land beyond it are not sent, their outputs are zero, and
             they are counted in `moe_overflow_tokens` (logged, never silent). XLA:CPU has no
             ragged-all-to-all: there an exact stand-in built from `all_to_all` of padded buffers
             runs instead (`ragged_all_to_all`), so the CPU tests cover everything around it.
  auto       ragged on a GPU target, allgather elsewhere.
Without an expert axis (n = 1) there is no exchange: `local`, the allgather code with nothing gathered.

The expert GEMMs themselves (`model.moe_expert_gemm`), on the rows a device holds sorted by local expert:
  ragged_dot  `jax.lax.ragged_dot` over the sorted rows (quant/grouped.py): no copy dropped. Both JAX's CPU
              lowering and XLA's GPU compiler expand it into a GEMM over every row for every local expert
              (E_local x the work; in bf16 on GPUs), which the CPU's small test models afford and GPUs do not
              beyond one local expert. (On the CPU the expert GEMMs of deepseek_tiny, 8 experts, take 60% of
              a step: `ragged_dot` masks every row once per expert.)
  capacity    each local expert's rows in a slot of C rows, [E_local, C, D], and one batched GEMM each way
              (quant/batched.py): batched cuBLASLt GEMMs on GPUs, FP8 under the fp8 recipes. C is
              `moe_expert_buffer` x the balanced load (n * T * k / E), or n * capacity with a capacity
              factor; copies past C are not computed (zero output) and counted in `moe_overflow_tokens`.
  auto        capacity on a GPU target with more than one local expert, ragged_dot elsewhere.
`choose` is that rule; `plan` adds the sizes (token shard, rows, slots), for the layer, the training log line
and the compile report alike.

Under a recipe that allows it (`Recipe.exchange_quantizer`: FP8 with current scaling) the copies cross the
exchange in E4M3 and their outputs' gradients in E5M2 (`Wire`, `across`): half the bytes of bf16 on the slowest
link of an expert-parallel step, as DeepSeek-V3 dispatches. The outputs on the way back and the copies'
gradients stay in the compute dtype: they are summed over a token's experts.

Everything around the collectives is shared: the sort of a device's copies by global expert (so by
destination, then local expert: `moe.dispatch_plan`), the counts and offsets, the receiver's sort by
local expert and its inverse, and the combine. Every gather here reads each source row at most once,
so its gradient (a scatter-add) never adds two values into one row: deterministic on GPUs too.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ember import remat
from ember.names import MOE_DISPATCHERS, MOE_EXPERT_GEMMS
from ember.parallel import sharding
from ember.platform import target_platform
from ember.quant import formats
from ember.quant.core import SCOPE_GRADIENT
from ember.quant.grouped import starts
from ember.quant.quantizers import Quantizer
from ember.quant.recipe import ACTIVATION, GRADIENT, X, Recipe
from ember.quant.varying import manual_axes, varying_as

AUTO, ALLGATHER, ALLTOALL, RAGGED = MOE_DISPATCHERS
_, RAGGED_DOT, CAPACITY = MOE_EXPERT_GEMMS
LOCAL = "local"  # No expert axis: no exchange.
SLOT_MULTIPLE = 32  # C is rounded up to it: whole blocks along C for the block-scaled recipes' wgrad.


def resolve(dispatch: str, platform: str | None = None) -> str:
  """The dispatcher `auto` means on `platform` (default: the platform being traced for)."""
  if dispatch != AUTO:
    return dispatch
  return RAGGED if (platform or target_platform()) == "gpu" else ALLGATHER


def choose(dispatch: str, expert_gemm: str, *, expert_parallel: int, num_local: int,
           platform: str | None = None) -> tuple[str, str]:
  """(the token exchange, the expert GEMM layout) an MoE layer runs (see the module doc)."""
  platform = platform or target_platform()
  exchange = LOCAL if expert_parallel == 1 else resolve(dispatch, platform)
  if expert_gemm == AUTO:
    expert_gemm = CAPACITY if platform == "gpu" and num_local > 1 else RAGGED_DOT
  return exchange, expert_gemm


@dataclasses.dataclass(frozen=True)
class Plan:
  """What an MoE layer runs for one token shard on a mesh, decided once (`plan`): the one answer the layer, the
  run's log line and the compile report read. A step decides it where it is jitted (trainer/step.py's
  `moe_plan`) and hands it down the model's call to each MoE layer."""
  exchange: str  # local | allgather | alltoall | ragged
  expert_gemm: str  # ragged_dot | capacity
  expert_axes: tuple[str, ...]  # The mesh axes the experts are split over.
  expert_parallel: int  # n: devices the experts are split over.
  num_local: int  # Experts on each of them.
  tokens: int  # T: tokens of one token shard.
  capacity: int | None  # Copies each expert keeps per token shard; None = dropless.
  buffer: int  # Rows per destination of the exchange: alltoall's send slots, ragged's receive buffer; 0 without.
  rows: int  # Rows of the expert GEMMs on one device, sorted by local expert.
  slots: int  # The capacity layout's rows per local expert (C); 0 with ragged_dot.


def plan(model, mesh, rules: dict, *, batch: tuple[int, int], platform: str | None = None,
         no_overflow: bool = False) -> Plan:
  """The Plan of `model`'s MoE layers (a ModelConfig: its `moe_*`, expert and capacity settings) for batches of
  `batch` = (sequences, length) on `mesh` under `rules` (platform: the one traced for). Without a mesh (or
  on one device) there is one token shard and no expert axis. `no_overflow`: buffers that hold every copy the
  model keeps (its capacity factor still applies), whatever their settings' headroom over the balanced load
  (sampling: a prompt's tokens are far from balanced, and no step counts what a buffer would drop)."""
  e, k = model.num_experts, model.experts_per_token
  sharded = mesh is not None and mesh.size > 1
  axes = sharding.expert_axes(rules, mesh) if sharded else ()
  n = math.prod(mesh.shape[a] for a in axes)
  token_shards = 1
  if sharded:
    local = manual_axes()  # Inside shard_map `batch` is already one shard's along these.
    token_shards = math.prod(mesh.shape[a] for a in sharding.token_axes(rules, mesh) if a not in local)
  t = batch[0] * batch[1] // token_shards
  num_local = e // n
  exchange, gemm = choose(model.moe_dispatch, model.moe_expert_gemm, expert_parallel=n, num_local=num_local,
                          platform=platform)
  capacity = expert_capacity(model.capacity_factor, t, k, e)
  if no_overflow and capacity is None:  # Slots sized by the balanced load could overflow; a capacity's never do.
    gemm = RAGGED_DOT
  # With no_overflow ragged's receive buffer holds n x T x k rows: at least all that can arrive (`gemm_rows`).
  rows_of = functools.partial(gemm_rows, tokens=t, k=k, num_local=num_local, capacity=capacity,
                              ragged_buffer=float(n) if no_overflow else model.moe_ragged_buffer)
  if exchange == ALLTOALL:
    buffer = rows_of(exchange, n=1)  # The most one source can keep for one device.
    rows = n * buffer
  elif exchange == RAGGED:
    buffer = rows = rows_of(exchange, n=n)
  else:
    buffer, rows = 0, rows_of(ALLGATHER, n=n)
  slots = slot_rows(tokens=t, k=k, num_experts=e, n=n, capacity=capacity, buffer=model.moe_expert_buffer,
                    rows=rows) if gemm == CAPACITY else 0
  return Plan(exchange, gemm, axes, n, num_local, t, capacity, buffer, rows, slots)


def slot_rows(*, tokens: int, k: int, num_experts: int, n: int, capacity: int | None, buffer: float,
              rows: int) -> int:
  """C, the rows of each local expert's slot in the capacity layout, for `rows` sorted rows on a device
  (n devices per expert group, T = `tokens` per token shard): n * capacity with a capacity factor (never
  exceeded), else `buffer` x the balanced load n * T * k / E; at most `rows`."""
  c = n * capacity if capacity is not None else math.ceil(buffer * n * tokens * k / num_experts)
  return -(-min(c, rows) // SLOT_MULTIPLE) * SLOT_MULTIPLE


def _gather(a_NxD, index_R):
  """a[index] with out-of-range indices giving zero rows."""
  return jnp.take(a_NxD, index_R, axis=0, mode="fill", fill_value=0)


# ----------------------------------------------------------------------------- the wire

@dataclasses.dataclass(frozen=True)
class Wire:
  """The formats token copies cross an exchange in: `rows` the copies on their way to the experts, `grads` the
  gradients of the experts' outputs on that same way in the backward pass; None: in the compute dtype. Each is
  quantized with the amax over `reduce_axes` (every token shard's copies), the expert GEMM's own amax, so the
  GEMM quantizes what arrives to the very values sent (`Recipe.exchange_quantizer`), at the same scale. Each value
  arrives as data x scale_inv rounded toward zero into the rows' dtype: within half an FP8 step of what was sent,
  and the largest of them between the amax sent and fmt.max x scale_inv, where scale_inv, the bf16 just above
  amax / fmt.max (ember/quant/quantizers.py), comes out again. Rounded to nearest, the largest could land a bf16
  above fmt.max x scale_inv and the GEMM's scale one bf16 step away from the one sent."""
  rows: Quantizer | None = None
  grads: Quantizer | None = None
  reduce_axes: tuple[str, ...] = ()
  # The remat name of the copies' quantized form at the first expert GEMM: the rows' health measured here is named
  # alike, so a policy that keeps that operand keeps its health too rather than quantizing the copies again.
  rows_name: str | None = None

  @classmethod
  def of(cls, wi: Recipe, wo: Recipe, reduce_axes: tuple[str, ...], wi_name: str | None = None) -> "Wire":
    """The wire of experts whose first GEMM runs `wi` (it reads the copies; `wi_name` its projection's name) and
    last `wo` (its dgrad reads the outputs' gradients)."""
    return cls(wi.exchange_quantizer(ACTIVATION), wo.exchange_quantizer(GRADIENT), tuple(reduce_axes),
               None if wi_name is None else remat.quantized_name(wi_name, X))

  def bytes_per_element(self, dtype) -> tuple[float, float]:
    """(a copy's element on the way to its expert, its output's gradient on that same way) for copies of `dtype`."""
    size = lambda q: jnp.dtype(dtype).itemsize if q is None else q.fmt.bits / 8
    return size(self.rows), size(self.grads)

  def dispatch(self, move, rows, *ints, health=None):
    """move(rows, *ints), a linear exchange of rows towards their experts, over this wire. `health`: a [STATS]
    input whose "gradient" is the rows' health as the wire quantized them (quant/health.py), or None."""
    return across(move, self.rows, None, self.reduce_axes, rows, ints, health, self.rows_name)

  def combine(self, move, rows, *ints, health=None):
    """move(rows, *ints), a linear exchange of the experts' outputs back to their tokens, over this wire.
    `health`: a [STATS] input whose "gradient" is the health of the outputs' gradients as the wire quantized them
    on their way back, or None."""
    return across(move, None, self.grads, self.reduce_axes, rows, ints, health)


def _send(move, quantizer, reduce_axes, rows, ints, stats: bool = False):
  """(move(rows, *ints), the rows sent quantized (and taken back to their dtype on arrival) if `quantizer`; their
  health as quantized where `stats`, else None)."""
  if quantizer is None:
    return move(rows, *ints), None
  q = quantizer.quantize(rows, axis=-1, reduce_axes=reduce_axes, stats=stats)
  return formats.cast_toward_zero(move(q.data, *ints).astype(jnp.float32) * q.scale_inv, rows.dtype), q.health


def across(move, forward: Quantizer | None, backward: Quantizer | None, reduce_axes, rows, ints, health=None,
           health_name: str | None = None):
  """move(rows, *ints) for `move` linear in the rows (an exchange; `ints` its offsets and sizes), the rows sent
  in `forward`'s format and the cotangent sent back (by move's transpose) in `backward`'s; None: as they are.
  Quantization is the identity for the gradient, as in every quantized GEMM. `health`: a [STATS] input whose
  "gradient" is the health of what the wire quantized (the rows, or the cotangent), or None. The expert GEMM
  measures only what arrives: a value the wire flushed to zero or clipped is no longer underflow or saturation
  there, so where the wire quantizes, its measure is the operand's. `health_name`: the remat name the rows'
  health is kept under (that of their quantized form)."""
  return _across(move, forward, backward, tuple(reduce_axes), (rows.shape, jnp.dtype(rows.dtype)), health_name,
                 rows, tuple(ints), health)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _across(move, forward, backward, reduce_axes, like, health_name, rows, ints, health):
  return _send(move, forward, reduce_axes, rows, ints)[0]


def _across_fwd(move, forward, backward, reduce_axes, like, health_name, rows, ints, health):
  out, measured = _send(move, forward, reduce_axes, rows, ints, stats=health is not None)
  if measured is not None and health_name:
    measured = checkpoint_name(measured, health_name)
  # What the backward pass hands back as `health`'s "gradient": the rows' health, or (the cotangent's, measured
  # there) a placeholder of its shape; None: not asked for.
  return out, (ints, measured if measured is not None or health is None else jnp.zeros_like(health))


def _across_bwd(move, forward, backward, reduce_axes, like, health_name, res, ct):
  (shape, dtype), (ints, measured) = like, res

  def transpose(a, *ints):  # The cotangent (or its quantized data) back the way the rows came.
    primal = varying_as(jnp.zeros(shape, a.dtype), a)
    return jax.linear_transpose(lambda r: move(r, *ints), primal)(a)[0]

  with jax.named_scope(SCOPE_GRADIENT):  # A gradient's cast, not a forward quantize the backward runs again.
    back, measured_back = _send(transpose, backward, reduce_axes, ct, ints, stats=measured is not None)
  return back.astype(dtype), None, measured if measured_back is None else measured_back


_across.defvjp(_across_fwd, _across_bwd)


# ----------------------------------------------------------------------------- the receiver's side

def _sorted_ffn(rows_RxD, expert_R, num_local: int, ffn):
  """ffn on rows sorted by local expert (rows with expert == num_local are padding: zero outputs),
  returned in the rows' own order, with the copies the ffn did not compute."""
  order = jnp.argsort(expert_R, stable=True)
  sizes = jnp.bincount(expert_R, length=num_local + 1)[:num_local].astype(jnp.int32)
  inverse = jnp.argsort(order)
  ys, overflow = ffn(_gather(rows_RxD, order), sizes)
  return _gather(ys, inverse), overflow


def saved_routing(a: jax.Array, values: int | None = None) -> jax.Array:
  """Integers the routing decided (expert choices, the counts an exchange sent) through the `remat.MOE_ROUTING` name, as
  uint8 where their `values` distinct values fit (1 byte each), else as they are: a policy that keeps rows in
  routing order keeps them too (remat.ROUTED)."""
  small = jnp.uint8 if values is not None and values <= 256 else a.dtype
  return checkpoint_name(a.astype(small), remat.MOE_ROUTING).astype(a.dtype)


# ----------------------------------------------------------------------------- alltoall

def alltoall(xs_CxD, expert_C, sizes_E, *, num_local: int, slots: int, axes, ffn, wire: Wire = Wire(),
             health=(None, None)):
  """Exchange by fixed buffers. `xs_CxD`: this device's copies sorted by global expert (`sizes_E` rows
  each; rows past their sum are not sent); returns each copy's expert output in the same order, and the
  copies received here that the expert GEMMs' slots did not hold. The rows cross `wire`; `health`: the
  (dispatch, combine) inputs of `Wire.dispatch` / `Wire.combine`."""
  n = sizes_E.shape[0] // num_local
  send_P = sizes_E.reshape(n, num_local).sum(axis=1)
  start_P = starts(send_P)
  slot_PxS = jnp.arange(slots)[None, :]
  live_PxS = slot_PxS < send_P[:, None]
  row_PxS = jnp.where(live_PxS, start_P[:, None] + slot_PxS, xs_CxD.shape[0])
  send_PxSxD = _gather(xs_CxD, row_PxS.reshape(-1)).reshape(n, slots, -1)
  expert_PxS = jnp.where(live_PxS, _gather(expert_C[:, None], row_PxS.reshape(-1))[:, 0].reshape(n, slots)
                         % num_local, num_local)
  exchange = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)
  recv_PxSxD = wire.dispatch(exchange, send_PxSxD, health=health[0])
  recv_expert_PxS = saved_routing(exchange(expert_PxS), num_local + 1)  # Kept with the rows it orders.
  d = recv_PxSxD.shape[-1]
  ys, overflow = _sorted_ffn(recv_PxSxD.reshape(-1, d), recv_expert_PxS.reshape(-1), num_local, ffn)
  back_PxSxD = wire.combine(exchange, ys.reshape(n, slots, d), health=health[1])
  # Copy c (sorted) went to destination p = the group holding it, slot c - start_P[p].
  dest_C = jnp.searchsorted(jnp.cumsum(send_P), jnp.arange(xs_CxD.shape[0]), side="right")
  slot_C = jnp.arange(xs_CxD.shape[0]) - _gather(start_P[:, None], dest_C)[:, 0]
  flat = jnp.where(dest_C < n, dest_C * slots + slot_C, n * slots)
  return _gather(back_PxSxD.reshape(-1, d), flat), overflow


# ----------------------------------------------------------------------------- ragged

def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axes):
  """`jax.lax.ragged_all_to_all` (one slice per device), or on a backend without it (XLA:CPU) an exact
  stand-in: every slice padded to the operand's length, `all_to_all`, then written at its offsets."""
  if target_platform() != "cpu":
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axes)
  n, rows = send_sizes.shape[0], operand.shape[0]
  i = jnp.arange(rows)[None, :]
  index_NxR = jnp.where(i < send_sizes[:, None], input_offsets[:, None] + i, rows)
  padded = _gather(operand, index_NxR.reshape(-1)).reshape(n, rows, *operand.shape[1:])
  exchange = lambda a: jax.lax.all_to_all(a, axes, 0, 0, tiled=True)
  received, offsets = exchange(padded), exchange(output_offsets)
  target_NxR = jnp.where(i < recv_sizes[:, None], offsets[:, None] + i, output.shape[0])
  return output.at[target_NxR.reshape(-1)].set(received.reshape(n * rows, *operand.shape[1:]), mode="drop",
                                               unique_indices=True)


def ragged(xs_CxD, sizes_E, *, num_local: int, buffer_rows: int, axes, ffn, wire: Wire = Wire(),
           health=(None, None)):
  """Exchange of the copies alone. Returns (each copy's expert output in `xs_CxD`'s order, copies that
  did not fit the receiver's `buffer_rows` here (not sent, zero output) plus those received here that
  the expert GEMMs' slots did not hold). The rows cross `wire`; `health` as `alltoall`'s."""
  n = sizes_E.shape[0] // num_local
  sizes_PxE = sizes_E.reshape(n, num_local)
  send_P = sizes_PxE.sum(axis=1)
  me = jax.lax.axis_index(axes)
  # [source, destination] copy counts, kept with the rows they place.
  sent_NxP = saved_routing(jax.lax.all_gather(send_P, axes, tiled=False))
  # Where each source's block starts in each destination's buffer, and how much of it fits.
  start_NxP = starts(sent_NxP, axis=0)
  fits_NxP = jnp.clip(buffer_rows - start_NxP, 0, sent_NxP)
  send_fit_P, out_offset_P = fits_NxP[me], start_NxP[me]
  recv_P = fits_NxP[:, me]
  recv_offset_P = start_NxP[:, me]
  in_offset_P = starts(send_P)
  d = xs_CxD.shape[-1]
  # Each receive buffer varies over the mesh axes as the rows sent do (zeros_like keeps their shard_map type): a
  # buffer typed invariant would make the result invariant too, and autodiff would sum its gradient over
  # the devices.
  def move(rows: int):
    return lambda a, *ints: ragged_all_to_all(a, jnp.zeros_like(a, shape=(rows, d)), *ints, axes=axes)

  recv_RxD = wire.dispatch(move(buffer_rows), xs_CxD, in_offset_P, send_fit_P, out_offset_P, recv_P,
                           health=health[0])
  # The local expert of each received row: blocks by source, each sorted by local expert.
  recv_sizes_PxE = saved_routing(jax.lax.all_to_all(sizes_PxE, axes, 0, 0, tiled=True))
  r = jnp.arange(buffer_rows)
  source_R = jnp.clip(jnp.searchsorted(recv_offset_P + recv_P, r, side="right"), 0, n - 1)
  within_R = r - recv_offset_P[source_R]
  live_R = within_R < recv_P[source_R]
  ends_PxE = jnp.cumsum(recv_sizes_PxE, axis=1)
  expert_R = jax.vmap(lambda s, i: jnp.searchsorted(ends_PxE[s], i, side="right"))(source_R, within_R)
  expert_R = jnp.where(live_R, expert_R, num_local)
  ys_RxD, slot_overflow = _sorted_ffn(recv_RxD, expert_R, num_local, ffn)
  back = wire.combine(move(xs_CxD.shape[0]), ys_RxD, recv_offset_P, recv_P, _source_offsets(sent_NxP, me),
                      send_fit_P, health=health[1])
  return back, jnp.sum(send_P - send_fit_P) + slot_overflow


def _source_offsets(sent_NxP, me):
  """For the way back: where this device's block for source s sits in s's sorted copies (s's exclusive
  cumsum of what it sent to the destinations before this one)."""
  return starts(sent_NxP, axis=1)[:, me]


def expert_capacity(capacity_factor: float, tokens: int, k: int, num_experts: int) -> int | None:
  """Copies each expert keeps per token shard of `tokens` tokens: ceil(factor * T * k / E); None = dropless."""
  if capacity_factor <= 0:
    return None
  return max(math.ceil(capacity_factor * tokens * k / num_experts), 1)


def gemm_rows(dispatch: str, *, tokens: int, k: int, num_local: int, n: int, capacity: int | None,
              ragged_buffer: float) -> int:
  """Rows of the grouped GEMMs on one device (static: the buffers are sized by it), for a token shard
  of `tokens` tokens, top-`k`, `num_local` experts per device, `n` devices per expert group and a
  per-expert `capacity` per token shard (None: dropless).

    allgather  n * T * min(k, E_local), or n * E_local * capacity: what may be routed here;
    alltoall   n * slots, slots = the most one source can keep for one device (the same bound);
    ragged     `ragged_buffer` * T * k: the balanced arrival times the buffer factor, capped by the above.
  """
  most = n * tokens * min(k, num_local)
  if capacity is not None:
    most = min(most, n * num_local * capacity)
  if dispatch == RAGGED:
    return max(1, min(most, math.ceil(ragged_buffer * tokens * k)))
  return most
