// Native CPU kernels for moestream's int4 / int8 / q4_0 / q4_1 / q5_0 / mxfp4 expert records, read in place
// (no repack).
// Numerics (the spec is kernels/ref.py: qlinear_q8 / moe_q8_ref):
//   activations are quantized per block of 32 to int8 (llama.cpp's Q8_0): d = amax / 127,
//   q = round_half_even(x * (1 / d)) clamped to [-127, 127] (int8 weights' down projection: int16,
//   d = amax / 32767); each block's integer dot with the
//   weights is exact (int32); blocks are combined in fp32 in a fixed order (int4 ascending; int8,
//   q4_0 and q4_1 in 8 lanes, BlockLanes) with the same
//   rounding steps as the reference, so every ISA variant gives the reference's bits for one linear.
// Build flags include -ffp-contract=off: no fused multiply-add may change those roundings.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_rows.h"
#include "kquant_cpu.h"

namespace moestream_cpu {
int64_t g_prefetch = 4096;  // bench A/B at 2 threads: 0 -> 2048 +15%, 4096 ~ 8192 ~ 2048
}  // namespace moestream_cpu

namespace {
using namespace moestream_cpu;

// f(i) for i in [0, n) over torch's threads, items handed out one at a time: on a shared machine a
// thread that loses its core holds up one item, not a static half. No result depends on who ran it.
// Below kSerialBytes of weights a call runs on the calling thread: waking a sleeping OpenMP thread
// (OMP_WAIT_POLICY=PASSIVE, as the CLI sets) costs ~10-70 us, more than reading that much.
constexpr int64_t kSerialBytes = 256 << 10;
template <typename F>
void parallel_items(int64_t n, const F& f, int64_t bytes) {
  if (bytes < kSerialBytes) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) f(i);
  });
}

// The threads of one parallel region go through the same phases. A phase is n items handed out
// through a counter; the next phase starts once every item is done (its done counter reaches n),
// not once every thread has arrived: a thread that lost its core to another process holds up only
// the item it took, and catches up through phases already done. What a thread needs for its items
// it computes itself when it takes its first one (`prep`: a norm, the router's pick, a quantized
// activation), from data the finished phases wrote and no open phase writes yet; a thread that
// takes no item of a phase skips that work. Nothing inside the region may throw (an exception
// there ends the process): run() checks every shape and flag before it starts.
struct Phases {
  std::unique_ptr<std::atomic<int64_t>[]> taken, done;  // one pair per phase of the whole step
  explicit Phases(int64_t count) : taken(new std::atomic<int64_t>[count]), done(new std::atomic<int64_t>[count]) {
    for (int64_t i = 0; i < count; ++i) taken[i].store(0), done[i].store(0);
  }
};

// Spin until ready(): an item is microseconds, so longer means its thread lost the core (yield).
template <typename R>
void wait_until(const R& ready) {
  for (int spin = 0; !ready(); ++spin) {
    if (spin < (1 << 12))
      _mm_pause();
    else
      sched_yield();
  }
}

// The hand-off between an expert's gate|up items and its down items in one stream (one_stream, the
// decode step's expert phase), per slot (an expert of a call, or of a layer): the thread that
// finishes a slot's last gate|up chunk quantizes its SiLU*up and publishes it; a down item of that
// slot spins until then.
class ExpertHandoff {
 public:
  ExpertHandoff(size_t slots, int chunks) : left_(slots), ready_(slots) {
    for (size_t i = 0; i < slots; ++i) left_[i].store(chunks, std::memory_order_relaxed), ready_[i].store(0);
  }
  template <typename F>
  void chunk_done(size_t slot, const F& quantize) {
    if (left_[slot].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      quantize();
      ready_[slot].store(1, std::memory_order_release);
    }
  }
  void wait(size_t slot) const {
    wait_until([&] { return ready_[slot].load(std::memory_order_acquire) != 0; });
  }

 private:
  std::vector<std::atomic<int>> left_, ready_;
};

struct Worker {
  Phases& ph;
  int tid, phase = 0;
  template <typename P, typename F>
  void items(int64_t n, const P& prep, const F& f) {
    std::atomic<int64_t>&t = ph.taken[phase], &d = ph.done[phase];
    bool first = true;
    for (int64_t i = t++; i < n; i = t++) {
      if (first) prep(), first = false;
      f(i);
      d.fetch_add(1, std::memory_order_release);
    }
    wait_until([&] { return d.load(std::memory_order_acquire) >= n; });
    ++phase;
  }
  template <typename F>
  void items(int64_t n, const F& f) {
    items(n, [] {}, f);
  }
};

// Two phases' items as one stream in one parallel region: the sleeping threads wake once (a K = 8
// layer op at 2 threads ran ~10% faster with spinning threads than with a region per phase), and
// no barrier between the phases: f2's items wait on what they need themselves (a layer op +4-15%
// in an interleaved A/B against a barrier). Items are taken in order, so whatever an f2 item waits
// for was taken before it, by a thread that does not wait. Serial below kSerialBytes.
template <typename F1, typename F2>
void one_stream(int64_t n1, const F1& f1, int64_t n2, const F2& f2, int64_t bytes) {
  const int nt = std::max(1, at::get_num_threads());
  if (bytes < kSerialBytes || nt == 1) {
    for (int64_t i = 0; i < n1; ++i) f1(i);
    for (int64_t i = 0; i < n2; ++i) f2(i);
    return;
  }
  Phases ph(1);
#pragma omp parallel num_threads(nt)
  {
    Worker w{ph, omp_get_thread_num()};
    w.items(n1 + n2, [&](int64_t i) { i < n1 ? f1(i) : f2(i - n1); });
  }
}

// Work items over weight rows: each of E weights' N rows (64-row blocks) in chunks of contiguous
// blocks (every restart of a stream costs a DRAM latency), enough of them for nt threads to share
// (8 each: K = 8 experts at 2 threads, two items per expert, so the last items of a phase are
// short; one weight, as a dense projection or a lone expert of the slot cache, in 8 nt; 4 and 16
// each measured slower at K = 8, 2 threads).
constexpr int kItemsPerThread = 8;
int row_chunks(int N, int E, int nt) {
  return std::min((N + BN - 1) / BN, std::max(1, (kItemsPerThread * nt + E - 1) / E));
}

// f(r0, n) for the 64-row blocks of chunk c of `chunks` over an N-row weight, in order, a block a
// call (the last may be shorter): chunk c covers blocks [blocks * c / chunks, blocks * (c + 1) /
// chunks).
template <typename F>
void chunk_blocks(int N, int chunks, int64_t c, const F& f) {
  const int blocks = (N + BN - 1) / BN;
  const int b0 = (int)(blocks * c / chunks), b1 = (int)(blocks * (c + 1) / chunks);
  for (int b = b0; b < b1; ++b) f(b * BN, std::min(BN, N - b * BN));
}

// Blocks [b0, b1) of row r (b1 < 0: to the end); x is the row's start.
template <typename Q>
void quantize_blocks(const float* x, QAct& a, int r, Q* q, float qmax, int b0, int b1) {
  for (int b = b0; b < b1; ++b) {
    const float* xb = x + b * G;
    float amax = 0.f;
    for (int i = 0; i < G; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / qmax;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < G; ++i) {
      const float v = std::min(qmax, std::max(-qmax, std::nearbyint(xb[i] * id)));
      q[b * G + i] = (Q)v;
      sum += (int32_t)v;
    }
    a.d[(size_t)r * a.K / G + b] = d;
    a.s[(size_t)r * a.K / G + b] = sum;
  }
}

// isa: the resolved variant (resolve()); the AVX-512 quantizer gives the same bits (the spec's).
void quantize_row(const float* x, QAct& a, int r, int64_t isa, int b0 = 0, int b1 = -1) {
  if (b1 < 0) b1 = a.K / G;
  if (isa >= kAvx512) {
    const size_t o = (size_t)r * a.K;
    return quantize_blocks_avx512(x, b0, b1, a.wide ? 32767.f : 127.f, a.wide ? nullptr : a.q.data() + o,
                                  a.wide ? a.q16.data() + o : nullptr, a.d.data() + o / G, a.s.data() + o / G,
                                  a.wide ? nullptr : a.pr.data() + o / 2);
  }
  if (a.wide) return quantize_blocks(x, a, r, a.q16.data() + (size_t)r * a.K, 32767.f, b0, b1);
  int8_t* q = a.q.data() + (size_t)r * a.K;
  quantize_blocks(x, a, r, q, 127.f, b0, b1);
  for (int i = b0 * G / 2; i < b1 * G / 2; ++i) {
    const uint32_t p = (uint8_t)q[2 * i] | ((uint32_t)(uint8_t)q[2 * i + 1] << 8);
    a.pr[(size_t)r * a.K / 2 + i] = (int32_t)(p | (p << 16));
  }
}

__attribute__((target("avx2,f16c"))) void fp16_row_f16c(const uint16_t* h, int n, float* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
  for (; i < n; ++i) out[i] = fp16(h[i]);
}

bool cpu_has_avx2();

}  // namespace

// Row r's nb int8 scales as fp32: the section itself (fp32), or widened into buf (fp16: exact,
// so a q8_0 row computes what the int8 row holding the same values computes).
const float* moestream_cpu::row_scales(const Weight& w, int r, int nb, float* buf) {
  if (!w.s16) return (const float*)w.s + (size_t)r * nb;
  const uint16_t* h = (const uint16_t*)w.s + (size_t)r * nb;
  static const bool f16c = cpu_has_avx2();
  if (f16c)
    fp16_row_f16c(h, nb, buf);
  else
    for (int j = 0; j < nb; ++j) buf[j] = fp16(h[j]);
  return buf;
}

