// Greedy sampling on CPU: the index of each row's largest logit, the first of equal ones, and the first
// NaN where a row has one (what `logits.max(dim=-1).indices` returns). One pass over the row with the
// running maximum and its index in AVX-512 registers; torch's reduction with an index is not vectorized
// and took ~2 ms for [64, 49152] floats. See cpu_sampling.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_rows.h"

namespace {

inline bool is_nan(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return pdserve_rows::is_nan_bits(u);
}

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (is_nan(x[i])) return i;
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i vidx = _mm512_setzero_si512();
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strictly greater: a lane keeps its first
      vmax = _mm512_mask_blend_ps(gt, vmax, v);
      vidx = _mm512_mask_blend_epi32(gt, vidx, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    if (nan) return first_nan(x, n);
    alignas(64) float lanes[16];
    alignas(64) int32_t lane_idx[16];
    _mm512_store_ps(lanes, vmax);
    _mm512_store_si512(lane_idx, vidx);
    best_i = lane_idx[0];
    best = lanes[0];
    for (int l = 1; l < 16; ++l)
      if (lanes[l] > best || (lanes[l] == best && lane_idx[l] < best_i)) {
        best = lanes[l];
        best_i = lane_idx[l];
      }
  } else
#endif
  {
    best = x[0];
    best_i = 0;
    if (is_nan(best)) return 0;
    i = 1;
  }
  for (; i < n; ++i) {
    if (is_nan(x[i])) return first_nan(x, n);
    if (x[i] > best) {
      best = x[i];
      best_i = i;
    }
  }
  return best_i;
}

at::Tensor greedy(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "greedy: logits must be float32 [B, V] on CPU");
  TORCH_CHECK(logits.size(1) > 0, "greedy: an empty vocabulary");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "greedy: the vocabulary must fit int32 indices");
  auto x = logits.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = argmax_row(xp + b * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) { m.def("greedy(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("greedy", &greedy); }
