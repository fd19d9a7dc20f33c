// Matrix products of a few rows (decode steps) that read GGUF Q4_1 and Q8_0 weights as they
// are stored, dequantizing in registers (built and called like gemv.cpp; C ABI, ctypes).
//
//   splitserve_qgemv_pack(packed, raw, type, out_features, in_features)
//     raw     [out_features][in_features / 32] GGUF blocks of `type` (3 = Q4_1, 8 = Q8_0),
//             row-major as in the file: a Q4_1 block is d (f16), m (f16), 16 bytes whose low
//             nibbles are inputs 0-15 and high nibbles 16-31; a Q8_0 block is d (f16) and 32
//             int8. Weight value: d * q + m (Q4_1), d * q (Q8_0).
//     packed  one group per (block of 16 outputs, block of 32 inputs), output blocks outer,
//             each output block's groups one contiguous stretch (Q4_1Group, Q8_0Group below:
//             the same bytes per weight as the file, laid out so that a register's 16 lanes
//             are 16 outputs)
//   splitserve_qgemv(out, out_f32, x, x_f32, rows, packed, type, bias, out_features,
//                    in_features, threads)
//     out [rows, out_features] (float32 when out_f32, else bf16) = x [rows, in_features]
//     (float32 when x_f32, else bf16) @ weight.T (+ bias [out], x's dtype, when not null).
//     rows <= kMaxRows; out_features a multiple of 16, in_features of 32. 0 done; -1
//     unsupported arguments (nothing written); -2 this build has neither AVX-512 (F, BW) nor
//     AVX2 + FMA (the caller keeps its dense path); -3 bf16 x or out where this build has no
//     AVX-512 BF16 (float32 x and out only: the avx2 and avx512 levels, as on Zen 3 EPYCs,
//     Skylake-SP and Cascade Lake Xeons).
//
// What is summed (per output o of row r; every row independently of the others of its call,
// so a row's result does not depend on its step's batch):
//   - float32 x: each weight is dequantized in float32 to exactly the value the float32
//     reference holds (gguf's dequantize: d * q + m with one rounding, q * d exact), then
//     sum_i w[o][i] * x[r][i] by fused multiply-adds, even and odd inputs in two sums in
//     input order, added at the end. Only the summation order differs from a float32 matmul
//     over the dequantized weights.
//   - bf16 x: sum_b (d_b * sum_{i in b} q_i * x_i [+ m_b * sum_{i in b} x_i for Q4_1]), the
//     block's products by vdpbf16ps on the integers q (exact in bf16; q * x exact in
//     float32), Q4_1's x sums in float32 in input order. The weights are the file's exactly;
//     the rounding differs from the dense bf16 path, which rounds each weight to bf16.
//
// Why: a decode step reads every weight once per step, and SmolLM2-135M's projections are
// 5 bits a weight in Q4_1 (8.5 in Q8_0) against 16 in bf16.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPLITSERVE_AVX512 1  // the float32 paths (float32 x and out)
#if defined(__AVX512BF16__)
#define SPLITSERVE_AVX512_BF16 1  // the bf16 paths too (bf16 x or out)
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPLITSERVE_AVX2 1  // the float32 paths in 8-lane registers (float32 x and out)
#endif

namespace {

constexpr int64_t kOutBlock = 16;  // outputs per group: one register's lanes
constexpr int64_t kInBlock = 32;  // inputs per GGUF block
constexpr int64_t kMaxRows = 32;
constexpr int64_t kGroupRows = 8;  // rows whose accumulators share the registers
constexpr int64_t kAhead = 4096;  // software prefetch distance in the packed weight, bytes
constexpr int kTypeQ4_1 = 3;  // ggml's type ids
constexpr int kTypeQ8_0 = 8;

struct Q4_1Group {  // 16 outputs x 32 inputs, 320 bytes
  uint16_t d[kOutBlock];  // f16 scale per output
  uint16_t m[kOutBlock];  // f16 minimum per output
  uint8_t q[kInBlock / 2][kOutBlock];  // q[k][j]: output j's inputs 2k (low nibble), 2k+1 (high)
};
struct Q8_0Group {  // 16 outputs x 32 inputs, 544 bytes
  uint16_t d[kOutBlock];  // f16 scale per output
  int8_t q[kInBlock][kOutBlock];  // q[i][j]: output j's input i
};
static_assert(sizeof(Q4_1Group) == 320 && sizeof(Q8_0Group) == 544, "group layout");
constexpr int64_t kQ4_1RawBlock = 20;  // bytes of one GGUF block
constexpr int64_t kQ8_0RawBlock = 34;

uint16_t raw_u16(const uint8_t* p) {
  uint16_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

void pack_q4_1(Q4_1Group* packed, const uint8_t* raw, int64_t out_features, int64_t in_features) {
  const int64_t blocks = in_features / kInBlock;
  for (int64_t o = 0; o < out_features; ++o) {
    const int64_t ob = o / kOutBlock, lane = o % kOutBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = raw + (o * blocks + b) * kQ4_1RawBlock;
      Q4_1Group& group = packed[ob * blocks + b];
      group.d[lane] = raw_u16(block);
      group.m[lane] = raw_u16(block + 2);
      const uint8_t* qs = block + 4;
      for (int k = 0; k < kInBlock / 2; ++k) {
        const int i0 = 2 * k, i1 = 2 * k + 1;  // inputs i < 16 low nibble of qs[i], else high
        const int q0 = i0 < 16 ? qs[i0] & 0xF : qs[i0 - 16] >> 4;
        const int q1 = i1 < 16 ? qs[i1] & 0xF : qs[i1 - 16] >> 4;
        group.q[k][lane] = static_cast<uint8_t>(q0 | (q1 << 4));
      }
    }
  }
}

void pack_q8_0(Q8_0Group* packed, const uint8_t* raw, int64_t out_features, int64_t in_features) {
  const int64_t blocks = in_features / kInBlock;
  for (int64_t o = 0; o < out_features; ++o) {
    const int64_t ob = o / kOutBlock, lane = o % kOutBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = raw + (o * blocks + b) * kQ8_0RawBlock;
      Q8_0Group& group = packed[ob * blocks + b];
      group.d[lane] = raw_u16(block);
      for (int i = 0; i < kInBlock; ++i) {
        group.q[i][lane] = static_cast<int8_t>(block[2 + i]);
      }
    }
  }
}