namespace {

// The row-major schemes (int8, q4_0) add a row's per-block fp32 terms in 8 lanes: block j of the
// first nb - nb % 8 goes to lane j mod 8 (in order), the lanes are summed by lanes_sum, then the
// last nb % 8 blocks are added in order (ref.qlinear_q8). The AVX2 rows keep the lanes in one
// vector, so no add waits on the one before it; int4's 64-row kernel adds blocks in plain order.
struct BlockLanes {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc = 0.f;
  int m;
  bool tail = false;
  explicit BlockLanes(int nb) : m(nb - nb % 8) {}
  void add(int j, float term) {
    if (j < m) {
      l[j % 8] = l[j % 8] + term;
      return;
    }
    if (!tail) acc = lanes_sum(l), tail = true;
    acc = acc + term;
  }
  float sum() const { return tail ? acc : lanes_sum(l); }
};

// ---- scalar (portable; the order every variant keeps) ------------------------------------------
void int4_rows_scalar(const Weight& w, int r0, int n, const QAct& a, int t, float* y) {
  const int b = std::min(BN, w.N - r0), h = b / 2;
  const uint8_t* blk = w.q + (size_t)r0 * w.K / 2;  // r0 is a block start
  const int8_t* xq = a.qr(t);
  for (int r = 0; r < n; ++r) {
    const int col = r % h, shift = r < h ? 0 : 4;
    float acc = 0.f;
    for (int j = 0; j < w.K / G; ++j) {
      int32_t dot = 0;
      for (int k = j * G; k < (j + 1) * G; ++k) dot += ((blk[(size_t)k * h + col] >> shift) & 15) * xq[k];
      const uint16_t* sz = (const uint16_t*)(int4_sz(w, r0, j) + r);  // (scale, zero)
      const float sq = (float)a.sr(t)[j];
      const float tt = bf16(sz[0]) * (float)(dot - 8 * a.sr(t)[j]) + bf16(sz[1]) * sq;
      acc = acc + a.dr(t)[j] * tt;
    }
    y[r] = acc;
  }
}

template <typename Q>
void int8_rows_scalar(const Weight& w, int r0, int n, const QAct& a, int t, float* y, const Q* xq) {
  const int nb = w.K / G;
  float sbuf[kMaxBlocks];
  for (int r = r0; r < r0 + n; ++r) {
    const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
    const float* s = row_scales(w, r, nb, sbuf);
    BlockLanes acc(nb);
    for (int j = 0; j < nb; ++j) {
      int32_t dot = 0;
      for (int k = j * G; k < (j + 1) * G; ++k) dot += q[k] * xq[k];
      acc.add(j, (s[j] * a.dr(t)[j]) * (float)dot);
    }
    y[r - r0] = acc.sum();
  }
}

// q4_0: per block (d_w * d_x) * sum((q - 8) * x), as int8 with its weights q - 8.
void q4_0_rows_scalar(const Weight& w, int r0, int n, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const uint16_t* d = (const uint16_t*)w.s;
  const int8_t* xq = a.qr(t);
  for (int r = r0; r < r0 + n; ++r) {
    const uint8_t* q = w.q + (size_t)r * w.K / 2;
    BlockLanes acc(nb);
    for (int j = 0; j < nb; ++j) {
      int32_t dot = 0;
      for (int i = 0; i < G / 2; ++i) {
        dot += ((q[j * G / 2 + i] & 15) - 8) * xq[j * G + i];
        dot += ((q[j * G / 2 + i] >> 4) - 8) * xq[j * G + G / 2 + i];
      }
      acc.add(j, (fp16(d[(size_t)r * nb + j]) * a.dr(t)[j]) * (float)dot);
    }
    y[r - r0] = acc.sum();
  }
}

// q4_1 (w = q * d + m, q the nibbles 0..15): per block, in this order, a = (d_w * d_x) * dot and
// b = (m_w * d_x) * sum(x), each rounded to fp32, then a + b (ref.qlinear_q8); dot = sum(q * x) and
// sum(x) are exact integers (<= 15 * 127 * 32).
int32_t q4_1_dot(const uint8_t* q, const int8_t* xq) {  // one block: 16 bytes, 32 activations
  int32_t dot = 0;
  for (int i = 0; i < G / 2; ++i) dot += (q[i] & 15) * xq[i] + (q[i] >> 4) * xq[G / 2 + i];
  return dot;
}

float q4_1_term(const uint16_t* dm, float dx, int32_t dot, int32_t sx) {
  return (fp16(dm[0]) * dx) * (float)dot + (fp16(dm[1]) * dx) * (float)sx;
}

void q4_1_rows_scalar(const Weight& w, int r0, int n, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const uint16_t* dm = (const uint16_t*)w.s;
  const int8_t* xq = a.qr(t);
  for (int r = r0; r < r0 + n; ++r) {
    const uint8_t* q = w.q + (size_t)r * w.K / 2;
    BlockLanes acc(nb);
    for (int j = 0; j < nb; ++j)
      acc.add(j, q4_1_term(dm + ((size_t)r * nb + j) * 2, a.dr(t)[j], q4_1_dot(q + j * G / 2, xq + j * G),
                           a.sr(t)[j]));
    y[r - r0] = acc.sum();
  }
}

// q5_0 / mxfp4 (cpu_rows.h: block32_values): per block (d_w * d_x) * sum(v * x).
void block32_rows_scalar(const Weight& w, int r0, int n, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const int8_t* xq = a.qr(t);
  for (int r = r0; r < r0 + n; ++r) {
    BlockLanes acc(nb);
    for (int j = 0; j < nb; ++j) {
      const uint8_t* blk = block32(w, r, j);
      int8_t v[G];
      block32_values(w.kind, blk, v);
      int32_t dot = 0;
      for (int i = 0; i < G; ++i) dot += v[i] * xq[j * G + i];
      acc.add(j, (block32_scale(w.kind, blk) * a.dr(t)[j]) * (float)dot);
    }
    y[r - r0] = acc.sum();
  }
}

// ---- AVX2 + FMA ----------------------------------------------------------------------------------
// int4, one full block of 64 rows: per k pair, the two k's nibbles of a row are interleaved into
// adjacent bytes so one maddubs gives that row's two products (u8 0..15 x s8: no saturation); 8
// pairs fit in int16 (<= 30480), then widen. Rows land permuted: acc32[i] holds rows kBase[i]..+7.
__attribute__((target("avx2,fma"))) void int4_block_avx2(const Weight& w, int r0, const QAct& a, int t,
                                                          float* y) {
  static constexpr int kBase[8] = {0, 16, 8, 24, 32, 48, 40, 56};
  const uint8_t* blk = w.q + (size_t)r0 * w.K / 2;
  const __m256i m4 = _mm256_set1_epi8(15), zmask = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256 yacc[8];
  for (auto& v : yacc) v = _mm256_setzero_ps();
  for (int j = 0; j < w.K / G; ++j) {
    const uint8_t* p = blk + (size_t)j * G * 32;
    const int32_t* pj = a.prr(t) + j * G / 2;
    const uint32_t* sz = int4_sz(w, r0, j);
    prefetch_ahead(p, G * 32);
    prefetch_ahead(sz, BN * 4);
    __m256i acc32[8];
    for (auto& v : acc32) v = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      __m256i acc16[4];
      for (auto& v : acc16) v = _mm256_setzero_si256();
      for (int k = half * 16; k < half * 16 + 16; k += 2) {
        const __m256i A = _mm256_loadu_si256((const __m256i*)(p + k * 32));
        const __m256i B = _mm256_loadu_si256((const __m256i*)(p + (k + 1) * 32));
        const __m256i al = _mm256_and_si256(A, m4), ah = _mm256_and_si256(_mm256_srli_epi16(A, 4), m4);
        const __m256i bl = _mm256_and_si256(B, m4), bh = _mm256_and_si256(_mm256_srli_epi16(B, 4), m4);
        const __m256i xp = _mm256_set1_epi32(pj[k / 2]);
        acc16[0] = _mm256_add_epi16(acc16[0], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(al, bl), xp));
        acc16[1] = _mm256_add_epi16(acc16[1], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(al, bl), xp));
        acc16[2] = _mm256_add_epi16(acc16[2], _mm256_maddubs_epi16(_mm256_unpacklo_epi8(ah, bh), xp));
        acc16[3] = _mm256_add_epi16(acc16[3], _mm256_maddubs_epi16(_mm256_unpackhi_epi8(ah, bh), xp));
      }
      for (int i = 0; i < 4; ++i) {
        acc32[2 * i] = _mm256_add_epi32(acc32[2 * i], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc16[i])));
        acc32[2 * i + 1] =
            _mm256_add_epi32(acc32[2 * i + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc16[i], 1)));
      }
    }
    const int32_t sq = a.sr(t)[j];
    const __m256i off = _mm256_set1_epi32(8 * sq);
    const __m256 sqf = _mm256_set1_ps((float)sq), dv = _mm256_set1_ps(a.dr(t)[j]);
    for (int i = 0; i < 8; ++i) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(sz + kBase[i]));
      const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(v, zmask));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc32[i], off));
      const __m256 tt = _mm256_add_ps(_mm256_mul_ps(s, dot), _mm256_mul_ps(z, sqf));
      yacc[i] = _mm256_add_ps(yacc[i], _mm256_mul_ps(dv, tt));
    }
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(y + kBase[i], yacc[i]);
}

// Eight int32 vectors -> one vector of their eight lane sums, in order.
__attribute__((target("avx2,fma"))) __m256i hsum8(const __m256i* p) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// int8, one row read front to back (one stream for the prefetchers): |w| x sign(x, w) in maddubs
// (<= 2 * 127 * 127, no saturation); eight blocks' dots reduced exactly to int32 at once, their
// fp32 terms then added into their 8 lanes (BlockLanes' order).
__attribute__((target("avx2,fma"))) void int8_row_avx2(const Weight& w, int r, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
  float sbuf[kMaxBlocks];
  const float* s = row_scales(w, r, nb, sbuf);
  const int8_t* xq = a.qr(t);
  const float* d = a.dr(t);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accv = _mm256_setzero_ps();  // lane b: blocks j + b (BlockLanes' order)
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    prefetch_ahead(q + j * G, 8 * G);  // rows of a work item are contiguous: one stream
    __m256i p[8];
    for (int b = 0; b < 8; ++b) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(q + (j + b) * G));
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G));
      p[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
    }
    const __m256 c = _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(d + j));
    accv = _mm256_add_ps(accv, _mm256_mul_ps(c, _mm256_cvtepi32_ps(hsum8(p))));
  }
  float l[8];
  _mm256_storeu_ps(l, accv);
  *y = int8_tail(lanes_sum(l), q, s, xq, d, j, nb);
}

// int8 weights x int16 activations: sign-extended weights in madd_epi16 (exact in int32).
__attribute__((target("avx2,fma"))) void int8_row16_avx2(const Weight& w, int r, const QAct& a, int t, float* y) {
  const int nb = w.K / G;
  const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
  float sbuf[kMaxBlocks];
  const float* s = row_scales(w, r, nb, sbuf);
  const int16_t* xq = a.q16r(t);
  const float* d = a.dr(t);
  __m256 accv = _mm256_setzero_ps();  // lane b: blocks j + b (BlockLanes' order)
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    __m256i p[8];
    for (int b = 0; b < 8; ++b) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(q + (j + b) * G));
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1));
      const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G));
      const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G + 16));
      p[b] = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
    }
    const __m256 c = _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(d + j));
    accv = _mm256_add_ps(accv, _mm256_mul_ps(c, _mm256_cvtepi32_ps(hsum8(p))));
  }
  float l[8];
  _mm256_storeu_ps(l, accv);
  *y = int8_tail(lanes_sum(l), q, s, xq, d, j, nb);
}

// Eight 32-input blocks of q4_0 / q4_1 nibbles from block j on (16 bytes each: input i low nibble,
// i + 16 high) -> wv[b] = the block's 32 u8 values in input order; rows of a work item are
// contiguous, so the bytes g_prefetch ahead are prefetched (one stream). Only the first n blocks
// are read (a row's tail), the others zero.
__attribute__((target("avx2,fma"))) inline void nibble_blocks8(const uint8_t* q, int j, __m256i* wv, int n = 8) {
  prefetch_ahead(q + j * G / 2, 8 * G / 2);
  const __m128i m4 = _mm_set1_epi8(15);
  for (int b = 0; b < 8; ++b) {
    if (b >= n) {
      wv[b] = _mm256_setzero_si256();
      continue;
    }
    const __m128i v = _mm_loadu_si128((const __m128i*)(q + (j + b) * G / 2));
    wv[b] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
  }
}

// A row's tail: the first n of eight blocks' unsigned values wv (<= 31) against activation row xq
// from block j on -> sums[b] = block b's sum of value x (maddubs, then madd: exact; only the n
// blocks' activations are read), as the eight-block loops take them.
__attribute__((target("avx2,fma"))) inline void tail_sums8(const __m256i* wv, const int8_t* xq, int j, int n,
                                                           int32_t* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[8];
  for (int b = 0; b < 8; ++b)
    p[b] = b < n ? _mm256_madd_epi16(_mm256_maddubs_epi16(wv[b], _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G))),
                                     ones)
                 : _mm256_setzero_si256();
  _mm256_storeu_si256((__m256i*)sums, hsum8(p));
}

// A q4_0 row's last blocks [j, nb) (fewer than eight) after its 8 lanes were summed into acc:
// their integer dots from the vector code (nothing past the row is read), then q4_0_tail's fp32
// steps, so the bits are the scalar path's.
__attribute__((target("avx2,fma,f16c"))) float q4_0_tail_avx2(float acc, const uint8_t* q, const uint16_t* dw,
                                                               const int8_t* xq, const float* d, const int32_t* sx,
                                                               int j, int nb) {
  const int n = nb - j;
  if (n <= 0) return acc;
  __m256i wv[8];
  int32_t sums[8];
  nibble_blocks8(q, j, wv, n);
  tail_sums8(wv, xq, j, n, sums);
  return q4_0_tail(acc, sums, dw, d, sx, j, nb);
}

// q4_0, one row front to back: a block's 16 bytes -> 32 u8 nibbles in element order, maddubs with
// the int8 activations (<= 2 * 15 * 127: no saturation), eight blocks' dots reduced to int32 at
// once, minus 8 * sum x (exactly sum (q - 8) x); the fp32 terms added into their 8 lanes.
__attribute__((target("avx2,fma,f16c"))) void q4_0_row_avx2(const Weight& w, int r, const QAct& a, int t,
                                                            float* y) {
  const int nb = w.K / G;
  const uint8_t* q = w.q + (size_t)r * w.K / 2;
  const uint16_t* dw = (const uint16_t*)w.s + (size_t)r * nb;
  const int8_t* xq = a.qr(t);
  const float* d = a.dr(t);
  const int32_t* sx = a.sr(t);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accv = _mm256_setzero_ps();  // lane b: blocks j + b (BlockLanes' order)
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    __m256i wv[8], p[8];
    nibble_blocks8(q, j, wv);
    for (int b = 0; b < 8; ++b)
      p[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[b], _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G))), ones);
    const __m256i off = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(sx + j)), 3);
    const __m256i dots = _mm256_sub_epi32(hsum8(p), off);
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dw + j)));
    const __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(d + j));
    accv = _mm256_add_ps(accv, _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
  }
  float l[8];
  _mm256_storeu_ps(l, accv);
  *y = q4_0_tail_avx2(lanes_sum(l), q, dw, xq, d, sx, j, nb);
}

// q4_1's (d, m) fp16 pairs of eight blocks -> d and m widened to fp32, lane b: block b.
__attribute__((target("avx2,f16c"))) void q4_1_scales8(const uint16_t* dm, __m256* d, __m256* m) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)dm);  // d0 m0 d1 m1 ... d7 m7
  const __m256i sh = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,  //
                                      0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  // per 128-bit half: d0..d3 m0..m3 | d4..d7 m4..m7; then the 64-bit quarters to d0..d7 m0..m7
  const __m256i p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, sh), _MM_SHUFFLE(3, 1, 2, 0));
  *d = _mm256_cvtph_ps(_mm256_castsi256_si128(p));
  *m = _mm256_cvtph_ps(_mm256_extracti128_si256(p, 1));
}

// Eight blocks' q4_1 terms (q4_1_term's steps, lane b: block b) from their exact dots and sums.
__attribute__((target("avx2,fma,f16c"))) __m256 q4_1_terms8(const uint16_t* dm, const float* dx, __m256i dots,
                                                             const int32_t* sx) {
  __m256 wd, wm;
  q4_1_scales8(dm, &wd, &wm);
  const __m256 x = _mm256_loadu_ps(dx);
  const __m256 s = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)sx));
  return _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(wd, x), _mm256_cvtepi32_ps(dots)),
                       _mm256_mul_ps(_mm256_mul_ps(wm, x), s));
}

