// Weight-only quantized linears for few rows (decode steps) on CPU: y = x @ W^T with W read as 4-bit or
// 8-bit codes. A decode step at batch 1 is a stream of weight reads; these kernels keep that stream
// fed, where torch's packed kernels reached ~10 GB/s on a machine whose caches give ~47 (measured, see
// cpu_quant_linear.py). Both lay the weights out by blocks of 16 output rows, so that the 16 lanes of
// an AVX-512 register (or two AVX2 registers of 8) are 16 output rows and each input value is
// broadcast: no horizontal sums. One packed layout for every instruction set.
//
//   int4_linear(x [..., K], packed [N/16, K/32, 320] uint8, N, bias?) -> [..., N] in x's dtype: x is
//       multiplied as bf16 and the result rounded to bf16 (as torch's int4 kernel takes and gives)
//       w = q * scale + minimum per group of 32 along K (GGUF's Q4_1). Per block of 16 rows and group,
//       4 chunks of 64 bytes (one 16-bit word per row and pair of inputs, 4 nibbles a word: nibble s of
//       row l's word j in chunk c holds q[l, 8c + 2s + j % 2] for j = 2l + j % 2), then 16 fp16 scales
//       and 16 fp16 minimums. A nibble q ORed into the bf16 bits of 128.0 is the bf16 value 128 + q, so
//       one `vpternlogd` decodes 32 codes; AVX512-BF16's `vdpbf16ps` multiplies them by pairs of inputs
//       (products exact in fp32, fp32 sums), and per group
//           y += scale * sum((128 + q) x) + (minimum - 128 scale) * sum(x).
//       Without AVX512-BF16 (AVX2 + FMA + F16C, or AVX-512 without BF16), x is multiplied as fp32 and the
//       result kept in fp32 until it is returned in x's dtype: each nibble is shifted, masked and
//       converted to fp32 (8 rows a register), y += scale * sum(q x) + minimum * sum(x) per group.
//   int8_linear(x [..., K], packed [N/16, K, 16] int8, scale [N] fp32, bias?) -> [..., N] in x's dtype
//       w = q * scale per output row (w8a16); codes widened to fp32 and multiplied by fp32 inputs.
//   int4_unpack_t_(packed [N/16, K/32, 320], out [K, N] fp32): the dequantized weights, transposed
//       (each input's 16 rows are contiguous there), for the many-row steps of a model that keeps no
//       dense copy: out is a scratch the caller owns, and x @ out is torch's GEMM.
//
// The kernels need AVX2 + FMA + F16C at least (the build's target, cpu_isa.py); `quant_linear_support()`
// says which this build has, and cpu_quant_linear.py keeps torch's kernels elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define PDSERVE_QUANT_512 1  // int8 (and int4 with BF16) in 16-lane registers
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_QUANT_256 1  // both in two 8-lane registers per block
#endif
#if defined(__AVX512BF16__)
#define PDSERVE_INT4_BF16 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_INT4_FP32 1
#endif

#include "cpu_rows.h"

