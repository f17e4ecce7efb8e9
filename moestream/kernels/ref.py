"""Pure-torch reference math for routed experts: the specification other kernels are tested against.

One expert e: y = down_e(silu(gate_e(x)) * up_e(x)). gate and up share the token's input; down
takes each slot's own activation (mixing these up silently corrupts output, see seed 001).
gpt_oss experts add biases (b13 after gate/up, b2 after down) and a clamped activation
(`ExpertActivation`); both are optional and the plain path runs the same ops as without them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """gpt_oss's clamped SwiGLU: g = gate.clamp(max=limit), u = up.clamp(-limit, limit),
    (u + 1) * g * sigmoid(alpha * g) (transformers' GptOssExperts._apply_gate). `None` stands for
    the plain silu(gate) * up everywhere an activation is passed."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    @staticmethod
    def from_args(args) -> ExpertActivation | None:
        """The activation a ModelArgs asks for (None: silu)."""
        if args.swiglu_limit is None:
            return None
        return ExpertActivation(args.swiglu_alpha, args.swiglu_limit)


def expert_ffn(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """x [T, D], w13 [2I, D] (gate rows then up rows), w2 [D, I], optional biases b13 [2I] and
    b2 [D] -> [T, D]. Biases are added after the matmul, as transformers' gpt_oss does."""
    h = F.linear(x, w13)
    if b13 is not None:
        h = h + b13
    gate, up = h.chunk(2, dim=-1)
    y = F.linear(F.silu(gate) * up if act is None else act(gate, up), w2)
    return y if b2 is None else y + b2


def group_by_expert(ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """ids [T, K] -> [(expert, tok [n], slot [n])] in ascending expert id, each expert's (token,
    slot) pairs in token order: one stable sort instead of a Python loop over tokens. The one
    grouping every prefill path uses, so all of them add experts in the same order."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=1).tolist()
    tok, slot = order // K, order % K
    groups, begin = [], 0
    for e, n in enumerate(counts):
        if n:
            groups.append((e, tok[begin : begin + n], slot[begin : begin + n]))
        begin += n
    return groups


def moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, get_expert) -> torch.Tensor:
    """Routed MoE: x [T, D], ids/weights [T, K]; get_expert(e) -> (w13, w2). Experts in ascending
    id order, each token's contribution scaled by its gate weight and summed (as transformers)."""
    out = torch.zeros_like(x)
    for e, tok, slot in group_by_expert(ids):
        w13, w2 = get_expert(e)
        y = expert_ffn(x[tok], w13, w2) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


# ---- quantized experts (sections as laid out in moestream/quant.py) --------------------------
def dequantize(sec: dict[str, torch.Tensor], name: str, group_size: int, dtype) -> torch.Tensor:
    """Section tensors of weight `name` ("w13" / "w2") -> dense [N, K] in dtype (the spec)."""
    from moestream.quant import int4_sz_kn, unpack_int4

    q = sec[f"{name}.q"]
    if q.dtype == torch.bfloat16:  # bf16 scheme
        return q.to(dtype)
    if _kquant(q):  # K-quant blocks [N, K/256, B]
        return dequantize_kquant(q).to(dtype)
    if f"{name}.dm" in sec:
        return dequantize_q4_1(q, sec[f"{name}.dm"]).to(dtype)
    if q.dtype == torch.int8 or q.dim() == 3 or f"{name}.d" in sec:
        # int8 / q8_0, q4_0 as (q - 8) and its d, q5_0 blocks as (q - 16) and theirs, mxfp4's as
        # twice the e2m1 values and half their scales
        q, s = _symmetric(sec, name)  # [N, K], [N, K/g]
        n, k = q.shape
        return (q.view(n, k // group_size, group_size) * s[..., None]).view(n, k).to(dtype)
    w = unpack_int4(q).float()  # [N, K]
    n, k = w.shape
    sz = int4_sz_kn(sec[f"{name}.sz"], n).float()  # [K/g, N, 2]
    s = sz[..., 0].t()[..., None]  # [N, K/g, 1]
    z = sz[..., 1].t()[..., None]
    # (v - 8) * s + z in place: the same roundings, one [N, K] fp32 buffer instead of four.
    w.view(n, k // group_size, group_size).sub_(8).mul_(s).add_(z)
    return w.to(dtype)


def dequantize_rows(
    sec: dict[str, torch.Tensor], name: str, rows: torch.Tensor, group_size: int, dtype
) -> torch.Tensor:
    """Rows `rows` [T] of dequantize(sec, name) -> [T, K] in dtype, the same values, reading only
    those rows (an embedding lookup)."""
    from moestream.quant import INT4_BLOCK_N, unpack_int4_rows

    q = sec[f"{name}.q"]
    if q.dtype == torch.bfloat16:
        return q[rows].to(dtype)
    if _kquant(q):
        return dequantize_kquant(q[rows]).to(dtype)
    if f"{name}.dm" in sec:
        return dequantize_q4_1(q[rows], sec[f"{name}.dm"][rows]).to(dtype)
    if q.dtype == torch.int8 or q.dim() == 3 or f"{name}.d" in sec:
        q, s = _symmetric({k: v[rows] for k, v in sec.items() if k.startswith(f"{name}.")}, name)
        t, k = q.shape
        return (q.view(t, k // group_size, group_size) * s[..., None]).view(t, k).to(dtype)
    w = unpack_int4_rows(q, rows).float()  # [T, K]
    t, k = w.shape
    n, kg = q.shape[0], k // group_size
    # row r's (scale, zero) of group j in the blocked layout: its block's [K/g, rows, 2] at r0 * K/g
    r0 = rows - rows % INT4_BLOCK_N
    at = (
        r0[:, None] * kg
        + torch.arange(kg, device=rows.device) * torch.clamp(n - r0, max=INT4_BLOCK_N)[:, None]
    )
    sz = sec[f"{name}.sz"][at + (rows - r0)[:, None]].float()  # [T, K/g, 2]
    s, z = sz[..., 0, None], sz[..., 1, None]  # [T, K/g, 1]
    w.view(t, k // group_size, group_size).sub_(8).mul_(s).add_(z)
    return w.to(dtype)


def dequantize_q4_1(q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """q4_1 nibbles q uint8 [N, K/2] and dm fp16 [N, K/32, 2] -> fp32 [N, K] with llama.cpp's
    roundings (dequantize_row_q4_1): (q * d) + m, the product rounded to fp32 first."""
    from moestream.quant import unpack_q4_0

    w = unpack_q4_0(q).float()
    n, k = w.shape
    dmf = dm.float()  # fp16 widened: exact
    w = w.view(n, k // 32, 32) * dmf[..., 0:1] + dmf[..., 1:2]
    return w.view(n, k)


def dequantize_kquant(q: torch.Tensor) -> torch.Tensor:
    """K-quant blocks q uint8 [N, K/256, B] -> fp32 [N, K] with llama.cpp's roundings
    (dequantize_row_q*_K): q4_k / q5_k (d * sc) * q - (dmin * m) per sub-block of 32, q6_k
    (d * sc) * (q - 32) per sub-block of 16, each product rounded to fp32 in that order."""
    from moestream.quant import unpack_kquant

    f = unpack_kquant(q)
    n, k = f["q"].shape
    nb = k // 256
    if "m" not in f:  # q6_k
        ds = f["d"][..., None] * f["sc"].view(n, nb, 16).float()  # [N, nb, 16]
        return (ds[..., None] * f["q"].view(n, nb, 16, 16).float()).view(n, k)
    ds = f["d"][..., None] * f["sc"].view(n, nb, 8).float()  # [N, nb, 8]
    dm = f["dmin"][..., None] * f["m"].view(n, nb, 8).float()
    return (ds[..., None] * f["q"].view(n, nb, 8, 32).float() - dm[..., None]).view(n, k)


def _kquant(q: torch.Tensor) -> bool:
    """q is K-quant blocks [N, K/256, B] (q5_0's and mxfp4's blocks, [N, K/32, 22 | 17], are 3-D
    too)."""
    from moestream.quant import KQUANT_OF_BYTES

    return q.dim() == 3 and q.shape[2] in KQUANT_OF_BYTES


def _symmetric(sec: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric weight's (q [N, K], scale fp32 [N, K/g]), w = q * scale per group: int8 as
    stored; q8_0 as stored with its fp16 d widened (exact); q4_0 unpacked to q - 8 (int8) with
    its fp16 d widened; q5_0's blocks unpacked to q - 16 (int8) and their d widened; mxfp4's to
    twice the e2m1 values (int8) and 2^(e - 128)."""
    from moestream.quant import MXFP4_BYTES, unpack_mxfp4, unpack_q4_0, unpack_q5_0

    q = sec[f"{name}.q"]
    if q.dim() == 3 and q.shape[2] == MXFP4_BYTES:  # mxfp4 blocks [N, K/32, 17]
        return unpack_mxfp4(q)
    if q.dim() == 3:  # q5_0 blocks [N, K/32, 22]
        q, d = unpack_q5_0(q)
        return q, d.float()
    if f"{name}.d" in sec:
        q = sec[f"{name}.q"]
        if q.dtype == torch.uint8:  # q4_0's nibbles (q8_0's q is int8)
            q = unpack_q4_0(q).to(torch.int8) - 8
        return q, sec[f"{name}.d"].float()
    return sec[f"{name}.q"], sec[f"{name}.s"]


def qlinear_ref(x: torch.Tensor, sec: dict, name: str, group_size: int) -> torch.Tensor:
    """x [T, K] @ dequantize(name).T -> [T, N]."""
    return F.linear(x, dequantize(sec, name, group_size, x.dtype))


def expert_ffn_q(
    x: torch.Tensor,
    sec: dict,
    group_size: int | tuple[int, int],
    linear=qlinear_ref,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """One expert from its record sections: x [T, D] -> [T, D]; `linear` picks the kernel;
    `group_size`: both projections', or (w13's, w2's) for a record of two schemes. Records with
    bias sections (`b13`, `b2`, stored unquantized) add them as expert_ffn does."""
    g13, g2 = (group_size, group_size) if isinstance(group_size, int) else group_size
    h = linear(x, sec, "w13", g13)
    b13, b2 = sec.get("b13"), sec.get("b2")
    if b13 is not None:
        h = h + b13.to(x.dtype)
    gate, up = h.chunk(2, dim=-1)
    y = linear(F.silu(gate) * up if act is None else act(gate, up), sec, "w2", g2)
    return y if b2 is None else y + b2.to(x.dtype)


# ---- the native kernels' numerics (kernels/native.py): int8 activations per block of 32 ------
def quantize_act(
    x: torch.Tensor, block: int = 32, qmax: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K/b, b] integer-valued fp32 in [-qmax, qmax], d [T, K/b]), x ~= d * q
    (llama.cpp's Q8_0 for qmax 127: d = amax / qmax, q = round-half-even(x * (1 / d)))."""
    T, K = x.shape
    xb = x.float().view(T, K // block, block)
    d = xb.abs().amax(-1) / float(qmax)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).clamp(-qmax, qmax), d


def qlinear_q8(
    x: torch.Tensor, sec: dict, name: str, group_size: int = 32, wide: bool = False
) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32 as the native kernels compute it: x quantized per block (int8, or
    int16 when `wide`: int8 weights only), exact integer block dots (int8: fp32 sums of integers
    < 2**24, exact in any order; int16: fp64, then rounded to fp32 as the kernels convert), then
    per block int8, q8_0 (its fp16 d widened), q4_0 (its weights q - 8, scale d), q5_0 (q -
    16, its blocks' d) and mxfp4 (twice the e2m1 values, 2^(e - 128)): (s * d) * dot; q4_1 (nibbles q, fp16 d and m widened): (d * dx) * dot + (m * dx) * sum q, each
    product rounded to fp32, then the sum; int4:
    d * (s * (dot - 8 * sum q) + z * sum q); K-quants (activation blocks of 32, the weights'
    super-block d, dmin widened from fp16): q6_k (d * dx) * dot with the integer weights
    sc * (q - 32) of its two sub-blocks of 16; q4_k / q5_k dx * ((d * sc) * dot - (dmin * m) *
    sum q); added in block order, except int8, q4_0, q4_1, q5_0, mxfp4 and the K-quants (the row-major schemes,
    whose rows keep 8 block sums in one vector): block b of the first nb - nb % 8 goes to lane b
    mod 8, the lanes are summed ((0+1)+(2+3))+((4+5)+(6+7)), then the last nb % 8 blocks in order
    (K-quants: none, a super-block is 8 blocks)."""
    from moestream.quant import int4_sz_kn, unpack_int4

    if sec[f"{name}.q"].dim() == 3:
        group_size = 32  # the activation block; the super-block is the weights' business
    q8, d = quantize_act(x, group_size, 32767 if wide else 127)  # [T, nb, g], [T, nb]
    wq = sec[f"{name}.q"]
    if _kquant(wq):
        return _lane_sum(_kquant_terms(q8, d, wq))
    if f"{name}.dm" in sec:
        return _lane_sum(_q4_1_terms(q8, d, wq, sec[f"{name}.dm"]))
    elif wq.dtype == torch.int8 or wq.dim() == 3 or f"{name}.d" in sec:
        # q4_0: weights q - 8, scale d; q5_0: q - 16, its blocks' d; mxfp4: 2x its values
        wq, ws = _symmetric(sec, name)
        n, k = wq.shape
        wb = wq.view(n, k // group_size, group_size)
        if wide:
            dots = torch.einsum("tbg,nbg->tnb", q8.double(), wb.double()).float()
        else:
            dots = torch.einsum("tbg,nbg->tnb", q8, wb.float())
        terms = (ws[None] * d[:, None, :]) * dots  # [T, N, nb]
        return _lane_sum(terms)
    else:
        w = unpack_int4(wq).float()
        n, k = w.shape
        dots = torch.einsum("tbg,nbg->tnb", q8, w.view(n, k // group_size, group_size))
        sq = q8.sum(-1)[:, None, :]  # [T, 1, nb]
        sz = int4_sz_kn(sec[f"{name}.sz"], n).float()  # [nb, N, 2]
        s, z = sz[..., 0].t()[None], sz[..., 1].t()[None]  # [1, N, nb]
        terms = d[:, None, :] * (s * (dots - 8 * sq) + z * sq)
    y = torch.zeros(terms.shape[:2])
    for b in range(terms.shape[2]):  # sequential, as every native variant adds blocks
        y = y + terms[..., b]
    return y


def _lane_sum(terms: torch.Tensor) -> torch.Tensor:
    """terms [T, N, nb] summed over blocks in the row-major kernels' order (qlinear_q8)."""
    nb = terms.shape[2]
    m = nb - nb % 8
    lanes = torch.zeros(*terms.shape[:2], 8)
    for b in range(0, m, 8):
        lanes = lanes + terms[..., b : b + 8]
    l = lanes.unbind(-1)  # noqa: E741
    y = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    for b in range(m, nb):
        y = y + terms[..., b]
    return y


def _q4_1_terms(q8: torch.Tensor, d: torch.Tensor, wq: torch.Tensor, dm: torch.Tensor):
    """Per block the fp32 terms [T, N, K/32] of q4_1 weights (qlinear_q8): the dot of the
    nibbles 0..15 with the int8 activations and the activations' sum are exact integers
    (<= 15 * 127 * 32 < 2**24), then (d * dx) * dot + (m * dx) * sum."""
    from moestream.quant import unpack_q4_0

    w = unpack_q4_0(wq).float()
    n, k = w.shape
    dots = torch.einsum("tbg,nbg->tnb", q8, w.view(n, k // 32, 32))
    sq = q8.sum(-1)[:, None, :]  # [T, 1, nb]
    dmf = dm.float()
    dw, mw = dmf[..., 0][None], dmf[..., 1][None]  # [1, N, nb]
    dx = d[:, None, :]  # [T, 1, nb]
    return (dw * dx) * dots + (mw * dx) * sq


def _kquant_terms(q8: torch.Tensor, d: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Per activation block of 32 the fp32 terms [T, N, K/32] of K-quant weights (qlinear_q8).
    Integer dots are exact in fp32: |q6_k sc * (q - 32)| <= 4096, 32 of them times 127 < 2**24."""
    from moestream.quant import unpack_kquant

    f = unpack_kquant(wq)
    n, k = f["q"].shape
    rep = k // 32 // f["d"].shape[1]  # activation blocks per super-block: 8
    if "m" not in f:  # q6_k: one integer weight per element, the super-block's d per block
        w = (f["sc"].float().repeat_interleave(16, 1) * f["q"].float()).view(n, k // 32, 32)
        dots = torch.einsum("tbg,nbg->tnb", q8, w)
        return (f["d"].repeat_interleave(rep, 1)[None] * d[:, None, :]) * dots
    dots = torch.einsum("tbg,nbg->tnb", q8, f["q"].float().view(n, k // 32, 32))
    sq = q8.sum(-1)[:, None, :]  # [T, 1, nb]
    ds = f["d"].repeat_interleave(rep, 1) * f["sc"].float()  # [N, nb]
    dm = f["dmin"].repeat_interleave(rep, 1) * f["m"].float()
    return d[:, None, :] * (ds[None] * dots - dm[None] * sq)


def moe_q8_ref(
    x: torch.Tensor, secs: list[dict], weights: torch.Tensor, act: ExpertActivation | None = None
) -> torch.Tensor:
    """The native layer op's spec: x [T, D], E records, weights [T, E] -> [T, D] fp32, experts
    silu(gate) * up (or `act`) through qlinear_q8 (int8 weights' down projection with int16
    activations), a record's biases added as expert_ffn_q adds them (fp32), weighted and added in
    list order."""
    out = torch.zeros(x.shape)
    for e, sec in enumerate(secs):
        h = qlinear_q8(x, sec, "w13")
        if "b13" in sec:
            h = h + sec["b13"].float()
        gate, up = h.chunk(2, dim=-1)
        wide = sec["w2.q"].dtype == torch.int8
        y = qlinear_q8(F.silu(gate) * up if act is None else act(gate, up), sec, "w2", wide=wide)
        if "b2" in sec:
            y = y + sec["b2"].float()
        out = out + weights[:, e : e + 1].float() * y
    return out
