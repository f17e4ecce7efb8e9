// GGUF K-quant kernels (q4_k, q5_k, q6_k) for moestream's native CPU path, read in place.
// Numerics (the spec is kernels/ref.py: qlinear_q8 / _kquant_terms): activations are int8 per block
// of 32 (moe_cpu.cpp's QAct, llama.cpp's Q8_0 rule); per activation block b
//   q4_k / q5_k (one sub-block of 32, 6-bit sc and m): dx * ((d * sc) * dot - (dmin * m) * sum x)
//   q6_k (two sub-blocks of 16, int8 sc): (d * dx) * sum(sc * (q - 32) * x)
// with every integer dot exact (int32) and the fp32 term of sub-block j of each super-block added
// into lane j, the 8 lanes summed at the end by lanes_sum (the row-major schemes' order, ref.py's
// _lane_sum), so every variant gives the reference's bits. Built with -ffp-contract=off (no FMA).
#include "kquant_cpu.h"

#include "cpu_rows.h"

#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstring>

namespace moestream_kquant {
namespace {

constexpr int G = 32;  // activation block
constexpr int kBytes[3] = {144, 176, 210};

float fp16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(v);
}

// The 8 (scale, min) pairs of a q4_k / q5_k block, 6 bits each, as ggml's get_scale_min_k4 packs them.
void scale_min(const uint8_t* s, float* sc, float* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = (float)(s[j] & 63);
    m[j] = (float)(s[j + 4] & 63);
    sc[j + 4] = (float)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
    m[j + 4] = (float)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// ---- scalar (portable; the order every variant keeps) ------------------------------------------
template <bool Q5>
float q45_row_scalar(const uint8_t* row, int nb, const int8_t* xq, const float* xd, const int32_t* xs) {
  constexpr int B = Q5 ? 176 : 144;
  float l[8] = {};
  for (int s = 0; s < nb; ++s) {
    const uint8_t* blk = row + (size_t)s * B;
    const float d = fp16(blk), dmin = fp16(blk + 2);
    float sc[8], m[8];
    scale_min(blk + 4, sc, m);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    for (int j = 0; j < 8; ++j) {  // sub-block j: chunk j / 2 of 32 bytes, its low or high nibbles
      const int b = s * 8 + j;
      const int8_t* x = xq + (size_t)b * G;
      int32_t dot = 0;
      for (int l = 0; l < G; ++l) {
        int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
        if (Q5) v |= ((qh[l] >> j) & 1) << 4;
        dot += v * x[l];
      }
      const float e = (d * sc[j]) * (float)dot - (dmin * m[j]) * (float)xs[b];
      l[j] = l[j] + xd[b] * e;
    }
  }
  return moestream_cpu::lanes_sum(l);
}

float q6_row_scalar(const uint8_t* row, int nb, const int8_t* xq, const float* xd) {
  float l[8] = {};
  for (int s = 0; s < nb; ++s) {
    const uint8_t* blk = row + (size_t)s * 210;
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t* sc = (const int8_t*)(blk + 192);
    const float d = fp16(blk + 208);
    for (int j = 0; j < 8; ++j) {  // values 32 j..: half h, quarter q of it
      const int h = j / 4, q = j % 4, b = s * 8 + j;
      const int8_t* x = xq + (size_t)b * G;
      int32_t dot = 0;
      for (int l = 0; l < G; ++l) {
        const int lo = (ql[64 * h + 32 * (q % 2) + l] >> (4 * (q / 2))) & 15;
        const int hi = (qh[32 * h + l] >> (2 * q)) & 3;
        dot += sc[2 * j + l / 16] * ((lo | (hi << 4)) - 32) * x[l];
      }
      l[j] = l[j] + (d * xd[b]) * (float)dot;
    }
  }
  return moestream_cpu::lanes_sum(l);
}

// ---- AVX2 + FMA + F16C ---------------------------------------------------------------------------
// Eight int32 vectors -> one vector of their eight lane sums, in order.
__attribute__((target("avx2,fma"))) __m256i hsum8(const __m256i* p) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// q4_k / q5_k: per block, 4 chunks of 32 bytes -> the low and high nibbles (q5_k: plus bit j of
// qh as bit 4) are sub-blocks 2c and 2c + 1 in element order; maddubs with the int8 activations
// (<= 2 * 31 * 127: no saturation), the eight sub-blocks' dots reduced to int32 at once, their fp32
// terms computed lane-wise with the scalar path's operations into the 8 lanes.
template <bool Q5>
__attribute__((target("avx2,fma,f16c"))) float q45_row_avx2(const uint8_t* row, int nb, const int8_t* xq,
                                                             const float* xd, const int32_t* xs) {
  constexpr int B = Q5 ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();  // lane j: sub-block j of every super-block
  for (int s = 0; s < nb; ++s) {
    const uint8_t* blk = row + (size_t)s * B;
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    const int8_t* x = xq + (size_t)s * 8 * G;
    __m256i p[8];
    const __m256i h = Q5 ? _mm256_loadu_si256((const __m256i*)(blk + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if (Q5) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), one), 4));
      }
      const __m256i x0 = _mm256_loadu_si256((const __m256i*)(x + 2 * c * G));
      const __m256i x1 = _mm256_loadu_si256((const __m256i*)(x + (2 * c + 1) * G));
      p[2 * c] = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones);
      p[2 * c + 1] = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones);
    }
    // the eight (scale, min) pairs as bytes, widened at once: per-element scalar unpacking and
    // int -> float conversions were a third of a q4_k row's time (412 -> 223 us, one thread)
    uint32_t sm[4];
    scale_min_words(blk + 4, sm);
    const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sm[1], (int)sm[0])));
    const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sm[3], (int)sm[2])));
    const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(fp16(blk)), scv);
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(fp16(blk + 2)), mv);
    const __m256 dot = _mm256_cvtepi32_ps(hsum8(p));
    const __m256 sx = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(xs + s * 8)));
    const __m256 e = _mm256_sub_ps(_mm256_mul_ps(ds, dot), _mm256_mul_ps(dm, sx));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(xd + s * 8), e));
  }
  float l[8];
  _mm256_storeu_ps(l, acc);
  return moestream_cpu::lanes_sum(l);
}

