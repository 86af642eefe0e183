// Rows of the pdserve_cpu kernels to and from float: plain loops the compiler vectorizes. bfloat16 is
// the top half of a float: a shift each way, rounding to nearest even on the way back (NaN stays NaN).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pdserve_rows {

// NaN by its bits: the library is built with -ffast-math, under which std::isnan may fold to false.
inline bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// A float's bits rounded to bfloat16 (to nearest even), as the top 16 bits; NaN stays a (quiet) NaN.
inline uint32_t bf16_bits(uint32_t u) {
  return is_nan_bits(u) ? ((u >> 16) | 0x40u) : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x rounded to T's precision and back: the rounding an eager op's output in T makes.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <>
inline float round_to<float>(float x) {
  return x;
}

template <>
inline float round_to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = bf16_bits(u) << 16;
  std::memcpy(&x, &u, 4);
  return x;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint16_t>(bf16_bits(s[i]));
}

}  // namespace pdserve_rows
