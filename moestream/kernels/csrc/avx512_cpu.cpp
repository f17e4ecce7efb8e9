// AVX-512 VNNI rows for moe_cpu.cpp's dispatch (Isa kAvx512). Each computes the AVX2 row's exact
// integer block dots with vpdpbusd / vpdpwssd, then applies the same fp32 steps in the same order
// (cpu_rows.h), so the bits equal the scalar and AVX2 variants' (tests/test_native_kernels.py).
// vpdpbusd multiplies unsigned by signed bytes: int8 weights enter as w + 128 (w ^ 0x80) and the
// 128 * sum(x) term is taken off again; int4 / q4_0 nibbles, q5_0's 5-bit values and mxfp4's
// doubled e2m1 values plus 12 are unsigned already.
#include <immintrin.h>

#include "cpu_rows.h"
#include "kquant_cpu.h"

namespace moestream_cpu {


bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

// Everything below is AVX-512 code, reached only when cpu_has_avx512() (moe_cpu.cpp's dispatch).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")

namespace {

// Four vectors of 16 int32 lanes, vector i holding blocks 2i (lanes 0-7) and 2i + 1 (8-15) ->
// the eight block sums in block order (exact: integer adds in any order).
inline __m256i block_sums8x8(const __m512i* z) {
  const __m512i u01 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
  const __m512i u23 = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
  // per 128-bit quarter q: [z0, z1, z2, z3] summed over q's four lanes
  const __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi64(u01, u23), _mm512_unpackhi_epi64(u01, u23));
  // quarters 0 + 1: blocks 0, 2, 4, 6; quarters 2 + 3: blocks 1, 3, 5, 7
  const __m512i s = _mm512_add_epi32(v, _mm512_shuffle_i32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, s));
}

// Two vectors of 16 int32 lanes, each 128-bit quarter q one block's four partials (a: blocks
// 0-3, b: blocks 4-7) -> the eight block sums in block order.
inline __m256i block_sums8x4(__m512i a, __m512i b) {
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i v = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, _MM_PERM_BADC));  // lane 0: a, lane 1: b
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, v));
}

}  // namespace

}  // namespace moestream_cpu

namespace moestream_kquant {

// q4_k / q5_k: chunk c of 32 bytes holds sub-blocks 2c (low nibbles) and 2c + 1 (high), whose
// activations are 64 contiguous bytes: the chunk broadcast to both halves of a vector, shifted by 0
// / 4 per half (q5_k: bit 2c / 2c + 1 of qh as bit 4), is one vpdpbusd against them, in
// block_sums8x8's layout. The eight pairs' scales widen from bytes (scale_min_words), d and dmin
// by F16C (exact, as the scalar conversion); the fp32 steps and lanes are q45_row_avx2's. NT
// activation rows (a prompt's token tile) share each super-block's unpacking; each row gets the
// one-row bits.
template <bool Q5, int NT>
void q45_rows_avx512(const uint8_t* row, int nb, const Act* x, float* y, size_t ys) {
  using namespace moestream_cpu;
  constexpr int B = Q5 ? 176 : 144;
  const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
  const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i shq[4];  // q5_k: bit 2c in the low half, 2c + 1 in the high
  for (int c = 0; c < 4; ++c)
    shq[c] = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1);
  __m256 acc[NT];  // lane j: sub-block j of every super-block
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int s = 0; s < nb; ++s) {
    const uint8_t* blk = row + (size_t)s * B;
    prefetch_ahead(blk, B);
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    const __m512i h = Q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 16))) : m4;
    __m512i w[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * c)));
      w[c] = _mm512_and_si512(_mm512_srlv_epi16(v, sh), m4);
      if (Q5) w[c] = _mm512_or_si512(w[c], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shq[c]), one), 4));
    }
    uint32_t sm[4];
    scale_min_words(blk + 4, sm);
    const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sm[1], (int)sm[0])));
    const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sm[3], (int)sm[2])));
    int32_t dd;
    std::memcpy(&dd, blk, 4);
    const __m128 dm2 = _mm_cvtph_ps(_mm_cvtsi32_si128(dd));  // d, dmin
    const __m256 ds = _mm256_mul_ps(_mm256_broadcastss_ps(dm2), scv);
    const __m256 dm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm2)), mv);
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = x[t].q + (size_t)s * 8 * G;
      __m512i z[4];
      for (int c = 0; c < 4; ++c) z[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c], _mm512_loadu_si512(xq + 2 * c * G));
      const __m256 dot = _mm256_cvtepi32_ps(block_sums8x8(z));
      const __m256 sx = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(x[t].s + s * 8)));
      const __m256 e = _mm256_sub_ps(_mm256_mul_ps(ds, dot), _mm256_mul_ps(dm, sx));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_loadu_ps(x[t].d + s * 8), e));
    }
  }
  for (int t = 0; t < NT; ++t) {
    float l[8];
    _mm256_storeu_ps(l, acc[t]);
    y[t * ys] = lanes_sum(l);
  }
}