namespace {

constexpr int64_t kRows = 16;        // output rows per block: the lanes of a register
constexpr int64_t kGroup = 32;       // int4: inputs per scale
constexpr int64_t kGroupBytes = 320; // int4: 256 bytes of codes, 16 fp16 scales, 16 fp16 minimums
constexpr int64_t kPrefetchGroups = 4; // int4: how far ahead each weight stream is prefetched (2-4 measured alike, best of 0-8)

// Each block's groups are one stretch of memory ([N/16, K/32, 320]); a tile reads several blocks at once,
// which keeps several streams in flight (one stream of 4 blocks side by side measured 10-15% slower).
inline const uint8_t* int4_group(const uint8_t* packed, int64_t block, int64_t g, int64_t groups) {
  return packed + (block * groups + g) * kGroupBytes;
}

// Each of blocks b0 .. b0 + NB's weight streams, group kPrefetchGroups ahead of g, requested now: the
// hardware prefetchers alone kept a core's weight stream at ~10 GB/s where a plain sum reads ~43 (EPYC,
// AVX512-BF16, no AMX).
template <int NB>
inline void prefetch_ahead(const uint8_t* packed, int64_t b0, int64_t g, int64_t groups) {
  if (g + kPrefetchGroups >= groups) return;
  for (int b = 0; b < NB; ++b) {
    const char* ahead = reinterpret_cast<const char*>(int4_group(packed, b0 + b, g + kPrefetchGroups, groups));
    for (int64_t line = 0; line < kGroupBytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);  // prefetcht0
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The AVX2 tiles' group epilogue: acc += scale * factor(m) * dot + minimum * sum(x) for group g, each block
// as two registers of 8 rows (factor: 1 for fp32 inputs, the group's dx for int8 ones).
template <int MR, int NB, typename Factor>
inline void add_group_256(__m256 (&acc)[MR][NB][2], const __m256 (&dot)[MR][NB][2], const uint8_t* packed,
                          int64_t b0, int64_t g, int64_t groups, const float* xsum, int64_t m0, const Factor& factor) {
  for (int b = 0; b < NB; ++b) {
    const uint8_t* sp = int4_group(packed, b0 + b, g, groups) + 256;
    for (int hh = 0; hh < 2; ++hh) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16 * hh)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32 + 16 * hh)));
      for (int m = 0; m < MR; ++m) {
        const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(factor(m)));
        acc[m][b][hh] = _mm256_fmadd_ps(dot[m][b][hh], s, acc[m][b][hh]);
        acc[m][b][hh] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[(m0 + m) * groups + g]), minimum, acc[m][b][hh]);
      }
    }
  }
}

template <int MR, int NB>
inline void store_tile_256(const __m256 (&acc)[MR][NB][2], float* out, int64_t N, int64_t m0, int64_t b0) {
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b)
      for (int hh = 0; hh < 2; ++hh) _mm256_storeu_ps(out + (m0 + m) * N + (b0 + b) * kRows + 8 * hh, acc[m][b][hh]);
}
#endif

// Every row of x against output blocks [begin, end) of a thread's share: tiles of up to 4 rows and
// 2-8 blocks (fewer rows, more blocks), so that enough independent sums and weight streams are in
// flight. tile(MR, NB, m0, b0) computes rows m0 .. m0 + MR against blocks b0 .. b0 + NB; MR and NB
// arrive as std::integral_constant, for the kernels' templates.
// Sixteen AVX2 registers hold half the sums of 32 AVX-512 ones: half the blocks per tile there.
template <typename Tile>
void for_tiles(int64_t rows, int64_t begin, int64_t end, const Tile& tile, bool narrow) {
  auto blocks = [&](auto mr, int64_t m0) {
    constexpr int NB = mr() == 1 ? 8 : mr() == 2 ? 4 : 2;
    if (narrow) {
      constexpr int NN = NB / 2;
      int64_t b = begin;
      for (; b + NN <= end; b += NN) tile(mr, std::integral_constant<int, NN>{}, m0, b);
      for (; b < end; ++b) tile(mr, std::integral_constant<int, 1>{}, m0, b);
      return;
    }
    int64_t b = begin;
    for (; b + NB <= end; b += NB) tile(mr, std::integral_constant<int, NB>{}, m0, b);
    for (; b < end; ++b) tile(mr, std::integral_constant<int, 1>{}, m0, b);
  };
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) blocks(std::integral_constant<int, 4>{}, m);
  switch (rows - m) {
    case 3: blocks(std::integral_constant<int, 3>{}, m); break;
    case 2: blocks(std::integral_constant<int, 2>{}, m); break;
    case 1: blocks(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

#if defined(PDSERVE_INT4_BF16)
// Rows m0 .. m0 + MR of x times blocks b0 .. b0 + NB of the packed int4 weights.
template <int MR, int NB>
void int4_tile(const uint16_t* x, const float* xsum, const uint8_t* packed, uint16_t* out, int64_t K,
               int64_t N, int64_t m0, int64_t b0) {
  const int64_t groups = K / kGroup;
  const __m512i nibble = _mm512_set1_epi32(0x000f000f);
  const __m512i bf16_128 = _mm512_set1_epi32(0x43004300);
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead<NB>(packed, b0, g, groups);
    __m512 part[MR][NB][2];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b) part[m][b][0] = part[m][b][1] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = int4_group(packed, b0 + b, g, groups) + 64 * c;
        const __m512i w = _mm512_loadu_si512(p);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
          const __m512i shifted = s == 0 ? w : _mm512_srli_epi16(w, 4 * s);
          // (shifted & 0xf) | 0x4300: the bf16 value 128 + q in every 16-bit lane
          const __m512bh codes = (__m512bh)_mm512_ternarylogic_epi32(shifted, nibble, bf16_128, 0xEA);
          for (int m = 0; m < MR; ++m) {
            int32_t pair;
            __builtin_memcpy(&pair, x + (m0 + m) * K + g * kGroup + 8 * c + 2 * s, 4);
            part[m][b][s & 1] = _mm512_dpbf16_ps(part[m][b][s & 1], codes, (__m512bh)_mm512_set1_epi32(pair));
          }
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* sp = int4_group(packed, b0 + b, g, groups) + 256;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 32)));
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), scale, minimum);  // minimum - 128 scale
      for (int m = 0; m < MR; ++m) {
        const __m512 dot = _mm512_add_ps(part[m][b][0], part[m][b][1]);
        acc[m][b] = _mm512_fmadd_ps(dot, scale, acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(m0 + m) * groups + g]), offset, acc[m][b]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + m) * N + (b0 + b) * kRows),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][b]));
}