#ifdef SPLITSERVE_AVX512

inline __m512 load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 bias_lanes(const void* bias, bool f32, int64_t ob) {
  if (bias == nullptr) return _mm512_setzero_ps();
  if (f32) return _mm512_loadu_ps(static_cast<const float*>(bias) + ob * kOutBlock);
  const __m256i raw =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(bias) +
                                                          ob * kOutBlock));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename Out>
inline void store_lanes(Out* out, __m512 sum) {
  if constexpr (sizeof(Out) == sizeof(float)) {
    _mm512_storeu_ps(out, sum);
  } else {
#ifdef SPLITSERVE_AVX512_BF16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(sum));
#endif
  }
}

template <int Rows>
inline void zero_rows(__m512* even, __m512* odd) {
  for (int r = 0; r < Rows; ++r) {
    even[r] = _mm512_setzero_ps();
    odd[r] = _mm512_setzero_ps();
  }
}

// Each row's outputs of block `ob`: its even and odd input sums plus the bias.
template <int Rows, typename Out>
inline void store_rows(Out* out, const __m512* even, const __m512* odd, __m512 bias_v,
                       int64_t out_features, int64_t ob) {
  for (int r = 0; r < Rows; ++r) {
    store_lanes(out + r * out_features + ob * kOutBlock,
                _mm512_add_ps(_mm512_add_ps(even[r], odd[r]), bias_v));
  }
}

#ifdef SPLITSERVE_AVX512_BF16
// The bf16 values 0..15 in the low 16 words: vpermw's table from a nibble to its bf16.
inline __m512i nibble_bf16_table() {
  alignas(64) uint16_t table[32] = {};
  for (int q = 0; q < 16; ++q) table[q] = splitserve_cpu::float_to_bf16(static_cast<float>(q));
  return _mm512_load_si512(table);
}

#endif  // SPLITSERVE_AVX512_BF16

inline __m512 nibble_f32_table() {
  alignas(64) float table[16];
  for (int q = 0; q < 16; ++q) table[q] = static_cast<float>(q);
  return _mm512_load_ps(table);
}

#ifdef SPLITSERVE_AVX512_BF16
// Q4_1, bf16 x: Rows rows of output block `ob` (its groups at g). xsum [Rows][blocks]: each
// row's float32 sum of every block's 32 inputs.
template <int Rows, typename Out>
void q4_1_bf16_rows(Out* out, const uint16_t* x, const float* xsum, const Q4_1Group* g,
                    const void* bias, int64_t out_features, int64_t in_features, int64_t ob) {
  const int64_t blocks = in_features / kInBlock;
  const __m512i table = nibble_bf16_table();
  const __m512i low_words = _mm512_set1_epi32(0x000F000F);
  const uint32_t* x_pairs[Rows];
  for (int r = 0; r < Rows; ++r) {
    x_pairs[r] = reinterpret_cast<const uint32_t*>(x + r * in_features);
  }
  __m512 total[Rows];
  for (int r = 0; r < Rows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Q4_1Group& group = g[b];
    _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 192, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 256, _MM_HINT_T0);
    __m512 even[Rows], odd[Rows];
    zero_rows<Rows>(even, odd);
    for (int k = 0; k < kInBlock / 2; k += 2) {
      __m512bh w[2];
      for (int h = 0; h < 2; ++h) {
        // dword j = q0 | q1 << 4 (output j); words (q0, q1); each word to its bf16
        const __m512i v =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group.q[k + h])));
        const __m512i words =
            _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), low_words, 0xA8);
        w[h] = (__m512bh)_mm512_permutexvar_epi16(words, table);
      }
      const int64_t pair = b * (kInBlock / 2) + k;
      for (int r = 0; r < Rows; ++r) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][pair]));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][pair + 1]));
        even[r] = _mm512_dpbf16_ps(even[r], w[0], x0);
        odd[r] = _mm512_dpbf16_ps(odd[r], w[1], x1);
      }
    }
    const __m512 d = load_f16(group.d), m = load_f16(group.m);
    for (int r = 0; r < Rows; ++r) {
      total[r] = _mm512_fmadd_ps(d, _mm512_add_ps(even[r], odd[r]), total[r]);
      total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * blocks + b]), total[r]);
    }
  }
  const __m512 bias_v = bias_lanes(bias, false, ob);
  for (int r = 0; r < Rows; ++r) {
    store_lanes(out + r * out_features + ob * kOutBlock, _mm512_add_ps(total[r], bias_v));
  }
}

