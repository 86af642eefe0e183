// GGUF's block formats, each decoding its blocks to float32 exactly as the `gguf` package's numpy
// dequantization does (quants.py; layouts as llama.cpp's ggml-common.h), for cpu_gguf_dequant.cpp.
//
// Every product in these decodings is exact in float32: an fp16 scale (11 significant bits) times
// integers of at most 13 bits together (Q6_K's 7-bit scale and 6-bit code), and fp16 subnormals are
// normal floats. So the one rounding is the final addition of a minimum (Q4_1, Q5_1, the K-quants),
// done in numpy's order, and -ffast-math's contraction into FMA, or a reordering of the exact
// products, cannot change a bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_half.h"
#include "cpu_rows.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "cpu_gguf_blocks.h reads GGUF's little-endian fields with plain loads"
#endif

namespace pdserve_gguf {

using pdserve_half::half_at;

// Each format decodes one block of kWeights weights from kBytes bytes into y, as quants.py does.
struct F32 {
  static constexpr int64_t kWeights = 1, kBytes = 4;
  static void decode(const uint8_t* b, float* y) { std::memcpy(y, b, 4); }
};

struct F16 {
  static constexpr int64_t kWeights = 1, kBytes = 2;
  static void decode(const uint8_t* b, float* y) { y[0] = half_at(b); }
};

struct BF16 {  // the top half of a float
  static constexpr int64_t kWeights = 1, kBytes = 2;
  static void decode(const uint8_t* b, float* y) {
    uint16_t h;
    std::memcpy(&h, b, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    std::memcpy(y, &bits, 4);
  }
};

struct Q4_0 {  // d, qs[16]: w = d (q - 8); element j the low nibble of qs[j], j + 16 its high nibble
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b);
    for (int j = 0; j < 16; ++j) y[j] = d * static_cast<float>((b[2 + j] & 15) - 8);
    for (int j = 0; j < 16; ++j) y[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
  }
};

struct Q4_1 {  // d, m, qs[16]: w = d q + m
  static constexpr int64_t kWeights = 32, kBytes = 20;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b), m = half_at(b + 2);
    for (int j = 0; j < 16; ++j) y[j] = d * static_cast<float>(b[4 + j] & 15) + m;
    for (int j = 0; j < 16; ++j) y[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
  }
};

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Q5_0 {  // d, qh[4], qs[16]: element i's fifth bit is bit i of qh; w = d (q - 16)
  static constexpr int64_t kWeights = 32, kBytes = 22;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b);
    const uint32_t qh = u32_at(b + 2);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[6 + j] & 15) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (b[6 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo - 16);
      y[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
};

struct Q5_1 {  // d, m, qh[4], qs[16]: w = d q + m
  static constexpr int64_t kWeights = 32, kBytes = 24;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[8 + j] & 15) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (b[8 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo) + m;
      y[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
};

struct Q8_0 {  // d, qs[32] int8: w = q d
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  }
};

// Sub-block j's 6-bit scale and minimum of Q4_K's and Q5_K's 12 bytes (llama.cpp's get_scale_min_k4).
inline void k_scale_min(const uint8_t* s, int j, float* sc, float* mn) {
  *sc = static_cast<float>(j < 4 ? (s[j] & 63) : ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)));
  *mn = static_cast<float>(j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)));
}

// Q4_K: d, dmin, scales[12], qs[128]; sub-block j (32 weights): the low (j even) or high (j odd)
// nibbles of the 32 bytes at 32 (j / 2); w = (d sc_j) q - dmin m_j.
struct Q4_K {
  static constexpr int64_t kWeights = 256, kBytes = 144;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      float sc, mn;
      k_scale_min(b + 4, j, &sc, &mn);
      const float dl = d * sc, ml = dmin * mn;
      const uint8_t* q = b + 16 + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int i = 0; i < 32; ++i) y[32 * j + i] = dl * static_cast<float>((q[i] >> shift) & 15) - ml;
    }
  }
};

// Q5_K: d, dmin, scales[12], qh[32], qs[128]: Q4_K's codes, sub-block j's fifth bit bit j of qh[i].
struct Q5_K {
  static constexpr int64_t kWeights = 256, kBytes = 176;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* qh = b + 16;
    for (int j = 0; j < 8; ++j) {
      float sc, mn;
      k_scale_min(b + 4, j, &sc, &mn);
      const float dl = d * sc, ml = dmin * mn;
      const uint8_t* q = b + 48 + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int i = 0; i < 32; ++i) {
        const int code = ((q[i] >> shift) & 15) | (((qh[i] >> j) & 1) << 4);
        y[32 * j + i] = dl * static_cast<float>(code) - ml;
      }
    }
  }
};

// Q6_K: ql[128], qh[64], scales[16] int8, d; per half h of 128 weights (llama.cpp's dequantize_row_q6_K),
// weight 32 u + l (u < 4, l < 32) has low 4 bits nibble u / 2 of ql[64 h + 32 (u % 2) + l], top 2 bits
// (qh[32 h + l] >> 2 u) & 3; w = (d sc) (q - 32), one scale per 16 weights.
struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static void decode(const uint8_t* b, float* y) {
    const float d = half_at(b + 208);
    float ds[16];
    for (int i = 0; i < 16; ++i) ds[i] = d * static_cast<float>(static_cast<int8_t>(b[192 + i]));
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      const float* sc = ds + 8 * h;
      float* out = y + 128 * h;
      for (int half = 0; half < 2; ++half) {
        const float s0 = sc[half], s1 = sc[half + 2], s2 = sc[half + 4], s3 = sc[half + 6];
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          out[l] = s0 * static_cast<float>(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
          out[l + 32] = s1 * static_cast<float>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
          out[l + 64] = s2 * static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          out[l + 96] = s3 * static_cast<float>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
    }
  }
};

template <typename B>
void dequant_row(const uint8_t* src, float* dst, int64_t k) {
  for (int64_t i = 0; i < k / B::kWeights; ++i) B::decode(src + i * B::kBytes, dst + i * B::kWeights);
}

template <>
inline void dequant_row<F32>(const uint8_t* src, float* dst, int64_t k) {
  std::memcpy(dst, src, 4 * k);
}

using RowFn = void (*)(const uint8_t*, float*, int64_t);

// A type's row decoder and its block: weights, bytes.
struct Format {
  RowFn row;
  int64_t weights, bytes;
};

template <typename B>
Format format() {
  return {&dequant_row<B>, B::kWeights, B::kBytes};
}

// The format of a GGML type id; an error naming the types there are for any other.
inline Format format_of(int64_t ggml_type) {
  switch (ggml_type) {
    case 0: return format<F32>();
    case 1: return format<F16>();
    case 2: return format<Q4_0>();
    case 3: return format<Q4_1>();
    case 6: return format<Q5_0>();
    case 7: return format<Q5_1>();
    case 8: return format<Q8_0>();
    case 12: return format<Q4_K>();
    case 13: return format<Q5_K>();
    case 14: return format<Q6_K>();
    case 30: return format<BF16>();
    default: break;
  }
  PDSERVE_CHECK(false, "gguf: GGML type ", ggml_type, " is not one of F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), ",
                "Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14), BF16 (30)");
  return {};
}

}  // namespace pdserve_gguf
