"""Checkpoint names and rematerialisation policy presets: the one place both live.

Layers tag the tensors a backward pass may want with `jax.ad_checkpoint.checkpoint_name`, using
the constants below (never spelled strings). A policy preset is data: the set of names kept on
device and the set moved to host memory; everything else is recomputed in the backward pass.
`jax.checkpoint` wraps one decoder block's body inside the layer scan (see layers/decoder.py), so
the scan carry (each block's input) is always kept and a policy decides the rest.

Quantized residuals are named `quantized.<projection>.<operand>`; operand is one of
`QUANTIZED_OPERANDS`: the forward GEMM's operands (`x`, `kernel`), and the copies quantized along
the backward GEMMs' contraction axes where a block-scaled recipe needs them (`x_t` for wgrad,
`kernel_t` for dgrad).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from ember.errors import ConfigError
from ember.names import LAYER_PROJECTIONS

# Activations (names follow MaxText's where one exists).
LAYER_INPUT = "decoder_layer_input"
QKV_PROJ = "qkv_proj"  # The fused query/key/value projection's output, whole (layers/attention.py).
QUERY = "query_proj"
KEY = "key_proj"
VALUE = "value_proj"
ATTENTION_INPUT = "attention_input"  # Q, K, V as attention reads them: after RoPE (and Qwen3's QK norm).
ATTENTION_CONTEXT = "attention_context"
OUT_PROJ = "out_proj"
# The residual stream after attention, x + out_proj's output: the sum the out projection's GEMM writes when it
# adds the residual in its epilogue. Kept, it is what the MLP's norm reads in the backward pass, so the projection's
# output alone need not be (nor added again).
ATTENTION_RESIDUAL = "attention_residual"
MLP_WI = "mlpwi"  # The fused gate/up projection's output [.., 2, F], whole (MaxText names its halves mlpwi_0 and
# mlpwi_1; saved apart, each half would be a copy of the GEMM's output, saved whole it is that output).
MLP_WO = "mlpwo"
MOE_WI_0 = "moe_wi_0"
MOE_WI_1 = "moe_wi_1"
MOE_WO = "moe_wo"
ROUTER_LOGITS = "router_logits"
MOE_ROUTING = "moe_routing"  # The top-k expert choices (uint8), and the counts an expert exchange sends; see ROUTED.
# The routed experts' outputs back in token order [T, k, D], what the combine weighs: its weights' gradient reads
# them, and rebuilt they would cross the expert axis again (layers/moe.py).
MOE_COMBINE = "moe_combine"
# Multi-head latent attention (ember/layers/mla.py): the low-rank query and the compressed key/value latent with
# the shared RoPE key, as their down-projections write them. Its queries, keys and values take QUERY, KEY, VALUE.
MLA_Q_LATENT = "mla_q_latent"
MLA_KV_LATENT = "mla_kv_latent"
# A multi-token-prediction module's projection of [embedding; hidden] (ember/layers/mtp.py), the input of its layer.
MTP_PROJ = "mtp_proj"

# A current-scaling tensor's amax (ember/quant/quantizers.py, CurrentScaling): a scalar every policy keeps. Its scale
# needs it before the cast, so recomputed it would be a pass of its own over the tensor. (Delayed scaling's amax is
# left to the policy: its forward pass does not need it, and XLA fuses its recompute into the backward's kernels.)
TENSOR_AMAX = "tensor_amax"

ACTIVATION_NAMES = (LAYER_INPUT, QKV_PROJ, QUERY, KEY, VALUE, ATTENTION_INPUT, ATTENTION_CONTEXT, OUT_PROJ,
                    ATTENTION_RESIDUAL, MLP_WI, MLP_WO, MOE_WI_0, MOE_WI_1, MOE_WO, MOE_COMBINE, ROUTER_LOGITS,
                    MOE_ROUTING, MLA_Q_LATENT, MLA_KV_LATENT, MTP_PROJ)

# Quantized residuals of every projection a checkpointed block runs (ember.names.LAYER_PROJECTIONS): the operand
# copies a quantized matmul may hold (ember/quant/recipe.py says which copies a recipe makes). The LM head names
# its copies too, but runs outside any checkpoint (its gradient is taken in the forward pass, ember/trainer/loss.py),
# so no policy can keep or drop them.
QUANTIZED = "quantized"
QUANTIZED_OPERANDS = ("x", "kernel", "x_t", "kernel_t")


def quantized_name(projection: str, operand: str) -> str:
  """The checkpoint name of one quantized residual, e.g. `quantized.wi.x`."""
  return f"{QUANTIZED}.{projection}.{operand}"


QUANTIZED_NAMES = tuple(quantized_name(p, o) for p in LAYER_PROJECTIONS for o in QUANTIZED_OPERANDS)
# The weight copies (`kernel`, `kernel_t`) and the activation copies (`x`, `x_t`) of QUANTIZED_NAMES.
QUANTIZED_KERNEL_NAMES = tuple(n for n in QUANTIZED_NAMES if n.rsplit(".", 1)[1].startswith("kernel"))
QUANTIZED_ACTIVATION_NAMES = tuple(n for n in QUANTIZED_NAMES if n not in QUANTIZED_KERNEL_NAMES)
# Residuals laid out in MoE routing order (sorted token copies). A policy that keeps any of them also
# keeps MOE_ROUTING: a recompute of the router need not be bitwise the forward's, and rows saved
# in one routing order are garbage under another (layers/moe.py).
ROUTED = (MOE_WI_0, MOE_WI_1, MOE_WO, MOE_COMBINE) + tuple(quantized_name(p, o) for p in ("moe_wi", "moe_wo")
                                              for o in QUANTIZED_OPERANDS)
ALL_NAMES = ACTIVATION_NAMES + QUANTIZED_NAMES

# The matmul outputs `minimal` keeps: every projection's, and attention's (its context and, where a fused kernel
# runs it, the softmax statistics that kernel's backward reads: layers/attention.py), so that its backward pass
# recomputes elementwise work only. Where the backward reads a matmul's output in another form, that form is listed
# too (q, k, v after RoPE; the residual sum the out projection's GEMM writes): a policy keeps what the backward reads
# of the names it lists, so that form is kept instead and nothing is rotated or added again.
MATMUL_OUTPUTS = (QKV_PROJ, QUERY, KEY, VALUE, ATTENTION_INPUT, ATTENTION_CONTEXT, OUT_PROJ, ATTENTION_RESIDUAL,
                  MLP_WI, MLP_WO, MOE_WI_0, MOE_WI_1, MOE_WO, MOE_COMBINE, ROUTER_LOGITS, MLA_Q_LATENT, MLA_KV_LATENT,
                  MTP_PROJ)


@dataclasses.dataclass(frozen=True)
class Preset:
  """What a policy keeps: names saved on device and names offloaded to host; `remat=False` = no checkpoint."""
  save: tuple[str, ...] = ()
  offload: tuple[str, ...] = ()
  remat: bool = True

  @property
  def quantized_only(self) -> bool:
    """Keeps quantized operand copies, which only a quantized recipe makes (under bf16 it is another preset)."""
    return any(n in QUANTIZED_NAMES for n in self.save + self.offload)


PRESETS: dict[str, Preset] = {
    "none": Preset(remat=False),
    "full": Preset(),
    "minimal": Preset(save=MATMUL_OUTPUTS),
    "save_quantized": Preset(save=QUANTIZED_NAMES),
    "minimal_quantized": Preset(save=MATMUL_OUTPUTS + QUANTIZED_NAMES),
    "save_qkv_proj": Preset(save=(QKV_PROJ, QUERY, KEY, VALUE, ATTENTION_INPUT, MLA_Q_LATENT, MLA_KV_LATENT)),
    "save_dot_except_mlp": Preset(save=(QKV_PROJ, QUERY, KEY, VALUE, ATTENTION_INPUT, ATTENTION_CONTEXT, OUT_PROJ,
                                        ATTENTION_RESIDUAL, ROUTER_LOGITS, MLA_Q_LATENT, MLA_KV_LATENT)),
    "minimal_offloaded": Preset(offload=MATMUL_OUTPUTS),
    "save_quantized_offloaded": Preset(offload=QUANTIZED_NAMES),
    # The activation copies to host, the weight copies kept on device. Under FSDP a weight copy is the
    # device's 1/fsdp shard in 8 bits, and one brought back from host is gathered after XLA has dequantized
    # it (bf16 gathers and bf16 GEMMs on the GPU; docs/remat.md): the FSDP choice.
    "save_quantized_x_offloaded": Preset(save=QUANTIZED_KERNEL_NAMES, offload=QUANTIZED_ACTIVATION_NAMES),
}
POLICIES = tuple(PRESETS) + ("custom", "auto")


def validate(remat_cfg) -> None:
  """Raises ConfigError for an unknown name in a custom list or an unknown candidate. (The policy's own name is
  one of POLICIES by its key's declared choices: ember/config/settings.py, Remat. `auto`'s budget is checked
  where it is used, ember/plan/auto_remat.py: the compile tools fill it in from the target's memory.)"""
  for key in ("save_names", "offload_names"):
    names = tuple(getattr(remat_cfg, key))
    unknown = [n for n in names if n not in ALL_NAMES]
    if unknown:
      raise ConfigError(f"config.remat.{key}: unknown checkpoint name {unknown[0]!r}; valid names: {', '.join(ALL_NAMES)}")
  if remat_cfg.policy == "custom" and not (remat_cfg.save_names or remat_cfg.offload_names):
    raise ConfigError("config.remat.policy: 'custom' with remat.save_names and remat.offload_names both empty keeps "
                      "nothing, as 'full' does: name what to keep, or choose 'full'")
  both = [n for n in remat_cfg.save_names if n in tuple(remat_cfg.offload_names)]
  if both:
    raise ConfigError(f"config.remat.offload_names: {both[0]!r} is also in remat.save_names; a tensor is either kept "
                      "on device or offloaded")
  unknown = [p for p in remat_cfg.auto_candidates if p not in PRESETS]
  if unknown:
    raise ConfigError(f"config.remat.auto_candidates: unknown preset {unknown[0]!r}; choose from {', '.join(PRESETS)}")


def preset(remat_cfg, name: str | None = None) -> Preset:
  """The Preset for a config's policy (`custom` reads the lists); `auto` must be resolved first."""
  name = name or remat_cfg.policy
  if name == "custom":
    return Preset(save=tuple(remat_cfg.save_names), offload=tuple(remat_cfg.offload_names))
  if name == "auto":
    raise ValueError("remat policy 'auto' must be resolved to a preset before building the model")
  return PRESETS[name]


def jax_policy(p: Preset) -> Callable | None:
  """A `jax.checkpoint` policy that saves `p.save`, offloads `p.offload` and recomputes the rest. Whatever the
  preset, it also saves TENSOR_AMAX (scalars), LAYER_INPUT (each layer's input: a checkpointed block of several
  layers, `model.moe_every` > 1, would otherwise keep its first layer's alone and run the others again to reach
  theirs; where a block is one layer, it is the block's input, kept anyway), and MOE_ROUTING where it keeps any
  ROUTED name.

  Offloading lowers to `annotate_device_placement` custom calls on GPU and TPU. The CPU backend
  keeps offloaded residuals in ordinary memory (its lowering of `device_put` drops memory kinds and
  XLA:CPU strips placement annotations), with the same numbers: see docs/remat.md.
  """
  if not p.remat:
    return None
  save, offload = frozenset(p.save) | {TENSOR_AMAX, LAYER_INPUT}, frozenset(p.offload)
  if (save | offload) & frozenset(ROUTED):
    save |= {MOE_ROUTING}

  def policy(prim, *_, **params):
    if prim.name != "name":
      return Recompute
    name = params["name"]
    if name in save:
      return Saveable
    if name in offload:
      return Offloadable(src="device", dst="pinned_host")
    return Recompute

  return policy


def checkpoint(fn: Callable, p: Preset, *, scanned: bool = True) -> Callable:
  """Wraps one decoder block's body. Inside a scan `prevent_cse=False` is right (and faster); a block called
  outside one (unrolled layers) needs XLA kept from merging its backward pass's recompute with the forward
  pass's values, which would keep every value alive and undo the policy."""
  if not p.remat:
    return fn
  return jax.checkpoint(fn, policy=jax_policy(p), prevent_cse=not scanned)
