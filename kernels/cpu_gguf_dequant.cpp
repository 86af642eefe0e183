// GGUF tensors dequantized to float32, and rounded to int4_linear's packed layout, row by row in C++:
// what the `gguf` package's numpy dequantization and torch's min/max rounding (runtime/quant_int4.py's
// int4_grouped, then pack_int4) do at load, without their temporaries (numpy's several per block, the
// int32 codes, a concatenation along the last dimension), and on every core.
//
//   gguf_dequant(raw [N, row bytes] uint8, ggml_type, K) -> float32 [N, K]
//   gguf_to_int4(raw [N, row bytes] uint8, ggml_type, K) -> packed [N/16, K/32, 320] uint8
//   float_to_int4(w [N, K] float32 | bfloat16 | float16) -> packed [N/16, K/32, 320] uint8
//
// Types: F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13),
// Q6_K (14), BF16 (30), decoded by cpu_gguf_blocks.h bit for bit as numpy decodes them.
//
// The rounding to 4 bits is int4_grouped's, per row and group of 32: lo = min, hi = max,
// scale = max((hi - lo) / 15, 1e-10), q = min(round((w - lo) / scale), 15) (to nearest even, as
// torch.round), then scale and lo to fp16 as pack_int4 stores them. The divisions must be true float
// divisions, which -ffast-math would turn into multiplications by reciprocals (x / 15 -> x * (1/15),
// 1/15 inexact), and the rounding must not be folded away: group_codes alone is compiled without fast
// math (the pragmas around it). Zeros: where a group's smallest value is a zero and it holds zeros of
// both signs, which of the two its minimum is follows the order of the comparisons, here as in torch's
// amin: the stored minimum may then be -0 where torch's is +0 (or the reverse), the same value, and
// every code and scale the same. NaN and infinite weights are not rounded as torch rounds them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_gguf_blocks.h"
#include "cpu_half.h"
#include "cpu_rows.h"

namespace {

using pdserve_gguf::Format;
using pdserve_gguf::RowFn;
using pdserve_gguf::dequant_row;
using pdserve_gguf::format_of;
using pdserve_half::half_bits;

constexpr int64_t kRows = 16;         // output rows per packed block
constexpr int64_t kGroup = 32;        // inputs per scale
constexpr int64_t kGroupBytes = 320;  // 256 bytes of codes, 16 fp16 scales, 16 fp16 minimums

// raw's checks (contiguous uint8 [N, row bytes] on CPU, K whole blocks) and its format.
Format checked(const char* op, const at::Tensor& raw, int64_t ggml_type, int64_t k) {
  const Format f = format_of(ggml_type);
  PDSERVE_CHECK(k > 0 && k % f.weights == 0, op, ": k=", k, " is not whole blocks of ", f.weights,
                " for GGML type ", ggml_type);
  const int64_t row_bytes = k / f.weights * f.bytes;
  PDSERVE_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.size(1) == row_bytes,
                op, ": raw must be uint8 [N, ", row_bytes, "] on CPU for GGML type ", ggml_type, " and k=", k);
  return f;
}

at::Tensor gguf_dequant(const at::Tensor& raw, int64_t ggml_type, int64_t k) {
  const Format f = checked("gguf_dequant", raw, ggml_type, k);
  const at::Tensor src = raw.contiguous();
  const int64_t n = src.size(0), row_bytes = src.size(1);
  at::Tensor out = at::empty({n, k}, raw.options().dtype(at::kFloat));
  const uint8_t* r = src.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f.row(r + i * row_bytes, o + i * k, k);
  });
  return out;
}

// Each group's minimum and maximum (exact: a comparison rounds nothing; see the file's note on zeros):
// its 4 stretches of 8 lane by lane, then across the 8 lanes by halves, in vector registers.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
// The same 8 floats loaded where they lie (4-byte aligned): a memcpy into an f32x8 went through the
// stack in halves under the AVX2 target's tuning, and reading it back stalled (the whole rounding
// measured 1.8x slower).
typedef float f32x8_loose __attribute__((vector_size(32), aligned(4), may_alias));
#if defined(__clang__)
#define PDSERVE_LANES(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define PDSERVE_LANES(v, ...) __builtin_shuffle(v, i32x8{__VA_ARGS__})
#endif

