// bf16 matrix products of a few rows (decode steps) on the CPU with AVX-512 BF16: the weight
// streams from memory once per call at close to the core's read bandwidth (built and called
// like paged_decode_attention.cpp; C ABI, ctypes).
//
//   splitserve_gemv_pack_bf16(packed, weight, out_features, in_features)
//     weight  [out_features, in_features] bf16, row-major
//     packed  [out_features / 16][in_features / 2][16][2] bf16, written: for each block of 16
//             outputs, each pair of inputs holds the 16 outputs' two weights side by side,
//             the operand layout of vdpbf16ps; one block is one contiguous stretch
//   splitserve_gemv_bf16(out, x, rows, packed, bias, out_features, in_features, threads)
//     out [rows, out_features] bf16 = x [rows, in_features] bf16 @ weight.T (+ bias [out]
//     bf16 when not null), float32 accumulation, one rounding at the end. rows <= kMaxRows.
//     Blocks of 16 outputs are split across `threads` OpenMP threads.
// out_features must be a multiple of 16 and in_features even. Both return 0; -1 for
// unsupported arguments (nothing written); -2 when this build has no AVX-512 BF16 (the caller
// uses torch).
//
// Summation order: row r's output o sums the products of even input pairs and of odd input
// pairs separately, in input order, then adds the two; the same for every row count, so a
// row's result does not depend on the other rows of its call (batch invariant up to kMaxRows).
//
// Why: oneDNN's prepacked bf16 GEMV reads a SmolLM2 decode step's 121 matrices at 28-31 GB/s
// on one core here (each matrix restarts the hardware prefetcher's stream); this loop with a
// software prefetch kAhead bytes ahead reads them at 37-40 GB/s for 1-8 rows.
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SPLITSERVE_AVX512 1
#endif

namespace {

constexpr int64_t kOutBlock = 16;  // outputs per zmm of float32 accumulators
constexpr int64_t kMaxRows = 8;
constexpr int64_t kAhead = 8192;  // software prefetch distance in the packed weight, bytes

#ifdef SPLITSERVE_AVX512
// Output blocks [first_block, end_block) of Rows rows.
template <int Rows>
void gemv_blocks(uint16_t* out, const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
                 int64_t out_features, int64_t in_features, int64_t first_block,
                 int64_t end_block) {
  const int64_t pairs = in_features / 2;
  const uint32_t* x_pairs[Rows];
  for (int r = 0; r < Rows; ++r) {
    x_pairs[r] = reinterpret_cast<const uint32_t*>(x + r * in_features);
  }
  for (int64_t block = first_block; block < end_block; ++block) {
    const uint16_t* w = packed + block * pairs * 2 * kOutBlock;
    const char* w_bytes = reinterpret_cast<const char*>(w);
    __m512 even[Rows], odd[Rows];
    for (int r = 0; r < Rows; ++r) {
      even[r] = _mm512_setzero_ps();
      odd[r] = _mm512_setzero_ps();
    }
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2) {
      _mm_prefetch(w_bytes + p * 64 + kAhead, _MM_HINT_T0);  // past the end: a no-op hint
      _mm_prefetch(w_bytes + p * 64 + kAhead + 64, _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (p + 1) * 32);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][p]));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][p + 1]));
        even[r] = _mm512_dpbf16_ps(even[r], w0, x0);
        odd[r] = _mm512_dpbf16_ps(odd[r], w1, x1);
      }
    }
    if (p < pairs) {  // an odd number of input pairs: the last one joins the even sums
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 32);
      for (int r = 0; r < Rows; ++r) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[r][p]));
        even[r] = _mm512_dpbf16_ps(even[r], w0, x0);
      }
    }
    __m512 bias_v = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + block * 16));
      bias_v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int r = 0; r < Rows; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(even[r], odd[r]), bias_v);
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(out + r * out_features + block * kOutBlock),
          (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

template <int Rows>
void gemv_rows(uint16_t* out, const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
               int64_t out_features, int64_t in_features, int threads) {
  const int64_t blocks = out_features / kOutBlock;
  if (threads <= 1) {
    gemv_blocks<Rows>(out, x, packed, bias, out_features, in_features, 0, blocks);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
      gemv_blocks<Rows>(out, x, packed, bias, out_features, in_features, block, block + 1);
    }
  }
}
#endif

}  // namespace

extern "C" {

int splitserve_gemv_pack_bf16(uint16_t* packed, const uint16_t* weight, int64_t out_features,
                              int64_t in_features) {
  if (out_features <= 0 || in_features <= 0 || out_features % kOutBlock || in_features % 2) {
    return -1;
  }
  const int64_t pairs = in_features / 2;
  for (int64_t o = 0; o < out_features; ++o) {
    const int64_t block = o / kOutBlock, lane = o % kOutBlock;
    for (int64_t i = 0; i < in_features; ++i) {
      packed[((block * pairs + i / 2) * kOutBlock + lane) * 2 + i % 2] =
          weight[o * in_features + i];
    }
  }
  return 0;
}

int splitserve_gemv_bf16(uint16_t* out, const uint16_t* x, int64_t rows, const uint16_t* packed,
                         const uint16_t* bias, int64_t out_features, int64_t in_features,
                         int threads) {
#ifndef SPLITSERVE_AVX512
  return -2;
#else
  if (rows <= 0 || rows > kMaxRows || out_features <= 0 || in_features <= 0 ||
      out_features % kOutBlock || in_features % 2 || threads <= 0) {
    return -1;
  }
  switch (rows) {
    case 1: gemv_rows<1>(out, x, packed, bias, out_features, in_features, threads); break;
    case 2: gemv_rows<2>(out, x, packed, bias, out_features, in_features, threads); break;
    case 3: gemv_rows<3>(out, x, packed, bias, out_features, in_features, threads); break;
    case 4: gemv_rows<4>(out, x, packed, bias, out_features, in_features, threads); break;
    case 5: gemv_rows<5>(out, x, packed, bias, out_features, in_features, threads); break;
    case 6: gemv_rows<6>(out, x, packed, bias, out_features, in_features, threads); break;
    case 7: gemv_rows<7>(out, x, packed, bias, out_features, in_features, threads); break;
    default: gemv_rows<8>(out, x, packed, bias, out_features, in_features, threads); break;
  }
  return 0;
#endif
}

}  // extern "C"
