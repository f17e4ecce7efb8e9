"""Ablation: the int4 gate/up projection of a decode token on tensor cores, in hand-written CUDA
(compiled at run time by NVRTC through CuPy, on the GPU machine only), against the product's
Triton gate/up (moestream/kernels/triton/decode.py) on the same experts.

The question (docs/gpu.md, "the int4 kernels under ncu"): the product's int4 rows kernels issue
6.3 (gate/up) and 8.1 (down) instructions a weight, so their issue alone takes longer than the
layer's bytes at the HBM rate. Is a gate/up at ~2.5 instructions a weight, with every weight load
in flight at once, bound by the bytes instead?

The kernel. A block of KW warps takes 16 gate rows and their 16 up rows of one pair, each warp a
K / KW slice; every weight load of the slice is issued before the first product. Per group of 32
inputs a lane holds, for rows g and g + 8 of the tile (g = lane / 4), the eight nibbles of inputs
2c, 2c+1, 2c+8, 2c+9, 2c+16, 2c+17, 2c+24, 2c+25 (c = lane % 4) in one word, ordered so that
`(w >> s) & 0x000F000F | 0x43004300` is a bf16 pair 128 + q (exact) for s = 0, 4, 8, 12, and one
bf16x2 FMA makes it q - 8 (exact): the A operand of `mma.m16n8k16` (bf16, fp32 accumulation) for
the group's two 16-input steps. The token fills every column of B, so each lane's accumulator
holds its rows' sums. Per group: acc += s * sum((q - 8) x) + z * sum(x) (fp32 FMAs; the group's
sum of x, the token and the tile's (scale, zero) words loaded once per block into shared memory,
behind the weight loads). The KW partial sums of a row are added in warp order,
then h = silu(g) * u rounded to bf16.

Numerics: every product (q - 8) x is exact in fp32; the tensor cores add 16 of them in their own
order, so the sums differ from the Triton kernel's in the last bits (checked here against the
float64 spec: the stored numbers dequantized exactly, as tests/test_triton_kernels.py does).

Layout: `mma_layout` repacks the pool's int4 rows (quant.int4_to_rows) per 16-row tile into
[tiles, K / 64, 32 lanes, 4 words] (words: group 2j rows g, g + 8, then group 2j + 1): a lane
loads 16 bytes for two groups, a warp 512 contiguous bytes. The (scale, zero) words stay as the
pool holds them. A pool would repack once, as records enter it, as it does for the rows layout.

Measured (H200, `--kw 4 8`, graphs of 8 layers with the L2 flushed, results/gpu_moe_trials.jsonl
rows "mma_int4_cuda"): the gate/up of Qwen3-30B-A3B 11.1 us against the Triton gate/up's 9.9 (its
whole layer 15.8), of Qwen3.5-35B-A3B 9.2 against 8.0 (layer 13.0). The same grid loading the
same bytes with no arithmetic (`read_tiles`) takes 7.8 / 6.8 us. ncu (kw 4, Qwen3): 3.3
instructions a weight (Triton's 6.3), 0.32 warps issued a scheduler-cycle, half of the stalls
waiting on loads, DRAM 32%, 109 registers (4 blocks an SM). Half the instructions, not faster:
at one token these bytes take ~8 us to read in this launch shape whatever the arithmetic, and
with every load of a warp issued before its products, the products run after the loads rather
than beside them. Not taken; the Triton kernels stay. `read_layer_bulk` reads the same gate/up bytes
by the bulk copy engine (`cp.async.bulk` into shared memory, 40 KB a block on one mbarrier): 7.3
/ 6.1 us, so no read mechanism of the GPU takes them much faster at this size; with down's rows
too, a whole layer's routed bytes in one launch: 9.0 / 7.3 us, 0.62 / 0.51 of the layer's
roofline, the most any kernel measured here reads at these shapes.

    python benchmarks/ablations/mma_int4_cuda.py --out gpu_moe_trials.jsonl --commit C
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from moestream.kernels.ref import dequantize
from moestream.quant import int4_from_rows

sys.path.insert(0, str(Path(__file__).parents[1]))

SRC = r"""
#define K_ %(K)d
#define I_ %(I)d
#define KW %(KW)d
#define NG (K_ / 32)
#define JS (NG / KW)
#define TILES (I_ / 16)

