// Paged decode attention on CPU: one new query token per request against its cached keys and values,
// read in place from the KV pool's rows (no gather into a padded copy). See cpu_decode_attention.py.
//
// For each request b (one task each, spread over the intra-op threads), every query head at once:
//   pass 1: s[j][t] = scale * q[j] . K[t][j / G]  over the request's lens[b] pool rows (and the new
//           key, when given), then a softmax per query head;
//   pass 2: out[j] = sum_t p[j][t] * V[t][j / G].
// A pool row holds every KV head of one position, contiguous: each K and V row is read once, whole,
// converted to float and used by all heads. Accumulation is in float.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is the top half of a float: a shift, which the compiler vectorizes.
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// Rows lie where their pages are, in no order the hardware prefetcher can follow from one page to the
// next: ask for a row a few positions ahead while this one is computed.
constexpr int64_t kPrefetchAhead = 6;

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

template <typename T>
void attend(const T* q, const T* rows, const int64_t* key_rows, const int64_t* lens, const T* k_new,
            const T* v_new, T* out, int64_t B, int64_t H, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t k_offset, int64_t v_offset, float scale) {
  const int64_t G = Hq / Hkv;
  const int64_t row = Hkv * D;  // one pool row: every KV head of one position, contiguous
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), kv(row), acc(Hq * D), s;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lens[b];
      const int64_t total = n + (k_new != nullptr ? 1 : 0);
      T* o = out + b * Hq * D;
      if (total == 0) {  // nothing visible: zeros
        for (int64_t i = 0; i < Hq * D; ++i) o[i] = static_cast<T>(0.f);
        continue;
      }
      s.resize(Hq * total);
      to_float(q + b * Hq * D, qf.data(), Hq * D);
      for (int64_t i = 0; i < Hq * D; ++i) qf[i] *= scale;
      const int64_t* kr = key_rows + b * H;
      // pass 1: scores of every query head (head j reads KV head j / G) against each key row
      for (int64_t t = 0; t < total; ++t) {
        if (t + kPrefetchAhead < n) prefetch_row(rows + (kr[t + kPrefetchAhead] + k_offset) * row, row);
        to_float(t < n ? rows + (kr[t] + k_offset) * row : k_new + b * row, kv.data(), row);
        for (int64_t h = 0, j = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g, ++j) s[j * total + t] = dot(qf.data() + j * D, kv.data() + h * D, D);
      }
      for (int64_t j = 0; j < Hq; ++j) {
        float* sj = s.data() + j * total;
        float m = sj[0];
        for (int64_t t = 1; t < total; ++t) m = sj[t] > m ? sj[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < total; ++t) {
          sj[t] = std::exp(sj[t] - m);
          sum += sj[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < total; ++t) sj[t] *= inv;
      }
      // pass 2: the weighted sum of the value rows
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < total; ++t) {
        if (t + kPrefetchAhead < n) prefetch_row(rows + (kr[t + kPrefetchAhead] + v_offset) * row, row);
        to_float(t < n ? rows + (kr[t] + v_offset) * row : v_new + b * row, kv.data(), row);
        for (int64_t h = 0, j = 0; h < Hkv; ++h) {
          const float* vr = kv.data() + h * D;
          for (int64_t g = 0; g < G; ++g, ++j) {
            const float p = s[j * total + t];
            float* a = acc.data() + j * D;
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int64_t i = 0; i < Hq * D; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& key_rows,
                                  const at::Tensor& lens, int64_t k_offset, int64_t v_offset, double scale,
                                  const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new) {
  TORCH_CHECK(q.dim() == 3 && rows.dim() == 3, "q must be [B, Hq, D] and rows [N, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && rows.device().is_cpu(), "paged_decode_attention runs on CPU");
  TORCH_CHECK(q.scalar_type() == rows.scalar_type(), "q and the KV rows must share a dtype");
  TORCH_CHECK(rows.is_contiguous(), "the KV rows must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t N = rows.size(0), Hkv = rows.size(1);
  TORCH_CHECK(rows.size(2) == D && Hkv > 0 && Hq % Hkv == 0, "head counts or sizes do not match");
  TORCH_CHECK(key_rows.dim() == 2 && key_rows.size(0) == B && key_rows.scalar_type() == at::kLong,
              "key_rows must be int64 [B, H]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kLong,
              "lens must be int64 [B]");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "give both k_new and v_new or neither");
  const int64_t H = key_rows.size(1);
  auto kr = key_rows.contiguous();
  auto ln = lens.contiguous();
  // Every row read must lie in the pool: a bad index is an error, never a read out of bounds.
  const int64_t* krp = kr.data_ptr<int64_t>();
  const int64_t* lnp = ln.data_ptr<int64_t>();
  const int64_t lo = std::min<int64_t>(k_offset, v_offset), hi = std::max<int64_t>(k_offset, v_offset);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lnp[b] >= 0 && lnp[b] <= H, "lens[", b, "] = ", lnp[b], " is outside [0, ", H, "]");
    for (int64_t t = 0; t < lnp[b]; ++t) {
      const int64_t r = krp[b * H + t];
      TORCH_CHECK(r + lo >= 0 && r + hi < N, "key row ", r, " is outside the pool");
    }
  }
  auto qc = q.contiguous();
  at::Tensor kn, vn;
  if (k_new.has_value()) {
    kn = k_new->contiguous();
    vn = v_new->contiguous();
    TORCH_CHECK(kn.sizes() == at::IntArrayRef({B, Hkv, D}) && vn.sizes() == kn.sizes(),
                "k_new and v_new must be [B, Hkv, D]");
    TORCH_CHECK(kn.scalar_type() == q.scalar_type() && vn.scalar_type() == q.scalar_type(),
                "k_new and v_new must share q's dtype");
  }
  auto out = at::empty({B, Hq, D}, q.options());
  const float sc = static_cast<float>(scale);
#define PDSERVE_ATTEND(T)                                                                                  \
  attend<T>(qc.data_ptr<T>(), rows.data_ptr<T>(), krp, lnp, kn.defined() ? kn.data_ptr<T>() : nullptr,  \
            vn.defined() ? vn.data_ptr<T>() : nullptr, out.data_ptr<T>(), B, H, Hq, Hkv, D, k_offset,  \
            v_offset, sc)
  switch (q.scalar_type()) {
    case at::kFloat: PDSERVE_ATTEND(float); break;
    case at::kBFloat16: PDSERVE_ATTEND(c10::BFloat16); break;
    case at::kHalf: PDSERVE_ATTEND(c10::Half); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
#undef PDSERVE_ATTEND
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor rows, Tensor key_rows, Tensor lens, int k_offset, "
      "int v_offset, float scale, Tensor? k_new=None, Tensor? v_new=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