// q6_k: values u = ql nibble | qh 2 bits << 4 (0..63) for sub-blocks j, j + 1 of one half h
// (pairs (4h, 4h + 1): the half's 64 ql bytes' low nibbles, qh shifted by 0 / 2; (4h + 2, 4h + 3):
// high nibbles, qh by 4 / 6) against their 64 contiguous activations: vpdpbusd gives sum u x per
// lane of 4, minus 32 sum x (a vpdpbusd of 32s), times the lane's sub-block scale (16 values per
// scale: 4 lanes), all exact int32 (|sc (u - 32) x| sums < 2**24), so block_sums8x8 gives
// q6_row_avx2's integer dots and its fp32 steps follow. NT rows as q45_rows_avx512.
template <int NT>
void q6_rows_avx512(const uint8_t* row, int nb, const Act* x, float* y, size_t ys) {
  using namespace moestream_cpu;
  const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3), c32 = _mm512_set1_epi8(32);
  __m512i shq[2];  // qh shifts: pair 0 of a half 0 | 2, pair 1 4 | 6 (16-bit lanes per 256-bit half)
  for (int i = 0; i < 2; ++i)
    shq[i] = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * i)), _mm256_set1_epi16((short)(4 * i + 2)), 1);
  __m128i sidx[4];  // pair p's four sub-block-half scales sc[4p + i], each for 4 lanes
  for (int p = 0; p < 4; ++p) {
    alignas(16) int8_t ix[16];
    for (int i = 0; i < 16; ++i) ix[i] = (int8_t)(4 * p + i / 4);
    sidx[p] = _mm_load_si128((const __m128i*)ix);
  }
  __m256 acc[NT];  // lane j: block j of every super-block
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int s = 0; s < nb; ++s) {
    const uint8_t* blk = row + (size_t)s * 210;
    prefetch_ahead(blk, 210);
    const __m128i scb = _mm_loadu_si128((const __m128i*)(blk + 192));
    __m512i u[4], sc[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h)));
      for (int i = 0; i < 2; ++i) {  // pair p = 2h + i: sub-blocks 4h + 2i, 4h + 2i + 1
        const int p = 2 * h + i;
        const __m512i nib = _mm512_and_si512(i ? _mm512_srli_epi16(l, 4) : l, m4);
        const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(qh, shq[i]), m3);
        u[p] = _mm512_or_si512(nib, _mm512_slli_epi16(hb, 4));
        sc[p] = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(scb, sidx[p]));
      }
    }
    int16_t dh;
    std::memcpy(&dh, blk + 208, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss((unsigned short)dh));
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = x[t].q + (size_t)s * 8 * G;
      __m512i z[4];
      for (int p = 0; p < 4; ++p) {
        const __m512i xv = _mm512_loadu_si512(xq + 2 * p * G);
        const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[p], xv),
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), c32, xv));
        z[p] = _mm512_mullo_epi32(dot, sc[p]);
      }
      const __m256 c = _mm256_mul_ps(d, _mm256_loadu_ps(x[t].d + s * 8));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(c, _mm256_cvtepi32_ps(block_sums8x8(z))));
    }
  }
  for (int t = 0; t < NT; ++t) {
    float l[8];
    _mm256_storeu_ps(l, acc[t]);
    y[t * ys] = lanes_sum(l);
  }
}