#endif  // SPLITSERVE_AVX512_BF16

// Q4_1, float32 x: each weight dequantized to its float32 value, then plain products.
// Blocks adjacent output blocks (ob, ob + 1, ...; their groups `blocks` apart) in one pass:
// each lane's operations are the same in the same order, and one row's 2 FMA chains a block
// become 2 x Blocks independent ones (one row was bound by the FMA's latency).
template <int Rows, typename Out, int Blocks = 1>
void q4_1_f32_rows(Out* out, const float* x, const Q4_1Group* g, const void* bias,
                   bool bias_f32, int64_t out_features, int64_t in_features, int64_t ob) {
  const int64_t blocks = in_features / kInBlock;
  const __m512 table = nibble_f32_table();
  __m512 even[Blocks][Rows], odd[Blocks][Rows];
  for (int u = 0; u < Blocks; ++u) zero_rows<Rows>(even[u], odd[u]);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 d[Blocks], m[Blocks];
    for (int u = 0; u < Blocks; ++u) {
      const Q4_1Group& group = g[u * blocks + b];
      for (int line = 0; line < 5; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 64 * line, _MM_HINT_T0);
      }
      d[u] = load_f16(group.d);
      m[u] = load_f16(group.m);
    }
    for (int k = 0; k < kInBlock / 2; ++k) {
      const int64_t i = b * kInBlock + 2 * k;
      for (int u = 0; u < Blocks; ++u) {
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(g[u * blocks + b].q[k])));
        const __m512 w0 = _mm512_fmadd_ps(d[u], _mm512_permutexvar_ps(v, table), m[u]);
        const __m512 w1 =
            _mm512_fmadd_ps(d[u], _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), m[u]);
        for (int r = 0; r < Rows; ++r) {
          even[u][r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * in_features + i]), even[u][r]);
          odd[u][r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * in_features + i + 1]), odd[u][r]);
        }
      }
    }
  }
  for (int u = 0; u < Blocks; ++u) {
    store_rows<Rows>(out, even[u], odd[u], bias_lanes(bias, bias_f32, ob + u), out_features,
                     ob + u);
  }
}

// Q8_0, float32 x (bf16 x is widened first): each weight d * q, then plain products; Blocks
// as for Q4_1.
template <int Rows, typename Out, int Blocks = 1>
void q8_0_f32_rows(Out* out, const float* x, const Q8_0Group* g, const void* bias,
                   bool bias_f32, int64_t out_features, int64_t in_features, int64_t ob) {
  const int64_t blocks = in_features / kInBlock;
  __m512 even[Blocks][Rows], odd[Blocks][Rows];
  for (int u = 0; u < Blocks; ++u) zero_rows<Rows>(even[u], odd[u]);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 d[Blocks];
    for (int u = 0; u < Blocks; ++u) {
      const Q8_0Group& group = g[u * blocks + b];
      for (int line = 0; line < 9; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 64 * line, _MM_HINT_T0);
      }
      d[u] = load_f16(group.d);
    }
    for (int i = 0; i < kInBlock; i += 2) {
      const int64_t col = b * kInBlock + i;
      for (int u = 0; u < Blocks; ++u) {
        const Q8_0Group& group = g[u * blocks + b];
        const __m512 w0 = _mm512_mul_ps(d[u], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(group.q[i])))));
        const __m512 w1 = _mm512_mul_ps(d[u], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(group.q[i + 1])))));
        for (int r = 0; r < Rows; ++r) {
          even[u][r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[r * in_features + col]), even[u][r]);
          odd[u][r] =
              _mm512_fmadd_ps(w1, _mm512_set1_ps(x[r * in_features + col + 1]), odd[u][r]);
        }
      }
    }
  }
  for (int u = 0; u < Blocks; ++u) {
    store_rows<Rows>(out, even[u], odd[u], bias_lanes(bias, bias_f32, ob + u), out_features,
                     ob + u);
  }
}