// q4_1, one row front to back: q4_0_row_avx2's nibbles and maddubs (no - 8: the nibbles are the
// weights' integers), the eight blocks' terms added into their 8 lanes.
__attribute__((target("avx2,fma,f16c"))) void q4_1_row_avx2(const Weight& w, int r, const QAct& a, int t,
                                                            float* y) {
  const int nb = w.K / G;
  const uint8_t* q = w.q + (size_t)r * w.K / 2;
  const uint16_t* dm = (const uint16_t*)w.s + (size_t)r * nb * 2;
  const int8_t* xq = a.qr(t);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accv = _mm256_setzero_ps();  // lane b: blocks j + b (BlockLanes' order)
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    __m256i wv[8], p[8];
    nibble_blocks8(q, j, wv);
    for (int b = 0; b < 8; ++b)
      p[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[b], _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G))), ones);
    accv = _mm256_add_ps(accv, q4_1_terms8(dm + 2 * j, a.dr(t) + j, hsum8(p), a.sr(t) + j));
  }
  float l[8];
  _mm256_storeu_ps(l, accv);
  float acc = lanes_sum(l);
  for (; j < nb; ++j)  // the last blocks: the scalar path's arithmetic
    acc = acc + q4_1_term(dm + 2 * j, a.dr(t)[j], q4_1_dot(q + j * G / 2, xq + j * G), a.sr(t)[j]);
  *y = acc;
}

// Eight q5_0 / mxfp4 (KD) blocks from block j of row r -> wv[b] = block b's 32 u8 values v + offset
// in input order (q5_0: the nibbles as nibble_blocks8 lays them, the qh bits expanded to 0x10 per
// byte, byte i from bit i; mxfp4: the nibbles through kE2M1x2 + 12 by vpshufb), and their eight
// scales in fp32 (block32_scale's: F16C widening is exact); only the first n blocks are read (a
// row's tail), the others zero.
template <Kind KD>
__attribute__((target("avx2,fma,f16c"))) inline __m256 block32_blocks8(const Weight& w, int r, int j, __m256i* wv,
                                                                        int n = 8) {
  const uint8_t* p = block32(w, r, j);
  constexpr int bytes = block32_bytes(KD);
  prefetch_ahead(p, 8 * bytes);
  const __m128i m4 = _mm_set1_epi8(15);
  const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // byte i: every bit but i % 8
  const __m256i ones = _mm256_set1_epi8(-1), bit4 = _mm256_set1_epi8(16);
  const __m128i lut = _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);  // kE2M1x2 + 12
  uint16_t d[8] = {};
  float ds[8] = {};
  for (int b = 0; b < 8; ++b) {
    if (b >= n) {
      wv[b] = _mm256_setzero_si256();
      continue;
    }
    const uint8_t* blk = p + b * bytes;
    if constexpr (KD == kMxfp4) {
      ds[b] = kE8m0Half.v[blk[0]];
      const __m128i v = _mm_loadu_si128((const __m128i*)(blk + 1));
      wv[b] = _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), m4)),
                               _mm_shuffle_epi8(lut, _mm_and_si128(v, m4)));
    } else {
      std::memcpy(d + b, blk, 2);
      const int32_t qh = (int32_t)q5_0_qh(blk);
      const __m128i v = _mm_loadu_si128((const __m128i*)(blk + 6));
      const __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
      const __m256i qb = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread), others);
      wv[b] = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(qb, ones), bit4));
    }
  }
  if constexpr (KD == kMxfp4) return _mm256_loadu_ps(ds);
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d));
}

// The last blocks [j, nb) of a q5_0 / mxfp4 row: block32_blocks8's values (zero past nb),
// block32_tail's fp32 steps in order.
template <Kind KD>
__attribute__((target("avx2,fma,f16c"))) float block32_tail_avx2(float acc, const Weight& w, int r, const QAct& a,
                                                                  int t, int j, int nb) {
  const int n = nb - j;
  if (n <= 0) return acc;
  __m256i wv[8];
  int32_t sums[8];
  block32_blocks8<KD>(w, r, j, wv, n);
  tail_sums8(wv, a.qr(t), j, n, sums);
  return block32_tail(acc, sums, w, r, a.dr(t), a.sr(t), j, nb);
}

// ---- token tiles: several activation rows per pass over the weights (prefill, dense T > 1) --------
// Each kernel below reads a weight block once for up to kTile activation rows and gives every
// output element the bits of the one-row kernel above: the same exact integer block dots, then
// per row the same fp32 steps in the same order (only the weights' unpacking is shared).
constexpr int kTile = 4;  // the scalar twins' BlockLanes arrays below are written for 4
int64_t g_token_tile = 0;  // 0: kTile; 1: one row per pass, the path of before (benchmarks only)
int token_tile() { return g_token_tile > 0 ? (int)std::min<int64_t>(g_token_tile, kTile) : kTile; }

// Activation rows ts[0, nt) -> y[i * ys + r]; scalar twins read each weight once per block.
void int4_rows_scalar_nt(const Weight& w, int r0, int n, const QAct& a, const int* ts, int nt, float* y,
                         size_t ys) {
  const int b = std::min(BN, w.N - r0), h = b / 2;
  const uint8_t* blk = w.q + (size_t)r0 * w.K / 2;
  for (int r = 0; r < n; ++r) {
    const int col = r % h, shift = r < h ? 0 : 4;
    float acc[kTile] = {};
    for (int j = 0; j < w.K / G; ++j) {
      int32_t dot[kTile] = {};
      for (int k = j * G; k < (j + 1) * G; ++k) {
        const int q = (blk[(size_t)k * h + col] >> shift) & 15;
        for (int i = 0; i < nt; ++i) dot[i] += q * a.qr(ts[i])[k];
      }
      const uint16_t* sz = (const uint16_t*)(int4_sz(w, r0, j) + r);  // (scale, zero)
      for (int i = 0; i < nt; ++i) {
        const int t = ts[i];
        const float sq = (float)a.sr(t)[j];
        const float tt = bf16(sz[0]) * (float)(dot[i] - 8 * a.sr(t)[j]) + bf16(sz[1]) * sq;
        acc[i] = acc[i] + a.dr(t)[j] * tt;
      }
    }
    for (int i = 0; i < nt; ++i) y[i * ys + r] = acc[i];
  }
}

template <typename Q>
void int8_rows_scalar_nt(const Weight& w, int r0, int n, const QAct& a, const int* ts, int nt, float* y,
                         size_t ys) {
  const int nb = w.K / G;
  float sbuf[kMaxBlocks];
  const Q* xq[kTile];
  for (int i = 0; i < nt; ++i) xq[i] = (const Q*)(a.wide ? (const void*)a.q16r(ts[i]) : (const void*)a.qr(ts[i]));
  for (int r = r0; r < r0 + n; ++r) {
    const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
    const float* s = row_scales(w, r, nb, sbuf);
    BlockLanes acc[kTile] = {BlockLanes(nb), BlockLanes(nb), BlockLanes(nb), BlockLanes(nb)};
    for (int j = 0; j < nb; ++j) {
      int32_t dot[kTile] = {};
      for (int k = j * G; k < (j + 1) * G; ++k)
        for (int i = 0; i < nt; ++i) dot[i] += q[k] * xq[i][k];
      for (int i = 0; i < nt; ++i) acc[i].add(j, (s[j] * a.dr(ts[i])[j]) * (float)dot[i]);
    }
    for (int i = 0; i < nt; ++i) y[i * ys + r - r0] = acc[i].sum();
  }
}

void q4_0_rows_scalar_nt(const Weight& w, int r0, int n, const QAct& a, const int* ts, int nt, float* y,
                         size_t ys) {
  const int nb = w.K / G;
  const uint16_t* d = (const uint16_t*)w.s;
  for (int r = r0; r < r0 + n; ++r) {
    const uint8_t* q = w.q + (size_t)r * w.K / 2;
    BlockLanes acc[kTile] = {BlockLanes(nb), BlockLanes(nb), BlockLanes(nb), BlockLanes(nb)};
    for (int j = 0; j < nb; ++j) {
      int32_t dot[kTile] = {};
      for (int k = 0; k < G / 2; ++k) {
        const int lo = (q[j * G / 2 + k] & 15) - 8, hi = (q[j * G / 2 + k] >> 4) - 8;
        for (int i = 0; i < nt; ++i) {
          const int8_t* xq = a.qr(ts[i]);
          dot[i] += lo * xq[j * G + k];
          dot[i] += hi * xq[j * G + G / 2 + k];
        }
      }
      const float dw = fp16(d[(size_t)r * nb + j]);
      for (int i = 0; i < nt; ++i) acc[i].add(j, (dw * a.dr(ts[i])[j]) * (float)dot[i]);
    }
    for (int i = 0; i < nt; ++i) y[i * ys + r - r0] = acc[i].sum();
  }
}

void q4_1_rows_scalar_nt(const Weight& w, int r0, int n, const QAct& a, const int* ts, int nt, float* y,
                         size_t ys) {
  const int nb = w.K / G;
  const uint16_t* dm = (const uint16_t*)w.s;
  for (int r = r0; r < r0 + n; ++r) {
    const uint8_t* q = w.q + (size_t)r * w.K / 2;
    BlockLanes acc[kTile] = {BlockLanes(nb), BlockLanes(nb), BlockLanes(nb), BlockLanes(nb)};
    for (int j = 0; j < nb; ++j) {
      int32_t dot[kTile] = {};
      for (int k = 0; k < G / 2; ++k) {
        const int lo = q[j * G / 2 + k] & 15, hi = q[j * G / 2 + k] >> 4;
        for (int i = 0; i < nt; ++i) {
          const int8_t* xq = a.qr(ts[i]);
          dot[i] += lo * xq[j * G + k];
          dot[i] += hi * xq[j * G + G / 2 + k];
        }
      }
      const uint16_t* dmj = dm + ((size_t)r * nb + j) * 2;
      for (int i = 0; i < nt; ++i) acc[i].add(j, q4_1_term(dmj, a.dr(ts[i])[j], dot[i], a.sr(ts[i])[j]));
    }
    for (int i = 0; i < nt; ++i) y[i * ys + r - r0] = acc[i].sum();
  }
}

void block32_rows_scalar_nt(const Weight& w, int r0, int n, const QAct& a, const int* ts, int nt, float* y,
                            size_t ys) {
  const int nb = w.K / G;
  for (int r = r0; r < r0 + n; ++r) {
    BlockLanes acc[kTile] = {BlockLanes(nb), BlockLanes(nb), BlockLanes(nb), BlockLanes(nb)};
    for (int j = 0; j < nb; ++j) {
      const uint8_t* blk = block32(w, r, j);
      int8_t v[G];
      block32_values(w.kind, blk, v);
      int32_t dot[kTile] = {};
      for (int k = 0; k < G; ++k)
        for (int i = 0; i < nt; ++i) dot[i] += v[k] * a.qr(ts[i])[j * G + k];
      const float dw = block32_scale(w.kind, blk);
      for (int i = 0; i < nt; ++i) acc[i].add(j, (dw * a.dr(ts[i])[j]) * (float)dot[i]);
    }
    for (int i = 0; i < nt; ++i) y[i * ys + r - r0] = acc[i].sum();
  }
}

// int4, one full block of 64 rows x NT activation rows: a half group's nibbles are interleaved
// once (U, 1 KiB in L1), then each row's maddubs run over them (int4_block_avx2's sums).
template <int NT>
__attribute__((target("avx2,fma"))) void int4_block_avx2_nt(const Weight& w, int r0, const QAct& a, const int* ts,
                                                             float* y, size_t ys) {
  static constexpr int kBase[8] = {0, 16, 8, 24, 32, 48, 40, 56};
  const uint8_t* blk = w.q + (size_t)r0 * w.K / 2;
  const __m256i m4 = _mm256_set1_epi8(15), zmask = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256 yacc[NT][8];
  for (auto& r : yacc)
    for (auto& v : r) v = _mm256_setzero_ps();
  for (int j = 0; j < w.K / G; ++j) {
    const uint8_t* p = blk + (size_t)j * G * 32;
    const uint32_t* sz = int4_sz(w, r0, j);
    prefetch_ahead(p, G * 32);
    prefetch_ahead(sz, BN * 4);
    __m256i acc32[NT][8];
    for (auto& r : acc32)
      for (auto& v : r) v = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      __m256i U[8][4];
      for (int kk = 0; kk < 8; ++kk) {
        const int k = half * 16 + 2 * kk;
        const __m256i A = _mm256_loadu_si256((const __m256i*)(p + k * 32));
        const __m256i B = _mm256_loadu_si256((const __m256i*)(p + (k + 1) * 32));
        const __m256i al = _mm256_and_si256(A, m4), ah = _mm256_and_si256(_mm256_srli_epi16(A, 4), m4);
        const __m256i bl = _mm256_and_si256(B, m4), bh = _mm256_and_si256(_mm256_srli_epi16(B, 4), m4);
        U[kk][0] = _mm256_unpacklo_epi8(al, bl), U[kk][1] = _mm256_unpackhi_epi8(al, bl);
        U[kk][2] = _mm256_unpacklo_epi8(ah, bh), U[kk][3] = _mm256_unpackhi_epi8(ah, bh);
      }
      for (int i = 0; i < NT; ++i) {
        const int32_t* pj = a.prr(ts[i]) + j * G / 2 + half * 8;
        __m256i acc16[4];
        for (auto& v : acc16) v = _mm256_setzero_si256();
        for (int kk = 0; kk < 8; ++kk) {
          const __m256i xp = _mm256_set1_epi32(pj[kk]);
          for (int c = 0; c < 4; ++c) acc16[c] = _mm256_add_epi16(acc16[c], _mm256_maddubs_epi16(U[kk][c], xp));
        }
        for (int c = 0; c < 4; ++c) {
          acc32[i][2 * c] =
              _mm256_add_epi32(acc32[i][2 * c], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc16[c])));
          acc32[i][2 * c + 1] =
              _mm256_add_epi32(acc32[i][2 * c + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc16[c], 1)));
        }
      }
    }
    __m256 S[8], Z[8];
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(sz + kBase[c]));
      S[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      Z[c] = _mm256_castsi256_ps(_mm256_and_si256(v, zmask));
    }
    for (int i = 0; i < NT; ++i) {
      const int32_t sq = a.sr(ts[i])[j];
      const __m256i off = _mm256_set1_epi32(8 * sq);
      const __m256 sqf = _mm256_set1_ps((float)sq), dv = _mm256_set1_ps(a.dr(ts[i])[j]);
      for (int c = 0; c < 8; ++c) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc32[i][c], off));
        const __m256 tt = _mm256_add_ps(_mm256_mul_ps(S[c], dot), _mm256_mul_ps(Z[c], sqf));
        yacc[i][c] = _mm256_add_ps(yacc[i][c], _mm256_mul_ps(dv, tt));
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(y + i * ys + kBase[c], yacc[i][c]);
}