#endif

#if defined(PDSERVE_INT4_FP32)
// The fp32 form of int4_tile: rows m0 .. m0 + MR of x (fp32) times blocks b0 .. b0 + NB. A block's chunk
// c is two 32-byte halves (rows 0-7, rows 8-15); in a half, lane l's 32 bits hold row l's codes of the
// chunk's 8 inputs, input 8c + 2s + h at bit 4s + 16h. Per group, dot = sum(q x) in one register per
// row, half and block (independent FMA chains), then acc += scale * dot + minimum * sum(x).
template <int MR, int NB>
void int4_tile_fp32(const float* x, const float* xs, const float* xsum, const uint8_t* packed, float* out,
                    int64_t K, int64_t N, int64_t m0, int64_t b0) {
  const int64_t groups = K / kGroup;
  const __m256i nibble = _mm256_set1_epi32(0xf), nibble_high = _mm256_set1_epi32(0xf0000);
  __m256 acc[MR][NB][2];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead<NB>(packed, b0, g, groups);
    __m256 dot[MR][NB][2];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b) dot[m][b][0] = dot[m][b][1] = _mm256_setzero_ps();
    const float* xg = x + g * kGroup;
    for (int c = 0; c < 4; ++c) {
      // Input 8c + 2s + h is nibble s of word h: one shift by 4s serves both words, the low word's code
      // masked as q, the high word's as q * 65536 (converted exactly, its input scaled by 2^-16).
#pragma GCC unroll 4
      for (int sh = 0; sh < 4; ++sh) {
        for (int b = 0; b < NB; ++b) {
          const uint8_t* p = int4_group(packed, b0 + b, g, groups) + 64 * c;
          for (int hh = 0; hh < 2; ++hh) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * hh));
            const __m256i t = sh == 0 ? w : _mm256_srli_epi32(w, 4 * sh);
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(t, nibble));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(t, nibble_high));
            // inputs broadcast from memory at each use (a load, not a register held across the loop:
            // sixteen registers hold the sums)
            for (int m = 0; m < MR; ++m) {
              const float* xm = xg + (m0 + m) * K + 8 * c + 2 * sh;
              dot[m][b][hh] = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(xm), dot[m][b][hh]);
              dot[m][b][hh] = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(xs + (xm - x) + 1), dot[m][b][hh]);
            }
          }
        }
      }
    }
    add_group_256(acc, dot, packed, b0, g, groups, xsum, m0, [](int) { return 1.f; });
  }
  store_tile_256(acc, out, N, m0, b0);
}
#endif

