// Paged decode attention on the CPU: one query token per sequence over its paged KV context,
// reading the cache blocks in place (no gather), GQA query heads of one KV head together.
//
// Built at install by setup.py once per instruction-set level (kernels/cpu_levels.py) into a small
// shared library with a C ABI, loaded through ctypes at the level the CPU runs
// (kernels/cpu_build.py); no torch headers. OpenMP: torch's CPU wheel ships libgomp.so.1, the
// soname this library links, so at run time both share one OpenMP runtime and thread pool.
//
// Contract of splitserve_paged_decode_attention_{bf16,f32} (all tensors row-major):
//   out          [num_seqs, num_heads, head_dim]                    written
//   query        [num_seqs, num_heads, head_dim], sequence stride query_stride (elements)
//   key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   contiguous
//   value_cache  same shape as key_cache
//   block_tables [num_seqs, table_stride] int64: block ids of each sequence, in order
//   context_lens [num_seqs] int64: tokens of each sequence's context, >= 1
// num_heads is a multiple of num_kv_heads; query head q uses KV head q / (num_heads/num_kv_heads).
// Every sequence is computed on its own, in an order that does not depend on the batch, so a
// sequence's result is independent of the others (batch invariant). Math in float32: scores,
// an exact (two-pass) softmax, the weighted sum of values; bf16 output is rounded to nearest
// even. Returns 0, or a negative code for unsupported arguments (nothing written then).
//
// At the avx2 level (AVX2 + FMA), float32, head_dim 32, 64 or 128, at most 8 query heads per KV
// head: the 8-lane register kernel (decode_sequence_avx2); bf16 and other shapes: the generic
// path's portable loops.
// With AVX-512 (F, BW), head_dim a multiple of 32: float32 rows by 16-lane FMAs (on a CPU
// without AVX-512 BF16, Skylake-SP or Cascade Lake, bf16 rows keep the generic path).
// bf16 with AVX-512 BF16, head_dim 32, 64 or 128 and few query heads per KV head (their
// accumulators fit in registers, see kMaxAccumulators): per KV head, the scores of 16 tokens
// come from 16 vdpbf16ps partial sums reduced together by one transpose (not 16 horizontal
// sums), and each value row is converted once and added into all of its query heads'
// register accumulators (not loaded and stored per head). Other shapes take the generic path.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPLITSERVE_AVX512 1  // the vectorized float32 rows (bf16 ones need AVX-512 BF16)
#if defined(__AVX512BF16__)
#define SPLITSERVE_AVX512_BF16 1  // bf16 dot products by vdpbf16ps, the register kernels
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPLITSERVE_AVX2 1  // float32 sequences by the 8-lane register kernel below
#endif

namespace {

using namespace splitserve_cpu;

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  }
  float total = 0.0f;
  for (; i < n; ++i) total += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

// Softmax weights of `scores` in place (unnormalised); returns their sum.
inline float softmax_weights(float* scores, int64_t n) {
  float lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = scores[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      lanes[j] = scores[i + j] > lanes[j] ? scores[i + j] : lanes[j];
    }
  }
  float max_score = scores[0];
  for (; i < n; ++i) max_score = scores[i] > max_score ? scores[i] : max_score;
  for (int j = 0; j < kLanes; ++j) max_score = lanes[j] > max_score ? lanes[j] : max_score;
  exp_nonpositive_shifted(scores, max_score, scores, n);
  for (int j = 0; j < kLanes; ++j) lanes[j] = 0.0f;
  for (i = 0; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += scores[i + j];
  }
  float total = 0.0f;
  for (; i < n; ++i) total += scores[i];
  for (int j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

#ifdef SPLITSERVE_AVX512

// AVX-512 row primitives; head_dim is a multiple of 32 (checked by the caller).
inline __m512 bf16x16_to_float(const uint16_t* src) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const uint16_t* src) { return bf16x16_to_float(src); }
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }

#ifdef SPLITSERVE_AVX512_BF16
// q . k over head_dim: bf16 pairs straight into float32 lanes (vdpbf16ps).
inline float dot_row(const uint16_t* q, const uint16_t* k, int64_t head_dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 32) {
    __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
    __m512bh kv = (__m512bh)_mm512_loadu_si512(k + d);
    acc = _mm512_dpbf16_ps(acc, qv, kv);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

// Whether rows of T take the vectorized path: float32 always, bf16 only with AVX-512 BF16
// (without it bf16 rows keep the generic path's sums).
template <typename T>
constexpr bool kVectorRows =
#ifdef SPLITSERVE_AVX512_BF16
    true;
#else
    std::is_same_v<T, float>;
#endif

inline float dot_row(const float* q, const float* k, int64_t head_dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
// acc[0:head_dim] += weight * row
template <typename T>
inline void axpy_row(float* acc, float weight, const T* row, int64_t head_dim) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int64_t d = 0; d < head_dim; d += 16) {
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(w, load16(row + d), _mm512_loadu_ps(acc + d)));
  }
}

// The totals of 16 vectors: lane L of the result is the sum of parts[4 * (L % 4) + L / 4]
// (a transpose-and-add in four halving stages; the caller stores token L's partial sums in
// slot 4 * (L % 4) + L / 4).
inline __m512 sum16(const __m512* parts) {
  __m512 half[8], quarter[4], eighth[2];
  for (int k = 0; k < 8; ++k) {
    const __m512 a = parts[2 * k], b = parts[2 * k + 1];
    half[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 a = half[2 * k], b = half[2 * k + 1];
    quarter[k] =
        _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int k = 0; k < 2; ++k) {
    const __m512 a = quarter[2 * k], b = quarter[2 * k + 1];
    eighth[k] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], 0x88),
                       _mm512_shuffle_ps(eighth[0], eighth[1], 0xDD));
}

constexpr int kMaxAccumulators = 24;  // zmm registers the value pass may hold as accumulators
constexpr int64_t kPrefetchTokens = 32;  // how far ahead of a pass its rows are asked for

// Asks for the cache rows of tokens first..first+15 (those before `context`), every line: the
// hardware prefetcher stops at each 4 KB page and at each block, so without this the passes
// wait on memory (10 sequences of 352 tokens, 30 layers, one core: 11.1 ms without, 7.3-8.9
// with the rows 32 tokens ahead; 16 and 64 did no better).
template <typename T>
inline void prefetch_rows(const T* cache, const int64_t* slots, int64_t first, int64_t context,
                          int64_t token_stride) {
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t t = first; t < first + 16 && t < context; ++t) {
    const char* row = reinterpret_cast<const char*>(cache + slots[t] * token_stride);
    for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch(row + line, _MM_HINT_T0);
  }
}

// A query head's chunks in registers, and its partial dot product with one key row: 16
// lanes whose sum is q . k. bf16 (AVX-512 BF16): pairs by vdpbf16ps; float32: FMAs.
template <typename T, int kChunks16>
struct QueryRegisters;

