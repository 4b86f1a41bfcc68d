"""The names ember's pieces agree on, spelled once: logical axes, batch keys, projections, RNG streams,
MoE statistics. A leaf module: code imports these constants and never respells the strings.

Checkpoint (remat) names live with the remat presets in ember/remat.py.
"""

from __future__ import annotations

# --- Logical axes: layers name these; the config's `mesh.rules` maps them to mesh axes. -----------
BATCH = "batch"
LENGTH = "length"
# The residual stream's length between a layer's attention and MLP blocks (its norms, adds and saved inputs): split
# over `tensor` as well as `context` (sequence parallelism), where LENGTH, the blocks' own, is whole on a tensor group.
RESIDUAL_LENGTH = "residual_length"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
# The MLP's hidden units as the down projection reads them (its kernel's leading axis): split over `tensor` as `mlp`
# is, and over the axes that shard the parameters (those `embed` would otherwise take in that kernel). A kernel split
# along its leading axis is gathered and has its gradient reduce-scattered with no transpose; split along `embed`,
# its last, the step copied each layer's float32 gradient and optimizer moments into the other layout once more.
MLP_IN = "mlp_in"
VOCAB = "vocab"
EXPERT = "expert"
LAYERS = "layers"
# The stacked layers of a scan segment that a pipeline does not split into stages (ModelConfig.staged_segment): the
# few layers before or after the staged run, which the first or the last stage runs whole.
EDGE_LAYERS = "edge_layers"
NORM = "norm"
QKV = "qkv"  # The (q groups, k, v) axis of the fused QKV kernel.
GATE = "gate"  # The (gate, up) axis of the fused SwiGLU kernel.
LOGICAL_AXES = (BATCH, LENGTH, RESIDUAL_LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, EXPERT, LAYERS,
                EDGE_LAYERS, NORM, QKV, GATE, MLP_IN)
RESIDUAL = (BATCH, RESIDUAL_LENGTH, EMBED)  # The residual stream's axes (ember/layers/decoder.py).
BLOCK = (BATCH, LENGTH, EMBED)  # A block's tokens whole on a tensor group (an MoE block's input; Linear.block_output).

# Mesh axes, in the mesh's order (the last vary fastest: tensor and expert on the closest devices).
MESH_AXES = ("pipeline", "data", "fsdp", "context", "tensor", "expert")
TENSOR = "tensor"  # The mesh axis tensor parallelism splits heads and MLP units over (kept inside a host).
PIPELINE = "pipeline"  # The mesh axis the decoder's layers are split into stages over (ember/parallel/pipeline.py).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

# --- A batch: int32 [batch, length] arrays under these keys (ember/data/pipeline.py builds them). ---
INPUTS = "inputs"
TARGETS = "targets"
SEGMENT_IDS = "segment_ids"  # 0 = padding; packed documents are 1, 2, ...
POSITIONS = "positions"  # Restart at 0 in every document.
BATCH_KEYS = (INPUTS, TARGETS, SEGMENT_IDS, POSITIONS)
# With `data.mixture`: the source of each token (1 + its index in the mixture; 0 = padding). The loop
# counts it for the per-source token shares and does not send it to the devices.
SOURCE = "source"

# --- Projections: the `name` of every quantized matmul (names its residuals, seeds its noise). ----
# Multi-head latent attention (ember/layers/mla.py) replaces `qkv` with q_a, q_b (or q_b alone: the full query
# projection), kv_a (the compressed latent and the shared RoPE key) and kv_b (the latent's keys and values);
# `mtp_proj` is a multi-token-prediction module's projection of [embedding; hidden] (ember/layers/mtp.py).
LAYER_PROJECTIONS = ("qkv", "out", "wi", "wo", "moe_wi", "moe_wo", "shared_wi", "shared_wo", "q_a", "q_b", "kv_a",
                     "kv_b", "mtp_proj")
LM_HEAD = "lm_head"
PROJECTIONS = LAYER_PROJECTIONS + (LM_HEAD,)

# The stochastic-rounding stream of each projection kind: its key is `fold_in(layer_key, stream)`.
# Explicit numbers, so that reordering a tuple can never change the noise (and a resumed run's bits).
RNG_STREAMS = {"qkv": 0, "out": 1, "wi": 2, "wo": 3, "moe_wi": 4, "moe_wo": 5, "shared_wi": 6, "shared_wo": 7,
               "lm_head": 8, "q_a": 9, "q_b": 10, "kv_a": 11, "kv_b": 12, "mtp_proj": 13}