__device__ __forceinline__ unsigned ext(unsigned w, int s) {
    unsigned v = ((w >> s) & 0x000F000Fu) | 0x43004300u;  // bf16 pair 128 + q
    unsigned r;
    asm("fma.rn.bf16x2 %%0, %%1, %%2, %%3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(0xC308C308u));
    return r;  // q - 8, exact
}

__device__ __forceinline__ void mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                    unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, "
        "{%%8,%%9}, {%%10,%%11,%%12,%%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),
          "f"(d[0]), "f"(d[1]), "f"(d[2]), "f"(d[3]));
}

__device__ __forceinline__ float lo_f(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }

// the same grid and loads as gate_up_mma (every weight and (scale, zero) word of the tiles), no
// arithmetic: what reading these bytes alone takes in this launch shape
extern "C" __global__ void __launch_bounds__(KW * 32)
read_tiles(const uint4* __restrict__ wq, const unsigned* __restrict__ wsz,
           const long long* __restrict__ ids, unsigned* __restrict__ sink) {
    const int t = blockIdx.x, p = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long e = ids[p];
    const uint4* wg = wq + ((e * (2 * TILES) + t) * (NG / 2) + warp * (JS / 2)) * 32 + lane;
    const uint4* wu = wg + (long long)TILES * (NG / 2) * 32;
    unsigned acc = 0;
#pragma unroll
    for (int i = 0; i < JS / 2; i++) {
        const uint4 a = __ldg(wg + i * 32), b = __ldg(wu + i * 32);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    }
    for (int i = threadIdx.x; i < 32 * NG / 4; i += KW * 32) {
        const int r = i / (NG / 4), q4 = i %% (NG / 4);
        const long long row = e * (2 * I_) + (r < 16 ? t * 16 + r : I_ + t * 16 + r - 16);
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(wsz + row * NG) + q4);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;  // keeps the loads; practically never stores
}

// a layer's routed bytes by the bulk copy engine (TMA) into shared memory, one mbarrier a block:
// blocks x < TILES a gate/up tile (gate and up weights, their (scale, zero) words), the others a
// 16-row tile of down (the pool's rows: w2 [E, D, I/2] bytes, its words [E, D, I/32]); a grid of
// TILES blocks a pair reads the gate/up bytes alone. One word of each block is consumed.
extern "C" __global__ void __launch_bounds__(128)
read_layer_bulk(const uint4* __restrict__ wq, const unsigned* __restrict__ wsz,
                const unsigned char* __restrict__ w2q, const unsigned* __restrict__ w2z,
                const long long* __restrict__ ids, unsigned* __restrict__ sink) {
    constexpr int WB = 16 * K_ / 2, SB = 16 * NG * 4, DB = 16 * I_ / 2, DS = 16 * (I_ / 32) * 4;
    __shared__ alignas(128) unsigned char buf[2 * WB + 2 * SB];
    __shared__ alignas(8) unsigned long long bar;
    const int t = blockIdx.x, p = blockIdx.y;
    const long long e = ids[p];
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" ::"r"(b));
        asm volatile("fence.proxy.async.shared::cta;");
        const unsigned char* src[4];
        int n[4], m;
        if (t < TILES) {
            src[0] = reinterpret_cast<const unsigned char*>(wq + (e * (2 * TILES) + t) * (NG / 2) * 32);
            src[1] = reinterpret_cast<const unsigned char*>(wq + (e * (2 * TILES) + TILES + t) * (NG / 2) * 32);
            src[2] = reinterpret_cast<const unsigned char*>(wsz + (e * (2 * I_) + t * 16) * NG);
            src[3] = reinterpret_cast<const unsigned char*>(wsz + (e * (2 * I_) + I_ + t * 16) * NG);
            n[0] = n[1] = WB;
            n[2] = n[3] = SB;
            m = 4;
        } else {
            const long long r0 = e * K_ + (long long)(t - TILES) * 16;
            src[0] = w2q + r0 * (I_ / 2);
            src[1] = reinterpret_cast<const unsigned char*>(w2z + r0 * (I_ / 32));
            n[0] = DB;
            n[1] = DS;
            m = 2;
        }
        int total = 0;
        for (int i = 0; i < m; i++) total += n[i];
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;" ::"r"(b), "r"(total));
        int off = 0;
        for (int i = 0; i < m; i++) {
            const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(buf + off));
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
                ::"r"(d), "l"(src[i]), "r"(n[i]), "r"(b) : "memory");
            off += n[i];
        }
    }
    __syncthreads();
    asm volatile(
        "{\n .reg .pred P;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P, [%%0], 0;\n"
        " @!P bra WAIT;\n}" ::"r"(b) : "memory");
    const unsigned v = reinterpret_cast<const unsigned*>(buf)[threadIdx.x * 8];
    if (v == 0x9E3779B9u) sink[0] = v;
}