inline f32x8 vmin(f32x8 a, f32x8 b) { return a < b ? a : b; }
inline f32x8 vmax(f32x8 a, f32x8 b) { return a > b ? a : b; }

void group_bounds(const float* w, int64_t groups, float* lo, float* hi) {
  for (int64_t g = 0; g < groups; ++g) {
    const f32x8_loose* x = reinterpret_cast<const f32x8_loose*>(w + g * kGroup);
    f32x8 a = vmin(vmin(x[0], x[1]), vmin(x[2], x[3])), b = vmax(vmax(x[0], x[1]), vmax(x[2], x[3]));
    a = vmin(a, PDSERVE_LANES(a, 4, 5, 6, 7, 0, 1, 2, 3));
    b = vmax(b, PDSERVE_LANES(b, 4, 5, 6, 7, 0, 1, 2, 3));
    a = vmin(a, PDSERVE_LANES(a, 2, 3, 0, 1, 6, 7, 4, 5));
    b = vmax(b, PDSERVE_LANES(b, 2, 3, 0, 1, 6, 7, 4, 5));
    lo[g] = std::min(a[0], a[1]);
    hi[g] = std::max(b[0], b[1]);
  }
}

#if defined(__clang__)
#pragma float_control(precise, on, push)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#endif
// Each group's scale and codes, in int4_grouped's float32 arithmetic: true divisions, ties to even.
void group_codes(const float* w, int64_t groups, const float* lo, const float* hi, float* scale, uint8_t* q) {
  for (int64_t g = 0; g < groups; ++g) {
    const float span = (hi[g] - lo[g]) / 15.0f;
    const float s = span < 1e-10f ? 1e-10f : span;
    scale[g] = s;
    for (int i = 0; i < kGroup; ++i) {
      // t in [0, 15] and a bit (w >= lo): adding 2^23 leaves no fraction bits, so the sum rounds t to
      // an integer, to nearest even; what the call to rint would give, without the call
      const float t = (w[g * kGroup + i] - lo[g]) / s;
      const float r = (t + 8388608.0f) - 8388608.0f;
      q[g * kGroup + i] = static_cast<uint8_t>(r < 15.0f ? r : 15.0f);
    }
  }
}
#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

// GCC's and clang's vector extensions: a two-source byte shuffle with constant indices (0..31), which
// compiles to byte shuffles (`pshufb`, `vpermi2b`) on x86 and `tbl` on ARM.
typedef uint8_t u8x16 __attribute__((vector_size(16)));
#if defined(__clang__)
#define PDSERVE_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PDSERVE_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, u8x16{__VA_ARGS__})
#endif

// Row l's codes, scales and minimums into its block's groups (pack_int4's layout: chunk c of a group,
// row l's 4 bytes at 64 c + 4 l, the nibbles, low first, of codes 8c + 0, 2, 4, 6, 1, 3, 5, 7). Byte i
// of the group's 16 is codes A_i | A_i + 2 << 4, A = 8 (i / 4) + (0, 4, 1, 5)[i % 4]: two shuffles.
void put_row(const uint8_t* q, const float* scale, const float* lo, int64_t groups, uint8_t* block, int64_t l) {
  for (int64_t g = 0; g < groups; ++g) {
    u8x16 first, second;  // codes 0..15, 16..31
    std::memcpy(&first, q + g * kGroup, 16);
    std::memcpy(&second, q + g * kGroup + 16, 16);
    const u8x16 a = PDSERVE_SHUFFLE2(first, second, 0, 4, 1, 5, 8, 12, 9, 13, 16, 20, 17, 21, 24, 28, 25, 29);
    const u8x16 b = PDSERVE_SHUFFLE2(first, second, 2, 6, 3, 7, 10, 14, 11, 15, 18, 22, 19, 23, 26, 30, 27, 31);
    uint8_t bytes[16];
    const u8x16 packed = a | (b << 4);
    std::memcpy(bytes, &packed, 16);
    uint8_t* dst = block + g * kGroupBytes;
    for (int c = 0; c < 4; ++c) std::memcpy(dst + 64 * c + 4 * l, bytes + 4 * c, 4);
    const uint16_t s = half_bits(scale[g]), m = half_bits(lo[g]);
    std::memcpy(dst + 256 + 2 * l, &s, 2);
    std::memcpy(dst + 288 + 2 * l, &m, 2);
  }
}