#define MOESTREAM_KQ_NT(NT)                                                                          \
  template void q45_rows_avx512<false, NT>(const uint8_t*, int, const Act*, float*, size_t);       \
  template void q45_rows_avx512<true, NT>(const uint8_t*, int, const Act*, float*, size_t);        \
  template void q6_rows_avx512<NT>(const uint8_t*, int, const Act*, float*, size_t);
MOESTREAM_KQ_NT(1)
MOESTREAM_KQ_NT(2)
MOESTREAM_KQ_NT(3)
MOESTREAM_KQ_NT(4)
#undef MOESTREAM_KQ_NT

}  // namespace moestream_kquant

namespace moestream_cpu {

// int4, one full block of 64 rows (layout: per k, 32 bytes, byte c = row c low, row c + 32 high).
// Four k's of a group are two 64-byte loads; vpermt2b gathers each byte column's four bytes (k ..
// k + 3) into one 32-bit lane, whose low nibbles are row c's and high nibbles row c + 32's, so one
// vpdpbusd adds 16 rows' four products (0..15 x int8: exact). Rows land in order: acc[i] holds
// rows 16 i .. 16 i + 15. Two dependency chains of int32 sums, the k steps' halves. Two streams:
// the block's nibbles and its (s, z) (int4_sz). The fp32 steps are int4_block_avx2's.
void int4_block_avx512(const Weight& w, int r0, const QAct& a, int t, float* y) {
  const uint8_t* blk = w.q + (size_t)r0 * w.K / 2;
  const int8_t* xq = a.qr(t);
  const __m512i m4 = _mm512_set1_epi8(15), zmask = _mm512_set1_epi32((int)0xFFFF0000u);
  alignas(64) uint8_t ix[2][64];  // lane r: byte column r (+16) of k, k + 1 (A), k + 2, k + 3 (B)
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < 16; ++r)
      for (int i = 0; i < 4; ++i) ix[h][4 * r + i] = (uint8_t)(32 * i + 16 * h + r);
  const __m512i idx0 = _mm512_load_si512(ix[0]), idx1 = _mm512_load_si512(ix[1]);
  __m512 yacc[4];
  for (auto& v : yacc) v = _mm512_setzero_ps();
  for (int j = 0; j < w.K / G; ++j) {
    const uint8_t* p = blk + (size_t)j * G * 32;
    const uint32_t* sz = int4_sz(w, r0, j);
    prefetch_ahead(p, G * 32);
    prefetch_ahead(sz, BN * 4);
    __m512i acc[2][4];
    for (auto& r : acc)
      for (auto& v : r) v = _mm512_setzero_si512();
    for (int k = 0; k < G; k += 4) {
      int32_t x4;
      std::memcpy(&x4, xq + j * G + k, 4);
      const __m512i xv = _mm512_set1_epi32(x4);
      const __m512i A = _mm512_loadu_si512(p + k * 32), B = _mm512_loadu_si512(p + (k + 2) * 32);
      // the bytes of rows 0-15 (low nibbles) and 32-47 (high), then of 16-31 and 48-63
      const __m512i P0 = _mm512_permutex2var_epi8(A, idx0, B), P1 = _mm512_permutex2var_epi8(A, idx1, B);
      __m512i* c = acc[(k >> 2) & 1];
      c[0] = _mm512_dpbusd_epi32(c[0], _mm512_and_si512(P0, m4), xv);
      c[1] = _mm512_dpbusd_epi32(c[1], _mm512_and_si512(P1, m4), xv);
      c[2] = _mm512_dpbusd_epi32(c[2], _mm512_and_si512(_mm512_srli_epi16(P0, 4), m4), xv);
      c[3] = _mm512_dpbusd_epi32(c[3], _mm512_and_si512(_mm512_srli_epi16(P1, 4), m4), xv);
    }
    const int32_t sq = a.sr(t)[j];
    const __m512i off = _mm512_set1_epi32(8 * sq);
    const __m512 sqf = _mm512_set1_ps((float)sq), dv = _mm512_set1_ps(a.dr(t)[j]);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(sz + 16 * i);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, zmask));
      const __m512i sum = _mm512_add_epi32(acc[0][i], acc[1][i]);  // exact: int32 sums
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, off));
      const __m512 tt = _mm512_add_ps(_mm512_mul_ps(s, dot), _mm512_mul_ps(z, sqf));
      yacc[i] = _mm512_add_ps(yacc[i], _mm512_mul_ps(dv, tt));
    }
  }
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(y + 16 * i, yacc[i]);
}

