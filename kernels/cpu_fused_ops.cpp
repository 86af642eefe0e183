// Fused elementwise ops for the CPU forward in bf16 / fp16: each reads its input once and writes its
// output once, where torch's eager ops make several passes and round to the storage dtype after each.
// Every op converts to float and computes in float, rounding its intermediate values to the dtype
// where the eager ops store them, so that it gives the eager path's values (bf16 output is sensitive to
// where it rounds: one rounding fewer flipped an answer of the bundled model). See cpu_fused_ops.py.
//
//   rms_norm(x [T, N], w [N], eps) -> w * normalize(x), normalized in float (transformers' order: the
//       normalized row is rounded to the dtype before the weight multiplies it, as in the eager path);
//   add_rms_norm(x [T, N], residual [T, N], w [N], eps) -> (rms_norm(s), s) with s = x + residual
//       rounded to the dtype, as the eager add stores it (vLLM's fused_add_rms_norm, out of place);
//   silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]  [T, I] (silu rounded, then the product);
//   rotary_(x [T, H, D] (rows of any stride), positions [T], cos [P, D], sin_signed [P, D] float32):
//       in place, x = x * cos[p] + roll(x, D / 2) * sin_signed[p] (HF's rotate_half form; the tables,
//       both products and the sum rounded, as eager computes it from the tables cast to x's dtype).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_rows.h"

namespace {

using pdserve_rows::load_row;
using pdserve_rows::round_to;
using pdserve_rows::store_row;

// Rows split over the intra-op threads; each thread has a float buffer of `width` per row in flight.
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(2 * width);
    for (int64_t r = begin; r < end; ++r) f(r, buf.data());
  });
}

// Row v (n floats, in the dtype's values) normalized and times wf into o: the normalized row rounded to
// the dtype before the weight multiplies it, the eager path's two roundings.
template <typename T>
void normalize_row(float* v, const float* wf, T* o, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) v[i] *= inv;
  store_row(v, o, n);
  load_row(o, v, n);
  for (int64_t i = 0; i < n; ++i) v[i] *= wf[i];
  store_row(v, o, n);
}

template <typename T>
void rms_norm_impl(const T* x, const T* w, T* out, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  std::vector<float> wf(n);
  load_row(w, wf.data(), n);
  for_rows(rows, n, [&](int64_t r, float* buf) {
    load_row(x + r * x_stride, buf, n);
    normalize_row(buf, wf.data(), out + r * n, n, eps);
  });
}

// sum = x + residual rounded to T (the eager add), then rms_norm of sum as above: one pass for both.
template <typename T>
void add_rms_norm_impl(const T* x, const T* res, const T* w, T* out, T* sum, int64_t rows, int64_t n,
                       int64_t x_stride, int64_t res_stride, float eps) {
  std::vector<float> wf(n);
  load_row(w, wf.data(), n);
  for_rows(rows, n, [&](int64_t r, float* buf) {
    float* v = buf;
    float* u = buf + n;
    load_row(x + r * x_stride, v, n);
    load_row(res + r * res_stride, u, n);
    for (int64_t i = 0; i < n; ++i) v[i] += u[i];
    T* sr = sum + r * n;
    store_row(v, sr, n);
    load_row(sr, v, n);  // the sum as stored: what the norm of the eager path reads
    normalize_row(v, wf.data(), out + r * n, n, eps);
  });
}

template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t inter, int64_t x_stride) {
  for_rows(rows, inter, [&](int64_t r, float* buf) {
    float* g = buf;
    float* u = buf + inter;
    load_row(x + r * x_stride, g, inter);
    load_row(x + r * x_stride + inter, u, inter);
    for (int64_t i = 0; i < inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i]));
    T* o = out + r * inter;
    store_row(g, o, inter);  // silu in the dtype, then the product: the eager path's two roundings
    load_row(o, g, inter);
    for (int64_t i = 0; i < inter; ++i) g[i] *= u[i];
    store_row(g, o, inter);
  });
}

