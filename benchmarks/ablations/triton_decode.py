"""Decode-kernel ablations (docs/gpu.md items 5, 10, 12), off the product path:

  fused     one persistent launch per layer (`_fused_kernel`): work items (gate/up first, then
            down) taken from a counter; 10-37% slower on the H200 (item 12).
  prefetch  gate/up programs bulk-prefetch their pair's w2 into L2 first; 15-25% slower (item 5).
  elem      False: int4 CUDA-core sums rows per K step instead of once at the end.
  q8        int4 rows with int8 activations and dp4a (decode_q8.py; lossy): 6% faster at
            Qwen3-30B-A3B shapes, 10% slower at Qwen3.5-35B-A3B's.
  chain     the row layouts' (int4 rows, q4_0, q4_1) 32-block products summed by one chain of
            fused multiply-adds (the product step's CHAIN hook, decode._chain) instead of a tree:
            fewer instructions (sm_90 SASS with half, Qwen3-30B-A3B: gate/up 5.00 -> 4.53 a
            weight, 122 -> 79 registers), but slower on the H200: 15.99 vs 14.69 us a layer (int4
            rows), 16.40 vs 14.91 (q4_0) (docs/gpu.md, d2c6d4e).
  MMA_CONFIGS  tensor-core tiles for every quant (the tuner's starting points; int4's default).

All of them run the product work items of moestream/kernels/triton/decode.py through its hooks
(READY, WAIT=2, ELEM, CHAIN); `moe_decode` here takes an `AblationConfig` (a DecodeConfig plus
these flags) and `stages=` (one kernel alone, for the per-kernel timing of tune_gpu_decode.py);
`check_shapes` is the product's with the flags' rules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from moestream.kernels.triton import decode as dk
from moestream.kernels.triton import kept
from moestream.kernels.triton.decode import (
    DecodeConfig,
    _down_item,
    _down_mma_item,
    _gate_up_item,
    _gate_up_mma_item,
)
from moestream.kernels.triton.layout import ROW_QUANTS

L2_PREFETCH_BYTES = 24 << 20  # prefetch w2 only while the pairs' w2 fit well inside L2 (50 MB)


@dataclass(frozen=True, slots=True)
class AblationConfig(DecodeConfig):
    """A DecodeConfig plus the ablation flags; all off is the product path."""

    elem: bool = True  # int4 CUDA cores: [groups, G, 32] products reduced once (the product's)
    prefetch: bool = False  # gate/up prefetches w2 into L2 (_gate_up_prefetch_kernel)
    fused: bool = False  # one persistent launch per layer (_fused_kernel) instead of two
    q8: bool = False  # int4 rows with int8 activations (decode_q8.py)
    chain: bool = False  # the row layouts' block sums by one chain of fused multiply-adds

    def __post_init__(self):
        DecodeConfig.__post_init__(self)  # (slots: no zero-argument super())
        assert not (self.chain and self.mma), "chain is the CUDA-core kernels' row-layout step"

    @classmethod
    def of(cls, cfg: DecodeConfig, **kw) -> AblationConfig:
        """A product config as an ablation config (flags off unless given)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(DecodeConfig)}, **kw)


def check_shapes(quant: str, hidden: int, inter: int, group: int,
                 cfg: AblationConfig) -> str | None:  # fmt: skip
    """The ablation flags' own rules, then decode.check_shapes: None when the kernels take them."""
    if cfg.chain and quant not in ROW_QUANTS:
        return f"chain is the row layouts' step ({', '.join(ROW_QUANTS)}), not {quant}'s"
    return dk.check_shapes(quant, hidden, inter, group, cfg)


def default(quant: str, hidden: int, inter: int, device: str | None = None) -> AblationConfig:
    """The product's tuned tiles (configs/tiles.json) for this shape on `device` (default: the
    first CUDA device; without one the file's fallback device), flags off."""
    if device is None and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    return AblationConfig.of(dk.tuned_config(quant, hidden, inter, device))


# Tensor-core variants (first guesses; benchmarks/tune_gpu_decode.py sweeps them)
MMA_CONFIGS = {
    "bf16": AblationConfig(bn=32, bk=256, split=2, bn_d=32, bk_d=256, mma=True),
    "int8": AblationConfig(bn=32, bk=512, split=2, bn_d=32, bk_d=256, mma=True),
    "int4": AblationConfig(bn=64, bk=256, split=4, bn_d=64, bk_d=256, mma=True),
}


