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
//   splitserve_gemv_bf16_f32(out, ...same...)
//     the same sums, out [rows, out_features] float32, never rounded to bf16 (logits: a bf16
//     logit's step, 1/16 at 8 to 16, turns near ties into exact ones that greedy then breaks
//     by token id).
//     Blocks of 16 outputs are split across `threads` OpenMP threads; within a block, rows go
//     in groups of 8 (their accumulators fill the registers), the block's weight read from
//     memory once and from cache for the next groups.
// out_features must be a multiple of 16 and in_features even. Both return 0; -1 for
// unsupported arguments (nothing written); -2 when this build has no AVX-512 BF16 (the caller
// uses torch).
//   splitserve_gemv_amx_init()
//     asks Linux for this process's AMX tile registers: 0 granted, -2 no AMX in this build,
//     -3 refused. Call once before the two below, which return -3 until it was granted (a
//     tile instruction without the permission would kill the process with SIGILL).
//   splitserve_gemv_amx_bf16(...), splitserve_gemv_amx_bf16_f32(...)
//     the same arguments and results through AMX tiles (TDPBF16PS): in_features must be a
//     multiple of 32; -2 without AMX. Bound by reading the weight at any row count (rows go
//     in tiles of 16; the weight's 16 pairs of one block, as packed, are one B tile).
//     Summation order: the tile instruction's, row by row; a row's result does not depend on
//     the other rows of its call either, but it is not the AVX-512 loop's (float32 sums that
//     differ in their last bits).
//
// Summation order: row r's output o sums the products of even input pairs and of odd input
// pairs separately, in input order, then adds the two; the same for every row count, so a
// row's result does not depend on the other rows of its call (batch invariant up to kMaxRows).
//
// Why: oneDNN's prepacked bf16 GEMV reads a SmolLM2 decode step's 121 matrices at 28-31 GB/s
// on one core here for one row (each matrix restarts the hardware prefetcher's stream) and
// slows with every row; this loop with a software prefetch kAhead bytes ahead took 7.2-7.5 ms
// against oneDNN's 8.8-9.0 for one row, 7.4-7.9 against 12.2-12.8 for 8, 12.7 against 16.7
// for 16, 21.9 against 24.8 for 32 (through the Python wrapper).
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SPLITSERVE_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#define SPLITSERVE_AMX 1
#endif
#endif

