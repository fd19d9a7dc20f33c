// Causal prefill attention on the CPU for bf16 (AVX-512 BF16), one sequence per call: the
// query rows are the last `num_queries` positions of a `context`-token sequence, query row i
// (position context - num_queries + i) attends keys 0 .. context - num_queries + i.
//
//   splitserve_prefill_attention_bf16(out, query, query_stride, key, key_stride, value,
//       value_stride, num_queries, context, num_heads, num_kv_heads, head_dim, scale, threads)
//   out    [num_queries, num_heads, head_dim] contiguous, written
//   query  [num_queries, num_heads, head_dim], row stride query_stride (elements)
//   key    [context, num_kv_heads, head_dim], row stride key_stride; value likewise
// Heads are contiguous within a row and head_dim within a head. Query head q uses KV head
// q / (num_heads / num_kv_heads). head_dim must be a multiple of 32, at most 256.
//
// Method: each KV head's keys and values are first repacked, 16 keys at a time, into the pair
// layout vdpbf16ps consumes (keys: [pair of dims][key][2], values: [pair of keys][dim][2]),
// then every query head runs, kTileRows query rows at a time, an online softmax over steps of
// kSpan 16-key blocks: scores of 16 keys by head_dim/2 vdpbf16ps, one max, rescale and sum
// per row per step, the probabilities rounded to bf16 for the value product (as GPU flash
// attention does), float32 everywhere else. One core, SmolLM2's 9 heads of 64, 1,400 tokens:
// 6.8 ms a layer with 6 rows x 4 blocks, 15.8 ms with the former 4 rows x 1 block (the
// softmax's reductions and exps per 16 keys cost as much as the products), torch's SDPA 31 ms.
// Returns 0; -1 for unsupported arguments
// (nothing written); -2 when this build has no AVX-512 BF16 (the caller uses torch).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SPLITSERVE_AVX512 1
#endif

#include "cpu_common.h"

namespace {

using namespace splitserve_cpu;

constexpr int64_t kBlock = 16;  // keys per block: one zmm of float32 scores

#ifdef SPLITSERVE_AVX512
// exp of 16 floats, each <= 0 (as exp_nonpositive in cpu_common.h, vectorised by hand).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(kExp2Taylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Taylor[i]));
  const __m512i exponent = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

// One KV head, packed: keys [blocks][head_dim/2][16][2], values [blocks][8][head_dim][2]
// (uint16 bf16 bits), zero beyond the context.
struct PackedHead {
  std::vector<uint16_t> keys;
  std::vector<uint16_t> values;
};

void pack_head(const uint16_t* key, int64_t key_stride, const uint16_t* value,
               int64_t value_stride, int64_t context, int64_t head_dim, PackedHead& packed) {
  const int64_t blocks = (context + kBlock - 1) / kBlock;
  packed.keys.assign(blocks * kBlock * head_dim, 0);
  packed.values.assign(blocks * kBlock * head_dim, 0);
  for (int64_t t = 0; t < context; ++t) {
    const int64_t block = t / kBlock, slot = t % kBlock;
    const uint16_t* k = key + t * key_stride;
    const uint16_t* v = value + t * value_stride;
    uint16_t* kb = packed.keys.data() + block * kBlock * head_dim;
    uint16_t* vb = packed.values.data() + block * kBlock * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) {
      kb[((d / 2) * kBlock + slot) * 2 + d % 2] = k[d];
      vb[((slot / 2) * head_dim + d) * 2 + slot % 2] = v[d];
    }
  }
}

constexpr int kTileRows = 6;  // query rows of one head attended together (independent chains)
constexpr int kSpan = 4;      // 16-key blocks per online-softmax step (64 keys)

// Running state of kTileRows query rows: float32 output accumulators, max and sum.
struct RowState {
  __m512 acc[kTileRows][16];
  float running_max[kTileRows];
  float running_sum[kTileRows];
};

