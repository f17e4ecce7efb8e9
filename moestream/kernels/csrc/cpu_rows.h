// The record and activation types every CPU row kernel shares (moe_cpu.cpp: scalar and AVX2 rows,
// the layer ops; avx512_cpu.cpp: the AVX-512 VNNI rows), and the rules their sums follow.
#pragma once
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace moestream_cpu {

constexpr int G = 32;   // weight group = activation block
constexpr int kG = G;  // (for code where G names a head group)
constexpr int BN = 64;  // int4 rows per packed block (torch's AVX-512 tinygemm layout)

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Software prefetch distance in bytes (0: off), ahead of each stream a row kernel reads.
extern int64_t g_prefetch;
// Weights and their scales are read once per token: prefetched non-temporal (NTA), so the stream
// does not evict the activations, partial sums and the next expert's lines from L2 (interleaved
// A/B of the layer op at 2 threads, I 768 / 512: +3-12% for int4, q4_0, q8_0, int8; T0 before).
inline void prefetch_line(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_NTA); }
// `bytes` from p + g_prefetch on, a line at a time (rows of a work item are one contiguous stream)
inline void prefetch_ahead(const void* p, int bytes) {
  if (g_prefetch)
    for (int c = 0; c < bytes; c += 64) prefetch_line((const char*)p + g_prefetch + c);
}

// Activation rows quantized per block of 32: x[r, 32 b + i] ~= d[r, b] * q[r, 32 b + i], q int8
// or (`wide`: int8 weights' down projection, whose SiLU*up input is heavy-tailed) int16.
struct QAct {
  int rows = 0, K = 0;
  bool wide = false;
  std::vector<int8_t> q;    // [rows, K]
  std::vector<int16_t> q16; // [rows, K] when wide
  std::vector<float> d;     // [rows, K/32]
  std::vector<int32_t> s;   // [rows, K/32] sum of q (the int4 zero-point term)
  std::vector<int32_t> pr;  // [rows, K/2] int8 (q[2i], q[2i+1]) twice per u32: int4's broadcast
  QAct(int r, int k, bool w = false)
      : rows(r), K(k), wide(w), q(w ? 0 : (size_t)r * k), q16(w ? (size_t)r * k : 0), d((size_t)r * k / G),
        s((size_t)r * k / G), pr(w ? 0 : (size_t)r * k / 2) {}
  const int8_t* qr(int r) const { return q.data() + (size_t)r * K; }
  const int16_t* q16r(int r) const { return q16.data() + (size_t)r * K; }
  const float* dr(int r) const { return d.data() + (size_t)r * K / G; }
  const int32_t* sr(int r) const { return s.data() + (size_t)r * K / G; }
  const int32_t* prr(int r) const { return pr.data() + (size_t)r * K / 2; }
};

// The K-quants (kquant_cpu.h) are kinds 3..5.
enum Kind : int { kInt8 = 0, kInt4 = 1, kQ4_0 = 2, kQ4_1 = 6, kQ5_0 = 7, kMxfp4 = 8 };
constexpr int kQ5_0Bytes = 22;  // block_q5_0: fp16 d, qh[4], qs[16]

// One [N, K] weight of a record: int4 q [N, K/2] + sz bf16 [N * K/32, 2] (blocked: int4_sz), int8 q [N, K] + s fp32
// [N, K/32], q4_0 q [N, K/2] (per row, per block 16 GGUF bytes: element i low, i + 16 high) +
// d fp16 [N, K/32], q4_1 q as q4_0 + dm fp16 [N, K/32, 2] (per block d, then m), or q5_0 blocks
// uint8 [N, K/32, 22] as a GGUF stores them (s unused), or mxfp4 blocks uint8 [N, K/32, 17] likewise.
struct Weight {
  const uint8_t* q;
  const void* s;
  int N, K;
  Kind kind;
  bool s16 = false;  // int8 with fp16 scales (q8_0: llama.cpp's Q8_0 blocks), else fp32
};

