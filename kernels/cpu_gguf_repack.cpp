// A GGUF file's 4-bit weight rows (Q4_0, Q4_1, Q4_K) straight into int4_linear's packed layout
// (cpu_quant_linear.cpp), byte for byte what pack_int4(*q4_codes(...)) gives in torch (gguf_repack.py),
// without the float copy of the weights, or the int32 copies of the codes, that path makes.
//
//   gguf_repack_q4(raw [N, row bytes] uint8, ggml_type 2 | 3 | 12, K) -> packed [N/16, K/32, 320] uint8
//
// The packed layout, per block of 16 rows and group g of 32 inputs (320 bytes): 4 chunks c of 64 bytes,
// row l's 4 bytes at 4 l, their nibbles (low first) q[8c + 0, 2, 4, 6, 1, 3, 5, 7]; then the 16 rows'
// scales and the 16 rows' minimums as fp16. A chunk's 8 codes are 8 consecutive GGUF bytes' low (or
// high) nibbles, so 16 GGUF bytes become 4 of a row's packed words by two byte shuffles and a few masks.
// Parallel over blocks of 16 rows; each writes its own stretch of the output.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "cpu_half.h"
#include "cpu_rows.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf_repack_q4 reads GGUF's little-endian fields with plain loads"
#endif

namespace {

using pdserve_half::half_at;
using pdserve_half::half_bits;

constexpr int64_t kRows = 16;         // output rows per block
constexpr int64_t kGroup = 32;        // inputs per scale
constexpr int64_t kGroupBytes = 320;  // 256 bytes of codes, 16 fp16 scales, 16 fp16 minimums

// GCC's and clang's vector extensions: one source for every target, a shuffle with constant indices
// compiles to one `pshufb` on x86 (SSSE3, in every build target) and to `tbl` on ARM.
typedef uint8_t u8x16 __attribute__((vector_size(16)));
#if defined(__clang__)
#define PDSERVE_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define PDSERVE_SHUFFLE(v, ...) __builtin_shuffle(v, u8x16{__VA_ARGS__})
#endif

// 16 GGUF code bytes -> 4 packed words of one row: the low nibbles' codes 0..7 and 8..15, then the high
// nibbles' (a packed word's nibbles are codes 0 2 4 6 1 3 5 7 of its 8). Byte i of a word pairs bytes
// a_i and b_i of its 8: lo(a) | lo(b) << 4 from the low nibbles, hi(a) | hi(b) << 4 from the high.
inline u8x16 packed_words(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, 16);
  const u8x16 x = PDSERVE_SHUFFLE(v, 0, 4, 1, 5, 8, 12, 9, 13, 2, 6, 3, 7, 10, 14, 11, 15);  // a | b
  const u8x16 y = PDSERVE_SHUFFLE(v, 2, 6, 3, 7, 10, 14, 11, 15, 0, 4, 1, 5, 8, 12, 9, 13);  // b | a
  const u8x16 keep = {15, 15, 15, 15, 15, 15, 15, 15, 240, 240, 240, 240, 240, 240, 240, 240};
  const u8x16 up = {240, 240, 240, 240, 240, 240, 240, 240, 0, 0, 0, 0, 0, 0, 0, 0};
  return (x & keep) | ((y << 4) & up) | ((y >> 4) & ~(keep | up));
}

// packed_words' words 0, 1 into chunks c, c + 1 of group `low` (row l's 4 bytes at 64 c + 4 l), its words
// 2, 3 into chunks h, h + 1 of group `high`: both of one group for Q4_0 and Q4_1, two Q4_K sub-blocks'.
inline void put_words(u8x16 w, uint8_t* low, int c, uint8_t* high, int h, int64_t l) {
  uint8_t bytes[16];
  std::memcpy(bytes, &w, 16);
  std::memcpy(low + c * 64 + 4 * l, bytes, 4);
  std::memcpy(low + (c + 1) * 64 + 4 * l, bytes + 4, 4);
  std::memcpy(high + h * 64 + 4 * l, bytes + 8, 4);
  std::memcpy(high + (h + 1) * 64 + 4 * l, bytes + 12, 4);
}

// Row l's scale (rounded to fp16 here) and minimum (fp16 bits) of a group.
inline void put_scales(uint8_t* group, int64_t l, float scale, uint16_t minimum_bits) {
  const uint16_t s = half_bits(scale);
  std::memcpy(group + 256 + 2 * l, &s, 2);
  std::memcpy(group + 288 + 2 * l, &minimum_bits, 2);
}

// Q4_0 and Q4_1 (one group a block): codes 0..15 the low nibbles of their 16 bytes, 16..31 the high.
inline void row_q4_0(const uint8_t* block, uint8_t* group, int64_t l) {
  const float d = half_at(block);
  put_words(packed_words(block + 2), group, 0, group, 2, l);
  put_scales(group, l, d, half_bits(-8.0f * d));
}

