// GGUF K-quant rows (kquant_cpu.cpp) for moe_cpu.cpp's dispatch: super-blocks of 256 read as a GGUF
// stores them, against int8 activations quantized per block of 32 (moe_cpu.cpp's QAct).
#pragma once
#include <cstdint>

namespace moestream_kquant {

constexpr int kQK = 256;  // llama.cpp's QK_K
// Weight kinds, numbered after moe_cpu.cpp's int8 (0), int4 (1) and q4_0 (2).
enum : int { kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };

inline bool is_kquant(int kind) { return kind >= kQ4_K && kind <= kQ6_K; }

// The kind whose block has `bytes` bytes (144 q4_k, 176 q5_k, 210 q6_k), or -1.
int kind_of_bytes(int64_t bytes);

// Rows [r0, r0 + n) of K-quant weight `blocks` (N rows of K / 256 blocks) times one activation row
// (xq int8 [K], xd its scale per block of 32, xs its sum per block of 32) -> y[0, n) fp32.
void rows(int kind, const uint8_t* blocks, int K, int r0, int n, const int8_t* xq, const float* xd,
          const int32_t* xs, bool avx2, float* y);

}  // namespace moestream_kquant