// x [..., K] as rows of K contiguous values in `dtype` (converted where it is another dtype).
at::Tensor input_rows(const at::Tensor& x, const at::Tensor& packed, int64_t k, at::ScalarType dtype) {
  PDSERVE_CHECK(x.dim() >= 1 && x.size(-1) == k, "x has ", x.size(-1), " inputs, the weights take ", k);
  PDSERVE_CHECK(x.device().is_cpu() && packed.is_contiguous() && packed.device().is_cpu(),
              "x and the packed weights must be on CPU, the weights contiguous");
  PDSERVE_CHECK(at::isFloatingType(x.scalar_type()), "x must be a floating-point tensor");
  return x.reshape({-1, k}).to(dtype).contiguous();
}

// out [rows, n] (in the kernel's dtype) as x's shape and dtype, plus the bias (rounded as the eager add).
at::Tensor output(at::Tensor out, const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  out = out.to(x.scalar_type()).view(shape);
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

// sum(x) per row and group of 32 inputs, in float: the minimums' share of each group.
std::vector<float> group_sums(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<float> xsum(rows * groups);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) s += x[m * k + g * kGroup + i];
      xsum[m * groups + g] = s;
    }
  return xsum;
}

void check_int4(const at::Tensor& packed, int64_t n) {
  PDSERVE_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == kGroupBytes,
              "packed int4 weights must be [N/16, K/32, 320] uint8");
  PDSERVE_CHECK(packed.size(0) * kRows == n, "packed int4 weights have ", packed.size(0) * kRows, " rows, not ", n);
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
#if defined(PDSERVE_INT4_BF16)
  check_int4(packed, n);
  const int64_t k = packed.size(1) * kGroup;
  const at::Tensor x = input_rows(x_in, packed, k, at::kBFloat16);
  const int64_t rows = x.size(0), blocks = n / kRows;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return output(out, x_in, n, bias);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xf(rows * k);
  for (int64_t m = 0; m < rows; ++m) pdserve_rows::load_row(x.data_ptr<c10::BFloat16>() + m * k, xf.data() + m * k, k);
  const std::vector<float> xsum = group_sums(xf.data(), rows, k);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for_tiles(rows, begin, end, [&](auto mr, auto nb, int64_t m0, int64_t b0) {
      int4_tile<mr(), nb()>(xp, xsum.data(), wp, op, k, n, m0, b0);
    }, false);
  });
  return output(out, x_in, n, bias);
#elif defined(PDSERVE_INT4_FP32)
  check_int4(packed, n);
  const int64_t k = packed.size(1) * kGroup;
  const at::Tensor x = input_rows(x_in, packed, k, at::kFloat);
  const int64_t rows = x.size(0), blocks = n / kRows;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return output(out, x_in, n, bias);
  const float* xp = x.data_ptr<float>();
  const std::vector<float> xsum = group_sums(xp, rows, k);
  std::vector<float> xs(rows * k);  // x / 65536: the inputs of the codes read as q * 65536
  for (int64_t i = 0; i < rows * k; ++i) xs[i] = xp[i] * (1.f / 65536.f);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for_tiles(rows, begin, end, [&](auto mr, auto nb, int64_t m0, int64_t b0) {
      int4_tile_fp32<mr(), nb()>(xp, xs.data(), xsum.data(), wp, op, k, n, m0, b0);
    }, true);
  });
  return output(out, x_in, n, bias);