// int8, one row front to back: two blocks per 64-byte vector, (w + 128) x x in vpdpbusd, eight
// blocks' sums at once minus 128 * sum x; their fp32 terms into the 8 lanes (int8_row_avx2's).
void int8_row_avx512(const Weight& w, int r, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
  float sbuf[kMaxBlocks];
  const float* s = row_scales(w, r, nb, sbuf);
  const int8_t* xq = a.qr(t);
  const float* d = a.dr(t);
  const int32_t* sx = a.sr(t);
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  __m256 accv = _mm256_setzero_ps();  // lane b: blocks j + b (BlockLanes' order)
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    prefetch_ahead(q + j * G, 8 * G);
    __m512i z[4];
    for (int i = 0; i < 4; ++i) {
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(q + (j + 2 * i) * G), bias);
      z[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(xq + (j + 2 * i) * G));
    }
    const __m256i off = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(sx + j)), 7);
    const __m256i dots = _mm256_sub_epi32(block_sums8x8(z), off);
    const __m256 c = _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(d + j));
    accv = _mm256_add_ps(accv, _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
  }
  float l[8];
  _mm256_storeu_ps(l, accv);
  *y = int8_tail(lanes_sum(l), q, s, xq, d, j, nb);
}

// int8 weights x int16 activations: sign-extended weights in vpdpwssd (exact in int32).
void int8_row16_avx512(const Weight& w, int r, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
  float sbuf[kMaxBlocks];
  const float* s = row_scales(w, r, nb, sbuf);
  const int16_t* xq = a.q16r(t);
  const float* d = a.dr(t);
  __m256 accv = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    prefetch_ahead(q + j * G, 8 * G);
    __m512i z[4];  // vector i: blocks 2i, 2i + 1, each block's 32 products in 8 lanes
    for (int i = 0; i < 4; ++i) {
      __m512i acc = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {  // block 2i + h -> lanes 8h .. 8h + 7
        const int b = j + 2 * i + h;
        const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + b * G)));
        const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w16, _mm512_loadu_si512(xq + b * G));
        // 16 lanes -> 8: lanes 8h.. of acc take p's two halves added
        const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
        acc = _mm512_inserti64x4(acc, half, h);
      }
      z[i] = acc;
    }
    const __m256 c = _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(d + j));
    accv = _mm256_add_ps(accv, _mm256_mul_ps(c, _mm256_cvtepi32_ps(block_sums8x8(z))));
  }
  float l[8];
  _mm256_storeu_ps(l, accv);
  *y = int8_tail(lanes_sum(l), q, s, xq, d, j, nb);
}

// Eight blocks' sums of q x against activation row xq from block j on, their unsigned values in
// q4_0's vector layout (lo / hi: four blocks' elements 0-15 / 16-31 a vector, a 128-bit quarter
// each; q4_0's nibbles, q5_0's 5-bit values): vpdpbusd, exact (<= 4 * 31 * 127 a lane); only the
// first n blocks' activations are read (a row's tail).
inline __m256i block_dots8(const __m512i* lo, const __m512i* hi, const int8_t* xq, int j, int n) {
  __m512i part[2];
  for (int h = 0; h < 2; ++h) {
    const int8_t* x = xq + (j + 4 * h) * G;
    const int b0 = std::max(0, std::min(2, n - 4 * h)), b1 = std::max(0, std::min(2, n - 4 * h - 2));
    const __m512i x0 = _mm512_maskz_loadu_epi8(b0 == 2 ? ~0ull : b0 == 1 ? 0xffffffffull : 0, x);
    const __m512i x1 = _mm512_maskz_loadu_epi8(b1 == 2 ? ~0ull : b1 == 1 ? 0xffffffffull : 0, x + 2 * G);
    const __m512i xlo = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));  // elements 0-15
    const __m512i xhi = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));  // elements 16-31
    part[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[h], xlo), hi[h], xhi);
  }
  return block_sums8x4(part[0], part[1]);
}

