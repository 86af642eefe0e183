// fp16 <-> float by integer arithmetic, exact as torch's and numpy's conversions are, for the GGUF
// kernels (cpu_gguf_repack.cpp, cpu_gguf_dequant.cpp). The library is built with -ffast-math (flush to
// zero, reassociation), under which the usual float tricks for these conversions are not exact; here
// the only float operation is a multiplication by a power of two that lands on a normal float.
#pragma once

#include <cstdint>
#include <cstring>

namespace pdserve_half {

// A float's bits rounded to fp16 (to nearest even), as torch's float -> half rounds: overflow to
// infinity, fp16 subnormals rounded at their own precision, NaN as the quiet NaN of its sign.
inline uint16_t half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // 65520 and up round to infinity
  if (a >= 0x38800000u)  // a normal fp16 (2^-14 and up): drop 13 bits, to nearest even, and rebias
    return static_cast<uint16_t>(sign | ((a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u) >> 13));
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // 2^-25 and below: zero (2^-25 ties to even)
  const uint32_t shift = 126u - (a >> 23);  // 14..24: an fp16 subnormal counts units of 2^-24
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t q = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (q & 1u))) ++q;  // may carry into the smallest normal: still right
  return static_cast<uint16_t>(sign | q);
}

// fp16 bits as a float: exact, subnormals included, infinities and NaN payloads kept (numpy's
// astype(float32) and torch's .float() give the same bits). Selects, no loops: loops over rows of
// these vectorize.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, em = h & 0x7FFFu;
  uint32_t bits;
  if (em >= 0x7C00u) {
    bits = (em << 13) | 0x7F800000u;  // infinity, NaN
  } else if (em >= 0x0400u) {
    bits = (em << 13) + 0x38000000u;  // normal: rebias the exponent by 127 - 15
  } else {
    const float sub = static_cast<float>(em) * 5.9604644775390625e-08f;  // em 2^-24, exact
    std::memcpy(&bits, &sub, 4);
  }
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A GGUF file's little-endian fp16 field as a float.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

}  // namespace pdserve_half