// int8 (int8 or int16 activations), one row x NT activation rows: eight blocks' |w| and sign (or
// widened weights) once, then per row int8_row_avx2's (int8_row16_avx2's) sums.
template <int NT, bool Wide>
__attribute__((target("avx2,fma"))) void int8_row_avx2_nt(const Weight& w, int r, const QAct& a, const int* ts,
                                                           float* y, size_t ys) {
  const int nb = w.K / G;
  const int8_t* q = (const int8_t*)w.q + (size_t)r * w.K;
  float sbuf[kMaxBlocks];
  const float* s = row_scales(w, r, nb, sbuf);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accv[NT];
  for (auto& v : accv) v = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    if (!Wide) prefetch_ahead(q + j * G, 8 * G);
    __m256i W0[8], W1[8];  // int8: |w|, w; Wide: w widened to int16, low and high half
    for (int b = 0; b < 8; ++b) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(q + (j + b) * G));
      if (Wide) {
        W0[b] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv));
        W1[b] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1));
      } else {
        W0[b] = _mm256_sign_epi8(wv, wv), W1[b] = wv;
      }
    }
    const __m256 sv = _mm256_loadu_ps(s + j);
    for (int i = 0; i < NT; ++i) {
      __m256i p[8];
      for (int b = 0; b < 8; ++b) {
        if (Wide) {
          const int16_t* xq = a.q16r(ts[i]) + (j + b) * G;
          p[b] = _mm256_add_epi32(_mm256_madd_epi16(W0[b], _mm256_loadu_si256((const __m256i*)xq)),
                                  _mm256_madd_epi16(W1[b], _mm256_loadu_si256((const __m256i*)(xq + 16))));
        } else {
          const __m256i xv = _mm256_loadu_si256((const __m256i*)(a.qr(ts[i]) + (j + b) * G));
          p[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(W0[b], _mm256_sign_epi8(xv, W1[b])), ones);
        }
      }
      const __m256 c = _mm256_mul_ps(sv, _mm256_loadu_ps(a.dr(ts[i]) + j));
      accv[i] = _mm256_add_ps(accv[i], _mm256_mul_ps(c, _mm256_cvtepi32_ps(hsum8(p))));
    }
  }
  for (int i = 0; i < NT; ++i) {
    float l[8];
    _mm256_storeu_ps(l, accv[i]);
    float acc = lanes_sum(l);
    const float* d = a.dr(ts[i]);
    for (int jj = j; jj < nb; ++jj) {
      int32_t dot = 0;
      if (Wide)
        for (int k = jj * G; k < (jj + 1) * G; ++k) dot += q[k] * a.q16r(ts[i])[k];
      else
        for (int k = jj * G; k < (jj + 1) * G; ++k) dot += q[k] * a.qr(ts[i])[k];
      acc = acc + (s[jj] * d[jj]) * (float)dot;
    }
    y[i * ys] = acc;
  }
}

// Eight blocks' maddubs (16 int16 lanes each, every lane |.| <= 2 * 15 * 127: q4_0's nibbles) -> one
// int32 vector of the eight block dots, in order. A 128-bit half's 8 lanes sum to <= 30480, so
// three rounds of int16 hadd (lane b of each half: block b's half) then one widening add are exact:
// the same integers as madd + hsum8, in fewer instructions.
__attribute__((target("avx2,fma"))) __m256i hsum8_16(const __m256i* m) {
  const __m256i q0 = _mm256_hadd_epi16(_mm256_hadd_epi16(m[0], m[1]), _mm256_hadd_epi16(m[2], m[3]));
  const __m256i q1 = _mm256_hadd_epi16(_mm256_hadd_epi16(m[4], m[5]), _mm256_hadd_epi16(m[6], m[7]));
  const __m256i r = _mm256_hadd_epi16(q0, q1);
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(r)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(r, 1)));
}

// q4_0, one row x NT activation rows: eight blocks' nibbles unpacked once (q4_0_row_avx2's sums).
template <int NT>
__attribute__((target("avx2,fma,f16c"))) void q4_0_row_avx2_nt(const Weight& w, int r, const QAct& a, const int* ts,
                                                                float* y, size_t ys) {
  const int nb = w.K / G;
  const uint8_t* q = w.q + (size_t)r * w.K / 2;
  const uint16_t* dw = (const uint16_t*)w.s + (size_t)r * nb;
  __m256 accv[NT];
  for (auto& v : accv) v = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    __m256i wv[8];
    nibble_blocks8(q, j, wv);
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dw + j)));
    for (int i = 0; i < NT; ++i) {
      const int8_t* xq = a.qr(ts[i]);
      __m256i m[8];
      for (int b = 0; b < 8; ++b)
        m[b] = _mm256_maddubs_epi16(wv[b], _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G)));
      const __m256i off = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a.sr(ts[i]) + j)), 3);
      const __m256i dots = _mm256_sub_epi32(hsum8_16(m), off);
      const __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(a.dr(ts[i]) + j));
      accv[i] = _mm256_add_ps(accv[i], _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
    }
  }
  for (int i = 0; i < NT; ++i) {
    float l[8];
    _mm256_storeu_ps(l, accv[i]);
    y[i * ys] = q4_0_tail_avx2(lanes_sum(l), q, dw, a.qr(ts[i]), a.dr(ts[i]), a.sr(ts[i]), j, nb);
  }
}

// q4_1, one row x NT activation rows: eight blocks' nibbles unpacked once, q4_0_row_avx2_nt's int16
// sums (a half block's 16 products of nibbles and int8 <= 30480), q4_1_row_avx2's terms.
template <int NT>
__attribute__((target("avx2,fma,f16c"))) void q4_1_row_avx2_nt(const Weight& w, int r, const QAct& a, const int* ts,
                                                                float* y, size_t ys) {
  const int nb = w.K / G;
  const uint8_t* q = w.q + (size_t)r * w.K / 2;
  const uint16_t* dm = (const uint16_t*)w.s + (size_t)r * nb * 2;
  __m256 accv[NT];
  for (auto& v : accv) v = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    __m256i wv[8];
    nibble_blocks8(q, j, wv);
    for (int i = 0; i < NT; ++i) {
      const int8_t* xq = a.qr(ts[i]);
      __m256i m[8];
      for (int b = 0; b < 8; ++b)
        m[b] = _mm256_maddubs_epi16(wv[b], _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G)));
      accv[i] = _mm256_add_ps(accv[i], q4_1_terms8(dm + 2 * j, a.dr(ts[i]) + j, hsum8_16(m), a.sr(ts[i]) + j));
    }
  }
  for (int i = 0; i < NT; ++i) {
    float l[8];
    _mm256_storeu_ps(l, accv[i]);
    float acc = lanes_sum(l);
    const int t = ts[i];
    for (int jj = j; jj < nb; ++jj)
      acc = acc + q4_1_term(dm + 2 * jj, a.dr(t)[jj], q4_1_dot(q + jj * G / 2, a.qr(t) + jj * G), a.sr(t)[jj]);
    y[i * ys] = acc;
  }
}

// q5_0 / mxfp4 (KD), one row x NT activation rows (NT = 1: a decode row): eight blocks' values
// unpacked once (block32_blocks8), in maddubs with each row's int8 activations (<= 2 * 31 * 127:
// no saturation), then madd to int32 (a half block's 16 products reach 16 * 31 * 127, past
// int16), minus offset * sum x (exactly sum v x); the fp32 terms into their 8 lanes
// (q4_0_row_avx2's steps), the last blocks in the scalar path's arithmetic.
template <int NT, Kind KD>
__attribute__((target("avx2,fma,f16c"))) void block32_row_avx2_nt(const Weight& w, int r, const QAct& a,
                                                                   const int* ts, float* y, size_t ys) {
  const int nb = w.K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 accv[NT];
  for (auto& v : accv) v = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= nb; j += 8) {
    __m256i wv[8];
    const __m256 wsv = block32_blocks8<KD>(w, r, j, wv);
    for (int i = 0; i < NT; ++i) {
      const int8_t* xq = a.qr(ts[i]);
      __m256i p[8];
      for (int b = 0; b < 8; ++b)
        p[b] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[b], _mm256_loadu_si256((const __m256i*)(xq + (j + b) * G))),
                                 ones);
      const __m256i off = block32_offsets8<KD>(_mm256_loadu_si256((const __m256i*)(a.sr(ts[i]) + j)));
      const __m256i dots = _mm256_sub_epi32(hsum8(p), off);
      const __m256 c = _mm256_mul_ps(wsv, _mm256_loadu_ps(a.dr(ts[i]) + j));
      accv[i] = _mm256_add_ps(accv[i], _mm256_mul_ps(c, _mm256_cvtepi32_ps(dots)));
    }
  }
  for (int i = 0; i < NT; ++i) {
    float l[8];
    _mm256_storeu_ps(l, accv[i]);
    y[i * ys] = block32_tail_avx2<KD>(lanes_sum(l), w, r, a, ts[i], j, nb);
  }
}

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// One q5_0 / mxfp4 row for NT activation rows on the vector ISA `isa` (>= AVX2).
template <int NT>
void block32_row_nt(const Weight& w, int r, const QAct& a, const int* ts, float* y, size_t ys, int64_t isa) {
  if (w.kind == kMxfp4)
    (isa >= kAvx512 ? block32_row_avx512_nt<NT, kMxfp4> : block32_row_avx2_nt<NT, kMxfp4>)(w, r, a, ts, y, ys);
  else
    (isa >= kAvx512 ? block32_row_avx512_nt<NT, kQ5_0> : block32_row_avx2_nt<NT, kQ5_0>)(w, r, a, ts, y, ys);
}

// Rows [r0, r0 + n) of w (r0 a multiple of 64, n <= 64: one block) for activation row t -> y[0, n).
void rows(const Weight& w, int r0, int n, const QAct& a, int t, float* y, int64_t isa) {
  TORCH_CHECK(w.kind == kInt8 || !a.wide, "int16 activations are for int8 weights");
  if (moestream_kquant::is_kquant(w.kind))
    return moestream_kquant::rows(w.kind, w.q, w.K, r0, n, a.qr(t), a.dr(t), a.sr(t), (int)isa, y);
  if (w.kind == kInt4) {
    if (isa >= kAvx512 && n == BN) return int4_block_avx512(w, r0, a, t, y);
    if (isa >= kAvx2 && n == BN) return int4_block_avx2(w, r0, a, t, y);
    return int4_rows_scalar(w, r0, n, a, t, y);
  }
  if (w.kind == kQ4_0) {
    if (isa >= kAvx512)
      for (int i = 0; i < n; ++i) q4_0_row_avx512(w, r0 + i, a, t, y + i);
    else if (isa >= kAvx2)
      for (int i = 0; i < n; ++i) q4_0_row_avx2(w, r0 + i, a, t, y + i);
    else
      q4_0_rows_scalar(w, r0, n, a, t, y);
    return;
  }
  if (w.kind == kQ4_1) {
    if (isa >= kAvx2)
      for (int i = 0; i < n; ++i) q4_1_row_avx2(w, r0 + i, a, t, y + i);
    else
      q4_1_rows_scalar(w, r0, n, a, t, y);
    return;
  }
  if (w.kind == kQ5_0 || w.kind == kMxfp4) {
    if (isa >= kAvx2)
      for (int i = 0; i < n; ++i) block32_row_nt<1>(w, r0 + i, a, &t, y + i, 1, isa);
    else
      block32_rows_scalar(w, r0, n, a, t, y);
    return;
  }
  if (isa >= kAvx512)
    for (int i = 0; i < n; ++i) (a.wide ? int8_row16_avx512 : int8_row_avx512)(w, r0 + i, a, t, y + i);
  else if (isa >= kAvx2)
    for (int i = 0; i < n; ++i) (a.wide ? int8_row16_avx2 : int8_row_avx2)(w, r0 + i, a, t, y + i);
  else if (a.wide)
    int8_rows_scalar(w, r0, n, a, t, y, a.q16r(t));
  else
    int8_rows_scalar(w, r0, n, a, t, y, a.qr(t));
}