#ifdef SPLITSERVE_AVX512_BF16
// Q8_0, bf16 x: per block, d * sum(q * x), the products by vdpbf16ps on the int8 values
// (exact in bf16), two inputs' 16 outputs converted together and interleaved into pairs.
template <int Rows, typename Out>
void q8_0_bf16_rows(Out* out, const uint16_t* x, const Q8_0Group* g, const void* bias,
                    int64_t out_features, int64_t in_features, int64_t ob) {
  const int64_t blocks = in_features / kInBlock;
  alignas(64) uint16_t interleave[32];  // word 2j <- input i's output j, 2j + 1 <- input i + 1's
  for (int j = 0; j < 16; ++j) {
    interleave[2 * j] = static_cast<uint16_t>(j);
    interleave[2 * j + 1] = static_cast<uint16_t>(16 + j);
  }
  const __m512i pairs_of = _mm512_load_si512(interleave);
  const uint32_t* x_pairs[Rows];
  for (int r = 0; r < Rows; ++r) {
    x_pairs[r] = reinterpret_cast<const uint32_t*>(x + r * in_features);
  }
  __m512 total[Rows];
  for (int r = 0; r < Rows; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Q8_0Group& group = g[b];
    for (int line = 0; line < 9; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 64 * line, _MM_HINT_T0);
    }
    __m512 even[Rows], odd[Rows];
    zero_rows<Rows>(even, odd);
    for (int k = 0; k < kInBlock / 2; k += 2) {
      __m512bh w[2];
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * (k + h);
        const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(group.q[i]))));
        const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(group.q[i + 1]))));
        const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(second, first);
        w[h] = (__m512bh)_mm512_permutexvar_epi16(pairs_of, halves);
      }
      const int64_t pair = b * (kInBlock / 2) + k;
      for (int r = 0; r < Rows; ++r) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][pair]));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][pair + 1]));
        even[r] = _mm512_dpbf16_ps(even[r], w[0], x0);
        odd[r] = _mm512_dpbf16_ps(odd[r], w[1], x1);
      }
    }
    const __m512 d = load_f16(group.d);
    for (int r = 0; r < Rows; ++r) {
      total[r] = _mm512_fmadd_ps(d, _mm512_add_ps(even[r], odd[r]), total[r]);
    }
  }
  const __m512 bias_v = bias_lanes(bias, false, ob);
  for (int r = 0; r < Rows; ++r) {
    store_lanes(out + r * out_features + ob * kOutBlock, _mm512_add_ps(total[r], bias_v));
  }
}

#endif  // SPLITSERVE_AVX512_BF16
#endif  // SPLITSERVE_AVX512

#ifdef SPLITSERVE_AVX2
// AVX2 + FMA (x86-64-v3), float32 x and out: a group's 16 outputs in two halves of 8 lanes,
// both in one pass over the output block's groups for one or two rows, else each half a pass
// (the second reads the groups from cache).
// Per output lane every operation is the AVX-512 float32 path's, in the same order (the weight
// d * q + m by one fused multiply-add, even and odd inputs in two sums, even + odd, + bias), so
// the two builds give the same bits.
constexpr int64_t kHalf = 8;  // outputs per 8-lane register

inline __m256 load_f16_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 bias_half(const void* bias, int64_t first) {
  return bias == nullptr ? _mm256_setzero_ps()
                         : _mm256_loadu_ps(static_cast<const float*>(bias) + first);
}

// Rows' outputs of `Halves` halves starting at `half0`: each half's even and odd sums + bias.
template <int Rows, int Halves>
inline void store_halves(float* out, const __m256 (*even)[Rows], const __m256 (*odd)[Rows],
                         const void* bias, int64_t out_features, int64_t ob, int64_t half0) {
  for (int h = 0; h < Halves; ++h) {
    const int64_t first = ob * kOutBlock + (half0 + h) * kHalf;
    const __m256 bias_v = bias_half(bias, first);
    for (int r = 0; r < Rows; ++r) {
      _mm256_storeu_ps(out + r * out_features + first,
                       _mm256_add_ps(_mm256_add_ps(even[h][r], odd[h][r]), bias_v));
    }
  }
}

// Halves of a group's 16 outputs one pass takes: both for one or two rows (each output's two
// sums are serial chains of fused multiply-adds, so one row's 2 chains a half would wait on
// the FMA's latency; both halves give 4 or 8 chains), one for more rows (their accumulators
// fill the registers).
template <int Rows>
constexpr int kHalvesPerPass = Rows <= 2 ? 2 : 1;

// Q4_1: each weight dequantized to its float32 value, then plain products.
template <int Rows>
void q4_1_f32_rows(float* out, const float* x, const Q4_1Group* g, const void* bias,
                   int64_t out_features, int64_t in_features, int64_t ob) {
  constexpr int Halves = kHalvesPerPass<Rows>;
  const int64_t blocks = in_features / kInBlock;
  const __m256i low_nibble = _mm256_set1_epi32(0xF);
  for (int64_t half0 = 0; half0 < kOutBlock / kHalf; half0 += Halves) {
    __m256 even[Halves][Rows], odd[Halves][Rows];
    for (int h = 0; h < Halves; ++h) {
      for (int r = 0; r < Rows; ++r) even[h][r] = odd[h][r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const Q4_1Group& group = g[b];
      if (half0 == 0) {
        for (int line = 0; line < 5; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 64 * line, _MM_HINT_T0);
        }
      }
      __m256 d[Halves], m[Halves];
      for (int h = 0; h < Halves; ++h) {
        d[h] = load_f16_half(group.d + (half0 + h) * kHalf);
        m[h] = load_f16_half(group.m + (half0 + h) * kHalf);
      }
      for (int k = 0; k < kInBlock / 2; ++k) {
        const int64_t i = b * kInBlock + 2 * k;
        for (int h = 0; h < Halves; ++h) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(group.q[k] + (half0 + h) * kHalf)));
          const __m256 w0 = _mm256_fmadd_ps(
              d[h], _mm256_cvtepi32_ps(_mm256_and_si256(v, low_nibble)), m[h]);
          const __m256 w1 =
              _mm256_fmadd_ps(d[h], _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), m[h]);
          for (int r = 0; r < Rows; ++r) {
            even[h][r] =
                _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + r * in_features + i), even[h][r]);
            odd[h][r] =
                _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + r * in_features + i + 1), odd[h][r]);
          }
        }
      }
    }
    store_halves<Rows, Halves>(out, even, odd, bias, out_features, ob, half0);
  }
}

