"""Pipeline parallelism: the decoder's layers split into stages over the mesh axis `pipeline`.

Each device along `pipeline` holds one stage: its rows of the stacked layers (the `layers` rule maps them to this
axis, so checkpoints keep the model's own layout and restore onto any mesh): one contiguous run of layers, or V
chunks of them under interleaved 1F1B (chunk v of stage s: virtual stage vS + s; `to_chunks` moves each stage's
chunks to it for the step). A step's `train.grad_accum_steps` micro-batches flow through the stages in a
`shard_map` manual over `pipeline` alone (the other axes stay the compiler's, so FSDP, tensor and expert
parallelism run inside a stage as they do without a pipeline); outputs pass to the next stage with a `ppermute`
(one point-to-point transfer per boundary, the least any schedule moves; XLA issues it as an asynchronous
collective-permute that overlaps the next tick's work).

Schedules (docs/parallelism.md):
- GPipe: iteration t = 0 .. M + S - 2 (M micro-batches, S stages), stage s runs micro-batch t - s; autodiff of
  that loop runs every backward pass after every forward, in reverse.
- 1F1B and interleaved 1F1B: each tick a stage runs one (micro-batch, chunk)'s forward pass and another's
  backward pass (`forward_unit`, `backward_unit`), in three phases (`phases`) so that no tick runs a pass no
  stage has.
Each idles (S - 1) / (MV + S - 1) of a step (`bubble_fraction`; V = 1 but for interleaved 1F1B). Where a GPipe
stage has no micro-batch it runs on zeros whose segment ids mark padding: the layers map them to zeros (no bias
terms; norms of zero are zero), no token is routed, and the results are masked out of the outputs, losses and
statistics. A 1F1B tick without a pass of a kind traced in it runs that pass on a real micro-batch (its position
clipped into range) and masks its results out: its ring slot is the spare one, its outputs, statistics and gradients
are dropped (`has_f`, `has_b` in ember/trainer/pipelined.py).

Values that are "gradients" of a whole-step kind rather than sums (delayed-scaling histories, health
statistics) reach every GPipe iteration through `fan_out`, whose transpose combines the iterations' cotangents
as the micro-batch loop does (max, `health.combine`) instead of summing them.
"""

from __future__ import annotations

import functools
import heapq
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ember.names import PIPELINE


def stages(mesh) -> int:
  """How many pipeline stages `mesh` has (1: no pipeline)."""
  return 1 if mesh is None else int(mesh.shape.get(PIPELINE, 1))