namespace {

constexpr int64_t kOutBlock = 16;  // outputs per zmm of float32 accumulators
constexpr int64_t kMaxRows = 32;
constexpr int64_t kGroupRows = 8;  // rows whose accumulators share the registers
constexpr int64_t kAhead = 8192;  // software prefetch distance in the packed weight, bytes

#ifdef SPLITSERVE_AVX512
// One block of 16 outputs (its packed weight at w) for Rows rows of x; Out is uint16_t (bf16)
// or float.
template <int Rows, typename Out>
inline void block_rows(Out* out, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                       int64_t out_features, int64_t in_features) {
  const int64_t pairs = in_features / 2;
  const char* w_bytes = reinterpret_cast<const char*>(w);
  const uint32_t* x_pairs[Rows];
  for (int r = 0; r < Rows; ++r) {
    x_pairs[r] = reinterpret_cast<const uint32_t*>(x + r * in_features);
  }
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
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias));
    bias_v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  for (int r = 0; r < Rows; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(even[r], odd[r]), bias_v);
    if constexpr (sizeof(Out) == sizeof(float)) {
      _mm512_storeu_ps(out + r * out_features, sum);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_features),
                          (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// Output block `block` for every row: groups of kGroupRows rows, each reading the block's
// weight (at most 48 KB for 1,536 inputs) from cache after the first group brought it in.
template <typename Out>
void block_all_rows(Out* out, const uint16_t* x, int64_t rows, const uint16_t* packed,
                    const uint16_t* bias, int64_t out_features, int64_t in_features,
                    int64_t block) {
  const uint16_t* w = packed + block * in_features * kOutBlock;
  const uint16_t* block_bias = bias == nullptr ? nullptr : bias + block * kOutBlock;
  for (int64_t row = 0; row < rows; row += kGroupRows) {
    Out* o = out + row * out_features + block * kOutBlock;
    const uint16_t* xr = x + row * in_features;
    switch (rows - row < kGroupRows ? rows - row : kGroupRows) {
      case 1: block_rows<1, Out>(o, xr, w, block_bias, out_features, in_features); break;
      case 2: block_rows<2, Out>(o, xr, w, block_bias, out_features, in_features); break;
      case 3: block_rows<3, Out>(o, xr, w, block_bias, out_features, in_features); break;
      case 4: block_rows<4, Out>(o, xr, w, block_bias, out_features, in_features); break;
      case 5: block_rows<5, Out>(o, xr, w, block_bias, out_features, in_features); break;
      case 6: block_rows<6, Out>(o, xr, w, block_bias, out_features, in_features); break;
      case 7: block_rows<7, Out>(o, xr, w, block_bias, out_features, in_features); break;
      default: block_rows<8, Out>(o, xr, w, block_bias, out_features, in_features); break;
    }
  }
}
#endif

// Both entry points: -2 without AVX-512 BF16, -1 for unsupported arguments, else 0.
template <typename Out>
int gemv(Out* out, const uint16_t* x, int64_t rows, const uint16_t* packed, const uint16_t* bias,
         int64_t out_features, int64_t in_features, int threads) {
#ifndef SPLITSERVE_AVX512
  return -2;
#else
  if (rows <= 0 || rows > kMaxRows || out_features <= 0 || in_features <= 0 ||
      out_features % kOutBlock || in_features % 2 || threads <= 0) {
    return -1;
  }
  const int64_t blocks = out_features / kOutBlock;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t block = 0; block < blocks; ++block) {
    block_all_rows<Out>(out, x, rows, packed, bias, out_features, in_features, block);
  }
  return 0;
#endif
}

#ifdef SPLITSERVE_AMX
// AMX: one tile instruction multiplies up to 16 rows of x by 32 inputs x 16 outputs of the
// packed weight, whose 16 pairs of one block are one B tile as packed (16 rows of 64 bytes).
// Tiles: tmm0/tmm1 the float32 sums of row groups 0-15 / 16-31 for one block of 16 outputs,
// tmm2/tmm3 those groups' 32 inputs, tmm4 the block's weight for those inputs.
constexpr int64_t kTileRows = 16;  // rows of x per tile
constexpr int64_t kTileInputs = 32;  // inputs per tile step (16 pairs)
constexpr int64_t kTileBytes = 1024;  // one B tile: 16 pairs x 16 outputs x 2 bf16

struct TileConfig {  // the layout ldtilecfg reads (palette 1)
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// This thread's tile shapes for `rows` rows of x (1..kMaxRows).
inline void configure_tiles(int64_t rows) {
  TileConfig config{};
  config.palette_id = 1;
  const int64_t group0 = rows < kTileRows ? rows : kTileRows, group1 = rows - group0;
  config.rows[0] = config.rows[2] = static_cast<uint8_t>(group0);
  config.colsb[0] = config.colsb[2] = 64;
  if (group1 > 0) {
    config.rows[1] = config.rows[3] = static_cast<uint8_t>(group1);
    config.colsb[1] = config.colsb[3] = 64;
  }
  config.rows[4] = 16;
  config.colsb[4] = 64;
  _tile_loadconfig(&config);
}

// Output block `block` for every row (tiles configured for `rows`); sums [rows][16] float32 in
// `scratch` ([kMaxRows][16], 64-byte aligned) before the bias and the store.
template <typename Out>
void amx_block(Out* out, const uint16_t* x, int64_t rows, const uint16_t* packed,
               const uint16_t* bias, int64_t out_features, int64_t in_features, int64_t block,
               float* scratch) {
  const char* w = reinterpret_cast<const char*>(packed + block * in_features * kOutBlock);
  const bool two_groups = rows > kTileRows;
  const int64_t x_stride = in_features * 2;  // bytes
  _tile_zero(0);
  if (two_groups) _tile_zero(1);
  for (int64_t step = 0; step < in_features / kTileInputs; ++step) {
    const char* tile = w + step * kTileBytes;
    _tile_loadd(4, tile, 64);
    _tile_loadd(2, x + step * kTileInputs, x_stride);
    _tile_dpbf16ps(0, 2, 4);
    if (two_groups) {
      _tile_loadd(3, x + kTileRows * in_features + step * kTileInputs, x_stride);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, scratch, 64);
  if (two_groups) _tile_stored(1, scratch + kTileRows * kOutBlock, 64);
  __m512 bias_v = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + block * kOutBlock));
    bias_v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_load_ps(scratch + r * kOutBlock), bias_v);
    Out* o = out + r * out_features + block * kOutBlock;
    if constexpr (sizeof(Out) == sizeof(float)) {
      _mm512_storeu_ps(o, sum);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}