// Q8_0: each weight d * q, then plain products.
template <int Rows>
void q8_0_f32_rows(float* out, const float* x, const Q8_0Group* g, const void* bias,
                   int64_t out_features, int64_t in_features, int64_t ob) {
  constexpr int Halves = kHalvesPerPass<Rows>;
  const int64_t blocks = in_features / kInBlock;
  for (int64_t half0 = 0; half0 < kOutBlock / kHalf; half0 += Halves) {
    __m256 even[Halves][Rows], odd[Halves][Rows];
    for (int h = 0; h < Halves; ++h) {
      for (int r = 0; r < Rows; ++r) even[h][r] = odd[h][r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const Q8_0Group& group = g[b];
      if (half0 == 0) {
        for (int line = 0; line < 9; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(&group) + kAhead + 64 * line, _MM_HINT_T0);
        }
      }
      __m256 d[Halves];
      for (int h = 0; h < Halves; ++h) d[h] = load_f16_half(group.d + (half0 + h) * kHalf);
      for (int i = 0; i < kInBlock; i += 2) {
        const int64_t col = b * kInBlock + i;
        for (int h = 0; h < Halves; ++h) {
          const int64_t lane0 = (half0 + h) * kHalf;
          const __m256 w0 = _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                                                        group.q[i] + lane0)))));
          const __m256 w1 = _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                                                        group.q[i + 1] + lane0)))));
          for (int r = 0; r < Rows; ++r) {
            even[h][r] =
                _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + r * in_features + col), even[h][r]);
            odd[h][r] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + r * in_features + col + 1),
                                        odd[h][r]);
          }
        }
      }
    }
    store_halves<Rows, Halves>(out, even, odd, bias, out_features, ob, half0);
  }
}
#endif  // SPLITSERVE_AVX2

#if defined(SPLITSERVE_AVX512) || defined(SPLITSERVE_AVX2)
// One call's arguments, and the float32 copies of x some kernels read.
struct Call {
  void* out;
  bool out_f32;
  const uint16_t* x_bf16;  // bf16 x, else null
  const float* x_f32;  // float32 x, else null
  const float* xsum;  // [rows][blocks] for Q4_1 with bf16 x
  int64_t rows;
  const void* packed;
  int type;
  const void* bias;
  bool bias_f32;
  int64_t out_features, in_features;
};

#ifdef SPLITSERVE_AVX2
constexpr int64_t kCallGroupRows = 4;  // rows whose accumulators share the 16 ymm registers

template <int Rows, typename Out>
void group_rows(const Call& c, int64_t row, int64_t ob) {
  static_assert(sizeof(Out) == sizeof(float), "the AVX2 build writes float32 only");
  float* out = static_cast<float*>(c.out) + row * c.out_features;
  const int64_t blocks = c.in_features / kInBlock;
  if (c.type == kTypeQ4_1) {
    q4_1_f32_rows<Rows>(out, c.x_f32 + row * c.in_features,
                        static_cast<const Q4_1Group*>(c.packed) + ob * blocks, c.bias,
                        c.out_features, c.in_features, ob);
  } else {
    q8_0_f32_rows<Rows>(out, c.x_f32 + row * c.in_features,
                        static_cast<const Q8_0Group*>(c.packed) + ob * blocks, c.bias,
                        c.out_features, c.in_features, ob);
  }
}
#else
constexpr int64_t kCallGroupRows = kGroupRows;

template <int Rows, typename Out>
void group_rows(const Call& c, int64_t row, int64_t ob) {
  Out* out = static_cast<Out*>(c.out) + row * c.out_features;
  const int64_t blocks = c.in_features / kInBlock;
  if (c.type == kTypeQ4_1) {
    const Q4_1Group* g = static_cast<const Q4_1Group*>(c.packed) + ob * blocks;
#ifdef SPLITSERVE_AVX512_BF16
    if (c.x_bf16 != nullptr) {
      q4_1_bf16_rows<Rows, Out>(out, c.x_bf16 + row * c.in_features, c.xsum + row * blocks, g,
                                c.bias, c.out_features, c.in_features, ob);
      return;
    }
#endif
    q4_1_f32_rows<Rows, Out>(out, c.x_f32 + row * c.in_features, g, c.bias, c.bias_f32,
                             c.out_features, c.in_features, ob);
  } else {
    const Q8_0Group* g = static_cast<const Q8_0Group*>(c.packed) + ob * blocks;
#ifdef SPLITSERVE_AVX512_BF16
    if (c.x_bf16 != nullptr) {
      q8_0_bf16_rows<Rows, Out>(out, c.x_bf16 + row * c.in_features, g, c.bias,
                                c.out_features, c.in_features, ob);
      return;
    }
#endif
    q8_0_f32_rows<Rows, Out>(out, c.x_f32 + row * c.in_features, g, c.bias, c.bias_f32,
                             c.out_features, c.in_features, ob);
  }
}

