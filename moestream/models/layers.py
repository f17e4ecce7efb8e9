"""Building blocks shared by the model files: RMSNorm, RoPE (with scaling), attention, SwiGLU MLP,
routers and the MoE block that hands routed tokens to an expert provider.

Shapes: T tokens, D hidden, H query heads, Hkv key/value heads, hd head dim, E experts, K top-k.
Numerics follow transformers' eager path (fp32 norms/softmax, casts at the same points).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ModelArgs, RopeArgs
from moestream.kernels import native
from moestream.kernels.dense import QuantLinear, RowsOf
from moestream.kernels.dispatch import (
    TOPK_TRITON_MAX_TOKENS,
    add_rms_norm_rows,
    attend_unsupported,
    decode_attend,
    rms_norm_rows,
    route_decode,
    topk,
)
from moestream.models.lowrank import LoraStack, plus_lora


def _cpu_fp32(x: torch.Tensor) -> bool:
    """Where the fused one-token decode ops (kernels/native.py) run: fp32, contiguous, CPU, and
    no autograd (they have no backward: recovery training takes the torch code)."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and not torch.is_grad_enabled()
    )


class RMSNorm(nn.Module):
    # Set by MoeCausalLM.set_fused_decode: fp32 rows on the CPU through native.rmsnorm (one call
    # instead of torch's six ops; same math, its own summation order).
    fused_decode = False
    # Set by MoeCausalLM.set_gpu_decode: a few bf16/fp16 rows on CUDA, outside a compiled step
    # (inductor fuses the norm there, with the residual add), as one Triton launch.
    gpu_decode = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op in fp32; other dtypes normalise in fp32 and cast back before the weight,
        # as transformers does.
        if self.gpu_decode and x.is_cuda and self._gpu_fusable(x):
            return rms_norm_rows(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            if self.fused_decode and x.dim() == 2 and _cpu_fp32(x) and self.weight.dtype == x.dtype:
                return native.rmsnorm(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)

    def add_norm(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, self(x + y)): a residual add and this norm after it, one Triton launch where
        forward would take rms_norm_rows (the same bits as the two steps)."""
        if self.gpu_decode and x.is_cuda and self._gpu_fusable(x) and y.dtype == x.dtype:
            return add_rms_norm_rows(x, y, self.weight, self.eps)
        s = x + y
        return s, self(s)

    def _gpu_fusable(self, x: torch.Tensor) -> bool:
        """rms_norm_rows' case: decode rows in bf16/fp16 with the weight in that dtype, eagerly."""
        return (
            type(self).forward is RMSNorm.forward  # (gpt-oss multiplies before its cast)
            and x.dim() == 2
            and x.shape[0] <= TOPK_TRITON_MAX_TOKENS
            and x.dtype in (torch.bfloat16, torch.float16)
            and self.weight.dtype == x.dtype
            and not torch.compiler.is_compiling()
        )


def rope_inv_freq(
    r: RopeArgs, dim: int, max_pos: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for one RoPE variant (same formulas as transformers)."""
    base = r.theta
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv = 1.0 / (base**exps)
    if r.rope_type in ("default",):
        return inv, 1.0
    if r.rope_type == "linear":
        return inv / r.factor, 1.0
    if r.rope_type == "dynamic":
        seq = max(seq_len or max_pos, max_pos)
        base = base * ((r.factor * seq / max_pos) - (r.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exps), 1.0
    if r.rope_type == "llama3":
        old = r.original_max_position_embeddings
        lo, hi = r.low_freq_factor, r.high_freq_factor
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / lo, inv / r.factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / r.factor + smooth * out
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, out), 1.0
    if r.rope_type == "yarn":
        return _yarn(r, dim, base)
    raise ValueError(f"unsupported rope type {r.rope_type}")


def _yarn(r: RopeArgs, dim: int, base: float) -> tuple[torch.Tensor, float]:
    factor, orig = r.factor, r.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = r.attention_factor
    if attn is None:
        attn = (
            mscale(factor, r.mscale) / mscale(factor, r.mscale_all_dim)
            if r.mscale and r.mscale_all_dim
            else mscale(factor)
        )

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(r.beta_fast or 32), corr_dim(r.beta_slow or 1)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


class Rope:
    """cos/sin tables; dynamic-NTK recomputes its frequencies as the sequence grows (as transformers)."""

    def __init__(self, r: RopeArgs, head_dim: int, max_pos: int):
        self.r, self.dim, self.max_pos = r, head_dim, max_pos
        self.inv_freq, self.scale = rope_inv_freq(r, head_dim, max_pos)
        self.cached_len = max_pos
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, start: int, end: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [end-start, hd] for positions start..end-1, from a table grown on demand. The
        first half of sin is negated: apply_rope takes this signed table."""
        if self.r.rope_type == "dynamic" and self._dynamic_update(end):
            self._tables.clear()
        cos, sin = self._tables.get(dtype, (None, None))
        if cos is None or cos.shape[0] < end:
            n = max(end, 2 * (0 if cos is None else cos.shape[0]), 256)
            freqs = torch.arange(n).float()[:, None] * self.inv_freq[None, :]  # [n, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
            sin[:, : self.dim // 2].neg_()  # signed for apply_rope's roll (exact: a sign flip)
            self._tables[dtype] = (cos, sin)
        return cos[start:end], sin[start:end]

    def _dynamic_update(self, seq: int) -> bool:
        """Dynamic NTK: grow the base past the trained context, reset below it (as transformers)."""
        if seq > self.cached_len:
            self.inv_freq, _ = rope_inv_freq(self.r, self.dim, self.max_pos, seq)
            self.cached_len = seq
            return True
        if seq < self.max_pos and self.cached_len > self.max_pos:
            self.inv_freq, _ = rope_inv_freq(self.r, self.dim, self.max_pos)
            self.cached_len = self.max_pos
            return True
        return False


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, hd], cos/sin [T, rd] from `Rope` (sin signed); partial rotary (rd < hd) rotates
    the first rd dims only. Equals transformers' x*cos + rotate_half(x)*sin bit for bit: the roll
    swaps the halves and the signed table supplies rotate_half's minus (4 ops instead of 6)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + x.roll(rd // 2, -1) * sin
    rot = x[..., :rd]
    return torch.cat((rot * cos + rot.roll(rd // 2, -1) * sin, x[..., rd:]), dim=-1)


class Attention(nn.Module):
    """GQA attention with a KV cache. qk_norm: None, 'head' (Qwen3: per head) or 'full' (OLMoE).
    `lora`: unmerged adapters on q/k/v/o_proj by name (recovery/adapter.py fills it)."""

    LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
    # Set by MoeCausalLM.set_fused_decode: a one-token fp32 CPU step runs everything between the
    # q/k/v and o projections (q/k head norm, RoPE, cache write, attention) as one native.attend.
    fused_decode = False
    # Set by MoeCausalLM.set_gpu_decode: a one-token CUDA step runs the same span as one Triton
    # launch (kernels/triton/attention.py), reading only the valid cache positions.
    gpu_decode = False

    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: str | None = None,
        clip_qkv: float | None = None,
    ):
        super().__init__()
        D, H, Hkv, hd = (
            args.hidden_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        self.layer, self.H, self.Hkv, self.hd = layer, H, Hkv, hd
        self.q_proj = nn.Linear(D, H * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = (
                RMSNorm(hd, args.rms_norm_eps),
                RMSNorm(hd, args.rms_norm_eps),
            )
        elif qk_norm == "full":
            self.q_norm, self.k_norm = (
                RMSNorm(H * hd, args.rms_norm_eps),
                RMSNorm(Hkv * hd, args.rms_norm_eps),
            )
        self._qk_key = None  # source of the cached side-by-side q/k norm weight
        self._fused, self._fused_key = None, None  # fused q/k/v weight and bias, see _qkv_proj
        self._qfused = None  # the fused QuantLinear when q/k/v are quantized (store dense quant)
        self._three = False  # q/k/v in different formats: three projections
        self.clip_qkv = clip_qkv
        self.window = args.sliding_windows[layer]
        self.scaling = hd**-0.5
        self.lora = nn.ModuleDict()
        self._lora_stack = LoraStack(("q_proj", "k_proj", "v_proj"), (H * hd, Hkv * hd, Hkv * hd))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int
    ) -> torch.Tensor:
        T, H, Hkv, hd = x.shape[0], self.H, self.Hkv, self.hd
        qkv = self._qkv_proj(x)  # [T, (H + 2*Hkv) * hd]: q heads, k heads, v heads
        if self.lora:
            qkv = self._lora_qkv(x, qkv)
        if self.fused_decode and T == 1 and isinstance(start, int) and self._fusable(qkv, cache):
            kc, vc = cache.buffers(self.layer, start + 1)
            qk_w, eps = (None, 0.0)
            if self.qk_norm == "head":
                qk_w, eps = self._qk_norm_weight(), self.q_norm.eps
            out = native.attend(qkv, qk_w, eps, cos[0], sin[0], kc, vc, start, self.scaling,
                                self.window, H, Hkv, sinks=self.attend_sinks())  # fmt: skip
            return plus_lora(self.lora, "o_proj", self.o_proj(out), out)
        if self.gpu_decode and T == 1 and qkv.is_cuda and self._gpu_fusable(qkv, cos):
            out = self._attend_gpu(qkv, cos, sin, cache, start)
            return plus_lora(self.lora, "o_proj", self.o_proj(out), out)
        if self.qk_norm == "full" or self.clip_qkv is not None:
            q, k, v = qkv.split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
            if self.qk_norm == "full":
                q, k = self.q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            qk = torch.cat((q.view(T, H, hd), k.view(T, Hkv, hd)), dim=1)
            v = v.view(T, Hkv, hd)
        else:
            # q and k heads side by side already: normed (per head) and rotated together.
            qk, v = qkv.view(T, H + 2 * Hkv, hd).split((H + Hkv, Hkv), dim=1)
        if self.qk_norm == "head":
            qk = self._head_norm(qk)
        qk = apply_rope(qk.transpose(0, 1), cos, sin)  # [H+Hkv, T, hd]
        q, k = qk.split((H, Hkv))
        k, v = cache.update(self.layer, k, v.transpose(0, 1), start)
        out = gqa_attention(q, k, v, self.scaling, start, self.window, self.softmax)
        return plus_lora(self.lora, "o_proj", self.o_proj(out), out)

    def _lora_qkv(self, x: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v output plus each projection's adapter delta on its own columns: two
        GEMMs at inference (`LoraStack`), each adapter on its own slice under training."""
        stacked = self._lora_stack.add_to(self.lora, qkv, x)
        if stacked is not None:
            return stacked
        parts = qkv.split(self._lora_stack.sizes, dim=-1)
        names = self._lora_stack.names
        return torch.cat([plus_lora(self.lora, n, p, x) for n, p in zip(names, parts)], dim=-1)

    def _qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v projections as one GEMM. q/k/v_proj's parameters are views of one fused
        weight (and bias): build_model fuses before the weights are loaded, so the fusion costs
        no memory; if the parameters were replaced since (moved, cast) it is remade here. With
        gradients on, the three modules run as they are (the fused tensor is not a parameter).
        Quantized q/k/v (loaded from a store) run as one fused QuantLinear."""
        if self._qfused is not None:
            return self._qfused(x)
        if torch.is_grad_enabled() or self._three:
            return torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        # Weights cannot change inside a compiled step (engine/graph.py), and dynamo cannot
        # trace the pointer check: skip it there.
        if not torch.compiler.is_compiling() and (
            self._fused is None or self._fused_key != self._param_key()
        ):
            with torch.inference_mode(False), torch.no_grad():
                self.fuse_qkv()
        w, b = self._fused
        return F.linear(x, w, b)

    def _param_key(self) -> tuple:
        return (
            self.q_proj.weight.data_ptr(),
            self.k_proj.weight.data_ptr(),
            self.v_proj.weight.data_ptr(),
        )

    def fuse_qkv(self) -> None:
        """Make q/k/v_proj's weight (and bias) views of one tensor each. Copies once; call it
        before loading weights (build_model does) so the unfused copies never coexist with
        loaded data. Quantized projections (the loader calls this again after placing them)
        become one QuantLinear, and q/k/v_proj row views of it."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not all(isinstance(p, nn.Linear) for p in projs):
            return self._fuse_quantized(projs)
        fused = []
        for name in ("weight", "bias"):
            parts = [getattr(p, name) for p in projs]
            if parts[0] is None:
                fused.append(None)
                continue
            whole = torch.cat([t.detach() for t in parts])
            for p, t, view in zip(projs, parts, whole.split([t.shape[0] for t in parts])):
                setattr(p, name, nn.Parameter(view, requires_grad=t.requires_grad))
            fused.append(whole)
        self._fused = tuple(fused)
        self._fused_key = self._param_key()

    def _fuse_quantized(self, projs: tuple[nn.Module, ...]) -> None:
        fused = QuantLinear.cat(list(projs))
        self._three = fused is None  # mixed formats (a shape one scheme cannot hold)
        if fused is None:
            return
        self._qfused, lo = fused, 0
        for name, p in zip(("q_proj", "k_proj", "v_proj"), projs):
            setattr(self, name, RowsOf(fused, lo, lo + p.out_features))
            lo += p.out_features

    @functools.cached_property
    def _attend_rule(self) -> bool:
        """native.attend computes this module's rule: no clipping, no whole-vector q/k norm, the
        plain softmax (or one with sinks, `attend_sinks`: models/gpt_oss.py) (fixed at
        construction: looked up once, not per token)."""
        return (
            self.qk_norm in (None, "head")
            and self.clip_qkv is None
            and type(self).softmax is type(self).native_softmax
        )

    def attend_sinks(self) -> torch.Tensor | None:
        """Each head's sink logit in its softmax (fp32 [H]; None: none), as native.attend takes it."""
        return None

    def _fusable(self, qkv: torch.Tensor, cache) -> bool:
        """native.attend's case: this module's rule, fp32 on the CPU, a plain KVCache of fp32
        buffers."""
        return (
            self._attend_rule
            and _cpu_fp32(qkv)
            and hasattr(cache, "buffers")  # engine/kv_cache.py: KVCache (int positions)
            and cache.k[self.layer].dtype == torch.float32
        )

    def _gpu_fusable(self, qkv: torch.Tensor, cos: torch.Tensor) -> bool:
        """decode_attend's case: this module's rule, and a shape and dtype the kernel takes."""
        return (
            self._attend_rule
            and self.attend_sinks() is None  # (the Triton kernel has no sinks)
            and attend_unsupported(self.H, self.Hkv, self.hd, cos.shape[-1], qkv.dtype) is None
        )

    def _attend_gpu(self, qkv: torch.Tensor, cos, sin, cache, start) -> torch.Tensor:
        """q/k head norm, RoPE, cache write and attention of one token in one launch -> [1, H*hd]."""
        if isinstance(start, int):
            (kc, vc), pos_t, pos = cache.buffers(self.layer, start + 1), None, start
        else:  # a captured step's device position (StaticKVCache)
            (kc, vc), pos_t, pos = (cache.k[self.layer], cache.v[self.layer]), start, 0
        qk_w, eps = (None, 0.0)
        if self.qk_norm == "head":
            qk_w, eps = self._qk_norm_weight(), self.q_norm.eps
        return decode_attend(qkv, qk_w, cos, sin, kc, vc, pos_t, pos, eps, self.scaling,
                             self.window or 0, self.H, self.Hkv)  # fmt: skip

    def _qk_norm_weight(self) -> torch.Tensor:
        """q_norm's and k_norm's weights side by side, [H + Hkv, hd], remade when either changes."""
        qw, kw = self.q_norm.weight, self.k_norm.weight
        if not torch.compiler.is_compiling():  # (weights are fixed inside a compiled step)
            key = (qw.data_ptr(), kw.data_ptr(), qw._version, kw._version)
            if self._qk_key != key:  # weights loaded, replaced or moved since: rebuild
                self._qk_weight = torch.cat((qw.expand(self.H, -1), kw.expand(self.Hkv, -1)))
                self._qk_key = key
        return self._qk_weight

    def _head_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """q_norm on the H query heads and k_norm on the Hkv key heads of qk [T, H+Hkv, hd] in
        one normalisation times the two weights side by side: the same roundings as two
        RMSNorm calls (normalise, cast, then the weight), one op fewer."""
        w, eps = self._qk_norm_weight(), self.q_norm.eps
        if qk.dtype == torch.float32:
            return w * F.rms_norm(qk, (self.hd,), None, eps)
        return w * F.rms_norm(qk.float(), (self.hd,), None, eps).to(qk.dtype)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Overridden by attention with sinks (gpt_oss)."""
        return softmax_fp32(scores)

    # The softmax native.attend computes for this class (a subclass with sinks names its own)
    native_softmax = softmax


def softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    """scores [Hkv, G*T, S] (query head h = kv * G + g) -> probabilities in the scores' dtype,
    the softmax in fp32 (as transformers' eager attention)."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return probs if scores.dtype == torch.float32 else probs.to(scores.dtype)


def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    start: int,
    window: int | None,
    softmax=softmax_fp32,
) -> torch.Tensor:
    """q [H, T, hd], k [Hkv, S, hd] and v [Hkv, S, vd] (the cache prefix) -> [T, H*vd].

    Query heads grouped under their KV head: one batched GEMM per KV head over its G*T query
    rows, without repeat_kv copies or a broadcast matmul (which copies K per query group)."""
    H, T, hd = q.shape
    Hkv, S, vd = v.shape
    G = H // Hkv
    scores = torch.bmm(q.reshape(Hkv, G * T, hd), k.transpose(1, 2)) * scaling
    mask = attention_mask(T, S, start, window, q.device)
    if mask is not None:
        scores = scores.view(Hkv, G, T, S).masked_fill(mask, float("-inf")).view(Hkv, G * T, S)
    out = torch.bmm(softmax(scores), v)  # [Hkv, G*T, vd] = [H, T, vd]
    if T == 1:
        return out.view(1, H * vd)
    return out.view(H, T, vd).transpose(0, 1).reshape(T, H * vd)


def attention_mask(T: int, S: int, start, window: int | None, device) -> torch.Tensor | None:
    """True where a query may NOT look: the future, and keys beyond the sliding window. `start`
    is an int, or a device tensor [1] for a captured decode step (engine/graph.py), whose S is the
    whole cache: then the mask is built on the device, never None."""
    static = isinstance(start, torch.Tensor)
    if not static and T == 1 and (window is None or S <= window):
        return None
    # an int start as arange's bounds: torch.tensor(start, device=) would copy from the host,
    # and that copy waited for the GPU once a layer (a prompt's profile: 16 syncs, 16 layers)
    if static:
        q_pos = (start + torch.arange(T, device=device))[:, None]
    else:
        q_pos = torch.arange(start, start + T, device=device)[:, None]
    k_pos = torch.arange(S, device=device)[None, :]
    blocked = k_pos > q_pos
    if window is not None:
        blocked |= k_pos <= q_pos - window
    return blocked


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). `lora`: unmerged adapters by projection name (only
    shared experts get them: recovery/adapter.py)."""

    LORA_TARGETS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)
        self.lora = nn.ModuleDict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lora:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        d = self.lora
        h = F.silu(plus_lora(d, "gate_proj", self.gate_proj(x), x))
        h = h * plus_lora(d, "up_proj", self.up_proj(x), x)
        return plus_lora(d, "down_proj", self.down_proj(h), h)


def group_limited_topk(scores: torch.Tensor, bias: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """DeepSeek-V3 / GLM-4.5 choice on sigmoid scores [T, E] fp32: the correction bias steers only
    the choice (best topk_group groups by the sum of their top-2, then top-k inside them)."""
    G, E = args.n_group, args.num_experts
    choice = scores + bias
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=args.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(choice, k=args.num_experts_per_tok, dim=-1, sorted=False)[1]


class SigmoidRouter(nn.Module):
    """`mlp.gate`: router weight and selection bias, both kept in fp32 whatever the model dtype
    (transformers' _keep_in_fp32_modules_strict); the loader honours `keep_fp32`."""

    keep_fp32 = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(args.num_experts), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> sigmoid scores [T, E] fp32."""
        return F.linear(x.float(), self.weight.float()).sigmoid()


class SparseMoe(nn.Module):
    """Router + routed experts (through the provider) + optional sigmoid-gated shared expert.

    The block owns its whole routing rule: `scores` (what the router computes from x), `select`
    (the experts it picks), `weigh` (their gate weights from their scores). `route` is the three
    in a row; `weights_for` weighs an expert set chosen elsewhere (predicted routing) by the same
    rule. The base rule: fp32 softmax over all experts, top-k, optional renormalisation.
    The model never holds expert weights: `provider.experts(layer, x, ids, weights)` does the math,
    whether the weights are resident, streamed from disk or on a GPU.
    """

    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        *,
        weights_in_act_dtype: bool,
        shared: bool = False,
        gate: nn.Module | None = None,
    ):
        super().__init__()
        self.layer, self.k, self.renorm = layer, args.num_experts_per_tok, args.norm_topk_prob
        # `gate` is the router module (checkpoint name `mlp.gate`); subclasses with another
        # routing rule pass their own and override scores/select/weigh.
        self.gate = (
            gate if gate is not None else nn.Linear(args.hidden_size, args.num_experts, bias=False)
        )
        # Qwen/OLMoE cast the top-k weights to the activation dtype; Mixtral keeps them in fp32.
        self.weights_in_act_dtype = weights_in_act_dtype
        if shared:
            self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
        self.provider = None  # set by the loader (the Runtime owns it)
        # Optional callable(layer, ids [T, K], weights [T, K], x [T, D]) for router traces; x is
        # the router's input. It must not synchronise (see moestream/obs/trace.py).
        self.observer = None

    # Scores are router probabilities (the stale gate ranks its predictions by them).
    scores_are_probs = True
    # Set by MoeCausalLM.set_fused_decode: one token's softmax top-k routing as one native.route
    # where the block keeps this class's rule and a bias-free fp32 router (or gpt-oss's: below).
    fused_decode = False
    # native.route's form of this class's rule: False, softmax over E then top-k (renormalised
    # when asked); True, top-k of the router's logits (its bias added) then softmax over those k
    # (models/gpt_oss.py: GptOssMoe).
    topk_first = False
    # Set by MoeCausalLM.set_gpu_decode: on CUDA, a few decode rows' router GEMM, softmax, top-k,
    # renormalisation and cast in one Triton launch (route_decode).
    gpu_decode = False

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, E]: what selection and weighting read."""
        return torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)

    def select(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scores [T, E] -> (ids [T, K], the scores of those ids [T, K])."""
        top, ids = topk(s, self.k)
        return ids, top

    def weigh(self, picked: torch.Tensor) -> torch.Tensor:
        """The chosen experts' scores [T, K] -> their gate weights [T, K]."""
        return picked / picked.sum(dim=-1, keepdim=True) if self.renorm else picked

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, K], ids [T, K]), weights in the dtype the rule makes."""
        if self.fused_decode and x.shape[0] == 1 and self._route_fusable(x):
            return native.route(x, self.gate.weight, self.k, self.renorm, bias=self.gate.bias,
                                topk_first=self.topk_first)  # fmt: skip
        ids, picked = self.select(self.scores(x))
        return self.weigh(picked), ids

    @functools.cached_property
    def _route_rule(self) -> bool:
        """native.route computes this block's rule: the base softmax top-k and a bias-free
        nn.Linear router (fixed at construction: looked up once, not per token)."""
        cls = type(self)
        return (cls.scores, cls.select, cls.weigh) == (
            SparseMoe.scores,
            SparseMoe.select,
            SparseMoe.weigh,
        ) and (type(self.gate) is nn.Linear and self.gate.bias is None)

    def _route_fusable(self, x: torch.Tensor) -> bool:
        if not (self._route_rule and _cpu_fp32(x)):
            return False
        w, b = self.gate.weight, self.gate.bias  # (an nn.Linear: the rule says so)
        return w.dtype == torch.float32 and w.is_contiguous() and (b is None or b.dtype == w.dtype)

    def _route_gpu_fusable(self, x: torch.Tensor) -> bool:
        """route_decode's case: the base rule on a few decode rows of at most 1024 experts."""
        return (
            self._route_rule
            and not self.topk_first  # (route_decode computes the base rule only)
            and x.shape[0] <= TOPK_TRITON_MAX_TOKENS
            and self.gate.out_features <= 1024
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and self.gate.weight.dtype == x.dtype
        )

    def weights_for(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Gate weights [T, K] (in the dtype the experts get) of a given expert set ids [T, K]."""
        return self._combine_dtype(self.weigh(self.scores(x).gather(1, ids)), x)

    def _combine_dtype(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return w.to(x.dtype) if self.weights_in_act_dtype and w.dtype != x.dtype else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gpu_decode and x.is_cuda and self._route_gpu_fusable(x):
            dtype = x.dtype if self.weights_in_act_dtype else torch.float32
            w, ids = route_decode(x, self.gate.weight, self.k, self.renorm, dtype)
        else:
            w, ids = self.route(x)  # [T, K] each
            w = self._combine_dtype(w, x)
        if self.observer is not None:
            self.observer(self.layer, ids, w, x)
        out = self.provider.experts(self.layer, x, ids, w)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class SigmoidMoe(SparseMoe):
    """DeepSeek-V3 / GLM-4.5 MoE block: sigmoid scores, a group-limited choice steered by the
    correction bias, weights from the unbiased scores (renormalised +1e-20, then scaled) kept in
    fp32 when combined, plus ungated shared experts (`mlp.shared_experts`) after the routed sum."""

    scores_are_probs = False

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer, weights_in_act_dtype=False, gate=SigmoidRouter(args))
        self.args = args
        inter = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args.hidden_size, inter) if inter else None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)

    def select(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = group_limited_topk(s, self.gate.e_score_correction_bias.float(), self.args)
        return ids, s.gather(1, ids)

    def weigh(self, picked: torch.Tensor) -> torch.Tensor:
        if self.args.norm_topk_prob:
            picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20)
        return picked * self.args.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)