// One online-softmax step over the Span 16-key blocks first_block .. first_block + Span - 1
// for the tile's rows; row r attends keys [0, first_limit + r). One max, one rescale of the
// accumulators and one sum per row per step: the more keys a step spans, the less of the
// softmax's reductions and exps per key (the score and value products do not change).
template <int Span, int64_t Chunks>
inline __attribute__((always_inline)) void attend_step(
    const uint32_t* const* q_pairs, const PackedHead& packed, int64_t first_block,
    int64_t first_limit, int64_t head_dim, __m512 scale_v, RowState& state) {
  const int64_t pairs = head_dim / 2;
  const int64_t chunks = Chunks > 0 ? Chunks : head_dim / 16;  // zmm of float32 outputs
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const uint16_t* kb = packed.keys.data() + first_block * kBlock * head_dim;
  __m512 scores[kTileRows][Span];
  for (int r = 0; r < kTileRows; ++r)
    for (int s = 0; s < Span; ++s) scores[r][s] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[Span];
    for (int s = 0; s < Span; ++s)
      k[s] = (__m512bh)_mm512_loadu_si512(kb + s * kBlock * head_dim + p * kBlock * 2);
    for (int r = 0; r < kTileRows; ++r) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[r][p]));
      for (int s = 0; s < Span; ++s) scores[r][s] = _mm512_dpbf16_ps(scores[r][s], k[s], qp);
    }
  }
  alignas(64) uint32_t prob_pairs[kTileRows][Span][kBlock / 2];
  for (int r = 0; r < kTileRows; ++r) {
    __m512 masked[Span];
    __m512 block_max = _mm512_set1_ps(neg_inf);
    int64_t live_keys = 0;
    for (int s = 0; s < Span; ++s) {
      const int64_t valid =
          std::clamp<int64_t>(first_limit + r - (first_block + s) * kBlock, 0, kBlock);
      live_keys += valid;
      const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1u);
      masked[s] = _mm512_mask_blend_ps(live, _mm512_set1_ps(neg_inf),
                                       _mm512_mul_ps(scores[r][s], scale_v));
      block_max = _mm512_max_ps(block_max, masked[s]);
    }
    const float old_max = state.running_max[r];
    const float new_max =
        live_keys == 0 ? old_max : std::max(old_max, _mm512_reduce_max_ps(block_max));
    float correction = 1.0f;
    if (new_max != old_max) {
      correction =
          old_max == neg_inf ? 0.0f : exp_nonpositive16(_mm512_set1_ps(old_max - new_max))[0];
    }
    const __m512 new_max_v = _mm512_set1_ps(new_max);
    __m512 total = _mm512_setzero_ps();
    for (int s = 0; s < Span; ++s) {
      // a masked key's exp is that of the floor (tiny, not 0): zeroed here
      const int64_t valid =
          std::clamp<int64_t>(first_limit + r - (first_block + s) * kBlock, 0, kBlock);
      const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512 probs =
          _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_sub_ps(masked[s], new_max_v)));
      total = _mm512_add_ps(total, probs);
      // probabilities as bf16 pairs (key 2j, key 2j+1) for the value product
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs[r][s]),
                         (__m256i)_mm512_cvtneps_pbh(probs));
    }
    state.running_sum[r] = state.running_sum[r] * correction + _mm512_reduce_add_ps(total);
    state.running_max[r] = new_max;
    if (correction != 1.0f) {
      const __m512 correction_v = _mm512_set1_ps(correction);
      for (int64_t c = 0; c < chunks; ++c)
        state.acc[r][c] = _mm512_mul_ps(state.acc[r][c], correction_v);
    }
  }
  const uint16_t* vb = packed.values.data() + first_block * kBlock * head_dim;
  for (int s = 0; s < Span; ++s) {
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      const uint16_t* vrow = vb + (s * kBlock / 2 + j) * head_dim * 2;
      __m512bh pj[kTileRows];
      for (int r = 0; r < kTileRows; ++r)
        pj[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[r][s][j]));
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(vrow + c * 32);
        for (int r = 0; r < kTileRows; ++r)
          state.acc[r][c] = _mm512_dpbf16_ps(state.acc[r][c], v, pj[r]);
      }
    }
  }
}