inline void row_q4_1(const uint8_t* block, uint8_t* group, int64_t l) {
  uint16_t m;  // fp16 already
  std::memcpy(&m, block + 2, 2);
  put_words(packed_words(block + 4), group, 0, group, 2, l);
  put_scales(group, l, half_at(block), m);
}

// Q4_K (8 groups a block): sub-block j's 6-bit scale and minimum (llama.cpp's get_scale_min_k4), its
// codes the low (j even) or high (j odd) nibbles of the 32 bytes at 32 (j / 2): packed_words of their
// first 16 bytes give chunks 0, 1 of sub-blocks j and j + 1, of the next 16 chunks 2, 3.
inline void row_q4_k(const uint8_t* block, uint8_t* group0, int64_t l) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* s = block + 4;
  const uint8_t* qs = block + 16;
  for (int j = 0; j < 8; j += 2) {
    uint8_t* even = group0 + j * kGroupBytes;
    uint8_t* odd = even + kGroupBytes;
    put_words(packed_words(qs + 16 * j), even, 0, odd, 0, l);
    put_words(packed_words(qs + 16 * j + 16), even, 2, odd, 2, l);
    for (int i = j; i < j + 2; ++i) {
      const int sc = i < 4 ? (s[i] & 63) : ((s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4));
      const int mn = i < 4 ? (s[i + 4] & 63) : ((s[i + 4] >> 4) | ((s[i] >> 6) << 4));
      // -(dmin m) by its sign bit: exact, and safe from -ffast-math's freedom with signed zeros
      const uint16_t minimum = static_cast<uint16_t>(half_bits(dmin * static_cast<float>(mn)) ^ 0x8000u);
      put_scales(group0 + i * kGroupBytes, l, d * static_cast<float>(sc), minimum);
    }
  }
}

// Every block of 16 rows: for each GGUF block along K, each row's part of its groups. `row` is a lambda
// (a type of its own), so that each type's row function is inlined into its loop.
template <typename Row>
void repack_rows(const uint8_t* raw, uint8_t* out, int64_t n, int64_t k, int64_t block_weights,
                 int64_t block_bytes, Row row) {
  const int64_t groups = k / kGroup, per_block = block_weights / kGroup, blocks = k / block_weights;
  const int64_t bytes_per_row = blocks * block_bytes;
  at::parallel_for(0, n / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint8_t* dst = out + b * groups * kGroupBytes;
      const uint8_t* src = raw + b * kRows * bytes_per_row;
      for (int64_t kb = 0; kb < blocks; ++kb)
        for (int64_t l = 0; l < kRows; ++l)
          row(src + l * bytes_per_row + kb * block_bytes, dst + kb * per_block * kGroupBytes, l);
    }
  });
}

at::Tensor gguf_repack_q4(const at::Tensor& raw, int64_t ggml_type, int64_t k) {
  const bool small = ggml_type == 2 || ggml_type == 3;  // Q4_0, Q4_1: 32 weights a block; Q4_K: 256
  PDSERVE_CHECK(small || ggml_type == 12, "gguf_repack_q4: GGML type ", ggml_type,
                " is not Q4_0 (2), Q4_1 (3) or Q4_K (12)");
  const int64_t block_weights = small ? 32 : 256, block_bytes = ggml_type == 2 ? 18 : ggml_type == 3 ? 20 : 144;
  PDSERVE_CHECK(k > 0 && k % block_weights == 0, "gguf_repack_q4: k=", k, " is not whole blocks of ", block_weights);
  const int64_t row_bytes = k / block_weights * block_bytes;
  PDSERVE_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.size(1) == row_bytes,
                "gguf_repack_q4: raw must be uint8 [N, ", row_bytes, "] on CPU for k=", k);
  const int64_t n = raw.size(0);
  PDSERVE_CHECK(n > 0 && n % kRows == 0, "gguf_repack_q4: N=", n, " is not a multiple of ", kRows);
  const at::Tensor src = raw.contiguous();
  at::Tensor out = at::empty({n / kRows, k / kGroup, kGroupBytes}, raw.options());
  const uint8_t* r = src.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const auto q4_0 = [](const uint8_t* b, uint8_t* g, int64_t l) { row_q4_0(b, g, l); };
  const auto q4_1 = [](const uint8_t* b, uint8_t* g, int64_t l) { row_q4_1(b, g, l); };
  const auto q4_k = [](const uint8_t* b, uint8_t* g, int64_t l) { row_q4_k(b, g, l); };
  if (ggml_type == 2) repack_rows(r, o, n, k, block_weights, block_bytes, q4_0);
  if (ggml_type == 3) repack_rows(r, o, n, k, block_weights, block_bytes, q4_1);
  if (ggml_type == 12) repack_rows(r, o, n, k, block_weights, block_bytes, q4_k);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) { m.def("gguf_repack_q4(Tensor raw, int ggml_type, int k) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("gguf_repack_q4", &gguf_repack_q4); }
