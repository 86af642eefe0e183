// Greedy sampling on CPU: the index of each row's largest logit, the first of equal ones, and the first
// NaN where a row has one (what `logits.max(dim=-1).indices` returns). One pass over the row with the
// running maximum and its index in vector registers (AVX-512 or AVX2, cpu_simd.h); torch's reduction with
// an index is not vectorized and took ~2 ms for [64, 49152] floats. See cpu_sampling.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_rows.h"
#include "cpu_simd.h"

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
#if defined(PDSERVE_SIMD)
  using V = pdserve_simd::Simd;
  if (n >= V::W) {
    typename V::Reg vmax = V::set1(-std::numeric_limits<float>::infinity());
    typename V::Idx vidx = V::idx_zero(), idx = V::iota();
    typename V::Mask nan = V::none();
    for (; i + V::W <= n; i += V::W) {
      const typename V::Reg v = V::load(x + i);
      nan = V::either(nan, V::nan(v));
      const typename V::Mask gt = V::greater(v, vmax);  // strictly greater: a lane keeps its first
      vmax = V::blend(gt, vmax, v);
      vidx = V::blend(gt, vidx, idx);
      idx = V::advance(idx);
    }
    if (V::any(nan)) return first_nan(x, n);
    float lanes[V::W];
    int32_t lane_idx[V::W];
    V::store(lanes, vmax);
    V::store(lane_idx, vidx);
    best_i = lane_idx[0];
    best = lanes[0];
    for (int l = 1; l < V::W; ++l)
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
  PDSERVE_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "greedy: logits must be float32 [B, V] on CPU");
  PDSERVE_CHECK(logits.size(1) > 0, "greedy: an empty vocabulary");
  PDSERVE_CHECK(logits.size(1) < (int64_t{1} << 31), "greedy: the vocabulary must fit int32 indices");
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

// The register width in bits of this build's vector kernels (cpu_simd.h), 0 where it has none.
int64_t simd_width() {
#if defined(PDSERVE_SIMD)
  return PDSERVE_SIMD;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("greedy(Tensor logits) -> Tensor");
  m.def("simd_width() -> int");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("greedy", &greedy); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CompositeExplicitAutograd, m) { m.impl("simd_width", &simd_width); }