#ifdef SPLITSERVE_AVX512_BF16
template <int kChunks16>
struct QueryRegisters<uint16_t, kChunks16> {
  __m512bh chunks[kChunks16 / 2];
  explicit QueryRegisters(const uint16_t* q) {
    for (int c = 0; c < kChunks16 / 2; ++c) chunks[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  }
  __m512 partial_dot(const uint16_t* key) const {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < kChunks16 / 2; ++c) {
      acc = _mm512_dpbf16_ps(acc, chunks[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
    }
    return acc;
  }
};
#endif

template <int kChunks16>
struct QueryRegisters<float, kChunks16> {
  __m512 chunks[kChunks16];
  explicit QueryRegisters(const float* q) {
    for (int c = 0; c < kChunks16; ++c) chunks[c] = _mm512_loadu_ps(q + 16 * c);
  }
  __m512 partial_dot(const float* key) const {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < kChunks16; ++c) {
      acc = _mm512_fmadd_ps(chunks[c], _mm512_loadu_ps(key + 16 * c), acc);
    }
    return acc;
  }
};

// One sequence's attention for bf16 or float32 (T), kChunks16 = head_dim / 16 (even), kGroup query heads per
// KV head. slots[t]: the cache row of token t; scores: room for heads * context floats;
// totals: heads floats; accum: heads * head_dim floats (heads = num_kv_heads * kGroup).
// Both passes go over the context 16 tokens at a time, every KV head of those tokens before
// the next 16: each token's cache row (all its KV heads side by side) is read once, front to
// back, the next 16 tokens' rows asked for ahead (prefetch_rows). Head by head over the whole
// context, as before, each pass read 2 lines of every 6 per token: 12.9 ms against 7.3-8.9
// for 10 sequences of 352 tokens over 30 layers on one core. Every score and every sum is
// computed by the same operations in the same order as head by head, so its bits are too.
template <typename T, int kChunks16, int kGroup>
void decode_sequence(T* seq_out, const T* seq_query, const T* key_cache, const T* value_cache,
                     const int64_t* slots, int64_t context, int64_t num_kv_heads, float scale,
                     float* scores, float* totals, float* accum) {
  static_assert(kChunks16 % 2 == 0 && kChunks16 * kGroup <= kMaxAccumulators);
  constexpr int64_t kHeadDim = 16 * kChunks16;
  const int64_t token_stride = num_kv_heads * kHeadDim;
  const int64_t heads = num_kv_heads * kGroup;
  const __m512 scale_vector = _mm512_set1_ps(scale);
  // scores[h, t] = scale * q_h . k_t (k of h's KV head)
  for (int64_t first = 0; first < kPrefetchTokens; first += 16) {
    prefetch_rows(key_cache, slots, first, context, token_stride);
  }
  int64_t t0 = 0;
  for (; t0 + 16 <= context; t0 += 16) {
    prefetch_rows(key_cache, slots, t0 + kPrefetchTokens, context, token_stride);
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      const T* keys = key_cache + kv_head * kHeadDim;
      for (int i = 0; i < kGroup; ++i) {
        const int64_t head = kv_head * kGroup + i;
        const QueryRegisters<T, kChunks16> query(seq_query + head * kHeadDim);
        __m512 parts[16];
        for (int slot = 0; slot < 16; ++slot) {
          parts[slot] =
              query.partial_dot(keys + slots[t0 + 4 * (slot % 4) + slot / 4] * token_stride);
        }
        _mm512_storeu_ps(scores + head * context + t0, _mm512_mul_ps(scale_vector, sum16(parts)));
      }
    }
  }
  for (; t0 < context; ++t0) {
    const T* key = key_cache + slots[t0] * token_stride;
    for (int64_t head = 0; head < heads; ++head) {
      scores[head * context + t0] = scale * dot_row(seq_query + head * kHeadDim,
                                                    key + (head / kGroup) * kHeadDim, kHeadDim);
    }
  }
  for (int64_t head = 0; head < heads; ++head) {
    totals[head] = softmax_weights(scores + head * context, context);
  }
  // accum[h] = sum_t weight[h, t] * v_t, tokens in order; a KV head's group sums sit in
  // registers for 16 tokens, in accum between
  std::fill(accum, accum + heads * kHeadDim, 0.0f);
  for (int64_t first = 0; first < kPrefetchTokens; first += 16) {
    prefetch_rows(value_cache, slots, first, context, token_stride);
  }
  for (t0 = 0; t0 < context; t0 += 16) {
    const int64_t t_end = t0 + 16 < context ? t0 + 16 : context;
    prefetch_rows(value_cache, slots, t0 + kPrefetchTokens, context, token_stride);
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      const T* values = value_cache + kv_head * kHeadDim;
      float* group_accum = accum + kv_head * kGroup * kHeadDim;
      const float* group_scores = scores + kv_head * kGroup * context;
      __m512 sums[kGroup][kChunks16];
      for (int i = 0; i < kGroup; ++i) {
        for (int c = 0; c < kChunks16; ++c) {
          sums[i][c] = _mm512_loadu_ps(group_accum + i * kHeadDim + 16 * c);
        }
      }
      for (int64_t t = t0; t < t_end; ++t) {
        const T* value = values + slots[t] * token_stride;
        __m512 weights[kGroup];
        for (int i = 0; i < kGroup; ++i) weights[i] = _mm512_set1_ps(group_scores[i * context + t]);
        for (int c = 0; c < kChunks16; ++c) {
          const __m512 v = load16(value + 16 * c);
          for (int i = 0; i < kGroup; ++i) sums[i][c] = _mm512_fmadd_ps(weights[i], v, sums[i][c]);
        }
      }
      for (int i = 0; i < kGroup; ++i) {
        for (int c = 0; c < kChunks16; ++c) {
          _mm512_storeu_ps(group_accum + i * kHeadDim + 16 * c, sums[i][c]);
        }
      }
    }
  }
  for (int64_t head = 0; head < heads; ++head) {
    const __m512 inverse = _mm512_set1_ps(1.0f / totals[head]);
    float row[kHeadDim];
    for (int c = 0; c < kChunks16; ++c) {
      _mm512_storeu_ps(row + 16 * c,
                       _mm512_mul_ps(_mm512_loadu_ps(accum + head * kHeadDim + 16 * c), inverse));
    }
    store_row(row, seq_out + head * kHeadDim, kHeadDim);
  }
}