#endif  // SPLITSERVE_AVX2

template <typename Out>
void block_all_rows(const Call& c, int64_t ob) {
  for (int64_t row = 0; row < c.rows; row += kCallGroupRows) {
    switch (c.rows - row < kCallGroupRows ? c.rows - row : kCallGroupRows) {
      case 1: group_rows<1, Out>(c, row, ob); break;
      case 2: group_rows<2, Out>(c, row, ob); break;
      case 3: group_rows<3, Out>(c, row, ob); break;
      case 4: group_rows<4, Out>(c, row, ob); break;
      case 5: group_rows<5, Out>(c, row, ob); break;
      case 6: group_rows<6, Out>(c, row, ob); break;
      case 7: group_rows<7, Out>(c, row, ob); break;
      default: group_rows<8, Out>(c, row, ob); break;
    }
  }
}

#ifdef SPLITSERVE_AVX512
// Output blocks ob and ob + 1 for the call's one or two float32 rows, in one pass.
template <int Rows>
void pair_rows(const Call& c, int64_t ob) {
  const int64_t blocks = c.in_features / kInBlock;
  float* out = static_cast<float*>(c.out);
  if (c.type == kTypeQ4_1) {
    q4_1_f32_rows<Rows, float, 2>(out, c.x_f32, static_cast<const Q4_1Group*>(c.packed) +
                                                    ob * blocks,
                                  c.bias, c.bias_f32, c.out_features, c.in_features, ob);
  } else {
    q8_0_f32_rows<Rows, float, 2>(out, c.x_f32, static_cast<const Q8_0Group*>(c.packed) +
                                                    ob * blocks,
                                  c.bias, c.bias_f32, c.out_features, c.in_features, ob);
  }
}
#endif

#endif  // SPLITSERVE_AVX512 || SPLITSERVE_AVX2

#if defined(__AVX2__) && defined(__FMA__)
// col[j] = byte j of each of the 16 rows at rows[0..15] (row stride 16 bytes): a 16 x 16 byte
// transpose in four interleaving stages (bytes, words, dwords, qwords).
inline void transpose16x16(const uint8_t* rows, __m128i* col) {
  __m128i r[16], s1[8][2], s2[4][4], s3[2][8];
  for (int i = 0; i < 16; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 16 * i));
  for (int p = 0; p < 8; ++p) {  // s1[p][h]: rows 2p, 2p+1 for columns 8h..8h+7
    s1[p][0] = _mm_unpacklo_epi8(r[2 * p], r[2 * p + 1]);
    s1[p][1] = _mm_unpackhi_epi8(r[2 * p], r[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // s2[q][g]: rows 4q..4q+3 for columns 4g..4g+3
    for (int h = 0; h < 2; ++h) {
      s2[q][2 * h] = _mm_unpacklo_epi16(s1[2 * q][h], s1[2 * q + 1][h]);
      s2[q][2 * h + 1] = _mm_unpackhi_epi16(s1[2 * q][h], s1[2 * q + 1][h]);
    }
  }
  for (int u = 0; u < 2; ++u) {  // s3[u][m]: rows 8u..8u+7 for columns 2m, 2m+1
    for (int g = 0; g < 4; ++g) {
      s3[u][2 * g] = _mm_unpacklo_epi32(s2[2 * u][g], s2[2 * u + 1][g]);
      s3[u][2 * g + 1] = _mm_unpackhi_epi32(s2[2 * u][g], s2[2 * u + 1][g]);
    }
  }
  for (int m = 0; m < 8; ++m) {
    col[2 * m] = _mm_unpacklo_epi64(s3[0][m], s3[1][m]);
    col[2 * m + 1] = _mm_unpackhi_epi64(s3[0][m], s3[1][m]);
  }
}

// 8 bytes at `bytes` (unsigned when Unsigned, else signed) as 8 float32 lanes.
template <bool Unsigned>
inline __m256 bytes_to_floats(__m128i bytes) {
  return _mm256_cvtepi32_ps(Unsigned ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes));
}