// q6_k: per activation block, 32 six-bit values (ql nibble | qh 2 bits << 4) - 32 as int8; |w| x
// sign(x, w) in maddubs (<= 2 * 32 * 127), then madd with the two sub-blocks' int8 scales as int16
// (lanes 0-7: values 0-15, lanes 8-15: values 16-31), exact in int32; the eight blocks' fp32 terms
// into the 8 lanes.
__attribute__((target("avx2,fma,f16c"))) float q6_row_avx2(const uint8_t* row, int nb, const int8_t* xq,
                                                            const float* xd) {
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
  __m256 acc = _mm256_setzero_ps();  // lane j: block j of every super-block
  for (int s = 0; s < nb; ++s) {
    const uint8_t* blk = row + (size_t)s * 210;
    const int8_t* sc = (const int8_t*)(blk + 192);
    const int8_t* x = xq + (size_t)s * 8 * G;
    __m256i p[8];
    for (int j = 0; j < 8; ++j) {
      const int h = j / 4, q = j % 4;
      const __m256i l = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32 * (q % 2)));
      const __m256i nib = _mm256_and_si256(q / 2 ? _mm256_srli_epi16(l, 4) : l, m4);
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
      const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * q), m3);
      const __m256i w = _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(hb, 4)), c32);
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + j * G));
      const __m256i pr = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
      const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
      p[j] = _mm256_madd_epi16(pr, scv);
    }
    const __m256 c = _mm256_mul_ps(_mm256_set1_ps(fp16(blk + 208)), _mm256_loadu_ps(xd + s * 8));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(c, _mm256_cvtepi32_ps(hsum8(p))));
  }
  float l[8];
  _mm256_storeu_ps(l, acc);
  return moestream_cpu::lanes_sum(l);
}

}  // namespace

int kind_of_bytes(int64_t bytes) {
  for (int i = 0; i < 3; ++i)
    if (bytes == kBytes[i]) return kQ4_K + i;
  return -1;
}

void rows(int kind, const uint8_t* blocks, int K, int r0, int n, const int8_t* xq, const float* xd,
          const int32_t* xs, int isa, float* y) {
  if (isa >= 2) {
    const Act x{xq, xd, xs};
    return rows_nt(kind, blocks, K, r0, n, &x, 1, isa, y, 1);
  }
  const int nb = K / kQK;
  const size_t stride = (size_t)nb * kBytes[kind - kQ4_K];
  for (int i = 0; i < n; ++i) {
    const uint8_t* row = blocks + (size_t)(r0 + i) * stride;
    if (kind == kQ6_K)
      y[i] = isa >= 1 ? q6_row_avx2(row, nb, xq, xd) : q6_row_scalar(row, nb, xq, xd);
    else if (kind == kQ5_K)
      y[i] = isa >= 1 ? q45_row_avx2<true>(row, nb, xq, xd, xs) : q45_row_scalar<true>(row, nb, xq, xd, xs);
    else
      y[i] = isa >= 1 ? q45_row_avx2<false>(row, nb, xq, xd, xs) : q45_row_scalar<false>(row, nb, xq, xd, xs);
  }
}

namespace {
template <int NT>
void rows_avx512(int kind, const uint8_t* blocks, int nb, size_t stride, int r0, int n, const Act* x, float* y,
                 size_t ys) {
  for (int i = 0; i < n; ++i) {
    const uint8_t* row = blocks + (size_t)(r0 + i) * stride;
    if (kind == kQ6_K)
      q6_rows_avx512<NT>(row, nb, x, y + i, ys);
    else if (kind == kQ5_K)
      q45_rows_avx512<true, NT>(row, nb, x, y + i, ys);
    else
      q45_rows_avx512<false, NT>(row, nb, x, y + i, ys);
  }
}
}  // namespace

void rows_nt(int kind, const uint8_t* blocks, int K, int r0, int n, const Act* x, int nt, int isa, float* y,
             size_t ys) {
  const int nb = K / kQK;
  const size_t stride = (size_t)nb * kBytes[kind - kQ4_K];
  if (isa < 2) {  // one row per pass
    for (int t = 0; t < nt; ++t) rows(kind, blocks, K, r0, n, x[t].q, x[t].d, x[t].s, isa, y + t * ys);
    return;
  }
  switch (nt) {
    case 1: return rows_avx512<1>(kind, blocks, nb, stride, r0, n, x, y, ys);
    case 2: return rows_avx512<2>(kind, blocks, nb, stride, r0, n, x, y, ys);
    case 3: return rows_avx512<3>(kind, blocks, nb, stride, r0, n, x, y, ys);
    default: return rows_avx512<4>(kind, blocks, nb, stride, r0, n, x, y, ys);
  }
}

}  // namespace moestream_kquant
