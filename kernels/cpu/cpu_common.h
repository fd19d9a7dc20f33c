// Helpers shared by the CPU kernels (see cpu_build.py): f16 and bf16 <-> float32 and a vectorizable
// exp. Header-only; every function is inline.
#pragma once

#include <cstdint>
#include <cstring>

namespace splitserve_cpu {

constexpr int kLanes = 16;  // one AVX-512 register of floats; loops below vectorize by lanes

inline float bf16_to_float(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// An IEEE half's exact float32 value (every half is a float32; subnormals, infinities, NaNs).
inline float f16_to_float(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1Fu, mantissa = value & 0x3FFu;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays a quiet NaN
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline void load_row(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
inline void load_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void store_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}
inline void store_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// exp(x) for x <= 0 (softmax arguments after subtracting the max); relative error below 1e-7.
// x = k*ln2 + r with k = round(x/ln2), |r| <= ln2/2; exp(r) by its degree-7 Taylor polynomial
// in f = r/ln2 (2^f, truncation error ~5e-9); 2^k built in the exponent bits. Branch-free, so
// loops over it vectorize with AVX-512. With AVX2 only GCC turns the clamp below kExpFloor into
// a branch (it threads the clamped case through the polynomial), so a loop over
// exp_nonpositive stays scalar there; a loop that clamps first and then calls
// exp_of_clamped (the same arithmetic, so the same bits) vectorizes at every level.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kExpFloor = -87.0f;  // keeps 2^k normal; exp(-87) ~ 1.6e-38
// 2^f = sum_i kExp2Taylor[i] * f^(7-i): (ln 2)^n / n!, highest degree first.
constexpr float kExp2Taylor[8] = {1.525273380405984e-05f,  1.5403530393381608e-04f,
                                  1.3333558146428443e-03f, 9.6181291076284772e-03f,
                                  5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                  6.9314718055994531e-01f, 1.0f};

// exp(x) for x in [kExpFloor, 0], by exp_nonpositive's arithmetic without its clamp.
inline float exp_of_clamped(float x) {
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = x * kLog2e;
  float shifted = t + kRoundMagic;
  float k = shifted - kRoundMagic;
  int32_t k_int;
  std::memcpy(&k_int, &shifted, sizeof(k_int));
  k_int -= 0x4b400000;  // the integer sits in the low mantissa bits of `shifted`
  float f = t - k;      // in [-0.5, 0.5]
  float p = kExp2Taylor[0];
  for (int i = 1; i < 8; ++i) p = p * f + kExp2Taylor[i];
  int32_t scale_bits = (k_int + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

inline float exp_nonpositive(float x) { return exp_of_clamped(x < kExpFloor ? kExpFloor : x); }

// out[i] = exp_nonpositive(in[i] - shift) for i < n (shift >= every in[i]; out may be in), in
// the two loops that vectorize at every level (clamp, then exp_of_clamped): the same bits.
inline void exp_nonpositive_shifted(const float* in, float shift, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float shifted = in[i] - shift;
    out[i] = shifted < kExpFloor ? kExpFloor : shifted;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = exp_of_clamped(out[i]);
}

}  // namespace splitserve_cpu