// Query rows row0 .. row0 + rows - 1 (rows <= kTileRows) of one head; row r attends keys
// [0, first_limit + r). Sharing each loaded key/value block between the rows keeps the
// vdpbf16ps chains of different rows independent (the FMA latency is hidden). Chunks: the
// head_dim / 16 the compiler may unroll for (0: read from head_dim).
template <int64_t Chunks>
void attend_rows(const uint16_t* query, int64_t query_stride, int rows, const PackedHead& packed,
                 int64_t first_limit, int64_t head_dim, float scale, uint16_t* out,
                 int64_t out_stride) {
  const int64_t chunks = Chunks > 0 ? Chunks : head_dim / 16;
  RowState state;
  const uint32_t* q_pairs[kTileRows];
  for (int r = 0; r < kTileRows; ++r) {
    for (int64_t c = 0; c < chunks; ++c) state.acc[r][c] = _mm512_setzero_ps();
    state.running_max[r] = -std::numeric_limits<float>::infinity();
    state.running_sum[r] = 0.0f;
    q_pairs[r] = reinterpret_cast<const uint32_t*>(query + std::min(r, rows - 1) * query_stride);
  }
  const __m512 scale_v = _mm512_set1_ps(scale);
  const int64_t last_limit = first_limit + rows - 1;
  const int64_t blocks = (last_limit + kBlock - 1) / kBlock;
  int64_t b = 0;
  for (; b + kSpan <= blocks; b += kSpan)
    attend_step<kSpan, Chunks>(q_pairs, packed, b, first_limit, head_dim, scale_v, state);
  for (; b < blocks; ++b)
    attend_step<1, Chunks>(q_pairs, packed, b, first_limit, head_dim, scale_v, state);
  for (int r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / state.running_sum[r]);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(state.acc[r][c], inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + c * 16),
                          (__m256i)rounded);
    }
  }
}
#endif

}  // namespace

extern "C" int splitserve_prefill_attention_bf16(
    uint16_t* out, const uint16_t* query, int64_t query_stride, const uint16_t* key,
    int64_t key_stride, const uint16_t* value, int64_t value_stride, int64_t num_queries,
    int64_t context, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    int threads) {
#ifndef SPLITSERVE_AVX512
  return -2;
#else
  if (num_queries <= 0 || context < num_queries || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || head_dim <= 0 || head_dim % 32 != 0 || head_dim > 256 ||
      threads <= 0) {
    return -1;
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t offset = context - num_queries;  // position of query row 0
  std::vector<PackedHead> packed(num_kv_heads);
  constexpr int64_t kRowsPerItem = 3 * kTileRows;  // whole tiles: no tile runs short mid-sequence
  const int64_t row_chunks = (num_queries + kRowsPerItem - 1) / kRowsPerItem;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      pack_head(key + h * head_dim, key_stride, value + h * head_dim, value_stride, context,
                head_dim, packed[h]);
    }
    // Later row chunks attend more keys: hand them out first, dynamically.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_heads * row_chunks; ++item) {
      const int64_t chunk = row_chunks - 1 - item / num_heads;
      const int64_t head = item % num_heads;
      const int64_t end = std::min(num_queries, (chunk + 1) * kRowsPerItem);
      for (int64_t row = chunk * kRowsPerItem; row < end; row += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, end - row));
        const auto attend = head_dim == 64 ? attend_rows<4> : attend_rows<0>;
        attend(query + row * query_stride + head * head_dim, query_stride, rows,
               packed[head / group], offset + row + 1, head_dim, scale,
               out + (row * num_heads + head) * head_dim, num_heads * head_dim);
      }
    }
  }
  return 0;
#endif
}