// rows() for activation rows ts[0, nt), nt <= kTile -> y[i * ys + (0, n)]: each element the bits
// rows() gives for that activation row alone.
template <int NT>
void rows_nt(const Weight& w, int r0, int n, const QAct& a, const int* ts, float* y, size_t ys, int64_t isa) {
  if (moestream_kquant::is_kquant(w.kind)) {
    moestream_kquant::Act x[NT];
    for (int i = 0; i < NT; ++i) x[i] = {a.qr(ts[i]), a.dr(ts[i]), a.sr(ts[i])};
    return moestream_kquant::rows_nt(w.kind, w.q, w.K, r0, n, x, NT, (int)isa, y, ys);
  }
  if (w.kind == kInt4) {
    if (isa >= kAvx512 && n == BN) return int4_block_avx512_nt<NT>(w, r0, a, ts, y, ys);
    if (isa >= kAvx2 && n == BN) return int4_block_avx2_nt<NT>(w, r0, a, ts, y, ys);
    return int4_rows_scalar_nt(w, r0, n, a, ts, NT, y, ys);
  }
  if (w.kind == kQ4_0) {
    if (isa < kAvx2) return q4_0_rows_scalar_nt(w, r0, n, a, ts, NT, y, ys);
    for (int i = 0; i < n; ++i)
      (isa >= kAvx512 ? q4_0_row_avx512_nt<NT> : q4_0_row_avx2_nt<NT>)(w, r0 + i, a, ts, y + i, ys);
    return;
  }
  if (w.kind == kQ4_1) {
    if (isa < kAvx2) return q4_1_rows_scalar_nt(w, r0, n, a, ts, NT, y, ys);
    for (int i = 0; i < n; ++i) q4_1_row_avx2_nt<NT>(w, r0 + i, a, ts, y + i, ys);
    return;
  }
  if (w.kind == kQ5_0 || w.kind == kMxfp4) {
    if (isa < kAvx2) return block32_rows_scalar_nt(w, r0, n, a, ts, NT, y, ys);
    for (int i = 0; i < n; ++i) block32_row_nt<NT>(w, r0 + i, a, ts, y + i, ys, isa);
    return;
  }
  if (isa < kAvx2)
    return a.wide ? int8_rows_scalar_nt<int16_t>(w, r0, n, a, ts, NT, y, ys)
                  : int8_rows_scalar_nt<int8_t>(w, r0, n, a, ts, NT, y, ys);
  for (int i = 0; i < n; ++i)
    (a.wide ? int8_row_avx2_nt<NT, true> : isa >= kAvx512 ? int8_row_avx512_nt<NT> : int8_row_avx2_nt<NT, false>)(
        w, r0 + i, a, ts, y + i, ys);
}

// Activation rows ts[0, cnt) through rows [r0, r0 + n) of w -> y[i * ys + (0, n)], token_tile()
// rows per pass (K-quants below AVX-512: one).
void rows_tokens(const Weight& w, int r0, int n, const QAct& a, const int* ts, int cnt, float* y, size_t ys,
                 int64_t isa) {
  TORCH_CHECK(w.kind == kInt8 || !a.wide, "int16 activations are for int8 weights");
  const int nt = moestream_kquant::is_kquant(w.kind) && isa < kAvx512 ? 1 : token_tile();
  for (int i = 0; i < cnt; i += nt) {
    const int m = std::min(nt, cnt - i);
    const int* t = ts + i;
    float* yi = y + (size_t)i * ys;
    if (m == 1)
      rows(w, r0, n, a, t[0], yi, isa);
    else if (m == 2)
      rows_nt<2>(w, r0, n, a, t, yi, ys, isa);
    else if (m == 3)
      rows_nt<3>(w, r0, n, a, t, yi, ys, isa);
    else
      rows_nt<4>(w, r0, n, a, t, yi, ys, isa);
  }
}

// The scheme is told by the section dtypes: int8 q + fp32 s, uint8 q + bf16 sz (int4, blocked), uint8 q +
// fp16 d (q4_0), uint8 q + fp16 dm [N, K/32, 2] (q4_1).
Weight weight(const torch::Tensor& q, const torch::Tensor& s) {
  TORCH_CHECK(q.is_contiguous() && s.is_contiguous(), "record sections must be contiguous");
  const auto qt = q.scalar_type(), st = s.scalar_type();
  if (q.dim() == 3 && (q.size(2) == kQ5_0Bytes || q.size(2) == kMxfp4Bytes)) {  // GGUF Q5_0 / MXFP4 blocks
    TORCH_CHECK(qt == torch::kUInt8, "q5_0 / mxfp4 blocks must be uint8 [N, K/32, 22 | 17] (s is q)");
    return {(const uint8_t*)q.data_ptr(), nullptr, (int)q.size(0), (int)q.size(1) * G,
            q.size(2) == kQ5_0Bytes ? kQ5_0 : kMxfp4};
  }
  if (q.dim() == 3) {  // GGUF K-quant blocks [N, K/256, B]: they carry their scales (s is q)
    const int kq = moestream_kquant::kind_of_bytes(q.size(2));
    TORCH_CHECK(qt == torch::kUInt8 && kq > 0, "K-quant blocks must be uint8 [N, K/256, 144|176|210]");
    return {(const uint8_t*)q.data_ptr(), nullptr, (int)q.size(0), (int)q.size(1) * moestream_kquant::kQK,
            (Kind)kq};
  }
  Kind kind;
  if (qt == torch::kInt8 && (st == torch::kFloat32 || st == torch::kHalf))
    kind = kInt8;
  else if (qt == torch::kUInt8 && st == torch::kBFloat16)
    kind = kInt4;
  else if (qt == torch::kUInt8 && st == torch::kHalf)
    kind = s.dim() == 3 ? kQ4_1 : kQ4_0;
  else
    TORCH_CHECK(false,
                "weights must be int8 + fp32 or fp16 (q8_0), int4 (uint8) + bf16, q4_0 (uint8) + fp16, or q4_1 "
                "(uint8) + fp16 [N, K/32, 2]");
  const int N = (int)q.size(0), K = (int)q.size(1) * (kind == kInt8 ? 1 : 2);
  TORCH_CHECK(K % G == 0 && (kind != kInt4 || N % 2 == 0), "K must be a multiple of 32 (int4: even N)");
  const int per_block = kind == kInt4 || kind == kQ4_1 ? 2 : 1;  // (scale, zero) / (d, m) pairs
  TORCH_CHECK(s.numel() == (int64_t)N * K / G * per_block, "scale section has the wrong size");
  TORCH_CHECK(kind != kInt4 || s.dim() == 2,
              "int4 (scale, zero) must be in the store's blocked layout [N * K/32, 2] (quant.int4_sz_blocked)");
  const bool s16 = kind == kInt8 && st == torch::kHalf;
  TORCH_CHECK(!s16 || K / G <= kMaxBlocks, "q8_0 rows are at most ", kMaxBlocks * G, " wide");
  return {(const uint8_t*)q.data_ptr(), s.data_ptr(), N, K, kind, s16};
}

int64_t resolve(int64_t isa) {
  static const int64_t best = cpu_has_avx512() ? kAvx512 : cpu_has_avx2() ? kAvx2 : kScalar;
  return isa < 0 ? best : std::min(isa, best);
}

QAct quantize(const torch::Tensor& x, bool wide, int64_t isa) {
  QAct a((int)x.size(0), (int)x.size(1), wide);
  TORCH_CHECK(a.K % G == 0, "activation width must be a multiple of 32");
  for (int r = 0; r < a.rows; ++r) quantize_row(x.data_ptr<float>() + (size_t)r * a.K, a, r, isa);
  return a;
}

// x [T, K] float -> [T, N] fp32 through one quantized weight (tests and single projections).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& s, bool wide,
                     int64_t isa) {
  const Weight w = weight(q, s);
  const auto xf = x.to(torch::kFloat).contiguous();
  TORCH_CHECK(xf.dim() == 2 && xf.size(1) == w.K, "x must be [T, K]");
  isa = resolve(isa);
  const QAct a = quantize(xf, wide, isa);
  auto y = torch::empty({a.rows, w.N}, xf.options());
  float* yp = y.data_ptr<float>();
  std::vector<int> ts(a.rows);
  for (int t = 0; t < a.rows; ++t) ts[t] = t;
  const int nc = row_chunks(w.N, 1, std::max(1, at::get_num_threads()));
  parallel_items(nc, [&](int64_t c) {
    chunk_blocks(w.N, nc, c, [&](int r0, int n) { rows_tokens(w, r0, n, a, ts.data(), a.rows, yp + r0, w.N, isa); });
  }, q.nbytes());
  return y;
}

// An expert's extras beyond its four weight tensors (gpt-oss): fp32 biases per expert, b13 [2I]
// added to gate|up and b2 [D] to the down rows (none: empty), and the clamped SwiGLU where limit > 0
// (ref.ExpertActivation: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) g sigmoid(alpha g)).
struct Extras {
  std::vector<const float*> b13, b2;
  float alpha = 0.f, limit = 0.f;
  const float* bias13(int e) const { return b13.empty() ? nullptr : b13[e]; }
  const float* bias2(int e) const { return b2.empty() ? nullptr : b2[e]; }
};

Extras extras(const std::vector<torch::Tensor>& biases, int E, int D, int I, double alpha, double limit) {
  Extras x;
  x.alpha = (float)alpha, x.limit = (float)limit;
  if (biases.empty()) return x;
  TORCH_CHECK((int)biases.size() == 2 * E, "biases: (b13, b2) per expert");
  for (int e = 0; e < E; ++e) {
    const auto &a = biases[2 * e], &b = biases[2 * e + 1];
    TORCH_CHECK(a.scalar_type() == torch::kFloat && b.scalar_type() == torch::kFloat && a.is_contiguous() &&
                    b.is_contiguous() && a.numel() == 2 * I && b.numel() == D,
                "biases: contiguous fp32 b13 [2I] and b2 [D]");
    x.b13.push_back(a.data_ptr<float>()), x.b2.push_back(b.data_ptr<float>());
  }
  return x;
}

