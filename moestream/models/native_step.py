"""The CPU decode step as one native call: every decoder layer of a one-token step in C++
(kernels/csrc/moe_cpu.cpp: DecodeStep), instead of ~7 native calls per layer issued from Python.

The per-module fused path (MoeCausalLM.set_fused_decode: native rmsnorm, linear, attend, route and
moe per layer) is this step's reference: DecodeStep runs the same C++ functions in the same order,
so its bits are that path's (tests/test_native_step.py). What it saves is the host's part of a
token: ~200 us of Python, dispatch and thread wake-ups per layer (benchmarks/bench_overhead.py).

A model qualifies when every layer is the plain decoder layer (attention with native.attend's rule,
sinks included, and quantized q/k/v and o projections on the native kernel, a MoE block with
native.route's rule (softmax top-k, or gpt-oss's top-k then softmax) without a shared expert) and
the provider keeps every record resident for the native kernels (`ExpertProvider.native_tables`,
with `native_extras`: gpt-oss's expert biases and clamped SwiGLU); `why_not` names what stops it. Anything else (a slot cache, a
predictor, router traces, adapters, float dense weights, bf16) runs the per-module path.
"""

from __future__ import annotations

import torch

from moestream.kernels import native
from moestream.kernels.dense import QuantLinear


def why_not(model, provider) -> str | None:
    """Why `model` with expert provider `provider` (the one set_provider handed it) cannot decode
    through one DecodeStep (None when it can)."""
    from moestream.models.base import DecoderLayer, MoeCausalLM
    from moestream.models.layers import RMSNorm, SparseMoe

    if not native.available():
        return "the native kernels did not build"
    if type(model).forward is not MoeCausalLM.forward:
        return f"{type(model).__name__} has its own forward"
    tables = provider.native_tables() if provider is not None else None
    if tables is None:
        return "the expert provider does not keep every record resident for the native kernels"
    for i, layer in enumerate(model.model.layers):
        if type(layer) is not DecoderLayer:
            return f"layer {i} is not a plain decoder layer"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(not _rms_norm_rule(n, RMSNorm) for n in norms):
            return f"layer {i}: the norms are not fp32 RMSNorm"
        attn, mlp = layer.self_attn, layer.mlp
        why = _attention_why_not(attn) or _moe_why_not(mlp, SparseMoe)
        if why:
            return f"layer {i}: {why}"
        if set(tables.get(mlp.layer, ())) != set(range(model.args.num_experts)):
            return f"layer {i}: not every expert record is resident"
    return None


def _rms_norm_rule(n, RMSNorm) -> bool:
    """An fp32 RMSNorm whose fp32 rows are RMSNorm.forward's (native.rmsnorm's)."""
    fp32_rows = type(n) is RMSNorm or type(n).__dict__.get("fp32_rows_are_rmsnorm", False)
    return isinstance(n, RMSNorm) and fp32_rows and n.weight.dtype == torch.float32


def _native_quant(p) -> bool:
    return isinstance(p, QuantLinear) and p.resolved_kernel(torch.device("cpu")) == "native"


def _attention_why_not(attn) -> str | None:
    if not (getattr(attn, "fused_decode", False) and getattr(attn, "_attend_rule", False)):
        return "attention is not native.attend's rule"
    if attn.lora:
        return "a recovery adapter is attached"
    qkv = _qkv_parts(attn)
    if qkv is None or not all(_native_quant(p) for p in (*qkv, attn.o_proj)):
        return "q/k/v and o are not quantized projections on the native kernel"
    if len({p.wide for p in qkv}) > 1 or len({p.bias is None for p in qkv}) > 1:
        return "q, k and v differ in activation width or in having a bias"
    return None


def _qkv_parts(attn) -> list | None:
    """q/k/v as DecodeStep takes them: the fused QuantLinear, or (formats differ, as a Q4_K_M's
    q/k in Q4_K beside v in Q6_K) the three projections; None when they are not quantized."""
    if attn._qfused is not None:
        return [attn._qfused]
    return [attn.q_proj, attn.k_proj, attn.v_proj] if attn._three else None


def _moe_why_not(mlp, SparseMoe) -> str | None:
    if not isinstance(mlp, SparseMoe) or type(mlp).forward is not SparseMoe.forward:
        return "the MLP is not a plain MoE block"
    if not (mlp.fused_decode and mlp._route_rule):
        return "the router is not native.route's rule"
    if mlp.gate.weight.dtype != torch.float32 or mlp.shared_expert is not None:
        return "the router is not fp32, or the block has a shared expert"
    if mlp.observer is not None:
        return "router traces observe every layer"
    return None


class NativeDecodeStep:
    """Every decoder layer of one decode token in one native call; built by `build`."""

    def __init__(self, model, provider):
        self.provider = provider
        tables = provider.native_tables()
        biases, act = provider.native_extras()
        alpha, limit = (act.alpha, act.limit) if act is not None else (0.0, 0.0)
        self._step = native.decode_step()
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o = _qkv_parts(attn), attn.o_proj
            bias = None if qkv[0].bias is None else torch.cat([p.bias.detach() for p in qkv])
            qk_w, qk_eps = (
                (attn._qk_norm_weight(), attn.q_norm.eps) if attn.qk_norm == "head" else (None, 0.0)
            )
            table = tables[mlp.layer]
            experts = [t for e in range(len(table)) for t in table[e]]
            eb = biases[mlp.layer] if biases is not None else None
            expert_biases = [t for e in range(len(table)) for t in eb[e]] if eb else []
            sinks = attn.attend_sinks()
            n_in, n_post = layer.input_layernorm, layer.post_attention_layernorm
            self._step.add_layer(
                n_in.weight.detach(), n_in.eps,
                [t for p in qkv for t in native._pair(p.qweight.sections(), "w")], bias, qkv[0].wide,
                qk_w, qk_eps,
                *native._pair(o.qweight.sections(), "w"), o.bias, o.wide,
                n_post.weight.detach(), n_post.eps,
                attn.H, attn.Hkv, attn.hd, attn.scaling, attn.window or 0,
                mlp.gate.weight.detach(), mlp.k, mlp.renorm, experts,
                None if sinks is None else sinks.detach().contiguous(),
                None if mlp.gate.bias is None else mlp.gate.bias.detach(), mlp.topk_first,
                expert_biases, alpha, limit,
            )  # fmt: skip
        self.k = model.moe_blocks[0].k
        self._seen = 0.0

    @classmethod
    def build(cls, model, provider) -> NativeDecodeStep | None:
        return None if why_not(model, provider) else cls(model, provider)

    def accepts(self, x: torch.Tensor, cache) -> bool:
        """A one-token fp32 CPU row and a plain KVCache of fp32 buffers (native.attend's case)."""
        return (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and hasattr(cache, "buffers")
            and cache.k[0] is not None
            and cache.k[0].dtype == torch.float32
        )

    def __call__(self, x: torch.Tensor, cos, sin, cache, start: int) -> torch.Tensor:
        """x [1, D] (the token's embedding) -> the residual stream after the last layer [1, D]."""
        cache.buffers(0, start + 1)  # the capacity check (every layer's buffer has one length)
        y = self._step.run(x, cos[0], sin[0], cache.k, cache.v, start, native._isa(None))
        total = self._step.expert_seconds  # cumulative: the provider is told this call's part
        self.provider.note_native_step(self.k * self._step.layers, total - self._seen)
        self._seen = total
        return y
