// GGUF K-quant rows (kquant_cpu.cpp) for moe_cpu.cpp's dispatch: super-blocks of 256 read as a GGUF
// stores them, against int8 activations quantized per block of 32 (moe_cpu.cpp's QAct).
#pragma once
#include <cstdint>
#include <cstring>

namespace moestream_kquant {

constexpr int kQK = 256;  // llama.cpp's QK_K
// Weight kinds, numbered after moe_cpu.cpp's int8 (0), int4 (1) and q4_0 (2).
enum : int { kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };

inline bool is_kquant(int kind) { return kind >= kQ4_K && kind <= kQ6_K; }

// The kind whose block has `bytes` bytes (144 q4_k, 176 q5_k, 210 q6_k), or -1.
int kind_of_bytes(int64_t bytes);

// Rows [r0, r0 + n) of K-quant weight `blocks` (N rows of K / 256 blocks) times one activation row
// (xq int8 [K], xd its scale per block of 32, xs its sum per block of 32) -> y[0, n) fp32; isa as
// moe_cpu.cpp's Isa (0 scalar, 1 AVX2, 2 AVX-512), the same bits.
void rows(int kind, const uint8_t* blocks, int K, int r0, int n, const int8_t* xq, const float* xd,
          const int32_t* xs, int isa, float* y);

// The 8 (scale, min) pairs of a q4_k / q5_k block (12 bytes at s, 6 bits each, ggml's
// get_scale_min_k4 packing) as bytes: w[0], w[1] the scales 0-3, 4-7; w[2], w[3] the mins.
inline void scale_min_words(const uint8_t* s, uint32_t* w) {
  uint32_t a, b, c;  // bytes 0-3, 4-7, 8-11
  std::memcpy(&a, s, 4), std::memcpy(&b, s + 4, 4), std::memcpy(&c, s + 8, 4);
  w[0] = a & 0x3F3F3F3Fu;
  w[1] = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);  // (s[j] >> 6) << 4, per byte
  w[2] = b & 0x3F3F3F3Fu;
  w[3] = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
}

// One activation row: int8 [K], its scale and its sum per block of 32.
struct Act {
  const int8_t* q;
  const float* d;
  const int32_t* s;
};

// Rows [r0, r0 + n) times activation rows x[0, nt) (nt <= 4: a prompt's token tile; AVX-512 only,
// else one row per pass) -> y[t * ys + (0, n)]: each row gets rows()'s bits.
void rows_nt(int kind, const uint8_t* blocks, int K, int r0, int n, const Act* x, int nt, int isa, float* y,
             size_t ys);

// The AVX-512 VNNI rows (avx512_cpu.cpp) for NT = 1..4 activation rows: the AVX2 rows' integer
// sub-block dots from vpdpbusd and their fp32 steps, so the same bits.
template <bool Q5, int NT>
void q45_rows_avx512(const uint8_t* row, int nb, const Act* x, float* y, size_t ys);
template <int NT>
void q6_rows_avx512(const uint8_t* row, int nb, const Act* x, float* y, size_t ys);

}  // namespace moestream_kquant
