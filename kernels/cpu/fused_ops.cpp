// Fused elementwise kernels of the decoder layer on the CPU: one pass over memory instead of
// torch's several ops and temporaries (built and called like paged_decode_attention.cpp; C ABI,
// ctypes).
//
//   splitserve_add_rms_norm_bf16(hidden, delta, weight, out, rows, cols, eps, threads)
//     if delta: hidden[r] = bf16(hidden[r] + delta[r])      (in place, the residual add)
//     out[r] = bf16(hidden[r] * rsqrt(mean(hidden[r]^2) + eps) * weight)
//     hidden, delta, out: [rows, cols] contiguous; weight: [cols]. Float32 math and one
//     rounding at the end, as torch's fused bf16 rms_norm.
//   splitserve_add_rms_norm_f32(hidden, delta, weight, out, rows, cols, eps, threads)
//     the same in float32: if delta, hidden[r] = hidden[r] + delta[r] (in place); then
//     out[r][c] = weight[c] * (hidden[r][c] * (1 / sqrt(sum(hidden[r]^2) / cols + eps))),
//     HF's float32 RMSNorm operation for operation (one rounding each, torch.rsqrt being
//     1 / sqrt), except how the squares are summed (in another order, by fused
//     multiply-adds).
//   splitserve_rotary_bf16 / splitserve_rotary_f32(out, x, token_stride, cos, sin, tokens,
//                                                  heads, head_dim)
//     out [tokens, heads, head_dim] contiguous = x * cos + rotate_half(x) * sin, where
//     x[t][h][i] is x[t * token_stride + h * head_dim + i] (a view of a fused qkv row),
//     cos, sin [tokens, head_dim] contiguous and rotate_half(x) = (-x[half:], x[:half]).
//     Bit for bit torch's ops (engine/rotary.py:apply_rotary): each product and the sum
//     rounded once to the dtype, in that order (never fused into one multiply-add: this
//     function is compiled with fp-contract off). head_dim even.
//   splitserve_silu_mul_bf16 / splitserve_silu_mul_f32(out, gate_up, rows, cols, threads)
//     out [rows, cols] = silu(gate) * up where gate_up [rows, 2 * cols] holds each row's gate
//     then its up (the fused gate_up projection's output), both contiguous. silu(x) is
//     x / (1 + exp(-x)), torch's formula, with exp by exp_any below (within about one ulp of
//     the correctly rounded value; torch's vectorised exp is another such approximation, so
//     results may differ from F.silu in the last bit). bf16: silu rounded to bf16, then the
//     product rounded, as torch's two bf16 ops round. Not faster than torch's two ops alone;
//     it exists so that the decode layer loop (decode_layers.cpp) and the Python layer path
//     compute the same bits.
// Rows are split across `threads` OpenMP threads when there is enough work.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace splitserve_cpu;

constexpr int64_t kMinParallelElements = 1 << 16;

inline int threads_for(int64_t elements, int threads) {
  return elements >= kMinParallelElements ? std::max(threads, 1) : 1;
}

inline float to_float(uint16_t value) { return bf16_to_float(value); }
inline float to_float(float value) { return value; }

template <typename T>
T from_float(float value);
template <>
inline uint16_t from_float<uint16_t>(float value) {
  return float_to_bf16(value);
}
template <>
inline float from_float<float>(float value) {
  return value;
}

// value rounded to T and back: a torch op's result in T, as the next op reads it.
template <typename T>
inline float round_to(float value) {
  return to_float(from_float<T>(value));
}

inline float sum_of_squares(const float* x, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[i + j] * x[i + j];
  }
  float total = 0.0f;
  for (; i < n; ++i) total += x[i] * x[i];
  for (int j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

// exp(x) for any float x, within about one ulp: x clamped to [-87.3, 88.3] (2^k stays a normal
// float), x = k ln2 + r with ln2 split in two parts (Cody and Waite), e^r by the classic
// degree-6 minimax polynomial on |r| <= ln2 / 2. Branch-free; but with AVX2 only GCC turns
// the clamp into a branch through the polynomial (as cpu_common.h's exp_nonpositive), so a
// loop that must vectorize at every level clamps first (clamp_exp_any) and then calls
// exp_of_clamped_any: exp_any's bits, in two loops.
inline float clamp_exp_any(float x) { return x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x); }

