# XLA flags and environment for H100 / H200 training: the one place they are chosen.
#
#   source launch/xla_flags.sh      # then: python train.py ...
#
# The options ember's numerics and recipes need (cuBLAS GEMMs, IEEE float32 division, no merged GEMMs) are not here:
# `import ember` adds them itself (REQUIRED_XLA_FLAGS, ember/xla_flags.py).
#
# Sourced by launch/slurm.sbatch and by the container command in launch/jobset.yaml. GPU-only:
# launch/local.sh (CPU processes) does not source it.
# Flags already in XLA_FLAGS come after these, so a value set by hand wins. XLA flags are
# jaxlib-version dependent: these were chosen for jax/jaxlib 0.10 (see the JAX GPU performance tips and
# NVIDIA JAX-Toolbox's GPU performance guide) and ran unchanged on 0.11.2 on an H100 (docs/performance.md);
# re-check them when upgrading.
#
# EMBER_LOOP_PIPELINING=0 leaves out the four loop-pipelining flags below (collectives moved into the previous
# loop iteration, double-buffered loops). They speed up FSDP over scanned layers: compiled for described H100s,
# llama3_8b's scanned steps are predicted 2.4-2.8% faster with them. Where they cost a step, its compile switches
# them off whatever this file says (ember/xla_flags.py, `loop_pipelining_off`): all four for pipeline stages (a
# llama3_70b layout on 64 GPUs with 1F1B over 4 stages was 16% slower with 11 GiB more at its peak), and the
# pipelined all-gather for layers run one after another, where it had XLA run each micro-batch's forward GEMMs
# twice (docs/performance.md, "XLA's scheduling flags"). Plan with the flags you launch with: ember.tools.plan and
# ember.tools.compile compile under the XLA_FLAGS they are given.

ember_xla_flags=(
  # Schedule collectives to overlap with compute (the FSDP all-gathers and reduce-scatters of
  # the scanned layers hide behind the previous layer's matmuls).
  --xla_gpu_enable_latency_hiding_scheduler=true
  # Issue async collectives on the highest-priority stream so compute kernels do not starve them.
  --xla_gpu_enable_highest_priority_async_stream=true
  # Combine all-gathers up to 128 MiB into one (fewer NCCL launches, better bandwidth).
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  # Combine all-reduces up to 128 MiB.
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  # Let all-gathers along different tensor dimensions combine too (weights of different shapes).
  --xla_gpu_enable_all_gather_combine_by_dim=false
  # ember decides what to rematerialise (remat.policy); XLA's own memory-driven remat pass would
  # recompute what a policy chose to save.
  --xla_disable_hlo_passes=rematerialization
  # Copy insertion by live ranges, not whole values: a scanned layer's loop no longer copies its carry (three
  # 64 MiB copies a layer on llama3_8b, 1.2-3.8 ms a step). XLA leaves it off on GPUs because the control edges
  # it adds can keep the latency-hiding scheduler from overlapping; with these flags every layout compiled was
  # predicted as fast or faster with it, the pipelined llama3_70b step 3.3% faster and 8.3 GiB smaller
  # (docs/performance.md, "A pipeline's ring written in place, and loop carries without copies").
  --xla_gpu_copy_insertion_use_region_analysis=true
)
# No reduce-scatter combine threshold: XLA's own is kept. Combined up to 64 MiB, as this file once set, each
# micro-batch's last gradients waited at the end of its backward pass (llama3_8b at 16 micro-batches of 8 on
# 8 H100s: predicted 3.2% slower).
ember_loop_pipelining_flags=(
  # Pipeline each layer's weight all-gather across scan iterations: layer i+1's weights are
  # gathered while layer i computes.
  --xla_gpu_enable_pipelined_all_gather=true
  # The same for the gradient reduce-scatter of the backward scan.
  --xla_gpu_enable_pipelined_reduce_scatter=true
  # The same for all-reduces in the scan (data-parallel gradients, tensor-parallel activations).
  --xla_gpu_enable_pipelined_all_reduce=true
  # Unroll the layer scan by two so consecutive layers' pipelined collectives use separate buffers.
  --xla_gpu_enable_while_loop_double_buffering=true
)
if [[ "${EMBER_LOOP_PIPELINING:-1}" != 0 ]]; then
  ember_xla_flags+=("${ember_loop_pipelining_flags[@]}")
fi
export XLA_FLAGS="${ember_xla_flags[*]}${XLA_FLAGS:+ ${XLA_FLAGS}}"
unset ember_xla_flags ember_loop_pipelining_flags

# Let XLA take 90% of each GPU (default 75%); the rest is for NCCL and cuDNN workspaces.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
# One hardware work queue per GPU: keeps the launch order XLA's latency-hiding scheduler chose,
# so collectives overlap compute as planned (recommended on Hopper; not on Blackwell).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