// group j of one tile: the two 16-input steps on tensor cores, then scale and zero
__device__ __forceinline__ void group(unsigned w0, unsigned w8, const unsigned* xs32, int j, int c,
                                      unsigned s0, unsigned s8, float xsum, float& a, float& b) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma(d, ext(w0, 0), ext(w8, 0), ext(w0, 4), ext(w8, 4), xs32[16 * j + c], xs32[16 * j + c + 4]);
    mma(d, ext(w0, 8), ext(w8, 8), ext(w0, 12), ext(w8, 12), xs32[16 * j + c + 8],
        xs32[16 * j + c + 12]);
    a = fmaf(lo_f(s0), d[0], a);
    a = fmaf(hi_f(s0), xsum, a);
    b = fmaf(lo_f(s8), d[2], b);
    b = fmaf(hi_f(s8), xsum, b);
}

extern "C" __global__ void __launch_bounds__(KW * 32)
gate_up_mma(const uint4* __restrict__ wq, const unsigned* __restrict__ wsz,
            const unsigned* __restrict__ x32, const long long* __restrict__ ids,
            unsigned short* __restrict__ h) {
    __shared__ unsigned xs32[K_ / 2];
    __shared__ float xsum[NG];
    __shared__ float red[KW][2][16];
    __shared__ unsigned ssm[32][NG + 1];  // the tile's (scale, zero) words: gate rows, up rows
    const int t = blockIdx.x, p = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long e = ids[p];
    const uint4* wg = wq + ((e * (2 * TILES) + t) * (NG / 2) + warp * (JS / 2)) * 32 + lane;
    const uint4* wu = wg + (long long)TILES * (NG / 2) * 32;
    uint4 qg[JS / 2], qu[JS / 2];
#pragma unroll
    for (int i = 0; i < JS / 2; i++) {  // every weight load of the slice before any product
        qg[i] = __ldg(wg + i * 32);
        qu[i] = __ldg(wu + i * 32);
    }
    for (int i = threadIdx.x; i < K_ / 2; i += KW * 32) xs32[i] = x32[i];
    for (int i = threadIdx.x; i < 32 * NG / 4; i += KW * 32) {  // 16-byte loads, row by row
        const int r = i / (NG / 4), q4 = i %% (NG / 4);
        const long long row = e * (2 * I_) + (r < 16 ? t * 16 + r : I_ + t * 16 + r - 16);
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(wsz + row * NG) + q4);
        ssm[r][4 * q4] = v.x;
        ssm[r][4 * q4 + 1] = v.y;
        ssm[r][4 * q4 + 2] = v.z;
        ssm[r][4 * q4 + 3] = v.w;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < NG; j += KW * 32) {
        float s = 0.f;
        for (int k = 0; k < 16; k++) {
            unsigned w = xs32[16 * j + k];
            s += lo_f(w);
            s += hi_f(w);
        }
        xsum[j] = s;
    }
    __syncthreads();
    float ga = 0.f, gb = 0.f, ua = 0.f, ub = 0.f;