inline float exp_of_clamped_any(float x) {
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * kLog2e + kRoundMagic;
  const float k = shifted - kRoundMagic;
  int32_t k_int;
  std::memcpy(&k_int, &shifted, sizeof(k_int));
  k_int -= 0x4b400000;  // the integer sits in the low mantissa bits of `shifted`
  float r = std::fma(-k, 0.693359375f, x);  // ln 2's leading bits: k * them is exact
  r = std::fma(-k, -2.12194440e-4f, r);     // the rest of ln 2
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float e_r = std::fma(p * r, r, r) + 1.0f;
  const int32_t scale_bits = (k_int + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return e_r * scale;
}

inline float exp_any(float x) { return exp_of_clamped_any(clamp_exp_any(x)); }

constexpr int64_t kSiluSpan = 256;  // columns whose exp silu_mul computes together

template <typename T>
int silu_mul(T* out, const T* gate_up, int64_t rows, int64_t cols, int threads) {
  if (rows < 0 || cols <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * cols, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * cols;
    const T* up = gate + cols;
    T* o = out + r * cols;
    float e[kSiluSpan];  // exp(-gate) of a span of columns: exp_any in two loops (above)
    for (int64_t start = 0; start < cols; start += kSiluSpan) {
      const int64_t span = std::min(kSiluSpan, cols - start);
      for (int64_t j = 0; j < span; ++j) e[j] = clamp_exp_any(-to_float(gate[start + j]));
      for (int64_t j = 0; j < span; ++j) e[j] = exp_of_clamped_any(e[j]);
      for (int64_t j = 0; j < span; ++j) {
        const float g = to_float(gate[start + j]);
        const float silu = round_to<T>(g / (1.0f + e[j]));
        o[start + j] = from_float<T>(silu * to_float(up[start + j]));
      }
    }
  }
  return 0;
}

// One token's heads; each product and the sum rounded as torch rounds them (see the header).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_token(
    T* out, const T* x, const T* cos, const T* sin, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * head_dim;
    T* oh = out + h * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) {
      const float value = to_float(xh[i]);
      const float partner = i < half ? -to_float(xh[i + half]) : to_float(xh[i - half]);
      const float straight = round_to<T>(value * to_float(cos[i]));
      const float turned = round_to<T>(partner * to_float(sin[i]));
      oh[i] = from_float<T>(straight + turned);
    }
  }
}

template <typename T>
int rotary(T* out, const T* x, int64_t token_stride, const T* cos, const T* sin, int64_t tokens,
           int64_t heads, int64_t head_dim, int threads) {
  if (tokens < 0 || heads <= 0 || head_dim <= 0 || head_dim % 2 || token_stride < heads * head_dim) {
    return -1;
  }
#pragma omp parallel for schedule(static) num_threads(threads_for(tokens * heads * head_dim, threads))
  for (int64_t t = 0; t < tokens; ++t) {
    rotate_token(out + t * heads * head_dim, x + t * token_stride, cos + t * head_dim,
                 sin + t * head_dim, heads, head_dim);
  }
  return 0;
}

}  // namespace

extern "C" {

int splitserve_rotary_bf16(uint16_t* out, const uint16_t* x, int64_t token_stride,
                           const uint16_t* cos, const uint16_t* sin, int64_t tokens,
                           int64_t heads, int64_t head_dim, int threads) {
  return rotary(out, x, token_stride, cos, sin, tokens, heads, head_dim, threads);
}

int splitserve_rotary_f32(float* out, const float* x, int64_t token_stride, const float* cos,
                          const float* sin, int64_t tokens, int64_t heads, int64_t head_dim,
                          int threads) {
  return rotary(out, x, token_stride, cos, sin, tokens, heads, head_dim, threads);
}

int splitserve_silu_mul_bf16(uint16_t* out, const uint16_t* gate_up, int64_t rows, int64_t cols,
                             int threads) {
  return silu_mul(out, gate_up, rows, cols, threads);
}

int splitserve_silu_mul_f32(float* out, const float* gate_up, int64_t rows, int64_t cols,
                            int threads) {
  return silu_mul(out, gate_up, rows, cols, threads);
}

int splitserve_add_rms_norm_bf16(uint16_t* hidden, const uint16_t* delta, const uint16_t* weight,
                                 uint16_t* out, int64_t rows, int64_t cols, float eps,
                                 int threads) {
  if (rows < 0 || cols <= 0) return -1;
#pragma omp parallel num_threads(threads_for(rows * cols, threads))
  {
    std::vector<float> row(cols);
    std::vector<float> scale(cols);
    for (int64_t c = 0; c < cols; ++c) scale[c] = bf16_to_float(weight[c]);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* h = hidden + r * cols;
      if (delta != nullptr) {
        const uint16_t* d = delta + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t sum = float_to_bf16(bf16_to_float(h[c]) + bf16_to_float(d[c]));
          h[c] = sum;
          row[c] = bf16_to_float(sum);
        }
      } else {
        load_row(h, row.data(), cols);
      }
      const float inverse_rms =
          1.0f / std::sqrt(sum_of_squares(row.data(), cols) / static_cast<float>(cols) + eps);
      uint16_t* o = out + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        o[c] = float_to_bf16(row[c] * inverse_rms * scale[c]);
      }
    }
  }
  return 0;
}

int splitserve_add_rms_norm_f32(float* hidden, const float* delta, const float* weight,
                                float* out, int64_t rows, int64_t cols, float eps, int threads) {
  if (rows < 0 || cols <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * cols, threads))
  for (int64_t r = 0; r < rows; ++r) {
    float* h = hidden + r * cols;
    if (delta != nullptr) {
      const float* d = delta + r * cols;
      for (int64_t c = 0; c < cols; ++c) h[c] = h[c] + d[c];
    }
    const float inverse_rms =
        1.0f / std::sqrt(sum_of_squares(h, cols) / static_cast<float>(cols) + eps);
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = weight[c] * (h[c] * inverse_rms);
  }
  return 0;
}

}  // extern "C"