// One group's 16 outputs x 32 inputs into the dense rows at `out` (row stride in_features).
inline void unpack_group(const Q4_1Group& group, float* out, int64_t in_features) {
  __m128i col[16];
  transpose16x16(&group.q[0][0], col);  // col[j]: output j's 16 bytes, inputs (2k, 2k + 1)
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  for (int j = 0; j < 16; ++j) {
    const __m128i low = _mm_and_si128(col[j], low_nibbles);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(col[j], 4), low_nibbles);
    const __m128i first = _mm_unpacklo_epi8(low, high);  // inputs 0..15
    const __m128i second = _mm_unpackhi_epi8(low, high);  // inputs 16..31
    const __m256 d = _mm256_set1_ps(splitserve_cpu::f16_to_float(group.d[j]));
    const __m256 m = _mm256_set1_ps(splitserve_cpu::f16_to_float(group.m[j]));
    float* row = out + j * in_features;
    _mm256_storeu_ps(row, _mm256_fmadd_ps(d, bytes_to_floats<true>(first), m));
    _mm256_storeu_ps(row + 8, _mm256_fmadd_ps(d, bytes_to_floats<true>(_mm_srli_si128(first, 8)), m));
    _mm256_storeu_ps(row + 16, _mm256_fmadd_ps(d, bytes_to_floats<true>(second), m));
    _mm256_storeu_ps(row + 24,
                     _mm256_fmadd_ps(d, bytes_to_floats<true>(_mm_srli_si128(second, 8)), m));
  }
}

inline void unpack_group(const Q8_0Group& group, float* out, int64_t in_features) {
  __m128i first[16], second[16];
  transpose16x16(reinterpret_cast<const uint8_t*>(&group.q[0][0]), first);  // inputs 0..15
  transpose16x16(reinterpret_cast<const uint8_t*>(&group.q[16][0]), second);  // 16..31
  for (int j = 0; j < 16; ++j) {
    const __m256 d = _mm256_set1_ps(splitserve_cpu::f16_to_float(group.d[j]));
    float* row = out + j * in_features;
    _mm256_storeu_ps(row, _mm256_mul_ps(d, bytes_to_floats<false>(first[j])));
    _mm256_storeu_ps(row + 8, _mm256_mul_ps(d, bytes_to_floats<false>(_mm_srli_si128(first[j], 8))));
    _mm256_storeu_ps(row + 16, _mm256_mul_ps(d, bytes_to_floats<false>(second[j])));
    _mm256_storeu_ps(row + 24,
                     _mm256_mul_ps(d, bytes_to_floats<false>(_mm_srli_si128(second[j], 8))));
  }
}
#endif

// Output `lane` of group `group_index` (Q4_1 or Q8_0 by `type`): its 32 dequantized inputs
// into row[0..32), each gguf's float32 value (d * q + m by one rounding, d * q exact).
inline void unpack_lane(float* row, const void* packed, int type, int64_t group_index,
                        int64_t lane) {
  if (type == kTypeQ4_1) {
    const Q4_1Group& group = static_cast<const Q4_1Group*>(packed)[group_index];
    const float d = splitserve_cpu::f16_to_float(group.d[lane]);
    const float m = splitserve_cpu::f16_to_float(group.m[lane]);
    for (int k = 0; k < kInBlock / 2; ++k) {
      const uint8_t pair = group.q[k][lane];
      row[2 * k] = std::fma(d, static_cast<float>(pair & 0xF), m);
      row[2 * k + 1] = std::fma(d, static_cast<float>(pair >> 4), m);
    }
  } else {
    const Q8_0Group& group = static_cast<const Q8_0Group*>(packed)[group_index];
    const float d = splitserve_cpu::f16_to_float(group.d[lane]);
    for (int i = 0; i < kInBlock; ++i) row[i] = d * static_cast<float>(group.q[i][lane]);
  }
}

// All 16 outputs of group `group_index` into the rows at first_row (row stride in_features):
// by the byte transpose where the build has AVX2 + FMA, lane by lane elsewhere (same values).
inline void unpack_group_rows(float* first_row, const void* packed, int type,
                              int64_t group_index, int64_t in_features) {
#if defined(__AVX2__) && defined(__FMA__)
  if (type == kTypeQ4_1) {
    unpack_group(static_cast<const Q4_1Group*>(packed)[group_index], first_row, in_features);
  } else {
    unpack_group(static_cast<const Q8_0Group*>(packed)[group_index], first_row, in_features);
  }
#else
  for (int64_t j = 0; j < kOutBlock; ++j) {
    unpack_lane(first_row + j * in_features, packed, type, group_index, j);
  }
#endif
}

}  // namespace

extern "C" {

int splitserve_qgemv_pack(void* packed, const void* raw, int type, int64_t out_features,
                          int64_t in_features) {
  if (out_features <= 0 || in_features <= 0 || out_features % kOutBlock ||
      in_features % kInBlock) {
    return -1;
  }
  const uint8_t* bytes = static_cast<const uint8_t*>(raw);
  if (type == kTypeQ4_1) {
    pack_q4_1(static_cast<Q4_1Group*>(packed), bytes, out_features, in_features);
  } else if (type == kTypeQ8_0) {
    pack_q8_0(static_cast<Q8_0Group*>(packed), bytes, out_features, in_features);
  } else {
    return -1;
  }
  return 0;
}

// The packed weight's values as a dense float32 [out_features][in_features], row-major: each
// exactly gguf's dequantized value (Q4_1 d * q + m with one rounding, Q8_0 d * q exact), the
// values a widened weight holds, so a dense product over them gives the dense path's bits.
// Portable C++ at every level. 0 done; -1 unsupported arguments (nothing written).
int splitserve_qgemv_unpack(float* out, const void* packed, int type, int64_t out_features,
                            int64_t in_features, int threads) {
  if (out_features <= 0 || in_features <= 0 || out_features % kOutBlock ||
      in_features % kInBlock || threads <= 0 || (type != kTypeQ4_1 && type != kTypeQ8_0)) {
    return -1;
  }
  const int64_t blocks = in_features / kInBlock, out_blocks = out_features / kOutBlock;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t ob = 0; ob < out_blocks; ++ob) {
    for (int64_t b = 0; b < blocks; ++b) {
      unpack_group_rows(out + ob * kOutBlock * in_features + b * kInBlock, packed, type,
                        ob * blocks + b, in_features);
    }
  }
  return 0;
}