// int4's (scale, zero) bf16 pairs, one u32 each, of group j for the rows of the 64-row block at r0
// (the last block may be shorter): the store keeps each block's [K/32, rows, 2] contiguous
// (quant.int4_sz_blocked), so a block's scales are one stream beside its nibbles. (Group-major
// [K/32, N, 2], torch's tinygemm layout, put them N * 4 bytes apart per group: the layer op ran
// 17-18% slower at I 768 / 512 in a per-call interleaved A/B.)
inline const uint32_t* int4_sz(const Weight& w, int r0, int j) {
  return (const uint32_t*)w.s + (size_t)r0 * (w.K / G) + (size_t)j * std::min(BN, w.N - r0);
}

inline float fp16(uint16_t v) { return c10::detail::fp16_ieee_to_fp32_value(v); }

constexpr int kMaxBlocks = 1024;  // K <= 32768 for fp16-scaled int8 rows (checked in weight())

inline float bf16(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Eight float partials summed in one fixed order (the row-major schemes' block sums, the fused
// ops' dots): ((0+1)+(2+3))+((4+5)+(6+7)).
inline float lanes_sum(const float* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

// A row's last nb % 8 blocks after its 8 lanes were summed into acc: the scalar path's arithmetic,
// in order (int8 weights x int8 or int16 activations; q4_0 as int8 weights q - 8).
template <typename X>
inline float int8_tail(float acc, const int8_t* q, const float* s, const X* xq, const float* d, int j, int nb) {
  for (; j < nb; ++j) {
    int32_t dot = 0;
    for (int k = j * G; k < (j + 1) * G; ++k) dot += q[k] * xq[k];
    acc = acc + (s[j] * d[j]) * (float)dot;
  }
  return acc;
}

// A q4_0 row's last blocks [j, nb) after its 8 lanes were summed into acc, from their sums of
// nibble x activation (sums[0] is block j's; the vector rows take them from zero-padded vectors):
// the scalar path's fp32 steps in order, (d_w * d_x) * (sum - 8 * sum x).
inline float q4_0_tail(float acc, const int32_t* sums, const uint16_t* dw, const float* d, const int32_t* sx, int j,
                       int nb) {
  for (int jj = j; jj < nb; ++jj) acc = acc + (fp16(dw[jj]) * d[jj]) * (float)(sums[jj - j] - 8 * sx[jj]);
  return acc;
}

// The 32-input block schemes kept as a GGUF stores them, one block after another per row:
// q5_0 (block_q5_0 {fp16 d, qh[4], qs[16]}: w = (q - 16) * d, q 0..31, the low nibble from qs, the
// 5th bit from qh) and mxfp4 (block_mxfp4 {e8m0 e, qs[16]}: gpt-oss's experts, w = the e2m1 value
// of a 4-bit code times 2^(e - 127)). Both as integers v times a fp32 block scale d_w: q5_0's v =
// q - 16 (-16..15) and its d; mxfp4's v = twice the e2m1 value (-12..12, kE2M1x2) and d_w = 2^(e -
// 128), exact in fp32 (subnormal below e = 2, as llama.cpp's e8m0_to_fp32_half). Per block
// (d_w * d_x) * sum(v * x), an exact integer dot (<= 16 * 127 * 32). The vector rows take the
// values unsigned, v + offset (0..31 / 0..24), and take offset * sum x off again.
constexpr int kMxfp4Bytes = 17;
constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int block32_bytes(Kind k) { return k == kQ5_0 ? kQ5_0Bytes : kMxfp4Bytes; }
constexpr int block32_offset(Kind k) { return k == kQ5_0 ? 16 : 12; }
// offset * sum x of eight blocks (16: a shift, as before mxfp4; 12 = 8 + 4: two)
template <Kind KD>
__attribute__((target("avx2"))) inline __m256i block32_offsets8(__m256i sx) {
  if constexpr (KD == kQ5_0) return _mm256_slli_epi32(sx, 4);
  return _mm256_add_epi32(_mm256_slli_epi32(sx, 3), _mm256_slli_epi32(sx, 2));
}

inline const uint8_t* block32(const Weight& w, int r, int j) {
  return w.q + ((size_t)r * (w.K / G) + j) * block32_bytes(w.kind);
}

inline uint32_t q5_0_qh(const uint8_t* blk) {
  uint32_t v;
  std::memcpy(&v, blk + 2, 4);
  return v;
}

// 2^(e - 128) for every e8m0 byte e (ldexp: exact, the subnormals included)
struct E8m0Half {
  float v[256];
  E8m0Half() {
    for (int e = 0; e < 256; ++e) v[e] = std::ldexp(1.f, e - 128);
  }
};
inline const E8m0Half kE8m0Half;

inline float block32_scale(Kind k, const uint8_t* blk) {
  if (k == kMxfp4) return kE8m0Half.v[blk[0]];
  uint16_t h;
  std::memcpy(&h, blk, 2);
  return fp16(h);
}

// One block's 32 integer weights v in input order: byte i of qs holds element i in its low nibble,
// i + 16 in the high one; q5_0: bit i of qh is element i's 5th bit.
inline void block32_values(Kind k, const uint8_t* blk, int8_t* v) {
  if (k == kMxfp4) {
    for (int i = 0; i < G / 2; ++i) v[i] = kE2M1x2[blk[1 + i] & 15], v[G / 2 + i] = kE2M1x2[blk[1 + i] >> 4];
    return;
  }
  const uint32_t qh = q5_0_qh(blk);
  const uint8_t* qs = blk + 6;
  for (int i = 0; i < G / 2; ++i) {
    v[i] = (int8_t)((int)((qs[i] & 15) | (((qh >> i) & 1) << 4)) - 16);
    v[G / 2 + i] = (int8_t)((int)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
  }
}

// A row's last blocks [j, nb) after its 8 lanes were summed into acc, from their sums of (v +
// offset) x (sums[0] is block j's): the scalar path's fp32 steps, (d_w * d_x) * (sum - offset * sum x).
inline float block32_tail(float acc, const int32_t* sums, const Weight& w, int r, const float* d, const int32_t* sx,
                          int j, int nb) {
  const int off = block32_offset(w.kind);
  for (int jj = j; jj < nb; ++jj)
    acc = acc + (block32_scale(w.kind, block32(w, r, jj)) * d[jj]) * (float)(sums[jj - j] - off * sx[jj]);
  return acc;
}

// Row r's nb int8 scales as fp32: the section itself (fp32), or widened into buf (fp16, exact).
const float* row_scales(const Weight& w, int r, int nb, float* buf);

// ---- AVX-512 VNNI rows (avx512_cpu.cpp): the AVX2 rows' exact integer block dots from vpdpbusd,
// then the same fp32 steps in the same order, so every variant gives the same bits.
bool cpu_has_avx512();  // avx512 f, bw, vl, vnni, vbmi (vpermt2b) and the AVX2 set
void int4_block_avx512(const Weight& w, int r0, const QAct& a, int t, float* y);  // one full block of 64 rows
void int8_row_avx512(const Weight& w, int r, const QAct& a, int t, float* y);
void int8_row16_avx512(const Weight& w, int r, const QAct& a, int t, float* y);
void q4_0_row_avx512(const Weight& w, int r, const QAct& a, int t, float* y);
// The same for activation rows ts[0, NT) (NT = 2, 3, 4) -> y[i * ys + (0, n)]: the weights read once.
template <int NT>
void int4_block_avx512_nt(const Weight& w, int r0, const QAct& a, const int* ts, float* y, size_t ys);
template <int NT>
void int8_row_avx512_nt(const Weight& w, int r, const QAct& a, const int* ts, float* y, size_t ys);
template <int NT>
void q4_0_row_avx512_nt(const Weight& w, int r, const QAct& a, const int* ts, float* y, size_t ys);
// q5_0 / mxfp4 (KD) for NT = 1 (a decode row) to 4
template <int NT, Kind KD>
void block32_row_avx512_nt(const Weight& w, int r, const QAct& a, const int* ts, float* y, size_t ys);
// Blocks [b0, b1) of an activation row (x its start; q8 or q16 and d, s, pr the row's own) quantized
// as moe_cpu.cpp's quantize_blocks does, bit for bit; pr may be null.
void quantize_blocks_avx512(const float* x, int b0, int b1, float qmax, int8_t* q8, int16_t* q16, float* d,
                            int32_t* s, int32_t* pr);

}  // namespace moestream_cpu