def padded_blocks(blocks: int, num_stages: int, virtual_stages: int = 1) -> int:
  """The stacked layers' rows under a pipeline: `blocks` rounded up to a multiple of the stages x chunks, so that
  every chunk holds as many rows (126 layers in 8 stages: 128 rows, 16 a stage). The rows past the model's blocks
  are padding, at the end (the last chunks hold them): zero parameters, which make a layer without bias terms the
  identity (its norms' scales are zero, so every projection reads zeros), whose gradients are exactly zero and stay
  so under the optimizer; the step keeps their amax histories at zero too (trainer/step.py). A checkpoint keeps
  them, zeros (an array's fingerprint does not see them, trainer/integrity.py); another mesh restores the model's
  rows (trainer/checkpointing.py)."""
  chunks = num_stages * virtual_stages
  return -(-blocks // chunks) * chunks


# The most padding rows (idle layers run every step), as a share of the blocks, a layout runs without a warning and
# the planner plans.
MAX_PADDING = 0.05


def staged_rows(front: int, blocks: int, num_stages: int, virtual_stages: int = 1) -> int:
  """The stacked rows of the segment a pipeline splits into stages (ModelConfig.staged_segment): its `blocks` and
  the `front` blocks of the segments that stage 0 runs ahead of it, padded to a multiple of the stages x chunks
  (`padded_blocks`). The rows are held in the model's order, padding last; a step rolls them forward by `front`
  (`roll_rows`), so that stage 0's first chunk starts with `front` padding rows, which it skips as it runs the
  blocks ahead of them: every stage's ticks run as many layers."""
  return padded_blocks(front + blocks, num_stages, virtual_stages)


def roll_rows(rows: jax.Array, front: int, num_stages: int, inverse: bool = False) -> jax.Array:
  """Inside the map over `pipeline`: this stage's rows of the staged segment [k, ...] (its contiguous shard in the
  model's order) rolled forward by `front` over the stages (`staged_rows`): the previous stage's last `front` rows
  ahead of its own first k - front, the last stage's (padding) reaching stage 0. One `ppermute` of `front` rows;
  `inverse`: back (the gradients, on their way back)."""
  if not front:
    return rows
  ring = [(s, (s + 1) % num_stages) for s in range(num_stages)]
  if inverse:
    back = jax.lax.ppermute(rows[:front], PIPELINE, [(d, s) for s, d in ring])
    return jnp.concatenate([rows[front:], back])
  return jnp.concatenate([jax.lax.ppermute(rows[-front:], PIPELINE, ring), rows[:-front]])


def stage_without_layers(blocks: int, num_stages: int, virtual_stages: int = 1) -> bool:
  """Whether `padded_blocks`' padding leaves a stage nothing but padding rows (9 blocks in 8 stages: 16 rows, 2 a
  stage, stages 5-7 all padding), or there are more chunks than blocks: layouts the config refuses. The last
  stage holds the most padding; its first chunk is virtual stage S - 1."""
  chunks = num_stages * virtual_stages
  per_chunk = padded_blocks(blocks, num_stages, virtual_stages) // chunks
  return blocks < chunks or (num_stages - 1) * per_chunk >= blocks


def iterations(micro_batches: int, num_stages: int) -> int:
  """GPipe's loop: the last micro-batch enters stage 0 at M - 1 and leaves the last stage S - 1 later."""
  return micro_batches + num_stages - 1


def phases(micro_batches: int, num_stages: int, virtual_stages: int = 1) -> tuple[int, int, int]:
  """The (interleaved) 1F1B loop's ticks in its three phases: (warm-up, steady, cool-down). Before the first
  backward pass anywhere (the last stage's of micro-batch 0's last chunk, tick VS - 1) the ticks run forward
  passes only; after the last forward pass (tick MV + S - 2) backward passes only; in between both."""
  m, s, v = micro_batches, num_stages, virtual_stages
  return v * s - 1, m * v + s - v * s, v * s - 1


def loop_length(micro_batches: int, num_stages: int, schedule: str, virtual_stages: int = 1) -> int:
  """The schedule's loop: GPipe's `iterations` (of each pass), the 1F1B schedules' ticks (`phases`)."""
  if schedule == "gpipe":
    return iterations(micro_batches, num_stages)
  return sum(phases(micro_batches, num_stages, virtual_stages))


def bubble_fraction(micro_batches: int, num_stages: int, schedule: str = "gpipe", virtual_stages: int = 1) -> float:
  """The share of a step each stage idles: (S - 1) / (MV + S - 1) for M micro-batches, S stages and V chunks a
  stage (V = 1 but for interleaved 1F1B). GPipe runs M + S - 1 forward and as many backward iterations for M of
  work; the 1F1B schedules run (VS - 1) forward-only ticks, MV + S - VS ticks of a forward and a backward pass
  and (VS - 1) backward-only ticks, each pass 1/V of a stage: MV + S - 1 ticks' worth of both passes for MV."""
  v = virtual_stages if schedule == "interleaved_1f1b" else 1
  return (num_stages - 1) / (micro_batches * v + num_stages - 1)


def in_flight(micro_batches: int, num_stages: int, schedule: str = "1f1b", virtual_stages: int = 1) -> int:
  """Chunks (1/V of a stage each) a stage holds residuals of at once, at most: from its forward pass through the
  tick of its backward pass. GPipe keeps every iteration's; under the 1F1B schedules stage 0 runs a forward pass
  every tick from tick 0 and a backward pass every tick from tick S + VS - 2 (`backward_unit`), so it holds
  S + VS - 1 (Megatron's count for its interleaved schedule, (S - 1) 2 + (V - 1) S + 1; 2S - 1 for V = 1), or all
  MV where fewer, and every other stage fewer."""
  if schedule == "gpipe":
    return iterations(micro_batches, num_stages)
  return max(ring_table(micro_batches, num_stages, virtual_stages)) + 1


def ring_slots(micro_batches: int, num_stages: int, virtual_stages: int = 1) -> int:
  """The slots of a 1F1B stage's ring of residuals (trainer/pipelined.py): one a chunk in flight, and a spare that
  a tick without a forward pass writes its unused residuals to, so that no slot is read back to be kept as it was
  (a select: host memory, where a policy's offloaded residuals lie, cannot run one)."""
  return in_flight(micro_batches, num_stages, "1f1b", virtual_stages) + 1


@functools.lru_cache(maxsize=64)
def ring_table(micro_batches: int, num_stages: int, virtual_stages: int = 1) -> tuple[int, ...]:
  """The ring slot of each forward pass of a 1F1B stage, by its position in the stage's forward order
  (`forward_index`): a slot is taken at the forward pass's tick and freed after its backward pass's, and each
  forward pass takes the lowest free slot, so the ring needs no more slots than chunks are ever in flight.

  Indexed by forward position modulo the slots, the ring would need as many as the longest wait (2VS - 1 ticks:
  a group's chunk 0, whose backward pass comes last) where S + VS - 1 are in flight (79 against 47 for S = 8, V = 5).
  Stage 0's table serves every stage: stage s runs forward position n at tick n + s and its backward pass 2s ticks
  sooner after it than stage 0 does, so each of its lifetimes lies inside stage 0's. Within a tick the forward pass
  writes its slot before the backward pass reads its own, so a slot freed by a tick's backward pass is taken from
  the next tick on."""
  m, s, v = micro_batches, num_stages, virtual_stages
  n = np.arange(m * v)
  with jax.ensure_compile_time_eval():  # Called while a step is traced: constants, not the trace's values.
    micro, chunk, _ = (np.asarray(a) for a in _unit(n, m, s, v, backward=True))
  # Stage 0 runs backward position k at tick k + (S - 1) + (VS - 1), forward position n at tick n.
  backward_tick = np.empty(m * v, np.int64)
  backward_tick[np.asarray(forward_index(micro, chunk, s, v))] = n + s - 1 + v * s - 1
  slots, free, taken, size = [], [], [], 0  # free, taken ((backward tick, slot)): heaps.
  for tick in range(m * v):
    while taken and taken[0][0] < tick:
      heapq.heappush(free, heapq.heappop(taken)[1])
    if free:
      slot = heapq.heappop(free)
    else:
      slot, size = size, size + 1
    heapq.heappush(taken, (int(backward_tick[tick]), slot))
    slots.append(slot)
  return tuple(slots)


def stage_transfers(micro_batches: int, num_stages: int, schedule: str, virtual_stages: int = 1) -> float:
  """Activation-sized transfers a stage sends a step: one per pass and boundary (GPipe: each iteration's output
  forward and its gradient back); the 1F1B schedules' forward passes and gradients plus, once a micro-batch (the
  ticks that run the LM head, `steady_runs`), the share of the last stage's output each stage's head takes and
  the gradient it returns (2 (S - 1) / S)."""
  if schedule == "gpipe":
    return 2 * iterations(micro_batches, num_stages)
  warm, steady, cool = phases(micro_batches, num_stages, virtual_stages)
  return warm + cool + 2 * steady + micro_batches * 2 * (num_stages - 1) / num_stages


def steady_runs(micro_batches: int, num_stages: int, virtual_stages: int = 1) -> list[tuple[int, bool]]:
  """The 1F1B schedules' steady ticks (`phases`) as runs of (ticks, whether the last stage ends a micro-batch in
  them: its forward pass runs the last chunk, so the LM head runs). Every steady tick for V = 1; S ticks of every
  SV under interleaved 1F1B, the others run no head at all."""
  s, v = num_stages, virtual_stages
  warm, steady, _ = phases(micro_batches, s, v)
  runs: list[tuple[int, bool]] = []
  for tau in range(warm, warm + steady):
    head = ((tau - (s - 1)) % (s * v)) // s == v - 1  # forward_unit's chunk for the last stage.
    if runs and runs[-1][1] == head:
      runs[-1] = (runs[-1][0] + 1, head)
    else:
      runs.append((1, head))
  return runs


def periods(runs: list) -> tuple[list, int]:
  """(a period of `runs`, how often it repeats from their start): the steady ticks' loop of loops."""
  period = runs[:2]
  repeats = 1
  while runs[repeats * len(period):(repeats + 1) * len(period)] == period:
    repeats += 1
  return period, repeats


def forward_unit(tick, stage, micro_batches: int, num_stages: int, virtual_stages: int):
  """The (micro-batch, chunk, whether there is one) whose forward pass `stage` runs at `tick` (1F1B schedules).

  A stage's forward passes run one a tick from tick `stage` on, in groups of S micro-batches: group g's micro-
  batches through chunk 0, then chunk 1, ... (Megatron's interleaved order). Chunk v of stage s holds the
  layers of virtual stage vS + s, so a micro-batch's output passes from stage s to s + 1 and from the last stage
  to stage 0's next chunk, one tick each."""
  n = tick - stage
  return _unit(n, micro_batches, num_stages, virtual_stages, backward=False)


def backward_unit(tick, stage, micro_batches: int, num_stages: int, virtual_stages: int):
  """The (micro-batch, chunk, whether there is one) whose backward pass `stage` runs at `tick`: the forward order
  with the chunks reversed, stage S - 1 starting at tick VS - 1, when its first chunk V - 1's forward pass runs (the
  same tick: its loss's gradient is taken there), and the gradient passing back one stage a tick."""
  n = tick - (num_stages - 1 - stage) - (virtual_stages * num_stages - 1)
  return _unit(n, micro_batches, num_stages, virtual_stages, backward=True)


def _unit(n, micro_batches: int, num_stages: int, virtual_stages: int, *, backward: bool):
  s, v = num_stages, virtual_stages
  valid = (n >= 0) & (n < micro_batches * v)
  n = jnp.clip(n, 0, micro_batches * v - 1)
  group, r = n // (s * v), n % (s * v)
  chunk = r // s
  return group * s + r % s, (v - 1 - chunk) if backward else chunk, valid


def forward_index(micro, chunk, num_stages: int, virtual_stages: int):
  """The position of (micro-batch, chunk) in a stage's forward order (`forward_unit`'s inverse)."""
  s, v = num_stages, virtual_stages
  return (micro // s) * s * v + chunk * s + micro % s


def from_pipeline_order(a: jax.Array, num_stages: int, virtual_stages: int) -> jax.Array:
  """Stacked-layer rows [L, ...] in stage-major order (stage s's rows: its chunks v = 0 .. V - 1, virtual stages
  vS + s) -> the model's order. The identity for V = 1."""
  if virtual_stages == 1:
    return a
  return a.reshape(num_stages, virtual_stages, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


def chunk_moves(num_stages: int, virtual_stages: int) -> list[list[tuple[int, int, int, int]]]:
  """How interleaved chunks reach their stages: rounds of (source stage, its local chunk u, destination stage, its
  local chunk v) moves, each round a partial permutation (one `ppermute`). In the model's order stage d holds
  virtual stages dV .. dV + V - 1; virtual stage c belongs on stage c mod S as its chunk c // S."""
  moves = [(d, u, (d * virtual_stages + u) % num_stages, (d * virtual_stages + u) // num_stages)
           for d in range(num_stages) for u in range(virtual_stages)]
  rounds: list[list[tuple[int, int, int, int]]] = []
  for move in moves:
    free = next((r for r in rounds if all(move[0] != m[0] and move[2] != m[2] for m in r)), None)
    if free is None:
      rounds.append(free := [])
    free.append(move)
  return rounds


def to_chunks(rows: jax.Array, num_stages: int, virtual_stages: int, inverse: bool = False) -> jax.Array:
  """Inside the map over `pipeline`: this stage's rows of the model's stacked layers [V k, ...] (its contiguous
  shard) -> its interleaved chunks [V k, ...] (chunk v: virtual stage vS + s), moved between the stages with
  `ppermute`s (`chunk_moves`): (V - 1) / V of the rows, where an all-to-all of the whole array by the compiler
  would gather every stage's rows. `inverse`: chunks -> rows (the gradients, on their way back)."""
  if virtual_stages == 1:
    return rows
  k = rows.shape[0] // virtual_stages
  me = stage_index()
  out = jnp.zeros_like(rows)
  for moves in chunk_moves(num_stages, virtual_stages):
    if inverse:
      moves = [(dst, v, src, u) for src, u, dst, v in moves]
    sent, kept = [0] * num_stages, [0] * num_stages
    receives = [False] * num_stages
    for src, u, dst, v in moves:
      sent[src], kept[dst], receives[dst] = u, v, True
    piece = jax.lax.dynamic_slice_in_dim(rows, jnp.asarray(sent)[me] * k, k)
    got = jax.lax.ppermute(piece, PIPELINE, [(src, dst) for src, _, dst, _ in moves])
    placed = jax.lax.dynamic_update_slice_in_dim(out, got, jnp.asarray(kept)[me] * k, 0)
    out = jnp.where(jnp.asarray(receives)[me], placed, out)
  return out


def stage_index() -> jax.Array:
  """This device's stage (inside the pipeline's shard_map)."""
  return jax.lax.axis_index(PIPELINE)


def to_next_stage(x: jax.Array, num_stages: int, ring: bool = False) -> jax.Array:
  """Each stage's `x` at the next stage; the first stage receives zeros, or the last stage's `x` on a `ring`
  (interleaved chunks: the last stage's output enters stage 0's next chunk)."""
  last = num_stages if ring else num_stages - 1
  return jax.lax.ppermute(x, PIPELINE, [(s, (s + 1) % num_stages) for s in range(last)])


def to_previous_stage(x: jax.Array, num_stages: int, ring: bool = False) -> jax.Array:
  """Each stage's `x` at the previous stage (a gradient on its way back); the last stage receives zeros, or stage
  0's on a `ring`."""
  last = num_stages if ring else num_stages - 1
  return jax.lax.ppermute(x, PIPELINE, [((s + 1) % num_stages, s) for s in range(last)])


def from_last_stage(x: jax.Array, num_stages: int, axis: int = 0) -> jax.Array:
  """The last stage's `x` split over the stages along `axis` (stage s gets the s-th of S equal slices): one
  reduce-scatter, so what follows the pipeline (the LM head and the loss) runs on every stage's share."""
  last = stage_index() == num_stages - 1
  return jax.lax.psum_scatter(jnp.where(last, x, jnp.zeros_like(x)), PIPELINE, scatter_dimension=axis, tiled=True)


def fan_out(tree, valid_T: jax.Array, combine: Callable, identity: Callable):
  """`tree` broadcast along a new leading axis of len(valid_T) (one copy per loop iteration), whose transpose
  combines the iterations' cotangents with `combine` (taking only the `valid` iterations; `identity(shape)`: the
  value `combine` leaves unchanged) instead of summing them. Floating leaves only; others pass as they are."""
  leaves, treedef = jax.tree.flatten(tree)
  floating = [jnp.issubdtype(a.dtype, jnp.floating) for a in leaves]
  fanned = _fan_out([a for a, f in zip(leaves, floating) if f], valid_T, combine, identity)
  it = iter(fanned)
  n = valid_T.shape[0]
  out = [next(it) if f else jnp.broadcast_to(a, (n, *a.shape)) for a, f in zip(leaves, floating)]
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fan_out(leaves, valid_T, combine, identity):
  return [jnp.broadcast_to(a, (valid_T.shape[0], *a.shape)) for a in leaves]


def _fan_out_fwd(leaves, valid_T, combine, identity):
  return _fan_out(leaves, valid_T, combine, identity), valid_T


def _fan_out_bwd(combine, identity, valid_T, cts):
  def reduce(ct_T):
    start = identity(ct_T.shape[1:]).astype(ct_T.dtype)
    masked = jnp.where(valid_T.reshape((-1,) + (1,) * (ct_T.ndim - 1)), ct_T, start)
    return jax.lax.scan(lambda acc, c: (combine(acc, c), None), start, masked)[0]
  return [reduce(ct) for ct in cts], None


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def lowest(shape) -> jax.Array:
  """The identity of `jnp.maximum`."""
  return jnp.full(shape, -jnp.inf, jnp.float32)