# --- MoE statistics a layer returns (summed over layers; logged only by MoE models). ----------------
MOE_LOAD_BALANCE_LOSS = "moe_load_balance_loss"
MOE_ROUTER_Z_LOSS = "moe_router_z_loss"
MOE_SEQ_BALANCE_LOSS = "moe_seq_balance_loss"  # DeepSeek-V3's sequence-wise balance loss (model.seq_load_balance_weight).
MOE_DROPPED_TOKENS = "moe_dropped_tokens"
MOE_ROUTED_TOKENS = "moe_routed_tokens"
MOE_OVERFLOW_TOKENS = "moe_overflow_tokens"  # Copies beyond the ragged dispatcher's receive buffer.
# MoE layer choices (ember/layers/moe_dispatch.py says what each means): `model.moe_dispatch`, the token
# exchange under expert parallelism, and `model.moe_expert_gemm`, the expert GEMMs' layout.
MOE_DISPATCHERS = ("auto", "allgather", "alltoall", "ragged")
MOE_EXPERT_GEMMS = ("auto", "ragged_dot", "capacity")
# Counts also kept per layer (`<key>_by_layer`, [num_layers]) and summed over every step between two logged
# steps: a copy dropped on a step that is not logged is still counted, and a warning can name its layer.
MOE_LAYER_COUNTS = (MOE_DROPPED_TOKENS, MOE_OVERFLOW_TOKENS)
# The copies routed to each expert [experts] of an MoE layer: kept per layer (`<key>_by_layer`, [num_layers,
# experts], zeros for dense layers) and summed over a step's micro-batches; the step reads it for the router bias
# and for MOE_LOAD_MAX_OVER_MEAN (its largest expert's load over the mean, averaged over the MoE layers).
MOE_EXPERT_LOADS = "moe_expert_loads"
MOE_LOAD_MAX_OVER_MEAN = "moe_load_max_over_mean"
BY_LAYER = "_by_layer"
# The name scope around every expert GEMM (forward, dgrad, wgrad): the compile report finds the expert
# GEMMs of the compiled program by it (op_name metadata), whatever kernel XLA chose for them.
EXPERT_GEMM_SCOPE = "expert_gemm"
# The name scope around a block-scaled GEMM emulated in bf16 where the GPU has no kernel for it
# (ember/quant/gemm.py): the compile report counts those GEMMs as `emulated`.
EMULATED_GEMM_SCOPE = "emulated_block_scaled_gemm"
# The name scope around cuDNN's block-scaled GEMM (ember/quant/gemm.py): the compile report's `memory_by_op` names
# the non-GEMM kernels of its partitioned region (NVFP4's float32 result scaled and cast) by it.
BLOCK_SCALED_GEMM_SCOPE = "block_scaled_gemm"
# The name scope around NVFP4's random Hadamard transform (16x16 float32 GEMMs on the wgrad operands): the
# compile report keeps them out of the expert GEMMs they feed.
HADAMARD_SCOPE = "random_hadamard_transform"
# The name scope around a kernel that reads one row of its largest operand, stacked [L, ...] (a layer's kernel where
# it lies among stacked kernels, ember/quant/fused_nvfp4.py), with L filled in: the compile report counts that
# row's bytes of the operand, not all L (ember/program/hlo.py).
STACKED_ROW_SCOPE = "reads_one_row_of_{}"
# The name scope around a `cond` whose branches run on some of its executions only, with how many of how many filled
# in (a pipeline's segments off the stages, ember/trainer/pipelined.py: on M of a pass's MV + S - 1 ticks, one
# stage's): the compile report counts them that share of the conditional's runs (ember/program/hlo.py).
RUNS_OF_SCOPE = "branch_runs_{}_of_{}"
# The name scope around a pipeline tick's backward work that autodiff does not name (1F1B takes each chunk's VJP by
# hand and adds its cotangents into the stage's accumulators, ember/trainer/pipelined.py): the compile report counts
# it in the backward pass, as JAX's `transpose(` names say of autodiff's (ember/program/cost.py, `pass_of`).
BACKWARD_SCOPE = "backward_tick"
AUX_KEYS = (MOE_LOAD_BALANCE_LOSS, MOE_ROUTER_Z_LOSS, MOE_DROPPED_TOKENS, MOE_ROUTED_TOKENS, MOE_OVERFLOW_TOKENS,
            MOE_SEQ_BALANCE_LOSS)

# Data sources (`data.source`, and the kind of a `data.mixture` entry) and what each needs besides its
# name, one table: the config's checks, the loaders and the progress line read it.
#   "path": a glob of files; "text_key": the record field that holds the text (jsonl / parquet records);
#   "tfds_name": a TFDS dataset; "hf_dataset": a Hugging Face dataset. `MIXABLE_SOURCES`: the kinds a mixture
#   entry may be (the two dataset libraries' are not). `RECORD_SOURCES`: files of records, whose bad records are
#   skipped and counted (ember/data/records.py).
SOURCE_NEEDS = {
    "synthetic": (),
    "text": (),
    "array_record": ("path",),
    "tfds": ("tfds_name",),
    "hf": ("hf_dataset", "text_key"),
    "jsonl": ("path", "text_key"),
    "parquet": ("path", "text_key"),
}
DATA_SOURCES = tuple(SOURCE_NEEDS)
MIXABLE_SOURCES = tuple(s for s in DATA_SOURCES if s not in ("tfds", "hf"))
RECORD_SOURCES = tuple(s for s, needs in SOURCE_NEEDS.items() if needs == ("path", "text_key"))

# `train.optimizer` (ember/trainer/optimizer.py), and the dtypes optimizer state and Muon's iteration may use.
OPTIMIZERS = ("adamw", "muon")
STATE_DTYPES = ("float32", "bfloat16")