#else
  PDSERVE_CHECK(false, "int4_linear needs AVX2 + FMA + F16C, which this build does not target");
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_INT4_A8 1
// int4_linear_a8: the int4 weights times x quantized to int8 per row and group of 32 inputs (x ~ dx * xq,
// dx = max|x| / 127, round to nearest), integer dot products as llama.cpp's Q4_1 x Q8_1: per group
//     y += scale * dx * sum(q * xq) + minimum * dx * sum(xq)
// Both terms multiply the same quantized x, so the error is sum(w * (dx xq - x)) with w = scale q + minimum
// centred on zero; the exact sum(x) in the second term would leave minimum * sum(dx xq - x) besides, which
// GGUF's minimums (about -8 scales) make the larger part: on the bundled model, KL to fp32 over a passage
// 0.0137 with the exact sum, 0.0032 with this one (w4a16 0.0011).
// In a 32-bit lane (one output row) a chunk's word pair holds the codes of inputs 8c + {0, 2, 4, 6}
// (word 0) and 8c + {1, 3, 5, 7} (word 1), a nibble each: the low nibbles of its 4 bytes are inputs
// 8c + {0, 4, 1, 5}, the high ones 8c + {2, 6, 3, 7}. `vpmaddubsw` multiplies those unsigned bytes by the
// matching signed bytes of x (xpat: the same 4 inputs broadcast to every lane) and adds pairs; products
// are at most 15 * 127, so the 16-bit sums of 4 cannot overflow.
struct XPattern {
  std::vector<int32_t> pat;  // [rows, K/8, 2]: inputs {0,4,1,5} and {2,6,3,7} of each chunk as 4 bytes
  std::vector<float> dx;     // [rows, K/32]
  std::vector<float> sum;    // [rows, K/32]: dx * sum(xq), the minimums' share
};

XPattern quantize_a8(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  XPattern out{std::vector<int32_t>(rows * (k / 8) * 2), std::vector<float>(rows * groups),
               std::vector<float>(rows * groups)};
  static constexpr int kLo[4] = {0, 4, 1, 5}, kHi[4] = {2, 6, 3, 7};
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * k + g * kGroup;
      float amax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      out.dx[m * groups + g] = d;
      int8_t q[kGroup];
      int32_t qsum = 0;
      for (int64_t i = 0; i < kGroup; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(xg[i] * inv));
        qsum += q[i];
      }
      out.sum[m * groups + g] = d * static_cast<float>(qsum);
      for (int64_t c = 0; c < 4; ++c) {
        uint8_t lo[4], hi[4];
        for (int j = 0; j < 4; ++j) {
          lo[j] = static_cast<uint8_t>(q[8 * c + kLo[j]]);
          hi[j] = static_cast<uint8_t>(q[8 * c + kHi[j]]);
        }
        int32_t* dst = out.pat.data() + ((m * (k / 8)) + g * 4 + c) * 2;
        std::memcpy(dst, lo, 4);
        std::memcpy(dst + 1, hi, 4);
      }
    }
  return out;
}

template <int MR, int NB>
void int4_tile_a8(const XPattern& xq, const float* xsum, const uint8_t* packed, float* out, int64_t K, int64_t N,
                  int64_t m0, int64_t b0) {
  const int64_t groups = K / kGroup, chunks = K / 8;
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NB][2];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_ahead<NB>(packed, b0, g, groups);
    __m256i dot[MR][NB][2];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b) dot[m][b][0] = dot[m][b][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = int4_group(packed, b0 + b, g, groups) + 64 * c;
        for (int hh = 0; hh < 2; ++hh) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * hh));
          const __m256i lo = _mm256_and_si256(w, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
          for (int m = 0; m < MR; ++m) {
            const int32_t* xp = xq.pat.data() + ((m0 + m) * chunks + g * 4 + c) * 2;
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xp[0])),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xp[1])));
            dot[m][b][hh] = _mm256_add_epi32(dot[m][b][hh], _mm256_madd_epi16(s16, ones));
          }
        }
      }
    }
    __m256 dotf[MR][NB][2];
    for (int m = 0; m < MR; ++m)
      for (int b = 0; b < NB; ++b)
        for (int hh = 0; hh < 2; ++hh) dotf[m][b][hh] = _mm256_cvtepi32_ps(dot[m][b][hh]);
    add_group_256(acc, dotf, packed, b0, g, groups, xsum, m0, [&](int m) { return xq.dx[(m0 + m) * groups + g]; });
  }
  store_tile_256(acc, out, N, m0, b0);
}
#endif