#endif

#ifdef SPLITSERVE_AMX
std::atomic<bool> amx_granted{false};  // set by splitserve_gemv_amx_init once Linux granted it
#endif

// Both AMX entry points: -2 without AMX in this build, -3 before splitserve_gemv_amx_init
// was granted, -1 for unsupported arguments, else 0.
template <typename Out>
int gemv_amx(Out* out, const uint16_t* x, int64_t rows, const uint16_t* packed,
             const uint16_t* bias, int64_t out_features, int64_t in_features, int threads) {
#ifndef SPLITSERVE_AMX
  return -2;
#else
  if (!amx_granted.load(std::memory_order_acquire)) {
    return -3;
  }
  if (rows <= 0 || rows > kMaxRows || out_features <= 0 || in_features <= 0 ||
      out_features % kOutBlock || in_features % kTileInputs || threads <= 0) {
    return -1;
  }
  const int64_t blocks = out_features / kOutBlock;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    alignas(64) float scratch[kMaxRows * kOutBlock];
    configure_tiles(rows);
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
      amx_block<Out>(out, x, rows, packed, bias, out_features, in_features, block, scratch);
    }
    _tile_release();
  }
  return 0;
#endif
}

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
  return gemv<uint16_t>(out, x, rows, packed, bias, out_features, in_features, threads);
}

int splitserve_gemv_bf16_f32(float* out, const uint16_t* x, int64_t rows, const uint16_t* packed,
                             const uint16_t* bias, int64_t out_features, int64_t in_features,
                             int threads) {
  return gemv<float>(out, x, rows, packed, bias, out_features, in_features, threads);
}

// The AMX path's permission: Linux hands a process the tile registers only once asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; once per process, every thread). 0 granted,
// -2 no AMX in this build, -3 refused by the kernel (an old Linux, or AMX disabled).
int splitserve_gemv_amx_init() {
#ifndef SPLITSERVE_AMX
  return -2;
#else
  constexpr int kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr int kTileData = 18;  // XFEATURE_XTILEDATA
  if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) {
    return -3;
  }
  amx_granted.store(true, std::memory_order_release);
  return 0;
#endif
}

// The same products through AMX tiles (in_features a multiple of 32); bf16 / float32 out.
int splitserve_gemv_amx_bf16(uint16_t* out, const uint16_t* x, int64_t rows,
                             const uint16_t* packed, const uint16_t* bias, int64_t out_features,
                             int64_t in_features, int threads) {
  return gemv_amx<uint16_t>(out, x, rows, packed, bias, out_features, in_features, threads);
}

int splitserve_gemv_amx_bf16_f32(float* out, const uint16_t* x, int64_t rows,
                                 const uint16_t* packed, const uint16_t* bias,
                                 int64_t out_features, int64_t in_features, int threads) {
  return gemv_amx<float>(out, x, rows, packed, bias, out_features, in_features, threads);
}

}  // extern "C"