// The expert activation of h [rows, 2I] (gate|up plus b13 when given; silu(gate) * up, or the
// clamped SwiGLU where limit > 0) quantized per row.
void act_quantize(const float* h, int I, QAct& act, int r, int64_t isa, const float* b13 = nullptr,
                  float alpha = 0.f, float limit = 0.f) {
  std::vector<float> v(I);
  const float* g = h + (size_t)r * 2 * I;
  if (!b13 && limit <= 0.f) {  // plain silu(gate) * up: the loop every other model runs
    for (int i = 0; i < I; ++i) v[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
    quantize_row(v.data(), act, r, isa);
    return;
  }
  for (int i = 0; i < I; ++i) {
    float gate = g[i], up = g[I + i];
    if (b13) gate = gate + b13[i], up = up + b13[I + i];
    if (limit > 0.f) {  // the reference's op order: (u + 1) * (g * sigmoid(g * alpha))
      gate = std::min(gate, limit), up = std::max(std::min(up, limit), -limit);
      v[i] = (up + 1.f) * (gate * (1.f / (1.f + std::exp(-(gate * alpha)))));
    } else {  // (biases, plain silu)
      v[i] = gate / (1.f + std::exp(-gate)) * up;
    }
  }
  quantize_row(v.data(), act, r, isa);
}

// A layer's (expert, token) pairs: expert e (w13[e], w2[e]) takes the rows tok[off[e], off[e+1])
// of x, pair p weighted pw[p]; out[t] = sum of pw * down(silu(gate) * up) over t's pairs in expert
// order, from zero in fp32 (moe's order per token). Work items: experts x 64-row blocks (gate|up),
// then 64-row blocks of D (down, every expert's pairs in order inside), token_tile() rows a pass.
torch::Tensor moe_pairs(const torch::Tensor& xf, const std::vector<Weight>& w13, const std::vector<Weight>& w2,
                        const std::vector<int>& tok, const std::vector<int64_t>& off, const std::vector<float>& pw,
                        int64_t b13, int64_t b2, int64_t isa, const Extras& ex = Extras()) {
  const int D = (int)xf.size(1), E = (int)w13.size(), N13 = w13[0].N, I = N13 / 2, P = (int)tok.size();
  const QAct ax = quantize(xf, false, isa);
  std::vector<float> h((size_t)P * N13);  // row p: pair p's gate|up
  const int nb13 = (N13 + BN - 1) / BN, nbd = (D + BN - 1) / BN;
  parallel_items((int64_t)E * nb13, [&](int64_t i) {
    const int e = (int)(i / nb13), r0 = (int)(i % nb13) * BN;
    rows_tokens(w13[e], r0, std::min(BN, N13 - r0), ax, tok.data() + off[e], (int)(off[e + 1] - off[e]),
                h.data() + (size_t)off[e] * N13 + r0, N13, isa);
  }, b13);
  QAct act(P, I, w2[0].kind == kInt8);  // row p: pair p
  std::vector<int> pe(P);  // pair p's expert
  for (int e = 0; e < E; ++e)
    for (int64_t p = off[e]; p < off[e + 1]; ++p) pe[p] = e;
  parallel_items(P, [&](int64_t r) {
    act_quantize(h.data(), I, act, (int)r, isa, ex.bias13(pe[r]), ex.alpha, ex.limit);
  }, (int64_t)P * I * 16);
  std::vector<int> pid(P);
  for (int p = 0; p < P; ++p) pid[p] = p;
  auto out = torch::zeros({xf.size(0), D}, xf.options());
  float* op = out.data_ptr<float>();
  parallel_items(nbd, [&](int64_t b) {
    float tmp[kTile * BN];
    const int r0 = (int)b * BN, n = std::min(BN, D - r0);
    for (int e = 0; e < E; ++e)  // experts in list order: each token's sum does not depend on threads
      for (int64_t p0 = off[e]; p0 < off[e + 1]; p0 += kTile) {
        const int m = (int)std::min<int64_t>(kTile, off[e + 1] - p0);
        rows_tokens(w2[e], r0, n, act, pid.data() + p0, m, tmp, BN, isa);
        const float* bd = ex.bias2(e);
        for (int k = 0; k < m; ++k) {
          float* o = op + (size_t)tok[p0 + k] * D + r0;
          const float we = pw[p0 + k], *y = tmp + k * BN;
          if (bd)
            for (int i = 0; i < n; ++i) o[i] = o[i] + we * (y[i] + bd[r0 + i]);
          else
            for (int i = 0; i < n; ++i) o[i] = o[i] + we * y[i];
        }
      }
  }, b2);
  return out;
}

// x [T, D], per expert (q13, s13, q2, s2) in the order they are to be summed, weights [T, E] (or
// [T, K] with `cols` naming each expert's column) ->
// sum_e weights[:, e] * down_e(silu(gate_e(x)) * up_e(x)) in fp32, added in list order.
torch::Tensor moe(const torch::Tensor& x, const std::vector<torch::Tensor>& secs, const torch::Tensor& weights,
                  int64_t isa, const std::vector<int64_t>& cols, const std::vector<torch::Tensor>& biases,
                  double alpha, double limit) {
  TORCH_CHECK(secs.size() % 4 == 0 && !secs.empty(), "4 sections per expert");
  const int E = (int)secs.size() / 4;
  std::vector<Weight> w13, w2;
  for (int e = 0; e < E; ++e) {
    w13.push_back(weight(secs[4 * e], secs[4 * e + 1]));
    w2.push_back(weight(secs[4 * e + 2], secs[4 * e + 3]));
  }
  const auto xf = x.to(torch::kFloat).contiguous();
  const auto wt = weights.to(torch::kFloat).contiguous();
  const int T = (int)xf.size(0), D = (int)xf.size(1), N13 = w13[0].N, I = N13 / 2;
  TORCH_CHECK(w13[0].K == D && w2[0].N == D && w2[0].K == I, "record shapes do not match x");
  // cols: the weights column of each expert (the router's slot order), else column e.
  const int Ew = (int)wt.size(1);
  TORCH_CHECK(wt.size(0) == T && (cols.empty() ? Ew == E : (int)cols.size() == E), "weights must be [T, E]");
  for (int64_t c : cols) TORCH_CHECK(c >= 0 && c < Ew, "moe: weight column out of range");
  const Extras ex = extras(biases, E, D, I, alpha, limit);
  isa = resolve(isa);
  if (T > 1) {  // a prompt: every expert takes every row, in token tiles (pairs e * T + t)
    int64_t b13 = 0, b2 = 0;
    for (int e = 0; e < E; ++e) b13 += secs[4 * e].nbytes(), b2 += secs[4 * e + 2].nbytes();
    std::vector<int> tok((size_t)E * T);
    std::vector<int64_t> off(E + 1);
    std::vector<float> pw((size_t)E * T);
    for (int e = 0; e < E; ++e) {
      off[e + 1] = (int64_t)(e + 1) * T;
      for (int t = 0; t < T; ++t)
        tok[e * T + t] = t, pw[e * T + t] = wt.data_ptr<float>()[t * Ew + (cols.empty() ? e : (int)cols[e])];
    }
    return moe_pairs(xf, w13, w2, tok, off, pw, b13, b2, isa, ex);
  }
  // One token (T == 1): the gate|up rows of each expert, its SiLU*up quantized by the thread that
  // finished its last chunk; then the down rows per (expert, chunk) into y[e], summed per output
  // row in list order at the end (out = 0 + w_0 y_0 + w_1 y_1 ..., the order moe_q8_ref adds).
  // Items are long runs of contiguous rows: each restart of a stream costs a DRAM latency.
  const QAct ax = quantize(xf, false, isa);
  std::vector<float> h((size_t)E * N13), y((size_t)E * D);
  const int nt = std::max(1, at::get_num_threads());
  const int c13 = row_chunks(N13, E, nt), cd = row_chunks(D, E, nt);
  int64_t b13 = 0, b2 = 0;  // weight bytes read (serial below kSerialBytes)
  for (int e = 0; e < E; ++e) b13 += secs[4 * e].nbytes(), b2 += secs[4 * e + 2].nbytes();
  QAct act(E, I, w2[0].kind == kInt8);
  ExpertHandoff handoff(E, c13);
  auto gate_up = [&](int64_t i) {
    const int e = (int)(i / c13);
    float* he = h.data() + (size_t)e * N13;
    chunk_blocks(N13, c13, i % c13, [&](int r0, int n) { rows(w13[e], r0, n, ax, 0, he + r0, isa); });
    handoff.chunk_done(e, [&] { act_quantize(h.data(), I, act, e, isa, ex.bias13(e), ex.alpha, ex.limit); });
  };
  auto down = [&](int64_t i) {
    const int e = (int)(i / cd);
    handoff.wait(e);
    float* ye = y.data() + (size_t)e * D;
    chunk_blocks(D, cd, i % cd, [&](int r0, int n) { rows(w2[e], r0, n, act, e, ye + r0, isa); });
  };
  one_stream((int64_t)E * c13, gate_up, (int64_t)E * cd, down, b13 + b2);
  auto out = torch::zeros({T, D}, xf.options());
  float* op = out.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  for (int e = 0; e < E; ++e) {  // list order: the bits do not depend on threads
    const float we = wp[cols.empty() ? e : (int)cols[e]];
    const float *ye = y.data() + (size_t)e * D, *bd = ex.bias2(e);
    if (bd)
      for (int i = 0; i < D; ++i) op[i] = op[i] + we * (ye[i] + bd[i]);
    else
      for (int i = 0; i < D; ++i) op[i] = op[i] + we * ye[i];
  }
  return out;
}

// Prefill through resident records: x [T, D], per expert (q13, s13, q2, s2) in ascending id,
// expert e taking the rows tok[off[e], off[e+1]) of x with weights pw (fp32 [P]) -> [T, D] fp32,
// each token's experts added in list order: the bits of one `moe` call per expert over its rows,
// summed in that order (StoreExperts._grouped).
torch::Tensor moe_grouped(const torch::Tensor& x, const std::vector<torch::Tensor>& secs, const torch::Tensor& tok,
                          const std::vector<int64_t>& off, const torch::Tensor& pw, int64_t isa,
                          const std::vector<torch::Tensor>& biases, double alpha, double limit) {
  TORCH_CHECK(secs.size() % 4 == 0 && !secs.empty() && off.size() == secs.size() / 4 + 1,
              "moe_grouped: 4 sections per expert and E + 1 offsets");
  const int E = (int)secs.size() / 4;
  std::vector<Weight> w13, w2;
  int64_t b13 = 0, b2 = 0;
  for (int e = 0; e < E; ++e) {
    w13.push_back(weight(secs[4 * e], secs[4 * e + 1]));
    w2.push_back(weight(secs[4 * e + 2], secs[4 * e + 3]));
    b13 += secs[4 * e].nbytes(), b2 += secs[4 * e + 2].nbytes();
  }
  const auto xf = x.to(torch::kFloat).contiguous();
  const auto tk = tok.to(torch::kLong).contiguous();
  const auto wf = pw.to(torch::kFloat).contiguous();
  const int T = (int)xf.size(0), D = (int)xf.size(1), P = (int)tk.numel();
  TORCH_CHECK(w13[0].K == D && w2[0].N == D && w2[0].K == w13[0].N / 2, "record shapes do not match x");
  TORCH_CHECK(off[0] == 0 && off[E] == P && wf.numel() == P, "moe_grouped: offsets must cover the P pairs");
  for (int e = 0; e < E; ++e) TORCH_CHECK(off[e] <= off[e + 1], "moe_grouped: offsets must not decrease");
  std::vector<int> t32(P);
  for (int p = 0; p < P; ++p) {
    t32[p] = (int)tk.data_ptr<int64_t>()[p];
    TORCH_CHECK(t32[p] >= 0 && t32[p] < T, "moe_grouped: token index out of range");
  }
  const Extras ex = extras(biases, E, D, w13[0].N / 2, alpha, limit);
  return moe_pairs(xf, w13, w2, t32, off, std::vector<float>(wf.data_ptr<float>(), wf.data_ptr<float>() + P), b13,
                   b2, resolve(isa), ex);
}


// ---- fused one-token decode ops (fp32; the references are the model's torch code) ----------------
// Every float sum below runs in one fixed order whatever the ISA or thread count: a length-n dot
// keeps 32 lane partials (lane l takes elements i = l mod 32 of the first n - n mod 32, multiply
// then add, no FMA; four independent vector chains on AVX2, so the adds do not wait on each
// other), folds them as ((p0 + p1) + (p2 + p3)) lane by lane, sums those 8 lanes as
// ((0+1)+(2+3))+((4+5)+(6+7)), then adds the tail in order; so the AVX2 and scalar variants agree
// bit for bit, and the slot cache, mmap and resident providers (which share these ops) too.

float dot_scalar(const float* a, const float* b, int n) {
  float l[32] = {};
  int i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 32; ++j) l[j] = l[j] + a[i + j] * b[i + j];
  float f[8];
  for (int j = 0; j < 8; ++j) f[j] = (l[j] + l[8 + j]) + (l[16 + j] + l[24 + j]);
  float acc = lanes_sum(f);
  for (; i < n; ++i) acc = acc + a[i] * b[i];
  return acc;
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int n) {
  __m256 v0 = _mm256_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    v0 = _mm256_add_ps(v0, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    v1 = _mm256_add_ps(v1, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    v2 = _mm256_add_ps(v2, _mm256_mul_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16)));
    v3 = _mm256_add_ps(v3, _mm256_mul_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24)));
  }
  float f[8];
  _mm256_storeu_ps(f, _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
  float acc = lanes_sum(f);
  for (; i < n; ++i) acc = acc + a[i] * b[i];
  return acc;
}

float dot(const float* a, const float* b, int n, int64_t isa) {
  return isa >= kAvx2 ? dot_avx2(a, b, n) : dot_scalar(a, b, n);
}

// y = w * (x * (1 / sqrt(mean(x^2) + eps))) over rows of n; w may be null (no weight).
void rms_row(const float* x, const float* w, float eps, int n, float* y, int64_t isa) {
  const float r = 1.f / std::sqrt(dot(x, x, n, isa) / (float)n + eps);
  for (int i = 0; i < n; ++i) y[i] = w ? w[i] * (x[i] * r) : x[i] * r;
}

// x [T, D] fp32, w [D] -> [T, D]: RMSNorm (normalise in fp32, then the weight).
torch::Tensor rmsnorm(const torch::Tensor& x, const torch::Tensor& w, double eps, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  w.is_contiguous() && x.dim() == 2 && w.numel() == x.size(1),
              "rmsnorm: x [T, D] and w [D], fp32 and contiguous");
  isa = resolve(isa);
  auto y = torch::empty_like(x);
  const int D = (int)x.size(1);
  for (int64_t t = 0; t < x.size(0); ++t)
    rms_row(x.data_ptr<float>() + t * D, w.data_ptr<float>(), (float)eps, D, y.data_ptr<float>() + t * D, isa);
  return y;
}

// One q or k head of a decode token: RMSNorm with its weight row (nw null: none), then RoPE as
// models/layers.py: apply_rope (x cos + roll(x, rd / 2) sin over the first rd dims) -> y [hd].
void rope_head(const float* x, const float* nw, float eps, const float* cs, const float* sn, int rd, int hd,
               float* tmp, float* y, int64_t isa) {
  if (nw)
    rms_row(x, nw, eps, hd, tmp, isa);
  else
    std::memcpy(tmp, x, hd * sizeof(float));
  for (int i = 0; i < rd; ++i) y[i] = tmp[i] * cs[i] + tmp[(i + rd / 2) % rd] * sn[i];
  for (int i = rd; i < hd; ++i) y[i] = tmp[i];
}

// One query head q [hd] over S cached keys K / values V [S, hd]: scores dot * scaling, softmax in
// fp32 (max subtracted), then sum_j p_j v_j in key order -> o [hd].
// sink: the head's learned logit (gpt-oss), one more term of the softmax that weighs no value
// (nullptr: none): max over the scores and it, its exp added to the sum after the keys'.
void attend_head(const float* q, const float* K, const float* V, int S, int hd, float scaling, float* o,
                 int64_t isa, const float* sink = nullptr) {
  std::vector<float> p(S);
  float m = sink ? *sink : -INFINITY;
  for (int j = 0; j < S; ++j) m = std::max(m, p[j] = dot(q, K + (size_t)j * hd, hd, isa) * scaling);
  float sum = 0.f;
  for (int j = 0; j < S; ++j) sum = sum + (p[j] = std::exp(p[j] - m));
  if (sink) sum = sum + std::exp(*sink - m);
  std::fill(o, o + hd, 0.f);
  for (int j = 0; j < S; ++j) {
    const float pj = p[j] / sum;
    const float* v = V + (size_t)j * hd;
    for (int i = 0; i < hd; ++i) o[i] = o[i] + pj * v[i];
  }
}