at::Tensor int4_linear_a8(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                          const c10::optional<at::Tensor>& bias) {
#if defined(PDSERVE_INT4_A8)
  check_int4(packed, n);
  const int64_t k = packed.size(1) * kGroup;
  const at::Tensor x = input_rows(x_in, packed, k, at::kFloat);
  const int64_t rows = x.size(0), blocks = n / kRows;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return output(out, x_in, n, bias);
  const float* xp = x.data_ptr<float>();
  const XPattern xq = quantize_a8(xp, rows, k);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for_tiles(rows, begin, end, [&](auto mr, auto nb, int64_t m0, int64_t b0) {
      int4_tile_a8<mr(), nb()>(xq, xq.sum.data(), wp, op, k, n, m0, b0);
    }, true);
  });
  return output(out, x_in, n, bias);
#else
  PDSERVE_CHECK(false, "int4_linear_a8 needs AVX2 + FMA + F16C, which this build does not target");
#endif
}

void int4_unpack_t_(const at::Tensor& packed, at::Tensor& out) {
  PDSERVE_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == kGroupBytes &&
                  packed.is_contiguous(),
              "packed int4 weights must be contiguous [N/16, K/32, 320] uint8");
  const int64_t blocks = packed.size(0), groups = packed.size(1), n = blocks * kRows, k = groups * kGroup;
  PDSERVE_CHECK(out.dim() == 2 && out.size(0) == k && out.size(1) == n && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(),
              "int4_unpack_t_: out must be contiguous float32 [K, N] = [", k, ", ", n, "]");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk)
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = int4_group(wp, blk, g, groups);
        const c10::Half* scale = reinterpret_cast<const c10::Half*>(p + 256);
        const c10::Half* minimum = reinterpret_cast<const c10::Half*>(p + 288);
        for (int64_t c = 0; c < 4; ++c)
          for (int64_t i = 0; i < 8; ++i) {  // input 8c + i: nibble i / 2 of word 2l + i % 2
            float* row = op + (g * kGroup + 8 * c + i) * n + blk * kRows;
            const int shift = 4 * (i >> 1) + 16 * (i & 1);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            for (int hh = 0; hh < 2; ++hh) {
              const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c + 32 * hh));
              const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(0xf)));
              const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 256 + 16 * hh)));
              const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 288 + 16 * hh)));
              _mm256_storeu_ps(row + 8 * hh, _mm256_fmadd_ps(q, s, lo));
            }
#else
            for (int64_t l = 0; l < kRows; ++l) {
              uint32_t word;
              std::memcpy(&word, p + 64 * c + 4 * l, 4);
              const float q = static_cast<float>((word >> shift) & 0xfu);
              row[l] = q * static_cast<float>(scale[l]) + static_cast<float>(minimum[l]);
            }
#endif
          }
        (void)scale;
        (void)minimum;
      }
  });
}