template <typename T>
using SequenceKernel = void (*)(T*, const T*, const T*, const T*, const int64_t*, int64_t,
                                int64_t, float, float*, float*, float*);

template <typename T, int kChunks16, int kGroup>
SequenceKernel<T> kernel_for_group(int64_t group) {
  if constexpr (kGroup == 0) {
    return nullptr;
  } else {
    if (group == kGroup) return decode_sequence<T, kChunks16, kGroup>;
    return kernel_for_group<T, kChunks16, kGroup - 1>(group);
  }
}

// The register-accumulator kernel for this shape and type, or nullptr (the generic path):
// float32 always, bf16 where the CPU has AVX-512 BF16.
template <typename T>
SequenceKernel<T> sequence_kernel(int64_t head_dim, int64_t group) {
#ifndef SPLITSERVE_AVX512_BF16
  if constexpr (std::is_same_v<T, uint16_t>) {
    return nullptr;
  } else
#endif
  {
    switch (head_dim) {
      case 32: return kernel_for_group<T, 2, 8>(group);
      case 64: return kernel_for_group<T, 4, 6>(group);
      case 128: return kernel_for_group<T, 8, 3>(group);
      default: return nullptr;
    }
  }
}
#endif  // SPLITSERVE_AVX512

#ifdef SPLITSERVE_AVX2
// AVX2 + FMA, float32 (head_dim a multiple of 8, at most 128; at most 8 query heads per KV
// head): one sequence by 8-lane registers. Scores: for 8 tokens at a time, each query head's 8
// partial dot products (8 independent FMA chains) reduced together by one transpose-and-add
// (sum8), each token's key row read once per query head of its group, from cache after the
// first. Values: the group's output chunks in registers over the whole context (in passes of
// as many chunks as fit), each value row's chunk loaded once for all query heads of its
// group. Every sum runs over the tokens in order, so a sequence's result does not depend on
// the others of its call.
constexpr int kAvx2Accumulators = 12;  // ymm registers the value pass holds as sums

// Lane L of the result: the sum of parts[L]'s 8 lanes.
inline __m256 sum8(const __m256* parts) {
  const __m256 a = _mm256_hadd_ps(parts[0], parts[1]);
  const __m256 b = _mm256_hadd_ps(parts[2], parts[3]);
  const __m256 c = _mm256_hadd_ps(parts[4], parts[5]);
  const __m256 d = _mm256_hadd_ps(parts[6], parts[7]);
  const __m256 ab = _mm256_hadd_ps(a, b);  // lanes 0-3: parts 0-3's low halves; 4-7: high
  const __m256 cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// 8 lanes whose sum is q . k (head_dim = 8 kChunks8), a chain of kChunks8 multiply-adds.
template <int kChunks8>
inline __m256 partial_dot8(const float* q, const float* k) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
  for (int c = 1; c < kChunks8; ++c) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), acc);
  }
  return acc;
}

inline float reduce8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