// A q4_0 row's last blocks [j, nb) (fewer than eight) after its 8 lanes were summed into acc: their
// integer dots from the vector code (masked loads: nothing past the row is read), then q4_0_tail's
// fp32 steps in order, so the bits are the scalar path's.
inline float q4_0_tail_avx512(float acc, const uint8_t* q, const uint16_t* dw, const int8_t* xq, const float* d,
                              const int32_t* sx, int j, int nb) {
  const int n = nb - j;
  if (n <= 0) return acc;
  const __m512i m4 = _mm512_set1_epi8(15);
  __m512i lo[2], hi[2];
  for (int h = 0; h < 2; ++h) {
    const int nh = std::max(0, std::min(4, n - 4 * h));  // this half's blocks, 16 bytes each
    const __m512i v = _mm512_maskz_loadu_epi8(nh == 4 ? ~0ull : (1ull << (16 * nh)) - 1, q + (j + 4 * h) * G / 2);
    lo[h] = _mm512_and_si512(v, m4), hi[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
  }
  int32_t sums[8];
  _mm256_storeu_si256((__m256i*)sums, block_dots8(lo, hi, xq, j, n));
  return q4_0_tail(acc, sums, dw, d, sx, j, nb);
}

// q4_0, one row front to back: four blocks' 64 bytes per vector, low nibbles (elements 0-15 of
// each block) and high (16-31) against the activations' matching halves, minus 8 * sum x; the
// fp32 terms are q4_0_row_avx2's.
void q4_0_row_avx512(const Weight& w, int r, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const uint8_t* q = w.q + (size_t)r * w.K / 2;
  const uint16_t* dw = (const uint16_t*)w.s + (size_t)r * nb;
  const int8_t* xq = a.qr(t);
  const float* d = a.dr(t);
  const int32_t* sx = a.sr(t);
  const __m512i m4 = _mm512_set1_epi8(15);
  __m256 accv = _mm256_setzero_ps();  // lane b: blocks j + b (BlockLanes' order)
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    prefetch_ahead(q + j * G / 2, 8 * G / 2);
    __m512i part[2];  // blocks j..j+3, j+4..j+7: 128-bit quarter = one block's four partials
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(q + (j + 4 * h) * G / 2);
      const __m512i x0 = _mm512_loadu_si512(xq + (j + 4 * h) * G), x1 = _mm512_loadu_si512(xq + (j + 4 * h + 2) * G);
      const __m512i xlo = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));  // elements 0-15
      const __m512i xhi = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));  // elements 16-31
      const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      part[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
    }
    const __m256i off = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(sx + j)), 3);
    const __m256i dots = _mm256_sub_epi32(block_sums8x4(part[0], part[1]), off);
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dw + j)));
    const __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(d + j));
    accv = _mm256_add_ps(accv, _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
  }
  float l[8];
  _mm256_storeu_ps(l, accv);
  *y = q4_0_tail_avx512(lanes_sum(l), q, dw, xq, d, sx, j, nb);
}

// quantize_blocks' arithmetic, 16 lanes at a time (max is exact and ignores NaNs in both; round to
// nearest even is nearbyint's default; the clamps keep std::min / std::max's NaN results): blocks
// [b0, b1) of a row starting at x -> q8 or q16, d, s, and (q8 rows) int4's pair broadcast pr.
void quantize_blocks_avx512(const float* x, int b0, int b1, float qmax, int8_t* q8, int16_t* q16,
                                      float* d, int32_t* s, int32_t* pr) {
  const __m512 hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  for (int b = b0; b < b1; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + b * G), x1 = _mm512_loadu_ps(x + b * G + 16);
    __m512 m = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps());
    m = _mm512_max_ps(_mm512_abs_ps(x1), m);
    const float amax = _mm512_reduce_max_ps(m);
    const float dd = amax / qmax;
    const __m512 id = _mm512_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
    __m512i v[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(h ? x1 : x0, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    }
    if (q8) {
      _mm_storeu_si128((__m128i*)(q8 + b * G), _mm512_cvtepi32_epi8(v[0]));
      _mm_storeu_si128((__m128i*)(q8 + b * G + 16), _mm512_cvtepi32_epi8(v[1]));
      if (pr) {  // 16 pairs (q[2i], q[2i + 1]) as u16, each twice in a u32
        const __m512i p = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(q8 + b * G)));
        _mm512_storeu_si512(pr + b * G / 2, _mm512_or_si512(p, _mm512_slli_epi32(p, 16)));
      }
    } else {
      _mm256_storeu_si256((__m256i*)(q16 + b * G), _mm512_cvtepi32_epi16(v[0]));
      _mm256_storeu_si256((__m256i*)(q16 + b * G + 16), _mm512_cvtepi32_epi16(v[1]));
    }
    d[b] = dd;
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(v[0], v[1]));
  }
}