#if defined(PDSERVE_QUANT_512)
template <int MR, int NB>
void int8_tile(const float* xf, const int8_t* packed, const float* scale, float* out, int64_t K, int64_t N,
               int64_t m0, int64_t b0) {
  __m512 acc[MR][NB][2];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b][0] = acc[m][b][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      for (int b = 0; b < NB; ++b) {
        const int8_t* p = packed + ((b0 + b) * K + k + h) * kRows;
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        for (int m = 0; m < MR; ++m)
          acc[m][b][h] = _mm512_fmadd_ps(w, _mm512_set1_ps(xf[(m0 + m) * K + k + h]), acc[m][b][h]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 s = _mm512_loadu_ps(scale + (b0 + b) * kRows);
    for (int m = 0; m < MR; ++m)
      _mm512_storeu_ps(out + (m0 + m) * N + (b0 + b) * kRows,
                       _mm512_mul_ps(_mm512_add_ps(acc[m][b][0], acc[m][b][1]), s));
  }
}
constexpr bool kNarrowTiles = false;
#elif defined(PDSERVE_QUANT_256)
// AVX2: a block's 16 codes of one input widened in two halves of 8 rows; one FMA chain per half.
template <int MR, int NB>
void int8_tile(const float* xf, const int8_t* packed, const float* scale, float* out, int64_t K, int64_t N,
               int64_t m0, int64_t b0) {
  __m256 acc[MR][NB][2];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = _mm256_broadcast_ss(xf + (m0 + m) * K + k);
    for (int b = 0; b < NB; ++b) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + ((b0 + b) * K + k) * kRows));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw)));
      for (int m = 0; m < MR; ++m) {
        acc[m][b][0] = _mm256_fmadd_ps(w0, xb[m], acc[m][b][0]);
        acc[m][b][1] = _mm256_fmadd_ps(w1, xb[m], acc[m][b][1]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int hh = 0; hh < 2; ++hh) {
      const __m256 s = _mm256_loadu_ps(scale + (b0 + b) * kRows + 8 * hh);
      for (int m = 0; m < MR; ++m)
        _mm256_storeu_ps(out + (m0 + m) * N + (b0 + b) * kRows + 8 * hh, _mm256_mul_ps(acc[m][b][hh], s));
    }
}
constexpr bool kNarrowTiles = true;
#endif

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
#if defined(PDSERVE_QUANT_512) || defined(PDSERVE_QUANT_256)
  PDSERVE_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(2) == kRows,
              "packed int8 weights must be [N/16, K, 16] int8");
  const int64_t k = packed.size(1), n = packed.size(0) * kRows;
  PDSERVE_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "int8_linear's scale must be [N] float32");
  const at::Tensor xf = input_rows(x_in, packed, k, at::kFloat);
  const int64_t rows = xf.size(0), blocks = n / kRows;
  at::Tensor outf = at::empty({rows, n}, xf.options());
  if (rows == 0) return output(outf, x_in, n, bias);
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = outf.data_ptr<float>();
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for_tiles(rows, begin, end, [&](auto mr, auto nb, int64_t m0, int64_t b0) {
      int8_tile<mr(), nb()>(xp, wp, sp, op, k, n, m0, b0);
    }, kNarrowTiles);
  });
  return output(outf, x_in, n, bias);
#else
  PDSERVE_CHECK(false, "int8_linear needs AVX2 + FMA + F16C, which this build does not target");
#endif
}

// Bit 0: int4_linear is built; bit 1: int8_linear is built; bit 2: int4_linear multiplies in bf16
// (AVX512-BF16) rather than fp32; bit 3: int4_linear_a8 is built.
int64_t quant_linear_support() {
  int64_t bits = 0;
#if defined(PDSERVE_INT4_BF16) || defined(PDSERVE_INT4_FP32)
  bits |= 1;
#endif
#if defined(PDSERVE_QUANT_512) || defined(PDSERVE_QUANT_256)
  bits |= 2;
#endif
#if defined(PDSERVE_INT4_BF16)
  bits |= 4;
#endif
#if defined(PDSERVE_INT4_A8)
  bits |= 8;
#endif
  return bits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias=None) -> Tensor");
  m.def("int4_unpack_t_(Tensor packed, Tensor(a!) out) -> ()");
  m.def("int4_linear_a8(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("quant_linear_support() -> int");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_unpack_t_", &int4_unpack_t_);
  m.impl("int4_linear_a8", &int4_linear_a8);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CompositeExplicitAutograd, m) { m.impl("quant_linear_support", &quant_linear_support); }
