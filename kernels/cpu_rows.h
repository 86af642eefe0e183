// Rows of the pdserve_cpu kernels to and from float: plain loops the compiler vectorizes. bfloat16 is
// the top half of a float: a shift each way, rounding to nearest even on the way back (NaN stays NaN).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace pdserve_rows {

// An error message from strings and numbers, joined with std::string and std::to_string only. TORCH_CHECK's
// own formatting streams numbers through std::ostream, and where a toolchain links its own copy of the
// C++ library into the extension (seen: a GPU host's g++ 13.3 wrapper with torch 2.11), that copy's
// stream facets are never set up and formatting a number crashed the process (a gdb backtrace:
// basic_ostream::_M_insert<long> -> codecvt::do_unshift inside the extension). Strings alone never
// touch the facets.
inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline std::string piece(T v) {
  return std::to_string(v);
}
template <typename... A>
std::string message(const A&... parts) {
  std::string s;
  ((s += piece(parts)), ...);
  return s;
}

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

// TORCH_CHECK with the message built by pdserve_rows::message (only when the check fails).
#define PDSERVE_CHECK(cond, ...) TORCH_CHECK(cond, ::pdserve_rows::message(__VA_ARGS__))