// ---- token tiles: the rows above for NT activation rows per pass over the weights (prefill) -----
// The weights are loaded and unpacked once per pass; each activation row then gets the one-row
// kernel's integer dots and fp32 steps, so every element has that kernel's bits.
template <int NT>
void int4_block_avx512_nt(const Weight& w, int r0, const QAct& a, const int* ts, float* y, size_t ys) {
  const uint8_t* blk = w.q + (size_t)r0 * w.K / 2;
  const __m512i m4 = _mm512_set1_epi8(15), zmask = _mm512_set1_epi32((int)0xFFFF0000u);
  alignas(64) uint8_t ix[2][64];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < 16; ++r)
      for (int i = 0; i < 4; ++i) ix[h][4 * r + i] = (uint8_t)(32 * i + 16 * h + r);
  const __m512i idx0 = _mm512_load_si512(ix[0]), idx1 = _mm512_load_si512(ix[1]);
  __m512 yacc[NT][4];
  for (auto& r : yacc)
    for (auto& v : r) v = _mm512_setzero_ps();
  for (int j = 0; j < w.K / G; ++j) {
    const uint8_t* p = blk + (size_t)j * G * 32;
    const uint32_t* sz = int4_sz(w, r0, j);
    prefetch_ahead(p, G * 32);
    prefetch_ahead(sz, BN * 4);
    __m512i acc[NT][4];
    for (auto& r : acc)
      for (auto& v : r) v = _mm512_setzero_si512();
    for (int k = 0; k < G; k += 4) {
      const __m512i A = _mm512_loadu_si512(p + k * 32), B = _mm512_loadu_si512(p + (k + 2) * 32);
      const __m512i P0 = _mm512_permutex2var_epi8(A, idx0, B), P1 = _mm512_permutex2var_epi8(A, idx1, B);
      const __m512i P[4] = {_mm512_and_si512(P0, m4), _mm512_and_si512(P1, m4),
                            _mm512_and_si512(_mm512_srli_epi16(P0, 4), m4), _mm512_and_si512(_mm512_srli_epi16(P1, 4), m4)};
      for (int i = 0; i < NT; ++i) {
        int32_t x4;
        std::memcpy(&x4, a.qr(ts[i]) + j * G + k, 4);
        const __m512i xv = _mm512_set1_epi32(x4);
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbusd_epi32(acc[i][c], P[c], xv);
      }
    }
    __m512 S[4], Z[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(sz + 16 * c);
      S[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      Z[c] = _mm512_castsi512_ps(_mm512_and_si512(v, zmask));
    }
    for (int i = 0; i < NT; ++i) {
      const int32_t sq = a.sr(ts[i])[j];
      const __m512i off = _mm512_set1_epi32(8 * sq);
      const __m512 sqf = _mm512_set1_ps((float)sq), dv = _mm512_set1_ps(a.dr(ts[i])[j]);
      for (int c = 0; c < 4; ++c) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][c], off));
        const __m512 tt = _mm512_add_ps(_mm512_mul_ps(S[c], dot), _mm512_mul_ps(Z[c], sqf));
        yacc[i][c] = _mm512_add_ps(yacc[i][c], _mm512_mul_ps(dv, tt));
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(y + i * ys + 16 * c, yacc[i][c]);
}

