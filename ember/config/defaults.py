"""Every key of ember's config and its default, with a comment on each key.

A config file starts from `get_config()` here (`from ember.config import defaults`) and changes what it needs;
a key not listed here is an error. Any key can be overridden on the command line:
`--config.model.num_layers=8`. Values derived from these (head_dim, the mesh shape once devices are known, ...)
are computed in ember/config/settings.py, never stored here.
"""

import ml_collections

from ember.quant.recipe import UNQUANTIZED

# data.eval_fraction's default, also the tokenizer trainer's (ember/data/train_tokenizer.py), so the documents a
# run holds out for eval are ones its tokenizer never read.
EVAL_FRACTION = 0.05


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "runs/default"  # metrics.jsonl, tensorboard/ and checkpoints/ go here.
  c.seed = 0  # One seed for init, data order and stochastic-rounding noise.
  c.steps = 1000  # Number of optimizer steps to train for.

  m = c.model = ml_collections.ConfigDict()
  m.name = "tiny"  # The preset the shapes came from (informational; set by configs/models/).
  m.num_layers = 2  # Decoder layers.
  m.d_model = 64  # Residual stream width.
  m.num_heads = 4  # Query heads; must divide d_model unless head_dim is set.
  m.num_kv_heads = 2  # Key/value heads (grouped-query attention); must divide num_heads.
  m.head_dim = 0  # 0 = d_model // num_heads.
  m.d_ff = 128  # Hidden units of the SwiGLU MLP (and of each expert).
  m.vocab_size = 0  # 0 = the tokenizer's vocabulary rounded up to a multiple of 128 (the byte tokenizer: 256).
  m.seq_len = 128  # Tokens per training sequence (packed).
  m.rope_theta = 10000.0  # Rotary embedding base.
  m.rope_scaling_factor = 0.0  # Llama 3.1's RoPE scaling (HF rope_type "llama3"): long wavelengths / this; 0 = none.
  m.rope_low_freq_factor = 1.0  # Wavelengths past rope_original_seq_len / this are scaled by the factor,
  m.rope_high_freq_factor = 4.0  # those below rope_original_seq_len / this kept, a smooth mix between.
  m.rope_original_seq_len = 8192  # The context the model was first trained at.
  m.norm_eps = 1e-5  # RMSNorm epsilon.
  m.qk_norm = False  # RMSNorm over each head's dims on queries and keys, before RoPE (Qwen3's QK-norm).
  # True: the layers run under one scan, so the program holds one layer and compiles in the time of one. False:
  # one after another, each checkpointed alone: the compile grows with the depth, but no layer's saved
  # activations are copied into a stacked buffer (nor that buffer zeroed) each step. Same parameters and
  # checkpoints either way (docs/remat.md, "Scanned or unrolled layers").
  m.scan_layers = True
  m.tie_embeddings = False  # Use the token embedding as the LM head.
  m.param_dtype = "float32"  # Master weights and optimizer state.
  m.dtype = "bfloat16"  # Activation / compute dtype.
  m.attention = "auto"  # "auto" (cuDNN flash attention on GPU, XLA elsewhere), "xla", "cudnn".
  m.init_std = 0.02  # Normal init for embeddings and projections (out projections scaled by depth).
  # Mixture of experts. num_experts = 0 means every layer is dense.
  m.num_experts = 0  # Routed experts per MoE layer.
  m.experts_per_token = 2  # Top-k.
  m.moe_every = 1  # Every n-th layer is MoE (1 = all); the others are dense.
  m.shared_expert_d_ff = 0  # Width of an always-on shared expert (0 = none).
  m.router_softmax_first = False  # False: softmax over the selected k; True: softmax, top-k, renormalise.
  m.norm_topk_prob = True  # Softmax-first or sigmoid scores: renormalise the top-k weights to sum to 1 (Qwen3-MoE,
  # DeepSeek-V3); False: the top-k probabilities as they are (DeepSeekMoE, Qwen2-MoE).
  m.capacity_factor = 0.0  # 0 = dropless; > 0 = drop tokens past capacity_factor * tokens*k/experts.
  # Token exchange under expert parallelism (ember/layers/moe_dispatch.py): "allgather" (gather the
  # expert group's tokens), "alltoall" (fixed buffers), "ragged" (only the routed copies; GPUs), or
  # "auto" (ragged on GPUs, allgather elsewhere).
  m.moe_dispatch = "auto"
  m.moe_ragged_buffer = 2.0  # ragged: receive-buffer rows = this x tokens x k per device; overflow is
  # counted in moe_overflow_tokens.
  # The expert GEMMs (ember/layers/moe_dispatch.py): "ragged_dot" (jax.lax.ragged_dot over the sorted rows:
  # exact work on CPUs, every local expert's on GPUs), "capacity" (a slot of rows per local expert and one
  # batched GEMM: batched FP8 cuBLASLt GEMMs on GPUs), or "auto" (capacity on GPUs with several local experts).
  m.moe_expert_gemm = "auto"
  m.moe_expert_buffer = 1.25  # capacity, dropless: a slot holds this x the balanced load; the rest is
  # counted in moe_overflow_tokens (with capacity_factor > 0 the slot holds exactly what the capacity keeps).
  m.load_balance_weight = 0.01  # Switch load-balancing loss weight.
  m.router_z_weight = 0.001  # Router z-loss weight.
  m.router_bias_update_rate = 0.0  # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the routing
  # scores for the top-k choice only, moved by this much per optimizer step toward balanced loads (after each
  # step: bias += rate * sign(mean load - load)); 0 = off. Usually with load_balance_weight = 0 (or tiny).
  # DeepSeek-V3's MoE (docs/deepseek.md, "DeepSeek's MoE"). "softmax" or "sigmoid" routing scores; sigmoid weights the
  # chosen experts by their scores renormalised over the k, times routed_scaling_factor.
  m.router_score = "softmax"
  m.n_group = 1  # Expert groups (contiguous experts); tokens choose their experts within the best topk_group
  m.topk_group = 1  # groups, a group scored by its two best experts (node-limited routing: a group per node).
  m.routed_scaling_factor = 1.0  # Multiplies the routed experts' weights.
  m.num_shared_experts = 0  # Always-on shared experts beside the routed ones, each of d_ff (DeepSeek-V3: 1).
  m.first_k_dense = 0  # The first k layers are dense (of dense_d_ff), the rest MoE.
  m.dense_d_ff = 0  # Width of the dense layers' SwiGLU in an MoE model (0 = d_ff).
  m.seq_load_balance_weight = 0.0  # DeepSeek-V3's sequence-wise balance loss (each packed row's loads; 0 = off).
  # Multi-head latent attention (ember/layers/mla.py), on where kv_lora_rank > 0: keys and values come from a
  # compressed latent of kv_lora_rank and a RoPE key of qk_rope_head_dim shared by all heads; queries from a
  # q_lora_rank latent (0 = a full projection). Per head: qk_nope_head_dim + qk_rope_head_dim query/key dims and
  # v_head_dim value dims. Sampling caches the latent and the RoPE key.
  m.q_lora_rank = 0
  m.kv_lora_rank = 0
  m.qk_rope_head_dim = 0
  m.qk_nope_head_dim = 0
  m.v_head_dim = 0
  # Multi-token prediction (ember/layers/mtp.py): mtp_depth modules predicting 2, 3, ... tokens ahead, sharing the
  # embedding and LM head; their mean loss (logged as mtp_loss) is added with mtp_loss_weight. Off in sampling.
  m.mtp_depth = 0
  m.mtp_loss_weight = 0.3

  t = c.train = ml_collections.ConfigDict()
  t.batch_size = 8  # Global batch, in sequences.
  t.learning_rate = 3e-3  # Peak learning rate.
  t.warmup_steps = 50  # Linear warm-up from 0 to the peak.
  t.decay_steps = 0  # Cosine decay length; 0 = until `steps`.
  t.min_lr_ratio = 0.1  # Cosine decays to learning_rate * min_lr_ratio.
  t.b1 = 0.9  # AdamW beta1.
  t.b2 = 0.95  # AdamW beta2.
  t.eps = 1e-8  # AdamW epsilon.
  t.weight_decay = 0.1  # Decoupled weight decay.
  t.decay_norms_and_embeddings = False  # Apply weight decay to norm scales and embeddings too.
  t.grad_clip_norm = 1.0  # Clip by global norm; 0 = off.
  t.optimizer = "adamw"  # "adamw", or "muon": Muon on the projection kernels, AdamW (the keys above) on
  # embeddings, norms, the router and the LM head (ember/trainer/optimizer.py).
  t.muon_learning_rate = 0.02  # muon: peak learning rate of the kernels (same warm-up and decay shape).
  t.muon_weight_decay = 0.0  # muon: decoupled weight decay of the kernels.
  t.muon_momentum = 0.95  # muon: momentum coefficient (Nesterov).
  t.muon_ns_steps = 5  # muon: Newton-Schulz iterations.
  t.muon_ns_dtype = "float32"  # muon: the dtype the Newton-Schulz iterations run in ("float32" or "bfloat16").
  t.optimizer_state_dtype = "float32"  # The dtype the moments / momentum are stored in between steps ("bfloat16"
  # halves their bytes; the update itself is computed in float32).
  t.shard_optimizer_state = True  # Split the optimizer state over the data- and expert-parallel replicas (ZeRO-1, as
  # Megatron's distributed optimizer): each gradient is reduce-scattered over them once a step, each replica updates
  # its piece and the new parameters are gathered back (trainer/state.py, `replica_splits`). False: every replica
  # holds and updates the whole state. Meshes without replicas (FSDP already splits the state) are unchanged.
  t.grad_accum_steps = 1  # Micro-batches per optimizer step: batch_size / grad_accum_steps sequences each, run
  # one after another with their gradients summed; batch_size stays the step's global batch.
  t.device_batch_size = 0  # > 0: sequences per device in each micro-batch, and grad_accum_steps follows from the mesh:
  # batch_size / (device_batch_size x the data-parallel devices). A job restarted on fewer devices then keeps each
  # device's memory and the global batch. 0 = grad_accum_steps as set.
  t.grad_reduce_dtype = "float32"  # The dtype each weight gradient leaves its GEMM in, and so the dtype it is
  # reduced in across data-parallel / FSDP devices: "bfloat16" halves those bytes (the GEMM still sums in
  # float32; micro-batch accumulation and the optimizer stay float32).
  t.schedule_by_prediction = True  # On GPUs ember/hardware/ has rates for: compile the step a second time with XLA's
  # scheduler told each kernel's and collective's predicted time, so that it overlaps the collectives it left
  # waiting (ember/program/schedule.py; about twice the compile time). False: XLA's own estimates, one compile.
  t.loss_chunk_size = 1024  # Live logits of the cross-entropy: about this many tokens' full-vocab logits per row
  # (each device's share of the sequence is cut into ceil(its length / loss_chunk_size) token chunks, a count that
  # divides it; ember/trainer/loss.py); 0 = all at once.
  t.z_loss_weight = 0.0  # Weight of the log(Z)^2 auxiliary loss.
  t.eval_every_steps = 100  # Eval loss every N steps (and after the last); 0 = never.
  t.eval_batches = 4  # Batches of the held-out split per evaluation.
  t.profile_start_step = -1  # Profiler trace of steps [start, start + profile_steps) into workdir; -1 = off.
  t.profile_steps = 3
  # Fault tolerance (docs/multihost.md, "When a job fails").
  t.max_skipped_steps = 10  # A step whose loss or gradients are not finite is skipped (no update; counted in
  # skipped_steps); this many in a row end the run (exit status 3). 0 = never end it.
  t.step_timeout_s = 0.0  # A step (and its logging) that takes longer ends the job (status 75, Python stacks in
  # the log; a stopped process or a stalled collective): 0 = 10x the median step once 5 are timed, at least 120 s;
  # -1 = never.
  # The exit status of a run stopped by SIGTERM (or Ctrl-C) once its checkpoint is saved: 0 where the scheduler
  # requeues a preempted job itself (SLURM), non-zero where it restarts only a failed one (Kubernetes' Jobs count
  # an exit 0 as done: launch/jobset.yaml sets 143).
  t.preempted_exit_status = 0
  t.compile_timeout_s = 3600.0  # The same for a stage that compiles or saves a checkpoint (and steps before timing).
  t.compilation_cache_dir = ""  # JAX's persistent compilation cache: a restarted or requeued job, and a sweep's
  # runs of one program, load the compiled steps from here instead of compiling them again. A directory (or gs://
  # path) every process of the job can read; "" = off, unless JAX_COMPILATION_CACHE_DIR is set.

  q = c.quant = ml_collections.ConfigDict()
  q.recipe = UNQUANTIZED  # bf16 (no quantization) | fp8_delayed | fp8_current | mxfp8 | nvfp4.
  q.exclude = ("lm_head",)  # Projections kept in bf16: a kind ("lm_head", "wo"), layers ("layers[0]",
  # "layers[-2:]": the last two; "mtp": the multi-token-prediction modules) or both ("layers[0:4].qkv"). Grammar:
  # ember/quant/recipe.py.
  q.amax_history_len = 1024  # fp8_delayed: amax history length.
  q.amax_compute_algo = "max"  # fp8_delayed: "max" or "most_recent" of the history.
  q.margin = 0  # fp8_delayed: scale_inv = amax * 2**margin / fp8_max (rounded up to a bfloat16: docs/quantization.md).
  q.nvfp4_rht = True  # nvfp4: random Hadamard transform on the wgrad operands.
  q.nvfp4_stochastic_rounding = True  # nvfp4: stochastic rounding of gradients.
  q.nvfp4_2d_weights = True  # nvfp4: 16x16 weight tiles (False: 1x16 along the contraction axis).
  q.rht_seed = 0  # Seed of the fixed random signs of the Hadamard transform.
  q.forward = "recipe"  # The forward GEMMs in the recipe's format, or "bf16" (the backward GEMMs keep the recipe).
  # Precision schedule: ((when, {quant key: value, ...}), ...), each entry's overrides of quant.* applied from
  # step `when` (an int) or from that fraction of `steps` (a float in (0, 1)) on; e.g. nvfp4 with the forward
  # GEMMs in bf16 for the last 20%: ((0.8, {"forward": "bf16"}),). The step recompiles once at each switch
  # (ember/trainer/precision.py).
  q.schedule = ()

  r = c.remat = ml_collections.ConfigDict()
  r.policy = "save_quantized"  # See ember/remat.py for the presets.
  r.save_names = ()  # policy=custom: checkpoint names to keep on device.
  r.offload_names = ()  # policy=custom: checkpoint names to move to host memory.
  r.memory_budget_gb = 0.0  # policy=auto: per-device budget for the compiled peak, GiB (2**30 bytes).
  r.auto_candidates = ()  # policy=auto: presets to try (empty = all that apply).

  d = c.data = ml_collections.ConfigDict()
  d.source = "text"  # synthetic | text | array_record | tfds | hf | jsonl | parquet.
  d.path = ""  # text: glob of files ("" = this interpreter's stdlib *.py); array_record: glob of files.
  d.tokenizer = "byte"  # "byte", a SentencePiece .model file, or a Hugging Face tokenizer.json (or its directory).
  d.eval_fraction = EVAL_FRACTION  # Share of documents held out for eval (by a hash of their name); the default
  # corpus has ~1,800 files, and at 2% a few large ones would dominate the eval bytes.
  d.chunk_shuffle_window = 16384  # Chunks shuffled together before packing (~200 stdlib files): batches
  # mix many documents, so consecutive steps do not train on the same few files. 0 = off. Synthetic data: at most 64
  # batches' worth of chunks (ember/data/pipeline.py).
  d.tfds_name = ""  # tfds: dataset name, e.g. "lm1b".
  d.tfds_data_dir = ""  # tfds: data_dir ("" = TFDS default).
  d.tfds_text_key = "text"  # tfds: the feature holding the text.
  d.hf_dataset = ""  # hf: a Hugging Face dataset: a hub name ("HuggingFaceFW/fineweb-edu"), or a local folder of
  # data files or a loading script (`datasets.load_dataset`'s path; needs `pip install -e '.[hf]'`).
  d.hf_config = ""  # hf: the dataset's configuration ("" = its default), e.g. "sample-10BT".
  d.hf_split = "train"  # hf: the dataset's split to read; ember holds out data.eval_fraction of it for eval.
  d.text_key = "text"  # jsonl, parquet, hf: the field / column holding each record's text (ember/data/records.py).
  d.cache_dir = ""  # jsonl: where .gz / .zst files are decompressed once ("" = the system temp directory);
  # hf: the datasets cache ("" = datasets' own, under HF_HOME).
  # Several sources mixed by weight (replaces data.source / path / text_key): a tuple of
  # (name, source, path, text_key, weight), e.g. (("code", "text", "src/**/*.py", "", 0.8),
  # ("web", "jsonl", "web/*.jsonl.zst", "text", 0.2)). Each source's share of the tokens follows its
  # weight (ember/data/mixing.py) and is logged as data_share/<name>. () = the single source above.
  d.mixture = ()
  d.eval_mixture = ()  # The held-out split's mixture, if it should differ; () = data.mixture's.
  d.num_threads = 2  # Grain prefetch threads.
  d.num_shards = 0  # Data shards: independent pipelines, each a block of rows of the global batch, spread
  # over the processes. 0 = one per row (train.batch_size): the batches are the same on any process count
  # that divides the batch, and resume across process counts.

  mesh = c.mesh = ml_collections.ConfigDict()
  mesh.data = 1  # Pure data parallelism (replicated parameters).
  mesh.fsdp = -1  # Fully-sharded data parallelism (-1 = fill with the remaining devices).
  mesh.context = 1  # Context parallelism: each sequence split over this many devices (docs/long_context.md);
  # they shard the parameters and optimizer state as `fsdp` does.
  mesh.tensor = 1  # Tensor parallelism over heads and MLP hidden units.
  mesh.expert = 1  # Expert parallelism (MoE).
  mesh.dcn_data = 1  # Across hosts (slow network): multiplies `data`.
  mesh.dcn_fsdp = 1  # Across hosts: multiplies `fsdp`.
  mesh.dcn_expert = 1  # Across hosts: multiplies `expert` (expert parallelism over the network).
  mesh.pipeline = 1  # Pipeline parallelism: the decoder's layers split into this many stages (docs/parallelism.md).
  mesh.dcn_pipeline = 1  # Across hosts: multiplies `pipeline` (stages on different nodes: the usual place for it).
  # Logical axis -> mesh axes. Layer code names logical axes only; this table decides the rest.
  mesh.rules = (
      ("batch", ("data", "fsdp", "expert")),
      ("length", "context"),
      ("residual_length", ("context", "tensor")),  # Sequence parallelism: docs/parallelism.md.
      ("embed", ("fsdp", "context")),
      ("heads", "tensor"),
      ("kv_heads", "tensor"),
      ("head_dim", None),
      ("mlp", "tensor"),
      ("mlp_in", ("tensor", "fsdp", "context")),  # The down projection's input: ember/names.py.
      ("vocab", "tensor"),
      ("expert", "expert"),
      ("layers", "pipeline"),  # Each pipeline stage holds its own layers.
      ("norm", None),
      ("qkv", None),
      ("gate", None),
  )

  pp = c.pipeline = ml_collections.ConfigDict()  # Used where mesh.pipeline x mesh.dcn_pipeline > 1.
  # gpipe: every micro-batch's forward, then every backward; 1f1b: a forward and a backward pass a tick, at most
  # 2S - 1 micro-batches kept; interleaved_1f1b: 1f1b over `virtual_stages` chunks a stage (ember/parallel/pipeline.py).
  pp.schedule = "gpipe"
  pp.virtual_stages = 1  # Chunks of layers a stage holds (interleaved_1f1b only); 1 = one contiguous stage.

  ck = c.checkpoint = ml_collections.ConfigDict()
  ck.every_steps = 500  # Save every N steps (and at the end); 0 = only at the end; -1 = never.
  ck.keep = 3  # Number of checkpoints kept.
  ck.async_save = True  # Save in a background thread while training continues.
  ck.local_dir = ""  # Node-local storage for the local tier ("{process}" is replaced by the process index): each
  # process's part of the state, and a copy of its peer's (docs/checkpointing.md, "Local checkpoints").
  ck.local_every_steps = 0  # Save to local_dir every N steps (0 = never); a restart takes the newest of either tier.
  ck.restore_from = ""  # Start a new run from this checkpoint directory (or step directory).
  ck.params_only = False  # With restore_from: take only the parameters.
  ck.init_from_hf = ""  # Start a new run from a Hugging Face Llama / Mixtral / Qwen3 / DeepSeek-V3 directory whose
  # shapes match the model (ember/hf/): parameters only, sharded straight onto the mesh.

  lg = c.log = ml_collections.ConfigDict()
  lg.every_steps = 10  # Console line, metrics.jsonl and TensorBoard every N steps.
  lg.tensorboard = True  # Write TensorBoard event files.
  lg.verbose = False  # Also show the native libraries' own log lines (XLA's C++ warnings, Gloo's connections);
  # read from the command line before JAX loads (train.py), so give it there: --config.log.verbose=true.
  lg.wandb_project = ""  # Also log every record to this Weights & Biases project ("" = off; needs the extra
  # `pip install -e '.[wandb]'`; WANDB_MODE=offline keeps it on disk). A resumed run continues the same W&B run.
  lg.wandb_entity = ""  # The W&B team or user ("" = the logged-in default).
  lg.wandb_run_name = ""  # The W&B run's name ("" = the workdir's last folder).
  lg.straggler_ratio = 1.3  # Several processes: warn when the slowest process's devices run a fixed GEMM probe this
  # many times slower than the median's (ember/trainer/watchdog.py); straggler_* keys in metrics.jsonl.
  lg.quant_stats_every = 0  # Quantization health (amax, scale, saturation, underflow, staleness per projection
  # and role; ember/quant/health.py) every N steps, with warnings past its thresholds; 0 = off (the step is
  # compiled without them).

  dist = c.distributed = ml_collections.ConfigDict()
  dist.coordinator_address = ""  # host:port of process 0 ("" = from the environment, or SLURM).
  dist.num_processes = 0  # 0 = from the environment (EMBER_NUM_PROCESSES) or SLURM.
  dist.process_id = -1  # -1 = from the environment (EMBER_PROCESS_ID) or SLURM.
  return c