#pragma unroll
    for (int jj = 0; jj < JS; jj++) {
        const int j = warp * JS + jj;
        const uint4 a = qg[jj / 2], b = qu[jj / 2];
        const float xj = xsum[j];
        group((jj & 1) ? a.z : a.x, (jj & 1) ? a.w : a.y, xs32, j, c, ssm[g][j], ssm[g + 8][j],
              xj, ga, gb);
        group((jj & 1) ? b.z : b.x, (jj & 1) ? b.w : b.y, xs32, j, c, ssm[16 + g][j],
              ssm[24 + g][j], xj, ua, ub);
    }
    if (c == 0) {
        red[warp][0][g] = ga;
        red[warp][0][g + 8] = gb;
        red[warp][1][g] = ua;
        red[warp][1][g + 8] = ub;
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const int r = threadIdx.x;
        float G = 0.f, U = 0.f;
        for (int w = 0; w < KW; w++) {
            G += red[w][0][r];
            U += red[w][1][r];
        }
        const float v = G / (1.f + __expf(-G)) * U;
        unsigned short o;
        asm("cvt.rn.bf16.f32 %%0, %%1;" : "=h"(o) : "f"(v));
        h[(long long)p * I_ + t * 16 + r] = o;
    }
}
"""

# word bit position of each of a lane's eight inputs 2c + off (see the docstring)
OFFSETS = (0, 1, 8, 9, 16, 17, 24, 25)
SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)


def mma_layout(rows: torch.Tensor) -> torch.Tensor:
    """int4 rows [E, N, K/2] uint8 (per 32 inputs 16 bytes, input i low nibble, i + 16 high) ->
    int32 [E, N/16, K/64, 32, 4]: lane 4g + c's words (group 2j: rows g, g + 8; group 2j + 1)."""
    E, N, k2 = rows.shape
    K = 2 * k2
    assert N % 16 == 0 and K % 64 == 0, (N, K)
    b = rows.view(E, N, K // 32, 16).to(torch.int64)
    v = torch.cat([b & 15, b >> 4], -1)  # [E, N, K/32, 32]: nibble of input i of the group
    words = torch.zeros(E, N, K // 32, 4, dtype=torch.int64, device=rows.device)
    for c in range(4):
        for off, sh in zip(OFFSETS, SHIFTS):
            words[..., c] |= v[..., 2 * c + off] << sh
    w = words.view(E, N // 16, 2, 8, K // 64, 2, 4)  # tile, half (g / g + 8), g, j / 2, j % 2, c
    w = w.permute(0, 1, 4, 3, 6, 5, 2).reshape(E, N // 16, K // 64, 32, 4)
    return _i32(w)


def _i32(w: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with those bits."""
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def h_spec(x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, words: torch.Tensor,
           I: int) -> torch.Tensor:  # fmt: skip
    """float64 h [P, I] = silu(g) * u with the stored numbers dequantized exactly (the pool's rows
    back to the store's sections, then kernels/ref.py's dequantize in float64)."""
    g = 2 * rows.shape[-1] // words.shape[-1]
    W = []
    for e in ids.tolist():
        q, sz = int4_from_rows(rows[e], words[e])
        W.append(dequantize({"w.q": q, "w.sz": sz}, "w", g, torch.float64))
    gu = torch.stack(W) @ x.double()
    return torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]


def compile_kernels(D: int, I: int, kw: int):
    """(gate_up_mma, read_tiles, read_layer_bulk) for hidden D, intermediate I, kw warps a block (NVRTC, sm_90)."""
    import cupy

    assert D % (64 * kw) == 0 and I % 16 == 0, (D, I, kw)
    mod = cupy.RawModule(code=SRC % dict(K=D, I=I, KW=kw), options=("--std=c++17", "-arch=sm_90"))
    names = ("gate_up_mma", "read_tiles", "read_layer_bulk")
    return tuple(mod.get_function(n) for n in names)


def _ptr(t: torch.Tensor):
    import numpy as np

    return np.uint64(t.data_ptr())


def gate_up(fn, mq, rz, x, ids, h, I: int, kw: int) -> None:
    """h [P, I] bf16 = silu(g) * u of token x [1, D] bf16 for the pairs' experts ids [P] int64,
    from the mma layout mq and the pool's (scale, zero) words rz, on torch's current stream."""
    import cupy

    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        fn((I // 16, ids.numel()), (kw * 32,), (_ptr(mq), _ptr(rz), _ptr(x), _ptr(ids), _ptr(h)))


def read_only(fn, mq, rz, ids, sink, I: int, kw: int) -> None:
    """read_tiles over the same tiles as gate_up (sink: int32 [1], practically never written)."""
    import cupy

    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        fn((I // 16, ids.numel()), (kw * 32,), (_ptr(mq), _ptr(rz), _ptr(ids), _ptr(sink)))


def read_layer(fn, mq, rz, w2q, w2z, ids, sink, D: int, I: int, gate_up_only: bool) -> None:
    """read_layer_bulk: a layer's routed bytes (gate/up tiles and down's rows) in one launch, or
    the gate/up tiles' alone."""
    import cupy

    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        fn((I // 16 + (0 if gate_up_only else D // 16), ids.numel()), (128,),
           (_ptr(mq), _ptr(rz), _ptr(w2q), _ptr(w2z), _ptr(ids), _ptr(sink)))  # fmt: skip


def within_spec(h: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 h against the float64 spec: one bf16 rounding, plus fp32 sums far below it."""
    return bool(((h.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-3 * want.abs().max()).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kw", nargs="+", type=int, default=[2, 4, 8], help="warps a block (K split)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("mma_int4_cuda.py: needs a CUDA GPU (and CuPy)", file=sys.stderr)
        sys.exit(2)
    from bench_gpu_moe import copy_bandwidth, graph_ms, random_layer, routing
    from common import bench_row, write_rows

    from moestream.kernels.triton import tuned
    from moestream.kernels.triton.decode import Launch, default_config, moe_decode

    bw = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    out = []
    for model, (D, I, E, K) in {"Qwen3-30B-A3B": (2048, 768, 128, 8),
                                "Qwen3.5-35B-A3B": (2048, 512, 256, 8)}.items():  # fmt: skip
        exs = [random_layer("int4r", D, I, E) for _ in range(a.layers)]
        secs = [(ex.sections["w13.q"], ex.sections["w13.rz"]) for ex in exs]
        mma_q = [mma_layout(q) for q, _ in secs]
        x = torch.randn(1, D, generator=gen).cuda().bfloat16()
        y = torch.empty_like(x)
        routes = [routing(1, E, K, gen) for _ in range(a.layers)]
        P = K
        hs = [torch.empty(P, I, dtype=torch.bfloat16, device="cuda") for _ in exs]
        sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        gu_bytes = sum(len(set(r[0].flatten().tolist())) for r in routes) / a.layers * (
            secs[0][0][0].nbytes + secs[0][1][0].nbytes)  # fmt: skip
        layer_bytes = sum(len(set(r[0].flatten().tolist())) for r in routes) / a.layers * (
            exs[0].expert_bytes())  # fmt: skip
        cfg = default_config("int4r", D, I, 32, tuned.device_name(x.device))
        launches = [Launch.build(x, ids, w, ex, cfg, y, True) for ex, (ids, w) in zip(exs, routes)]

        def triton_gate_up():
            for ln in launches:
                ln.gate_up()

        def triton_layer():
            for ex, (ids, w) in zip(exs, routes):
                moe_decode(x, ids, w, ex, cfg, out=y)

        rows = {"triton gate/up": graph_ms(triton_gate_up, a.layers),
                "triton layer": graph_ms(triton_layer, a.layers)}  # fmt: skip
        for kw in a.kw:
            if D % (64 * kw):
                continue
            fn, rd, layer_bulk = compile_kernels(D, I, kw)

            def cuda_gate_up(fn=fn, kw=kw):
                for mq, (_, rz), (ids, _), h in zip(mma_q, secs, routes, hs):
                    gate_up(fn, mq, rz, x, ids.view(-1), h, I, kw)

            def cuda_read(rd=rd, kw=kw):
                for mq, (_, rz), (ids, _) in zip(mma_q, secs, routes):
                    read_only(rd, mq, rz, ids.view(-1), sink, I, kw)

            cuda_gate_up()
            torch.cuda.synchronize()
            for (q, rz), (ids, _), h in zip(secs, routes, hs):  # the float64 spec, every layer
                assert within_spec(h, h_spec(x[0], ids.view(-1), q, rz, I)), f"kw {kw}"
            rows[f"cuda mma gate/up kw={kw}"] = graph_ms(cuda_gate_up, a.layers)
            cuda_read()
            rows[f"cuda read-only gate/up bytes kw={kw}"] = graph_ms(cuda_read, a.layers)
            if kw == a.kw[0]:  # one block of 128 threads a tile, whatever kw

                def bulk_read(gate_up_only: bool, lb=layer_bulk):
                    for ex, mq, (ids, _) in zip(exs, mma_q, routes):
                        sc = ex.sections
                        read_layer(lb, mq, sc["w13.rz"], sc["w2.q"], sc["w2.rz"], ids.view(-1),
                                   sink, D, I, gate_up_only)  # fmt: skip

                for only, name in ((True, "cuda bulk-copy (TMA) read of the gate/up bytes"),
                                   (False, "cuda bulk-copy (TMA) read of the layer's bytes, one launch")):  # fmt: skip
                    bulk_read(only)
                    rows[name] = graph_ms(lambda only=only: bulk_read(only), a.layers)
        for name, ms in rows.items():
            part = "gate/up" if "gate/up" in name else "layer"
            frac = (gu_bytes if part == "gate/up" else layer_bytes) / bw / (ms * 1e-3)
            print(f"{model:16} {name:26} {ms * 1e3:6.2f} us  {frac:.2f} of the {part} bytes' roofline",
                  flush=True)  # fmt: skip
            out.append(bench_row("mma_int4_cuda", {"model": model, "D": D, "I": I, "E": E, "K": K,
                                                   "variant": name, "layers_in_graph": a.layers},
                                 {"us": ms * 1e3, "gate_up_bytes": gu_bytes, "layer_bytes": layer_bytes,
                                  "copy_bw_gbps": bw / 1e9, "bytes_of": part, "roofline_fraction": frac},
                                 a.commit))  # fmt: skip
    write_rows(a.out, out)


if __name__ == "__main__":
    main()