template <int NT>
void int8_row_avx512_nt(const Weight& w, int r, const QAct& a, const int* ts, float* y, size_t ys) {
  const int nb = w.K / G;
  const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
  float sbuf[kMaxBlocks];
  const float* s = row_scales(w, r, nb, sbuf);
  const __m512i bias = _mm512_set1_epi8((char)0x80);
  __m256 accv[NT];
  for (auto& v : accv) v = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    prefetch_ahead(q + j * G, 8 * G);
    __m512i wv[4];
    for (int i = 0; i < 4; ++i) wv[i] = _mm512_xor_si512(_mm512_loadu_si512(q + (j + 2 * i) * G), bias);
    const __m256 sv = _mm256_loadu_ps(s + j);
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = a.qr(ts[t]);
      __m512i z[4];
      for (int i = 0; i < 4; ++i)
        z[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[i], _mm512_loadu_si512(xq + (j + 2 * i) * G));
      const __m256i off = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a.sr(ts[t]) + j)), 7);
      const __m256i dots = _mm256_sub_epi32(block_sums8x8(z), off);
      const __m256 c = _mm256_mul_ps(sv, _mm256_loadu_ps(a.dr(ts[t]) + j));
      accv[t] = _mm256_add_ps(accv[t], _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
    }
  }
  for (int t = 0; t < NT; ++t) {
    float l[8];
    _mm256_storeu_ps(l, accv[t]);
    y[t * ys] = int8_tail(lanes_sum(l), q, s, a.qr(ts[t]), a.dr(ts[t]), j, nb);
  }
}

template <int NT>
void q4_0_row_avx512_nt(const Weight& w, int r, const QAct& a, const int* ts, float* y, size_t ys) {
  const int nb = w.K / G;
  const uint8_t* q = w.q + (size_t)r * w.K / 2;
  const uint16_t* dw = (const uint16_t*)w.s + (size_t)r * nb;
  const __m512i m4 = _mm512_set1_epi8(15);
  __m256 accv[NT];
  for (auto& v : accv) v = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    prefetch_ahead(q + j * G / 2, 8 * G / 2);
    __m512i lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(q + (j + 4 * h) * G / 2);
      lo[h] = _mm512_and_si512(v, m4), hi[h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dw + j)));
    for (int t = 0; t < NT; ++t) {
      const int8_t* xq = a.qr(ts[t]);
      __m512i part[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i x0 = _mm512_loadu_si512(xq + (j + 4 * h) * G), x1 = _mm512_loadu_si512(xq + (j + 4 * h + 2) * G);
        const __m512i xlo = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i xhi = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
        part[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[h], xlo), hi[h], xhi);
      }
      const __m256i off = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a.sr(ts[t]) + j)), 3);
      const __m256i dots = _mm256_sub_epi32(block_sums8x4(part[0], part[1]), off);
      const __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(a.dr(ts[t]) + j));
      accv[t] = _mm256_add_ps(accv[t], _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
    }
  }
  for (int t = 0; t < NT; ++t) {
    float l[8];
    _mm256_storeu_ps(l, accv[t]);
    y[t * ys] = q4_0_tail_avx512(lanes_sum(l), q, dw, a.qr(ts[t]), a.dr(ts[t]), a.sr(ts[t]), j, nb);
  }
}

