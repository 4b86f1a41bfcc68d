"""The unquantized GEMM of every layout (dense, grouped, capacity), with the one custom VJP they share.

Each layout says only how it contracts two operands for each pass (its `Contract`: x @ w forward, g @ w.T
dgrad, x.T @ g wgrad); the rule for dtypes lives here. Every GEMM takes compute-dtype operands and accumulates
in float32, written in its consumer's dtype by the GEMM itself on GPUs (quant/gemm.py's `output_dtype`), in
float32 and then rounded on the CPU.

Why a custom VJP: autodiff of `dot(..., preferred_element_type=f32)` pairs the float32 cotangent with the
operand, and XLA runs dgrad and wgrad as f32 x f32 GEMMs (TF32's rate on twice the bytes). Here the cotangent
is cast to the compute dtype first: the cotangent of a bf16 output is bf16-exact, so that changes no value; a
float32 output's (the LM head's logits) is rounded there, as every quantized projection's is.

wgrad writes `wgrad_dtype` (Recipe.wgrad_out): the weight's own (float32: under FSDP XLA reduce-scatters the
f32 sum, before any rounding) or bfloat16 (the reduction in bf16). Inside `shard_map` a kernel may be
replicated over axes its rows vary over: its gradient is summed over them (`varying.sum_to`), as shard_map's
transpose of the implicit broadcast would, since a custom VJP must return a cotangent of its primal's type.

A `prologue` makes x from the operand handed in (the MLP's gate/up pair: layers/glu.py's SwiGLU) inside the VJP,
so that the backward pass makes x again for wgrad in the same kernel as the source's gradient, after dgrad.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import jax
import jax.numpy as jnp

from ember.quant.gemm import output_dtype
from ember.quant.varying import sum_to, vma_of

Pass = Literal["forward", "dgrad", "wgrad"]
# contract(a, b, groups, pass, preferred_element_type) -> the GEMM's output, unrounded: x @ w (forward),
# g @ w.T (dgrad), x.T @ g (wgrad); `groups` is the layout's extra operand (the grouped GEMM's group sizes).
Contract = Callable[[jax.Array, jax.Array, "jax.Array | None", Pass, jnp.dtype], jax.Array]


def unquantized_matmul(contract: Contract, x: jax.Array, w: jax.Array, groups: jax.Array | None = None, *,
                       dtype, wgrad_dtype, out_dtype=None, prologue=None) -> jax.Array:
  """x @ w in `dtype` (the compute dtype) as `contract` lays it out, written in `out_dtype` (default `dtype`).
  w comes in its own dtype and is cast to `dtype` inside; its gradient leaves in w's dtype (the LM head hands
  its float32 parameter, whose gradient is then not rounded to the compute dtype). `prologue`: the GEMM reads
  `prologue.forward(x)`, and the backward pass asks `prologue.backward(x, its gradient)` for (it again, x's
  gradient) (module doc); None: the GEMM reads x."""
  dtype = jnp.dtype(dtype)
  types = (jnp.dtype(out_dtype or dtype), jnp.dtype(wgrad_dtype), jnp.dtype(w.dtype), vma_of(x), vma_of(w),
           prologue)
  return _matmul(contract, types, x.astype(dtype), w, groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(contract, types, x, w, groups):
  out, prologue = types[0], types[5]
  a = x if prologue is None else prologue.forward(x)
  return contract(a, w.astype(x.dtype), groups, "forward", output_dtype(out)).astype(out)


def _matmul_fwd(contract, types, x, w, groups):
  w = w.astype(x.dtype)  # The residual is the cast copy: under FSDP, the one XLA gathered for the forward GEMM.
  return _matmul(contract, types, x, w, groups), (x, w, groups)


def _matmul_bwd(contract, types, res, g):
  _, wgrad_dtype, w_dtype, x_vma, w_vma, prologue = types
  x, w, groups = res
  g = g.astype(x.dtype)
  dx = contract(g, w, groups, "dgrad", output_dtype(x.dtype))
  a = x
  if prologue is not None:
    a, dx = prologue.backward(x, dx.astype(x.dtype))
  dw = contract(a, g, groups, "wgrad", output_dtype(wgrad_dtype)).astype(wgrad_dtype)
  return sum_to(dx, x_vma).astype(x.dtype), sum_to(dw, w_vma).astype(w_dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