template <typename T>
void rotary_impl(T* x, const int64_t* pos, const float* cos, const float* sin, int64_t T_, int64_t H,
                 int64_t D, int64_t s0, int64_t s1) {
  const int64_t half = D / 2;
  for_rows(T_, H * D, [&](int64_t t, float* buf) {
    const int64_t p = pos[t];
    const float* c = cos + p * D;
    const float* s = sin + p * D;
    float* v = buf;
    float* o = buf + D;
    for (int64_t h = 0; h < H; ++h) {
      T* row = x + t * s0 + h * s1;
      load_row(row, v, D);
      for (int64_t i = 0; i < half; ++i)
        o[i] = round_to<T>(v[i] * round_to<T>(c[i])) + round_to<T>(v[i + half] * round_to<T>(s[i]));
      for (int64_t i = half; i < D; ++i)
        o[i] = round_to<T>(v[i] * round_to<T>(c[i])) + round_to<T>(v[i - half] * round_to<T>(s[i]));
      store_row(o, row, D);
    }
  });
}

void check_input(const at::Tensor& x, const char* op) {
  PDSERVE_CHECK(x.device().is_cpu(), op, " runs on CPU");
  PDSERVE_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat,
              op, ": unsupported dtype ", x.scalar_type());
}

#define PDSERVE_DISPATCH(dtype, ...)                                    \
  switch (dtype) {                                                      \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }           \
    case at::kBFloat16: { using T = c10::BFloat16; __VA_ARGS__; break; } \
    case at::kHalf: { using T = c10::Half; __VA_ARGS__; break; }        \
    default: PDSERVE_CHECK(false, "unsupported dtype ", dtype);           \
  }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_input(x, "rms_norm");
  PDSERVE_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: x [..., N], weight [N]");
  PDSERVE_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  const int64_t n = x.size(-1);
  at::Tensor x2 = x.reshape({-1, n});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty({x2.size(0), n}, x.options());
  PDSERVE_DISPATCH(x.scalar_type(), rms_norm_impl<T>(x2.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(),
                                                     x2.size(0), n, x2.stride(0), static_cast<float>(eps)));
  return out.view(x.sizes());
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_input(x, "add_rms_norm");
  PDSERVE_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "add_rms_norm: x and residual [T, N], weight [N]");
  PDSERVE_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: x, residual and weight must share a dtype");
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor rc = residual.stride(1) == 1 ? residual : residual.contiguous();
  auto w = weight.contiguous();
  const int64_t n = x.size(1);
  auto out = at::empty({x.size(0), n}, x.options());
  auto sum = at::empty({x.size(0), n}, x.options());
  PDSERVE_DISPATCH(x.scalar_type(),
                   add_rms_norm_impl<T>(xc.data_ptr<T>(), rc.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(),
                                        sum.data_ptr<T>(), x.size(0), n, xc.stride(0), rc.stride(0),
                                        static_cast<float>(eps)));
  return {out, sum};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_input(x, "silu_and_mul");
  PDSERVE_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2 * I]");
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t inter = x.size(1) / 2;
  auto out = at::empty({x.size(0), inter}, x.options());
  PDSERVE_DISPATCH(x.scalar_type(), silu_and_mul_impl<T>(xc.data_ptr<T>(), out.data_ptr<T>(), xc.size(0), inter,
                                                         xc.stride(0)));
  return out;
}

void rotary_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin_signed) {
  check_input(x, "rotary_");
  PDSERVE_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary_: x must be [T, H, D] with unit stride in D");
  PDSERVE_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && positions.scalar_type() == at::kLong,
              "rotary_: positions must be int64 [T]");
  PDSERVE_CHECK(cos.dim() == 2 && cos.sizes() == sin_signed.sizes() && cos.size(1) == x.size(2) &&
                  cos.scalar_type() == at::kFloat && sin_signed.scalar_type() == at::kFloat,
              "rotary_: cos and sin_signed must be float32 [P, D]");
  auto c = cos.contiguous();
  auto s = sin_signed.contiguous();
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.size(0); ++t)
    PDSERVE_CHECK(pp[t] >= 0 && pp[t] < c.size(0), "rotary_: position ", pp[t], " is outside the table");
  PDSERVE_DISPATCH(x.scalar_type(), rotary_impl<T>(x.data_ptr<T>(), pp, c.data_ptr<float>(), s.data_ptr<float>(),
                                                   x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin_signed) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
}