// q5_0 / mxfp4 (KD): blocks [j, j + n) of row r (n <= 8; the rest of the 8 lanes zero) -> lo / hi:
// four blocks' 16 qs bytes per vector (a 128-bit quarter each; the 22 / 17-byte blocks are not
// contiguous nibbles), their low / high nibbles; q5_0: each 5th bit added as 16 under a byte mask
// built from the blocks' qh words (bit 16b + i: the low nibble of block b's byte i; the high word:
// its high one); mxfp4: the codes through kE2M1x2 + 12 (vpshufb). The eight block scales in fp32
// (block32_scale's; zero past n).
template <Kind KD>
inline __m256 block32_values8(const Weight& w, int r, int j, int n, __m512i* lo, __m512i* hi) {
  constexpr int bytes = block32_bytes(KD);
  const __m512i m4 = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const uint8_t* p = block32(w, r, j);
  prefetch_ahead(p, 8 * bytes);
  uint16_t d[8] = {};
  float ds[8] = {};
  for (int h = 0; h < 2; ++h) {
    __m128i qs[4];
    uint64_t klo = 0, khi = 0;
    for (int b = 0; b < 4; ++b) {
      qs[b] = _mm_setzero_si128();
      if (4 * h + b >= n) continue;
      const uint8_t* blk = p + (4 * h + b) * bytes;
      if constexpr (KD == kMxfp4) {
        ds[4 * h + b] = kE8m0Half.v[blk[0]];
        qs[b] = _mm_loadu_si128((const __m128i*)(blk + 1));
      } else {
        std::memcpy(d + 4 * h + b, blk, 2);
        const uint64_t qh = q5_0_qh(blk);
        klo |= (qh & 0xffff) << (16 * b);
        khi |= (qh >> 16) << (16 * b);
        qs[b] = _mm_loadu_si128((const __m128i*)(blk + 6));
      }
    }
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(qs[1], qs[0])),
                                         _mm256_set_m128i(qs[3], qs[2]), 1);
    const __m512i l = _mm512_and_si512(v, m4), u = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if constexpr (KD == kMxfp4) {
      // a zero block past n reads lut[0] = 12: its activations are zero (block_dots8's masked loads)
      lo[h] = _mm512_shuffle_epi8(lut, l), hi[h] = _mm512_shuffle_epi8(lut, u);
    } else {
      lo[h] = _mm512_mask_add_epi8(l, (__mmask64)klo, l, bit4);
      hi[h] = _mm512_mask_add_epi8(u, (__mmask64)khi, u, bit4);
    }
  }
  if constexpr (KD == kMxfp4) return _mm256_loadu_ps(ds);
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d));
}

// q5_0 / mxfp4, one row x NT activation rows (NT = 1: a decode row): eight blocks' values unpacked
// once (block32_values8), their sums of (v + offset) x per activation row minus offset * sum x:
// block32_row_avx2_nt's integer dots, then its fp32 steps. The last nb % 8 blocks take the same
// integer dots from the vector code and the scalar path's fp32 steps in order (block32_tail).
template <int NT, Kind KD>
void block32_row_avx512_nt(const Weight& w, int r, const QAct& a, const int* ts, float* y, size_t ys) {
  const int nb = w.K / G;
  __m256 accv[NT];
  for (auto& v : accv) v = _mm256_setzero_ps();
  int j = 0;
  __m512i lo[2], hi[2];
  for (; j + 8 <= nb; j += 8) {
    const __m256 ws = block32_values8<KD>(w, r, j, 8, lo, hi);
    for (int t = 0; t < NT; ++t) {
      const __m256i off = block32_offsets8<KD>(_mm256_loadu_si256((const __m256i*)(a.sr(ts[t]) + j)));
      const __m256i dots = _mm256_sub_epi32(block_dots8(lo, hi, a.qr(ts[t]), j, 8), off);
      const __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(a.dr(ts[t]) + j));
      accv[t] = _mm256_add_ps(accv[t], _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
    }
  }
  const int n = nb - j;
  if (n > 0) block32_values8<KD>(w, r, j, n, lo, hi);
  for (int t = 0; t < NT; ++t) {
    float l[8];
    _mm256_storeu_ps(l, accv[t]);
    float acc = lanes_sum(l);
    if (n > 0) {
      int32_t sums[8];
      _mm256_storeu_si256((__m256i*)sums, block_dots8(lo, hi, a.qr(ts[t]), j, n));
      acc = block32_tail(acc, sums, w, r, a.dr(ts[t]), a.sr(ts[t]), j, nb);
    }
    y[t * ys] = acc;
  }
}

template void int4_block_avx512_nt<2>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void int4_block_avx512_nt<3>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void int4_block_avx512_nt<4>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void int8_row_avx512_nt<2>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void int8_row_avx512_nt<3>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void int8_row_avx512_nt<4>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void q4_0_row_avx512_nt<2>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void q4_0_row_avx512_nt<3>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void q4_0_row_avx512_nt<4>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<1, kQ5_0>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<2, kQ5_0>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<3, kQ5_0>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<4, kQ5_0>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<1, kMxfp4>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<2, kMxfp4>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<3, kMxfp4>(const Weight&, int, const QAct&, const int*, float*, size_t);
template void block32_row_avx512_nt<4, kMxfp4>(const Weight&, int, const QAct&, const int*, float*, size_t);

#pragma GCC pop_options

}  // namespace moestream_cpu