template <int kChunks8, int kGroup>
void decode_sequence_avx2(float* seq_out, const float* seq_query, const float* key_cache,
                          const float* value_cache, const int64_t* slots, int64_t context,
                          int64_t num_kv_heads, float scale, float* scores, float* totals) {
  constexpr int64_t kHeadDim = 8 * kChunks8;
  const int64_t token_stride = num_kv_heads * kHeadDim;
  const int64_t heads = num_kv_heads * kGroup;
  const __m256 scale_vector = _mm256_set1_ps(scale);
  // scores[h, t] = scale * q_h . k_t
  for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    const float* keys = key_cache + kv_head * kHeadDim;
    for (int i = 0; i < kGroup; ++i) {
      const int64_t head = kv_head * kGroup + i;
      const float* q = seq_query + head * kHeadDim;
      float* head_scores = scores + head * context;
      int64_t t0 = 0;
      for (; t0 + 8 <= context; t0 += 8) {
        __m256 parts[8];
        for (int slot = 0; slot < 8; ++slot) {
          parts[slot] = partial_dot8<kChunks8>(q, keys + slots[t0 + slot] * token_stride);
        }
        _mm256_storeu_ps(head_scores + t0, _mm256_mul_ps(scale_vector, sum8(parts)));
      }
      for (; t0 < context; ++t0) {
        head_scores[t0] =
            scale * reduce8(partial_dot8<kChunks8>(q, keys + slots[t0] * token_stride));
      }
    }
  }
  for (int64_t head = 0; head < heads; ++head) {
    totals[head] = softmax_weights(scores + head * context, context);
  }
  // out[h] = sum_t weight[h, t] * v_t / total[h], tokens in order
  constexpr int kPass = kAvx2Accumulators / kGroup < 1 ? 1 : kAvx2Accumulators / kGroup;
  constexpr int kPassChunks = kPass < kChunks8 ? kPass : kChunks8;
  for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    const float* values = value_cache + kv_head * kHeadDim;
    const float* group_scores = scores + kv_head * kGroup * context;
    for (int c0 = 0; c0 < kChunks8; c0 += kPassChunks) {
      __m256 sums[kGroup][kPassChunks];
      for (int i = 0; i < kGroup; ++i) {
        for (int c = 0; c < kPassChunks; ++c) sums[i][c] = _mm256_setzero_ps();
      }
      for (int64_t t = 0; t < context; ++t) {
        const float* value = values + slots[t] * token_stride + 8 * c0;
        for (int c = 0; c < kPassChunks && c0 + c < kChunks8; ++c) {
          const __m256 v = _mm256_loadu_ps(value + 8 * c);
          for (int i = 0; i < kGroup; ++i) {
            sums[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(group_scores[i * context + t]), v,
                                         sums[i][c]);
          }
        }
      }
      for (int i = 0; i < kGroup; ++i) {
        const int64_t head = kv_head * kGroup + i;
        const __m256 inverse = _mm256_set1_ps(1.0f / totals[head]);
        for (int c = 0; c < kPassChunks && c0 + c < kChunks8; ++c) {
          _mm256_storeu_ps(seq_out + head * kHeadDim + 8 * (c0 + c),
                           _mm256_mul_ps(sums[i][c], inverse));
        }
      }
    }
  }
}

using Avx2SequenceKernel = void (*)(float*, const float*, const float*, const float*,
                                    const int64_t*, int64_t, int64_t, float, float*, float*);

template <int kChunks8, int kGroup>
Avx2SequenceKernel avx2_kernel_for_group(int64_t group) {
  if constexpr (kGroup == 0) {
    return nullptr;
  } else {
    if (group == kGroup) return decode_sequence_avx2<kChunks8, kGroup>;
    return avx2_kernel_for_group<kChunks8, kGroup - 1>(group);
  }
}

// The AVX2 register kernel for float32 of this shape, or nullptr (the generic path).
inline Avx2SequenceKernel avx2_sequence_kernel(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 32: return avx2_kernel_for_group<4, 8>(group);
    case 64: return avx2_kernel_for_group<8, 8>(group);
    case 128: return avx2_kernel_for_group<16, 8>(group);
    default: return nullptr;
  }
}
#endif  // SPLITSERVE_AVX2

// slots[t]: the cache row of a sequence's token t (its block table's block t / block_size).
inline void fill_slots(std::vector<int64_t>& slots, const int64_t* table, int64_t context,
                       int64_t block_size) {
  slots.resize(context);
  for (int64_t t = 0, block = 0, offset = 0; t < context; ++t) {
    slots[t] = table[block] * block_size + offset;
    if (++offset == block_size) offset = 0, ++block;
  }
}