// One decode token's attention after the q/k/v projection (GQA, RoPE with a signed sin table as
// models/layers.py: apply_rope, optional per-head q/k RMSNorm with weights side by side):
// qkv [1, (H + 2 Hkv) hd] -> out [1, H hd]; k and v are written into the caches kc, vc [Hkv, M, hd]
// at `pos` first. Keys [lo, pos] are attended (lo = pos - window + 1 with a sliding window).
// Scores are dot * scaling, softmax in fp32 (max subtracted; with `sinks` [H], each head's sink
// logit in it too: attend_head), then sum_j p_j v_j in key order.
torch::Tensor attend(const torch::Tensor& qkv, const c10::optional<torch::Tensor>& qk_w, double eps,
                     const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor kc, torch::Tensor vc,
                     int64_t pos, double scaling, int64_t window, int64_t H, int64_t Hkv, int64_t isa,
                     const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(kc.dim() == 3 && vc.sizes() == kc.sizes() && kc.is_contiguous() && vc.is_contiguous() &&
                  kc.scalar_type() == torch::kFloat && vc.scalar_type() == torch::kFloat,
              "attend: caches must be fp32 [Hkv, M, hd], contiguous");
  const int hd = (int)kc.size(2), M = (int)kc.size(1), rd = (int)cos.numel();
  TORCH_CHECK(kc.size(0) == Hkv && H % Hkv == 0 && pos >= 0 && pos < M, "attend: heads or position out of range");
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat && qkv.is_contiguous() && qkv.numel() == (H + 2 * Hkv) * hd,
              "attend: qkv must be fp32 [1, (H + 2 Hkv) hd]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && sin.numel() == rd && rd % 2 == 0 && rd <= hd,
              "attend: cos/sin must be fp32 [rd], rd even and <= hd");
  const float* nw = nullptr;
  if (qk_w.has_value()) {
    TORCH_CHECK(qk_w->scalar_type() == torch::kFloat && qk_w->is_contiguous() && qk_w->numel() == (H + Hkv) * hd,
                "attend: q/k norm weights must be fp32 [H + Hkv, hd]");
    nw = qk_w->data_ptr<float>();
  }
  const float* sk = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == torch::kFloat && sinks->is_contiguous() && sinks->numel() == H,
                "attend: sinks must be fp32 [H]");
    sk = sinks->data_ptr<float>();
  }
  isa = resolve(isa);
  const float* src = qkv.data_ptr<float>();
  const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
  std::vector<float> qk((size_t)(H + Hkv) * hd), tmp(hd);
  for (int h = 0; h < H + Hkv; ++h)
    rope_head(src + (size_t)h * hd, nw ? nw + (size_t)h * hd : nullptr, (float)eps, cs, sn, rd, hd, tmp.data(),
              qk.data() + (size_t)h * hd, isa);
  float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  for (int h = 0; h < Hkv; ++h) {
    std::memcpy(kp + ((size_t)h * M + pos) * hd, qk.data() + (size_t)(H + h) * hd, hd * sizeof(float));
    std::memcpy(vp + ((size_t)h * M + pos) * hd, src + (size_t)(H + Hkv + h) * hd, hd * sizeof(float));
  }
  const int lo = window > 0 ? (int)std::max<int64_t>(0, pos - window + 1) : 0, S = (int)pos + 1 - lo;
  const int G = (int)(H / Hkv);
  auto out = torch::empty({1, H * hd}, qkv.options());
  float* op = out.data_ptr<float>();
  auto head = [&](int h) {
    const size_t kv = ((size_t)(h / G) * M + lo) * hd;
    attend_head(qk.data() + (size_t)h * hd, kp + kv, vp + kv, S, hd, (float)scaling, op + (size_t)h * hd, isa,
                sk ? sk + h : nullptr);
  };
  // Threads only where the keys outweigh waking them (~10 us): a head is S * hd * 4 multiply-adds.
  if ((int64_t)H * S * hd < (1 << 20)) {
    for (int h = 0; h < H; ++h) head(h);
  } else {
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) head((int)h);
    });
  }
  return out;
}

// Router scores s [E] (dots, overwritten) -> softmax in fp32 (max subtracted), the k largest in
// descending order (ties: lower id first) -> w [k] (renormalised to sum 1 when `renorm`), ids [k].
void route_pick(float* s, int E, int k, bool renorm, float* w, int64_t* ids) {
  float m = -INFINITY, sum = 0.f;
  for (int e = 0; e < E; ++e) m = std::max(m, s[e]);
  for (int e = 0; e < E; ++e) sum = sum + (s[e] = std::exp(s[e] - m));
  for (int e = 0; e < E; ++e) s[e] = s[e] / sum;
  std::vector<int> idx(E);
  for (int e = 0; e < E; ++e) idx[e] = e;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int a, int b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
  float tot = 0.f;
  for (int i = 0; i < k; ++i) tot = tot + s[idx[i]];
  for (int i = 0; i < k; ++i) {
    w[i] = renorm ? s[idx[i]] / tot : s[idx[i]];
    ids[i] = idx[i];
  }
}

// gpt-oss's rule: logits s [E] (bias added) -> the k largest in descending order (ties: lower id
// first) -> w [k] their softmax in fp32 (max subtracted: the first), ids [k].
void route_pick_logits(const float* s, int E, int k, float* w, int64_t* ids) {
  std::vector<int> idx(E);
  for (int e = 0; e < E; ++e) idx[e] = e;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int a, int b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
  const float m = s[idx[0]];
  float sum = 0.f;
  for (int i = 0; i < k; ++i) sum = sum + (w[i] = std::exp(s[idx[i]] - m));
  for (int i = 0; i < k; ++i) {
    w[i] = w[i] / sum;
    ids[i] = idx[i];
  }
}

// The top-k router for one token: x [1, D], gate [E, D] fp32 -> (weights [1, k] fp32, ids [1, k]
// int64). By default probabilities fp32 softmax over all E (max subtracted), the k largest in
// descending order (ties: lower id first), renormalised to sum 1 when `renorm`; `topk_first`
// (gpt-oss): the logits plus `bias` [E], their k largest, softmax over those k (route_pick_logits).
std::vector<torch::Tensor> route(const torch::Tensor& x, const torch::Tensor& gate, int64_t k, bool renorm,
                                 int64_t isa, const c10::optional<torch::Tensor>& bias, bool topk_first) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && gate.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  gate.is_contiguous() && x.numel() == gate.size(1) && gate.dim() == 2,
              "route: x [1, D] and gate [E, D], fp32 and contiguous");
  const int E = (int)gate.size(0), D = (int)gate.size(1);
  TORCH_CHECK(k > 0 && k <= E, "route: k must be in [1, E]");
  isa = resolve(isa);
  std::vector<float> s(E);
  const float *xp = x.data_ptr<float>(), *gp = gate.data_ptr<float>();
  // Two threads read a 1 MB-class gate from DRAM at about twice the rate of one.
  parallel_items((E + 15) / 16, [&](int64_t c) {
    for (int64_t e = c * 16; e < std::min<int64_t>(E, c * 16 + 16); ++e) s[e] = dot(xp, gp + (size_t)e * D, D, isa);
  }, gate.nbytes());
  auto w = torch::empty({1, k}, x.options());
  auto ids = torch::empty({1, k}, x.options().dtype(torch::kLong));
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == E,
                "route: bias must be fp32 [E]");
    const float* b = bias->data_ptr<float>();
    for (int e = 0; e < E; ++e) s[e] = s[e] + b[e];
  }
  if (topk_first)
    route_pick_logits(s.data(), E, (int)k, w.data_ptr<float>(), ids.data_ptr<int64_t>());
  else
    route_pick(s.data(), E, (int)k, renorm, w.data_ptr<float>(), ids.data_ptr<int64_t>());
  return {w, ids};
}
// ---- the whole one-token decode step: every decoder layer in one native call ----------------------
// The per-module fused path (models/layers.py with fused_decode on) calls rmsnorm, linear, attend,
// linear, rmsnorm, route and moe once each per layer from Python: ~200 us of dispatch and wake-ups
// per layer. DecodeStep runs the same functions in the same order on the same data for every layer
// inside one OpenMP region: the threads stay awake between phases (Worker). Every output
// element is computed by exactly the code the per-module path runs, so the bits are that path's
// (tests/test_native_step.py), whatever the thread count.

// One decoder layer's weights (views of the model's tensors, kept alive by `keep`).
struct StepLayer {
  std::vector<torch::Tensor> keep;
  const float *in_w = nullptr, *post_w = nullptr, *qk_w = nullptr, *qkv_b = nullptr, *o_b = nullptr;
  const float *gate = nullptr, *gate_b = nullptr, *sinks = nullptr;
  float in_eps = 0, post_eps = 0, qk_eps = 0, scaling = 1;
  bool topk_first = false;  // gpt-oss's router: route_pick_logits
  Extras ex;  // gpt-oss's expert biases and clamped SwiGLU (none: plain SwiGLU)
  std::vector<Weight> qkv;  // q/k/v as one fused weight, or three (their formats differ: Q4_K_M)
  std::vector<int> qkv_off;  // each part's first row of the q/k/v output
  Weight o{};
  bool qkv_wide = false, o_wide = false, renorm = false;
  int window = 0;
  std::vector<Weight> w13, w2;  // by expert id
};

const float* opt_f32(const c10::optional<torch::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->numel() == n,
              "decode step: ", what, " must be fp32, contiguous, ", n, " values");
  return t->data_ptr<float>();
}

class DecodeStep {
 public:
  int D = 0, H = 0, Hkv = 0, hd = 0, E = 0, k = 0, I = 0;
  double expert_seconds = 0;  // time in the routed experts' phases (the providers' compute_seconds)

  int64_t layers() const { return (int64_t)L.size(); }

  void add_layer(const torch::Tensor& in_w, double in_eps, const std::vector<torch::Tensor>& qkv_parts,
                 const c10::optional<torch::Tensor>& qkv_b, bool qkv_wide, const c10::optional<torch::Tensor>& qk_w,
                 double qk_eps, const torch::Tensor& o_q, const torch::Tensor& o_s,
                 const c10::optional<torch::Tensor>& o_b, bool o_wide, const torch::Tensor& post_w, double post_eps,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, int64_t window,
                 const torch::Tensor& gate, int64_t top_k, bool renorm, const std::vector<torch::Tensor>& experts,
                 const c10::optional<torch::Tensor>& sinks, const c10::optional<torch::Tensor>& gate_b,
                 bool topk_first, const std::vector<torch::Tensor>& expert_biases, double alpha, double limit) {
    StepLayer l;
    TORCH_CHECK(qkv_parts.size() == 2 || qkv_parts.size() == 6, "decode step: q/k/v as one or three (q, s) pairs");
    int nqkv = 0;
    for (size_t i = 0; i < qkv_parts.size(); i += 2) {
      l.qkv.push_back(weight(qkv_parts[i], qkv_parts[i + 1]));
      l.qkv_off.push_back(nqkv);
      nqkv += l.qkv.back().N;
      TORCH_CHECK(l.qkv.back().K == l.qkv[0].K, "decode step: q, k and v must read the same width");
      TORCH_CHECK(!qkv_wide || l.qkv.back().kind == kInt8, "int16 activations are for int8 weights");
    }
    l.o = weight(o_q, o_s);
    const int d = l.qkv[0].K;
    TORCH_CHECK(gate.dim() == 2 && gate.scalar_type() == torch::kFloat && gate.is_contiguous() && gate.size(1) == d,
                "decode step: the router must be fp32 [E, D]");
    TORCH_CHECK(!experts.empty() && experts.size() == 4 * (size_t)gate.size(0), "decode step: 4 tensors per expert");
    const int e_n = (int)gate.size(0);
    if (L.empty()) {
      D = d, H = (int)heads, Hkv = (int)kv_heads, hd = (int)head_dim, E = e_n, k = (int)top_k;
    }
    TORCH_CHECK(d == D && heads == H && kv_heads == Hkv && head_dim == hd && e_n == E && top_k == k,
                "decode step: every layer must have the same shapes");
    TORCH_CHECK(H % Hkv == 0 && k > 0 && k <= E, "decode step: heads or top-k out of range");
    TORCH_CHECK(nqkv == (H + 2 * Hkv) * hd && l.o.K == H * hd && l.o.N == D,
                "decode step: q/k/v and o projection shapes do not match the heads");
    for (int e = 0; e < E; ++e) {
      l.w13.push_back(weight(experts[4 * e], experts[4 * e + 1]));
      l.w2.push_back(weight(experts[4 * e + 2], experts[4 * e + 3]));
      const Weight &a = l.w13.back(), &b = l.w2.back();
      if (I == 0) I = b.K;
      // one layer's records share a layout (layers may differ: a kept Q4_K_M file's do)
      TORCH_CHECK(a.K == D && a.N == 2 * I && b.N == D && b.K == I && a.kind == l.w13[0].kind &&
                      b.kind == l.w2[0].kind,
                  "decode step: a layer's expert records must share one shape and scheme");
    }
    TORCH_CHECK(!o_wide || l.o.kind == kInt8, "int16 activations are for int8 weights");
    TORCH_CHECK(L.empty() || (qkv_wide == L[0].qkv_wide && o_wide == L[0].o_wide),
                "decode step: every layer must take the same activation widths");
    l.in_w = opt_f32(in_w, D, "the input norm weight");
    l.post_w = opt_f32(post_w, D, "the post-attention norm weight");
    l.qk_w = opt_f32(qk_w, (int64_t)(H + Hkv) * hd, "the q/k norm weights");
    l.qkv_b = opt_f32(qkv_b, nqkv, "the q/k/v bias");
    l.o_b = opt_f32(o_b, D, "the o bias");
    l.gate = gate.data_ptr<float>();
    l.sinks = opt_f32(sinks, H, "the attention sinks");
    l.gate_b = opt_f32(gate_b, E, "the router bias");
    l.topk_first = topk_first;
    l.ex = extras(expert_biases, E, D, I, alpha, limit);
    l.in_eps = (float)in_eps, l.post_eps = (float)post_eps, l.qk_eps = (float)qk_eps;
    l.scaling = (float)scaling, l.window = (int)window, l.renorm = renorm;
    l.qkv_wide = qkv_wide, l.o_wide = o_wide;
    l.keep = {in_w, o_q, o_s, post_w, gate};
    l.keep.insert(l.keep.end(), qkv_parts.begin(), qkv_parts.end());
    for (const auto* t : {&qkv_b, &qk_w, &o_b, &sinks, &gate_b})
      if (t->has_value()) l.keep.push_back(**t);
    l.keep.insert(l.keep.end(), experts.begin(), experts.end());
    l.keep.insert(l.keep.end(), expert_biases.begin(), expert_biases.end());
    L.push_back(std::move(l));
  }