# ---- L2 bulk prefetch of w2 by the gate/up programs ---------------------------------------------
@triton.jit
def _prefetch_l2(base, start, end, NT: tl.constexpr):
    """Bulk-prefetch bytes [start, end) after `base` into L2, split over NT threads (16 B units)."""
    sub = ((end - start + NT - 1) // NT + 15) // 16 * 16
    lo = start + tl.arange(0, NT) * sub
    size = tl.minimum(lo + sub, end) - lo
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.gt.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r",
        [base + lo, size.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _gate_up_prefetch_kernel(
    x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr, w2q_ptr, w2s_ptr, P,
    D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr, ELEM: tl.constexpr,
    FAST: tl.constexpr, W2Q_BYTES: tl.constexpr, W2S_BYTES: tl.constexpr, NT: tl.constexpr,
    PDL: tl.constexpr, HOST: tl.constexpr, HALF: tl.constexpr = False,
    CHAIN: tl.constexpr = False,
):  # fmt: skip
    """The product gate/up program after prefetching its share of the pair's w2 (and scales)."""
    p = tl.program_id(0)
    nb = tl.program_id(1)
    sk = tl.program_id(2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.load(ids_ptr + p).to(tl.int64)
    j = (nb * SPLIT + sk).to(tl.int64)
    n_j = tl.num_programs(1) * SPLIT
    qb = w2q_ptr.to(tl.pointer_type(tl.int8)) + e * W2Q_BYTES
    _prefetch_l2(qb, j * W2Q_BYTES // n_j, (j + 1) * W2Q_BYTES // n_j, NT)
    if W2S_BYTES > 0:
        sb = w2s_ptr.to(tl.pointer_type(tl.int8)) + e * W2S_BYTES
        _prefetch_l2(sb, j * W2S_BYTES // n_j, (j + 1) * W2S_BYTES // n_j, NT)
    _gate_up_item(x_ptr, ids_ptr, q_ptr, s_ptr, hq_ptr, hs_ptr, part_ptr, cnt_ptr, h_ptr, cnt_ptr,
                  p, nb, sk, P, D, I, QUANT, G, BN, BK, SPLIT, TOPK, ELEM, FAST, False,
                  HOST, HALF, CHAIN)  # fmt: skip


# ---- one persistent launch per layer ------------------------------------------------------------
@triton.jit
def _fused_kernel(
    x_ptr, ids_ptr, rw_ptr, q13_ptr, s13_ptr, q2_ptr, s2_ptr, part_ptr, cnt_g_ptr, h_ptr,
    ready_ptr, work_ptr, dpart_ptr, cnt_d_ptr, out_ptr, P: tl.constexpr, NPROG: tl.constexpr,
    D: tl.constexpr, I: tl.constexpr, QUANT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, SPLIT: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
    TOPK: tl.constexpr, ELEM: tl.constexpr, FAST: tl.constexpr, MMA: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, COMBINE: tl.constexpr,
    HALF: tl.constexpr = False, CHAIN: tl.constexpr = False,
):  # fmt: skip
    """A whole layer in one launch of NPROG persistent programs. Work items are numbered gate/up
    first, then down, and taken in that order from a counter (work[0]); a program takes its
    next item before it works on the current one, so the counter's round trip overlaps the work.
    A down item loads its first weight tile, then waits until its pair's NBG h blocks are
    counted in ready[p]: no second launch, and a pair's down reads overlap other pairs' gate/up.
    Never a deadlock, whatever the number of programs the GPU holds at once: an item waits only
    on gate/up items, which were taken before it by running programs that finish them without
    waiting. The last program to leave (work[1] counts them) resets the counters for the next
    call. P and NPROG are constexpr because the interpreter cannot run a loop on run-time
    values."""
    NBG: tl.constexpr = I // BN
    NBD: tl.constexpr = D // BN_D
    N_GU: tl.constexpr = P * NBG * SPLIT
    N: tl.constexpr = N_GU + P * NBD
    it = tl.atomic_add(work_ptr, 1, sem="relaxed", scope="gpu")
    while it < N:
        nxt = tl.atomic_add(work_ptr, 1, sem="relaxed", scope="gpu")
        if it < N_GU:
            p = it // (NBG * SPLIT)
            nb = (it // SPLIT) % NBG
            sk = it % SPLIT
            if MMA:
                _gate_up_mma_item(x_ptr, ids_ptr, q13_ptr, s13_ptr, q13_ptr, s13_ptr, part_ptr,
                                  cnt_g_ptr, h_ptr, ready_ptr, p, nb, sk, P, D, I, QUANT, G, BN,
                                  BK, SPLIT, TOPK, FAST, DT, PREC, STAGES, True,
                                  False)  # fmt: skip
            else:
                _gate_up_item(x_ptr, ids_ptr, q13_ptr, s13_ptr, q13_ptr, s13_ptr, part_ptr,
                              cnt_g_ptr, h_ptr, ready_ptr, p, nb, sk, P, D, I, QUANT, G, BN, BK,
                              SPLIT, TOPK, ELEM, FAST, True, False, HALF, CHAIN)  # fmt: skip
        else:
            p = (it - N_GU) // NBD
            nb = (it - N_GU) % NBD
            if MMA:
                _down_mma_item(h_ptr, ids_ptr, rw_ptr, q2_ptr, s2_ptr, q2_ptr, s2_ptr, dpart_ptr,
                               cnt_d_ptr, out_ptr, ready_ptr, p, nb, D, I, QUANT, G, BN_D, BK_D,
                               TOPK, FAST, 2, NBG, COMBINE, DT, PREC, False)  # fmt: skip
            else:
                _down_item(h_ptr, ids_ptr, rw_ptr, q2_ptr, s2_ptr, q2_ptr, s2_ptr, dpart_ptr,
                           cnt_d_ptr, out_ptr, ready_ptr, p, nb, D, I, QUANT, G, BN_D, BK_D, TOPK,
                           ELEM, FAST, 2, NBG, COMBINE, False, HALF, CHAIN)  # fmt: skip
        it = nxt
    if tl.atomic_add(work_ptr + 1, 1, sem="acq_rel", scope="gpu") == NPROG - 1:
        for i in tl.static_range(P):  # every item is done
            tl.store(ready_ptr + i, 0)
        tl.atomic_xchg(work_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(work_ptr + 1, 0, sem="relaxed", scope="gpu")


# ---- host side ----------------------------------------------------------------------------------
_RESIDENT: dict = {}


def blocks_per_sm(regs: int, warps: int, shared: int, sm_regs: int = 65536, sm_warps: int = 64,
                  sm_shared: int = 228 << 10, sm_blocks: int = 32) -> int:  # fmt: skip
    """Programs one SM holds at once (sm_90 limits by default): registers are allocated per warp
    in units of 256, and each program reserves 1 KB of shared memory."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(sm_regs // (per_warp * warps), sm_warps // warps, sm_blocks,
               sm_shared // (shared + 1024))  # fmt: skip


def _resident_programs(args, kw) -> int:
    """How many programs of the fused kernel the GPU holds at once (compiled first, to read its
    registers and shared memory)."""
    key = tuple(sorted((k, str(v)) for k, v in kw.items())) + (str(args[0].device),)
    n = _RESIDENT.get(key)
    if n is None:
        ck = _fused_kernel.warmup(*args, grid=(1,), NPROG=1, **kw)
        ck._init_handles()
        props = torch.cuda.get_device_properties(args[0].device)
        per_sm = blocks_per_sm(ck.n_regs, kw["num_warps"], ck.metadata.shared,
                               sm_regs=getattr(props, "regs_per_multiprocessor", 65536),
                               sm_warps=props.max_threads_per_multi_processor // 32,
                               sm_shared=getattr(props, "shared_memory_per_multiprocessor",
                                                 228 << 10))  # fmt: skip
        assert per_sm >= 1, f"the fused kernel does not fit an SM ({ck.n_regs} registers)"
        n = _RESIDENT[key] = per_sm * props.multi_processor_count
    return n


def _counters(device, P: int):
    """The fused kernel's int32 ready [P] and work [2] counters: zero, reset by its last program
    (cached, like the product workspace, for CUDA graphs)."""

    def make():
        c = torch.zeros(P + 2, device=device, dtype=torch.int32)
        return c[:P], c[P:]

    return kept(("fused ablation", str(device), P), make)


def _run_fused(launch: dk.Launch, cfg: AblationConfig) -> None:
    part, h, dpart, cnt_g, cnt_d = launch.ws
    ready, work = _counters(launch.x.device, launch.P)
    P, D, I = launch.P, launch.common["D"], launch.common["I"]
    assert not launch.common["HOST"], "the fused ablation reads the VRAM pool only"
    args = (launch.x, launch.ids, launch.weights, *launch.w13[:2], *launch.w2[:2], part, cnt_g, h,
            ready, work, dpart, cnt_d, launch.out if launch.combine else dpart, P)  # fmt: skip
    # the other family's constexprs are unused: fixed values, one compiled kernel
    kw = dict(DT=tl.float32, PREC="ieee", STAGES=cfg.stages)
    kw.update(BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split, BN_D=cfg.bn_d, BK_D=cfg.bk_d, MMA=cfg.mma,
              COMBINE=launch.combine, num_warps=cfg.num_warps, **launch.common)  # fmt: skip
    kw.update(ELEM=cfg.elem, CHAIN=cfg.chain)
    del kw["HOST"]
    # as many programs as the GPU holds at once (more would only queue); the interpreter runs
    # programs one after another, so it gets one
    n_items = P * max(I // cfg.bn * cfg.split, D // cfg.bn_d)
    n = min(_resident_programs(args, kw) if launch.gpu else 1, n_items)
    _fused_kernel[(n,)](*args, NPROG=n, **kw)


def _prefetch_args(launch: dk.Launch, cfg: AblationConfig) -> dict | None:
    """The prefetch kernel's extra arguments, or None when it does not run (interpreter, mma,
    or the pairs' w2 too large for L2)."""
    (w2q, w2s), quant = launch.w2[:2], launch.common["QUANT"]
    q_bytes = w2q[0].numel() * w2q.element_size()
    s_bytes = 0 if quant == dk.QUANT_CODE["bf16"] else w2s[0].numel() * w2s.element_size()
    if not (launch.gpu and cfg.prefetch and not cfg.mma):
        return None
    if launch.P * (q_bytes + s_bytes) > L2_PREFETCH_BYTES:
        return None
    return dict(w2q_ptr=w2q, w2s_ptr=w2s, W2Q_BYTES=q_bytes, W2S_BYTES=s_bytes,
                NT=32 * cfg.num_warps)  # fmt: skip


def moe_decode(x, ids, weights, experts, cfg: DecodeConfig | None = None, out=None,
               stages: str = "gate_up+down", combine: bool = True) -> torch.Tensor:  # fmt: skip
    """decode.moe_decode with the ablations of an AblationConfig (a DecodeConfig runs the product
    path). `stages` launches only the kernel it names (the tuner times each kernel; the output
    is then not the MoE result)."""
    if cfg is None or (type(cfg) is DecodeConfig and stages == "gate_up+down"):
        return dk.moe_decode(x, ids, weights, experts, cfg, out=out, combine=combine)
    if type(cfg) is DecodeConfig:
        cfg = AblationConfig.of(cfg)
    if cfg.q8:
        from ablations import decode_q8

        assert stages == "gate_up+down", "the int8-activation layer runs both stages"
        return decode_q8.moe_decode(x, ids, weights, experts, cfg, out=out, combine=combine)
    why = check_shapes(experts.kernel_quant, x.shape[1], experts.inter,
                       experts.scheme.group_size, cfg)  # fmt: skip
    assert why is None, why
    launch = dk.Launch.build(x, ids, weights, experts, cfg, out, combine)
    if cfg.fused:
        assert stages == "gate_up+down", "the fused kernel runs both stages"
        _run_fused(launch, cfg)
        return launch.result()
    elem = {} if cfg.mma else {"ELEM": cfg.elem, "CHAIN": cfg.chain}
    if "gate_up" in stages:
        pre = _prefetch_args(launch, cfg)
        if pre is None:
            launch.gate_up(**elem)
        else:
            launch.gate_up(_gate_up_prefetch_kernel, **pre, **elem)
    if "down" in stages:
        launch.down(**elem)
    return launch.result()