// Every block of 16 rows, in parallel: `fill(row, scratch)` gives row `row` as K floats (in scratch,
// or wherever they already are), rounded then to 4 bits into the block's stretch of the output.
template <typename Fill>
at::Tensor rows_to_int4(const char* op, int64_t n, int64_t k, const at::TensorOptions& options, Fill fill) {
  PDSERVE_CHECK(n > 0 && n % kRows == 0 && k % kGroup == 0, op, ": a [", n, ", ", k,
                "] weight does not fit int4_linear: N must be a multiple of ", kRows, " (and > 0), K of ", kGroup);
  const int64_t groups = k / kGroup;
  at::Tensor out = at::empty({n / kRows, groups, kGroupBytes}, options.dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(k), lo(groups), hi(groups), scale(groups);
    std::vector<uint8_t> q(k);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t l = 0; l < kRows; ++l) {
        const float* w = fill(b * kRows + l, scratch.data());
        group_bounds(w, groups, lo.data(), hi.data());
        group_codes(w, groups, lo.data(), hi.data(), scale.data(), q.data());
        put_row(q.data(), scale.data(), lo.data(), groups, o + b * groups * kGroupBytes, l);
      }
    }
  });
  return out;
}

at::Tensor gguf_to_int4(const at::Tensor& raw, int64_t ggml_type, int64_t k) {
  const Format f = checked("gguf_to_int4", raw, ggml_type, k);
  const at::Tensor src = raw.contiguous();
  const uint8_t* r = src.data_ptr<uint8_t>();
  const int64_t row_bytes = src.size(1);
  return rows_to_int4("gguf_to_int4", src.size(0), k, raw.options(), [&](int64_t i, float* scratch) {
    f.row(r + i * row_bytes, scratch, k);
    return static_cast<const float*>(scratch);
  });
}

at::Tensor float_to_int4(const at::Tensor& w) {
  const auto t = w.scalar_type();
  PDSERVE_CHECK(w.device().is_cpu() && w.dim() == 2 && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf),
                "float_to_int4: w must be a float32, bfloat16 or float16 [N, K] tensor on CPU, not ", t, " of ",
                w.dim(), " dimensions");
  const at::Tensor src = w.contiguous();
  const int64_t n = src.size(0), k = src.size(1);
  const uint8_t* bytes = static_cast<const uint8_t*>(src.data_ptr());
  const RowFn row = t == at::kBFloat16 ? &dequant_row<pdserve_gguf::BF16> : &dequant_row<pdserve_gguf::F16>;
  const int64_t row_bytes = k * static_cast<int64_t>(src.element_size());
  return rows_to_int4("float_to_int4", n, k, w.options(), [&](int64_t i, float* scratch) {
    if (t == at::kFloat) return reinterpret_cast<const float*>(bytes + i * row_bytes);
    row(bytes + i * row_bytes, scratch, k);
    return static_cast<const float*>(scratch);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("gguf_dequant(Tensor raw, int ggml_type, int k) -> Tensor");
  m.def("gguf_to_int4(Tensor raw, int ggml_type, int k) -> Tensor");
  m.def("float_to_int4(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("gguf_dequant", &gguf_dequant);
  m.impl("gguf_to_int4", &gguf_to_int4);
  m.impl("float_to_int4", &float_to_int4);
}