  // x [1, D] fp32 (the embedding's row) at position pos, cos/sin [rd] that position's RoPE row, the
  // caches kcs/vcs [Hkv, M, hd] per layer -> the residual stream after the last layer, [1, D].
  torch::Tensor run(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& kcs, const std::vector<torch::Tensor>& vcs, int64_t pos,
                    int64_t isa) {
    TORCH_CHECK(!L.empty(), "decode step: no layers");
    TORCH_CHECK(x_in.scalar_type() == torch::kFloat && x_in.numel() == D, "decode step: x must be fp32 [1, D]");
    const int rd = (int)cos.numel();
    TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
                    sin.is_contiguous() && sin.numel() == rd && rd % 2 == 0 && rd <= hd,
                "decode step: cos/sin must be fp32 [rd], rd even and <= hd");
    TORCH_CHECK(kcs.size() == L.size() && vcs.size() == L.size(), "decode step: one k and v cache per layer");
    for (size_t i = 0; i < L.size(); ++i) {
      const auto &kc = kcs[i], &vc = vcs[i];
      TORCH_CHECK(kc.dim() == 3 && vc.sizes() == kc.sizes() && kc.is_contiguous() && vc.is_contiguous() &&
                      kc.scalar_type() == torch::kFloat && vc.scalar_type() == torch::kFloat &&
                      kc.size(0) == Hkv && kc.size(2) == hd && pos >= 0 && pos < kc.size(1),
                  "decode step: caches must be fp32 [Hkv, M, hd], contiguous, with pos < M");
    }
    isa = resolve(isa);
    auto x = x_in.to(torch::kFloat).contiguous().clone().view({1, D});
    float* xp = x.data_ptr<float>();
    const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
    const int Nqkv = (H + 2 * Hkv) * hd, N13 = 2 * I, G = H / Hkv;
    // Shared between the threads: the q/k/v, attention, score, expert and output buffers. The
    // norms, the router's pick and the activations entering q/k/v and the experts are each
    // thread's own (Worker's prep: the same code on the same data, so the same bits).
    std::vector<float> qkv(Nqkv), qk((size_t)(H + Hkv) * hd), att((size_t)H * hd), sc(E), hx((size_t)k * N13), y(D), yk((size_t)k * D);
    // the down projections' input, per layer in its weights' width (int16 for int8 weights, as
    // native.moe quantizes it): a buffer for each width some layer takes (the other one empty)
    bool wide = false, narrow = false;
    for (const StepLayer& l : L) (l.w2[0].kind == kInt8 ? wide : narrow) = true;
    QAct ao(1, H * hd, L[0].o_wide), act8(narrow ? k : 0, I, false), act16(wide ? k : 0, I, true);
    // o's activation blocks line up with a KV group's heads: each group quantizes its own
    const bool group_blocks = (G * hd) % kG == 0;
    constexpr int kPhasesPerLayer = 7;
    Phases phases((int64_t)L.size() * kPhasesPerLayer);
    const int nt = std::max(1, at::get_num_threads()), nbd = (D + BN - 1) / BN;
    const int cd1 = row_chunks(D, 1, nt), c13 = row_chunks(N13, k, nt), cd = row_chunks(D, k, nt);
    ExpertHandoff handoff(L.size() * k, c13);  // slot li * k + e: layer li's e-th routed expert
    double expert_s = 0;
#pragma omp parallel num_threads(nt)
    {
      Worker w{phases, omp_get_thread_num()};
      std::vector<float> h(D), tmp(hd), we(k), s(E);
      std::vector<int64_t> ids(k);
      std::vector<int> order(k);  // the picked experts' slots by ascending id
      QAct aq(1, D, L[0].qkv_wide), ax(1, D, false);
      for (size_t li = 0; li < L.size(); ++li) {
        const StepLayer& l = L[li];
        QAct& act = l.w2[0].kind == kInt8 ? act16 : act8;
        const int M = (int)kcs[li].size(1);
        float *kp = kcs[li].data_ptr<float>(), *vp = vcs[li].data_ptr<float>();
        // input norm, q/k/v (+ bias): native.rmsnorm, then QuantLinear -> native.linear
        auto norm_in = [&] {
          rms_row(xp, l.in_w, l.in_eps, D, h.data(), isa);
          quantize_row(h.data(), aq, 0, isa);
        };
        // (chunks of each part's rows: three parts when q/k/v's formats differ)
        int cq[3] = {}, nq = 0;
        for (size_t p = 0; p < l.qkv.size(); ++p) nq += cq[p] = row_chunks(l.qkv[p].N, 1, nt);
        w.items(nq, norm_in, [&](int64_t c) {
          size_t p = 0;
          for (; c >= cq[p]; ++p) c -= cq[p];
          const int off = l.qkv_off[p];
          chunk_blocks(l.qkv[p].N, cq[p], c, [&](int r0, int n) {
            rows(l.qkv[p], r0, n, aq, 0, qkv.data() + off + r0, isa);
            if (l.qkv_b)
              for (int i = off + r0; i < off + r0 + n; ++i) qkv[i] = qkv[i] + l.qkv_b[i];
          });
        });
        // native.attend per KV group: its k head normed, rotated and written with v at pos, then
        // its q heads normed, rotated and attending keys [lo, pos]
        const int lo = l.window > 0 ? (int)std::max<int64_t>(0, pos - l.window + 1) : 0, S = (int)pos + 1 - lo;
        auto head = [&](int hi) {
          rope_head(qkv.data() + (size_t)hi * hd, l.qk_w ? l.qk_w + (size_t)hi * hd : nullptr, l.qk_eps, cs, sn, rd,
                    hd, tmp.data(), qk.data() + (size_t)hi * hd, isa);
        };
        w.items(Hkv, [&](int64_t g) {
          head((int)(H + g));
          std::memcpy(kp + ((size_t)g * M + pos) * hd, qk.data() + (size_t)(H + g) * hd, hd * sizeof(float));
          std::memcpy(vp + ((size_t)g * M + pos) * hd, qkv.data() + (size_t)(H + Hkv + g) * hd, hd * sizeof(float));
          const size_t kv = ((size_t)g * M + lo) * hd;
          for (int hi = (int)g * G; hi < (int)(g + 1) * G; ++hi) {
            head(hi);
            attend_head(qk.data() + (size_t)hi * hd, kp + kv, vp + kv, S, hd, l.scaling, att.data() + (size_t)hi * hd,
                        isa, l.sinks ? l.sinks + hi : nullptr);
          }
          if (group_blocks) quantize_row(att.data(), ao, 0, isa, (int)g * G * hd / kG, (int)(g + 1) * G * hd / kG);
        });
        w.items(group_blocks ? 0 : 1, [&](int64_t) { quantize_row(att.data(), ao, 0, isa); });
        w.items(cd1, [&](int64_t c) {
          chunk_blocks(D, cd1, c, [&](int r0, int n) {
            float t2[BN];
            rows(l.o, r0, n, ao, 0, t2, isa);
            for (int i = 0; i < n; ++i) xp[r0 + i] = xp[r0 + i] + (l.o_b ? t2[i] + l.o_b[r0 + i] : t2[i]);
          });
        });
        // post-attention norm and the router: native.rmsnorm, then native.route
        bool normed = false, picked = false;
        auto norm_post = [&] {
          if (!normed) rms_row(xp, l.post_w, l.post_eps, D, h.data(), isa), normed = true;
        };
        w.items((E + 15) / 16, norm_post, [&](int64_t c) {
          for (int e = (int)c * 16; e < std::min(E, (int)c * 16 + 16); ++e)
            sc[e] = dot(h.data(), l.gate + (size_t)e * D, D, isa);
        });
        const double t0 = w.tid == 0 ? now_s() : 0;
        auto pick = [&] {
          if (picked) return;
          std::copy(sc.begin(), sc.end(), s.begin());  // route_pick overwrites its scores
          if (l.gate_b)  // (native.route's order: every dot, then its bias)
            for (int e = 0; e < E; ++e) s[e] = s[e] + l.gate_b[e];
          if (l.topk_first)
            route_pick_logits(s.data(), E, k, we.data(), ids.data());
          else
            route_pick(s.data(), E, k, l.renorm, we.data(), ids.data());
          for (int i = 0; i < k; ++i) order[i] = i;
          std::sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
          picked = true;
        };
        // the routed experts as native.moe over ascending ids: per expert gate+up and its SiLU*up
        // quantized, then the down rows with the weighted sum in that order
        auto expert_in = [&] {
          norm_post();
          pick();
          quantize_row(h.data(), ax, 0, isa);
        };
        // gate|up per (expert, chunk of c13); its SiLU*up by the thread that finishes its last chunk
        auto gate_up = [&](int64_t i) {
          const int e = (int)(i / c13);
          const Weight& w13 = l.w13[ids[order[e]]];
          float* he = hx.data() + (size_t)e * N13;
          chunk_blocks(N13, c13, i % c13, [&](int r0, int n) { rows(w13, r0, n, ax, 0, he + r0, isa); });
          handoff.chunk_done(li * k + e, [&] {
            act_quantize(hx.data(), I, act, e, isa, l.ex.bias13((int)ids[order[e]]), l.ex.alpha, l.ex.limit);
          });
        };
        // down rows per (expert, chunk of cd): long contiguous runs, each restart of a stream
        // costs a DRAM latency; then every row's weighted sum in ascending id, as native.moe
        auto down = [&](int64_t i) {
          const int e = (int)(i / cd);
          handoff.wait(li * k + e);
          const Weight& w2 = l.w2[ids[order[e]]];
          float* ye = yk.data() + (size_t)e * D;
          chunk_blocks(D, cd, i % cd, [&](int r0, int n) { rows(w2, r0, n, act, e, ye + r0, isa); });
        };
        // one stream of items, no barrier between gate|up and down (as native.moe's one_stream)
        const int64_t n13 = (int64_t)k * c13;
        w.items(n13 + (int64_t)k * cd, expert_in, [&](int64_t i) { i < n13 ? gate_up(i) : down(i - n13); });
        w.items(nbd, pick, [&](int64_t b) {
          const int r0 = (int)b * BN, n = std::min(BN, D - r0);
          float* o = y.data() + r0;
          std::fill(o, o + n, 0.f);
          for (int e = 0; e < k; ++e) {
            const float wt = we[order[e]], *t2 = yk.data() + (size_t)e * D + r0;
            const float* bd = l.ex.bias2((int)ids[order[e]]);
            if (bd)  // (native.moe's: the down bias, then the weight)
              for (int i = 0; i < n; ++i) o[i] = o[i] + wt * (t2[i] + bd[r0 + i]);
            else
              for (int i = 0; i < n; ++i) o[i] = o[i] + wt * t2[i];
          }
          for (int i = 0; i < n; ++i) xp[r0 + i] = xp[r0 + i] + o[i];
        });
        if (w.tid == 0) expert_s += now_s() - t0;
      }
    }
    expert_seconds += expert_s;
    return x;
  }

 private:
  std::vector<StepLayer> L;
  static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
};
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x [T, K] through one int4/int8/q4_0/q4_1 weight -> [T, N] fp32");
  m.def("moe", &moe, "weighted sum of experts over record sections -> [T, D] fp32", py::arg("x"), py::arg("secs"),
        py::arg("weights"), py::arg("isa"), py::arg("cols") = std::vector<int64_t>{},
        py::arg("biases") = std::vector<torch::Tensor>{}, py::arg("alpha") = 0.0, py::arg("limit") = 0.0);
  m.def("moe_grouped", &moe_grouped, "a prefill's experts over their token groups -> [T, D] fp32", py::arg("x"),
        py::arg("secs"), py::arg("tok"), py::arg("off"), py::arg("pw"), py::arg("isa"),
        py::arg("biases") = std::vector<torch::Tensor>{}, py::arg("alpha") = 0.0, py::arg("limit") = 0.0);
  m.def("_set_token_tile", [](int64_t n) { g_token_tile = n; }, "activation rows per pass, 0 default (benchmarks)");
  m.def("_set_prefetch", [](int64_t d) { g_prefetch = d; }, "prefetch distance in bytes, 0 off (benchmarks)");
  m.def("rmsnorm", &rmsnorm, "x [T, D] fp32 RMSNorm with weight w [D]");
  m.def("attend", &attend, "one decode token's attention after q/k/v (norm, rope, cache write, GQA)",
        py::arg("qkv"), py::arg("qk_w"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("kc"), py::arg("vc"),
        py::arg("pos"), py::arg("scaling"), py::arg("window"), py::arg("H"), py::arg("Hkv"), py::arg("isa"),
        py::arg("sinks") = py::none());
  m.def("route", &route, "top-k router of one token -> (weights, ids)", py::arg("x"), py::arg("gate"), py::arg("k"),
        py::arg("renorm"), py::arg("isa"), py::arg("bias") = py::none(), py::arg("topk_first") = false);
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("run", &DecodeStep::run)
      .def_property_readonly("layers", &DecodeStep::layers)
      .def_readonly("expert_seconds", &DecodeStep::expert_seconds);
  m.def("best_isa", [] { return resolve(-1); }, "0 scalar, 1 avx2, 2 avx512 (VNNI + VBMI)");
}