template <typename T>
int paged_decode_attention(T* out, const T* query, int64_t query_stride, const T* key_cache,
                           const T* value_cache, const int64_t* block_tables,
                           int64_t table_stride, const int64_t* context_lens, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int num_threads) {
  if (num_seqs < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 ||
      block_size <= 0 || num_threads <= 0) {
    return -1;
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (context_lens[s] <= 0 || context_lens[s] > table_stride * block_size) return -2;
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // elements between cache tokens
#ifdef SPLITSERVE_AVX512
  const bool vectorized = head_dim % 32 == 0 && kVectorRows<T>;
  const SequenceKernel<T> fast = sequence_kernel<T>(head_dim, group);
#else
  const bool vectorized = false;
#endif
#ifdef SPLITSERVE_AVX2
  const Avx2SequenceKernel avx2 =
      std::is_same_v<T, float> ? avx2_sequence_kernel(head_dim, group) : nullptr;
#endif

  // One work item per sequence: its cache rows (all KV heads of a token are adjacent) are
  // read front to back, once for the keys and once for the values.
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> queries(num_heads * head_dim);  // [heads, head_dim], pre-scaled (scalar)
    std::vector<float> row(token_stride);              // one cache token, as float (scalar)
    std::vector<float> accum(num_heads * head_dim);    // [heads, head_dim]
    std::vector<float> scores;                         // [heads, context]
    std::vector<float> totals(num_heads);

    std::vector<int64_t> slots;                        // [context]: cache row of each token

#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t context = context_lens[seq];
      const int64_t* table = block_tables + seq * table_stride;
      const T* seq_query = query + seq * query_stride;
      scores.resize(num_heads * context);
#ifdef SPLITSERVE_AVX512
      if (fast != nullptr) {
        fill_slots(slots, table, context, block_size);
        fast(out + seq * num_heads * head_dim, seq_query, key_cache, value_cache, slots.data(),
             context, num_kv_heads, scale, scores.data(), totals.data(), accum.data());
        continue;
      }
#endif
#ifdef SPLITSERVE_AVX2
      if constexpr (std::is_same_v<T, float>) {
        if (avx2 != nullptr) {
          fill_slots(slots, table, context, block_size);
          avx2(out + seq * num_heads * head_dim, seq_query, key_cache, value_cache, slots.data(),
               context, num_kv_heads, scale, scores.data(), totals.data());
          continue;
        }
      }
#endif

      // scores[h, t] = scale * q_h . k_t (k of query head h's KV head)
      if (vectorized) {
#ifdef SPLITSERVE_AVX512
        if constexpr (kVectorRows<T>) {  // no bf16 dot_row without AVX-512 BF16
          for (int64_t t = 0; t < context; ++t) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            const T* key = key_cache + slot * token_stride;
            for (int64_t h = 0; h < num_heads; ++h) {
              scores[h * context + t] = scale * dot_row(seq_query + h * head_dim,
                                                        key + (h / group) * head_dim, head_dim);
            }
          }
        }
#endif
      } else {
        load_row(seq_query, queries.data(), num_heads * head_dim);
        for (int64_t i = 0; i < num_heads * head_dim; ++i) queries[i] *= scale;
        for (int64_t t = 0; t < context; ++t) {
          const int64_t slot = table[t / block_size] * block_size + t % block_size;
          load_row(key_cache + slot * token_stride, row.data(), token_stride);
          for (int64_t h = 0; h < num_heads; ++h) {
            scores[h * context + t] =
                dot(queries.data() + h * head_dim, row.data() + (h / group) * head_dim, head_dim);
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        totals[h] = softmax_weights(scores.data() + h * context, context);
      }

      // accum[h] = sum_t weight[h, t] * v_t
      std::fill(accum.begin(), accum.end(), 0.0f);
      for (int64_t t = 0; t < context; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* value = value_cache + slot * token_stride;
        if (vectorized) {
#ifdef SPLITSERVE_AVX512
          for (int64_t h = 0; h < num_heads; ++h) {
            axpy_row(accum.data() + h * head_dim, scores[h * context + t],
                     value + (h / group) * head_dim, head_dim);
          }
#endif
        } else {
          load_row(value, row.data(), token_stride);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float weight = scores[h * context + t];
            const float* v = row.data() + (h / group) * head_dim;
            float* acc = accum.data() + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) acc[d] += weight * v[d];
          }
        }
      }
      T* seq_out = out + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* acc = accum.data() + h * head_dim;
        const float inverse = 1.0f / totals[h];
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= inverse;
        store_row(acc, seq_out + h * head_dim, head_dim);
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int splitserve_paged_decode_attention_bf16(
    uint16_t* out, const uint16_t* query, int64_t query_stride, const uint16_t* key_cache,
    const uint16_t* value_cache, const int64_t* block_tables, int64_t table_stride,
    const int64_t* context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int num_threads) {
  return paged_decode_attention(out, query, query_stride, key_cache, value_cache, block_tables,
                                table_stride, context_lens, num_seqs, num_heads, num_kv_heads,
                                head_dim, block_size, scale, num_threads);
}

int splitserve_paged_decode_attention_f32(
    float* out, const float* query, int64_t query_stride, const float* key_cache,
    const float* value_cache, const int64_t* block_tables, int64_t table_stride,
    const int64_t* context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int num_threads) {
  return paged_decode_attention(out, query, query_stride, key_cache, value_cache, block_tables,
                                table_stride, context_lens, num_seqs, num_heads, num_kv_heads,
                                head_dim, block_size, scale, num_threads);
}

}  // extern "C"