// Rows `ids[0..count)` of the packed weight as dense float32, out [count][in_features]: the
// values splitserve_qgemv_unpack gives those rows (an embedding table read as stored). 0 done;
// -1 unsupported arguments or a row id outside [0, out_features) (nothing written).
int splitserve_qgemv_rows(float* out, const void* packed, int type, int64_t out_features,
                          int64_t in_features, const int64_t* ids, int64_t count) {
  if (out_features <= 0 || in_features <= 0 || out_features % kOutBlock ||
      in_features % kInBlock || count < 0 || (type != kTypeQ4_1 && type != kTypeQ8_0)) {
    return -1;
  }
  for (int64_t r = 0; r < count; ++r) {
    if (ids[r] < 0 || ids[r] >= out_features) return -1;
  }
  const int64_t blocks = in_features / kInBlock;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t ob = ids[r] / kOutBlock, lane = ids[r] % kOutBlock;
    for (int64_t b = 0; b < blocks; ++b) {
      unpack_lane(out + r * in_features + b * kInBlock, packed, type, ob * blocks + b, lane);
    }
  }
  return 0;
}

// Bytes of the packed weight (the GGUF tensor's own size); -1 for an unsupported type/shape.
int64_t splitserve_qgemv_packed_bytes(int type, int64_t out_features, int64_t in_features) {
  if (out_features <= 0 || in_features <= 0 || out_features % kOutBlock ||
      in_features % kInBlock) {
    return -1;
  }
  const int64_t groups = (out_features / kOutBlock) * (in_features / kInBlock);
  if (type == kTypeQ4_1) return groups * static_cast<int64_t>(sizeof(Q4_1Group));
  if (type == kTypeQ8_0) return groups * static_cast<int64_t>(sizeof(Q8_0Group));
  return -1;
}

int splitserve_qgemv(void* out, int out_f32, const void* x, int x_f32, int64_t rows,
                     const void* packed, int type, const void* bias, int64_t out_features,
                     int64_t in_features, int threads) {
#if !defined(SPLITSERVE_AVX512) && !defined(SPLITSERVE_AVX2)
  (void)out; (void)out_f32; (void)x; (void)x_f32; (void)rows; (void)packed; (void)type;
  (void)bias; (void)out_features; (void)in_features; (void)threads;
  return -2;
#else
  if (rows <= 0 || rows > kMaxRows || out_features <= 0 || in_features <= 0 ||
      out_features % kOutBlock || in_features % kInBlock || threads <= 0 ||
      (type != kTypeQ4_1 && type != kTypeQ8_0)) {
    return -1;
  }
#ifndef SPLITSERVE_AVX512_BF16
  if (!x_f32 || !out_f32) return -3;  // bf16 x or out: this build has no AVX-512 BF16
#endif
  const int64_t blocks = in_features / kInBlock;
  Call c{out, out_f32 != 0, nullptr, nullptr, nullptr, rows, packed, type, bias, x_f32 != 0,
         out_features, in_features};
  std::vector<float> sums;
  if (x_f32) {
    c.x_f32 = static_cast<const float*>(x);
  } else {
    c.x_bf16 = static_cast<const uint16_t*>(x);
  }
  if (!x_f32 && type == kTypeQ4_1) {
    sums.resize(rows * blocks);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        float sum = 0.0f;
        for (int64_t i = 0; i < kInBlock; ++i) {
          sum += splitserve_cpu::bf16_to_float(c.x_bf16[r * in_features + b * kInBlock + i]);
        }
        sums[r * blocks + b] = sum;
      }
    }
    c.xsum = sums.data();
  }
  const int64_t out_blocks = out_features / kOutBlock;
#ifdef SPLITSERVE_AVX512
  if (c.x_f32 != nullptr && c.out_f32 && rows <= 2 && out_blocks >= 2) {
    // two output blocks a pass (pair_rows): the same bits, 4 or 8 FMA chains rather than 2
    const int64_t pairs = out_blocks / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      if (rows == 1) {
        pair_rows<1>(c, 2 * pair);
      } else {
        pair_rows<2>(c, 2 * pair);
      }
    }
    if (out_blocks % 2) block_all_rows<float>(c, out_blocks - 1);
    return 0;
  }
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t ob = 0; ob < out_blocks; ++ob) {
    if (c.out_f32) {
      block_all_rows<float>(c, ob);
    } else {
#ifdef SPLITSERVE_AVX512_BF16
      block_all_rows<uint16_t>(c, ob);
#endif
    }
  }
  return 0;
#endif
}

}  // extern "C"
