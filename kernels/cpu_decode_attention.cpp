// Paged decode attention on CPU: one new query token per request against its cached keys and values,
// read in place from the KV pool's rows (no gather into a padded copy). See cpu_decode_attention.py.
//
// For each request b (one task each, spread over the intra-op threads):
//   pass 1: s[j][t] = scale * q[j] . K[t][j / G]  over the request's lens[b] pool rows (and the new
//           key, when given), then a softmax per query head;
//   pass 2: out[j] = sum_t p[j][t] * V[t][j / G].
// A pool row holds every KV head of one position, contiguous. The vector path (head sizes 32, 64, 128;
// AVX-512 or AVX2 registers, cpu_simd.h)
// walks the request's rows once per KV head and block of its query heads, with the queries (pass 1) or
// the accumulators (pass 2) in registers; the rows stay in L2 between walks, since a request's K or V of
// one layer is its length x 384 bytes for the bundled model. The plain path converts each row whole and
// serves every head from it. Accumulation is in float.
//
// Memory: a decode batch reads every cached row of every request once per layer, from pages scattered
// over the pool, and the walks above leave the core little room to have many cache misses in flight.
// So the vector path splits the two: while it computes request b from the cache, it asks for request
// b + 1's rows, one cache line of K and one of V per step of its walks (Stager); a request that no
// previous one staged (a thread's first) prefetches its own rows a few positions ahead, as the plain
// path does. Batch 64 of the bundled model's shapes: 1.6-1.7x faster than prefetching each request's own
// rows only (docs/cpu.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_rows.h"
#include "cpu_simd.h"

namespace {

using pdserve_rows::load_row;

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

// One request's rows: K and V of position t < n at rows + (kr[t] + offset) * row, then (when given)
// the new token's at k_new / v_new.
template <typename T>
struct Request {
  const T* rows;
  const int64_t* kr;
  int64_t n, total, row, k_offset, v_offset;
  const T* k_new;
  const T* v_new;
  const T* key(int64_t t) const { return t < n ? rows + (kr[t] + k_offset) * row : k_new; }
  const T* value(int64_t t) const { return t < n ? rows + (kr[t] + v_offset) * row : v_new; }
  void prefetch_key(int64_t t) const {
    if (t < n) prefetch_row(rows + (kr[t] + k_offset) * row, row);
  }
  void prefetch_value(int64_t t) const {
    if (t < n) prefetch_row(rows + (kr[t] + v_offset) * row, row);
  }
};

// Spreads the prefetches of the next request's rows over the current request's compute: each step()
// asks for one cache line of K and one of V of the next request's rows, in order.
template <typename T>
struct Stager {
  const Request<T>* r = nullptr;
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t t = 0, line = 0, lines_per_row = 0;

  void start(const Request<T>* next) {
    r = next->n > 0 ? next : nullptr;
    t = line = 0;
    lines_per_row = (next->row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    if (r) at_row();
  }
  void at_row() {
    k = reinterpret_cast<const char*>(r->key(t));
    v = reinterpret_cast<const char*>(r->value(t));
  }
  inline void step() {
    if (!r) return;
    __builtin_prefetch(k + line * 64, 0, 2);
    __builtin_prefetch(v + line * 64, 0, 2);
    if (++line == lines_per_row) {
      line = 0;
      if (++t >= r->n) {
        r = nullptr;
        return;
      }
      at_row();
    }
  }
};

// s [Hq, total] scores to probabilities, row by row. The exponentials in registers where the build has them
// (pdserve_simd::exp, a row's tail through a padded block, so every entry takes the same function), then
// summed in order: a scalar std::exp per score was most of a long prompt's attention time.
inline void softmax_rows(float* s, int64_t Hq, int64_t total) {
  for (int64_t j = 0; j < Hq; ++j) {
    float* sj = s + j * total;
    float m = sj[0];
    for (int64_t t = 1; t < total; ++t) m = sj[t] > m ? sj[t] : m;
#if defined(PDSERVE_SIMD)
    using V = pdserve_simd::Simd;
    const typename V::Reg mv = V::set1(m);
    int64_t t = 0;
    for (; t + V::W <= total; t += V::W) V::store(sj + t, pdserve_simd::exp<V>(V::sub(V::load(sj + t), mv)));
    if (t < total) {
      float tail[V::W];
      for (int i = 0; i < V::W; ++i) tail[i] = t + i < total ? sj[t + i] : m;
      V::store(tail, pdserve_simd::exp<V>(V::sub(V::load(tail), mv)));
      for (int64_t i = 0; t + i < total; ++i) sj[t + i] = tail[i];
    }
#else
    for (int64_t t = 0; t < total; ++t) sj[t] = std::exp(sj[t] - m);
#endif
    float sum = 0.f;
    for (int64_t t = 0; t < total; ++t) sum += sj[t];
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < total; ++t) sj[t] *= inv;
  }
}

// Any head size and dtype: rows converted to float whole, then plain loops.
template <typename T>
void attend_request(const Request<T>& r, const float* qf, float* s, float* kv, float* acc, int64_t Hq,
                    int64_t Hkv, int64_t D) {
  const int64_t G = Hq / Hkv, total = r.total;
  // pass 1: scores of every query head (head j reads KV head j / G) against each key row
  for (int64_t t = 0; t < total; ++t) {
    r.prefetch_key(t + kPrefetchAhead);
    load_row(r.key(t), kv, r.row);
    for (int64_t h = 0, j = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g, ++j) s[j * total + t] = dot(qf + j * D, kv + h * D, D);
  }
  softmax_rows(s, Hq, total);
  // pass 2: the weighted sum of the value rows
  std::fill(acc, acc + Hq * D, 0.f);
  for (int64_t t = 0; t < total; ++t) {
    r.prefetch_value(t + kPrefetchAhead);
    load_row(r.value(t), kv, r.row);
    for (int64_t h = 0, j = 0; h < Hkv; ++h) {
      const float* vr = kv + h * D;
      for (int64_t g = 0; g < G; ++g, ++j) {
        const float p = s[j * total + t];
        float* a = acc + j * D;
        for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
      }
    }
  }
}

#if defined(PDSERVE_SIMD)
// Head size D, a multiple of the register width: for each KV head in [h0, h1) and block of GB of its
// query heads, the queries (pass 1) or the accumulators (pass 2) stay in registers while the request's
// rows stream past; each row is converted to float in registers, never stored.
template <typename V, typename T, int D>
void attend_request_simd(const Request<T>& r, const float* qf, float* s, float* acc, int64_t Hq, int64_t Hkv,
                         int64_t h0, int64_t h1, bool staged, Stager<T>& next) {
  using Reg = typename V::Reg;
  constexpr int NC = D / V::W;
  constexpr int64_t GB = NC <= 4 ? 12 / NC : 1;  // query heads per block: <= 12 registers of state
  const int64_t G = Hq / Hkv, total = r.total;
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      const int64_t gb = std::min<int64_t>(GB, G - g0);
      const int64_t j0 = h * G + g0;
      Reg qv[GB][NC];
      for (int64_t g = 0; g < GB; ++g)
        for (int c = 0; c < NC; ++c) qv[g][c] = g < gb ? V::load(qf + (j0 + g) * D + c * V::W) : V::zero();
      for (int64_t t = 0; t < total; ++t) {
        next.step();
        if (!staged) r.prefetch_key(t + kPrefetchAhead);
        const T* k = r.key(t) + h * D;
        Reg kv[NC];
        for (int c = 0; c < NC; ++c) kv[c] = V::load(k + c * V::W);
        for (int64_t g = 0; g < GB; ++g) {
          Reg a = V::mul(qv[g][0], kv[0]);
          for (int c = 1; c < NC; ++c) a = V::fmadd(qv[g][c], kv[c], a);
          if (g < gb) s[(j0 + g) * total + t] = V::sum(a);
        }
      }
    }
  }
  softmax_rows(s + h0 * G * total, (h1 - h0) * G, total);
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      const int64_t gb = std::min<int64_t>(GB, G - g0);
      const int64_t j0 = h * G + g0;
      Reg av[GB][NC];
      for (int64_t g = 0; g < GB; ++g)
        for (int c = 0; c < NC; ++c) av[g][c] = V::zero();
      for (int64_t t = 0; t < total; ++t) {
        next.step();
        if (!staged) r.prefetch_value(t + kPrefetchAhead);
        const T* v = r.value(t) + h * D;
        Reg vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = V::load(v + c * V::W);
        for (int64_t g = 0; g < GB; ++g) {
          const Reg p = V::set1(g < gb ? s[(j0 + g) * total + t] : 0.f);
          for (int c = 0; c < NC; ++c) av[g][c] = V::fmadd(p, vv[c], av[g][c]);
        }
      }
      for (int64_t g = 0; g < gb; ++g)
        for (int c = 0; c < NC; ++c) V::store(acc + (j0 + g) * D + c * V::W, av[g][c]);
    }
  }
}

// attend_request_simd for a head size known at run time (32, 64 or 128).
template <typename T>
void attend_simd(int64_t D, const Request<T>& r, const float* qf, float* s, float* acc, int64_t Hq, int64_t Hkv,
                 int64_t h0, int64_t h1, bool staged, Stager<T>& next) {
  using V = pdserve_simd::Simd;
  if (D == 64) attend_request_simd<V, T, 64>(r, qf, s, acc, Hq, Hkv, h0, h1, staged, next);
  if (D == 128) attend_request_simd<V, T, 128>(r, qf, s, acc, Hq, Hkv, h0, h1, staged, next);
  if (D == 32) attend_request_simd<V, T, 32>(r, qf, s, acc, Hq, Hkv, h0, h1, staged, next);
}
#endif

// Q: the queries' and the output's dtype; T: the pool's (and the new keys' and values'), the same or, for a
// float32 model, float16 / bfloat16 (--kv-cache-dtype): each row is converted to float as it is read.
template <typename Q, typename T>
void attend(const Q* q, const T* rows, const int64_t* key_rows, const int64_t* lens, const T* k_new,
            const T* v_new, Q* out, int64_t B, int64_t H, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t k_offset, int64_t v_offset, float scale) {
  const int64_t row = Hkv * D;  // one pool row: every KV head of one position, contiguous
  const bool has_new = k_new != nullptr;
  auto request = [&](int64_t b) {
    const int64_t n = lens[b];
    return Request<T>{rows,     key_rows + b * H, n,        n + (has_new ? 1 : 0),
                      row,      k_offset,         v_offset, has_new ? k_new + b * row : nullptr,
                      has_new ? v_new + b * row : nullptr};
  };
#if defined(PDSERVE_SIMD)
  // Fewer requests than threads (batch 1 above all): one task per request and KV head, so that every
  // thread has work; each reads only its head's share of the rows.
  if (B < at::get_num_threads() && Hkv > 1 && (D == 64 || D == 128 || D == 32)) {
    const int64_t G = Hq / Hkv;
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(Hq * D), acc(Hq * D), s;
      Stager<T> none;  // no staging across tasks
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / Hkv, h = i % Hkv, j0 = h * G;
        const Request<T> r = request(b);
        Q* o = out + (b * Hq + j0) * D;
        if (r.total == 0) {
          for (int64_t e = 0; e < G * D; ++e) o[e] = static_cast<Q>(0.f);
          continue;
        }
        s.resize(Hq * r.total);
        load_row(q + (b * Hq + j0) * D, qf.data() + j0 * D, G * D);
        for (int64_t e = j0 * D; e < (j0 + G) * D; ++e) qf[e] *= scale;
        attend_simd<T>(D, r, qf.data(), s.data(), acc.data(), Hq, Hkv, h, h + 1, false, none);
        for (int64_t e = 0; e < G * D; ++e) o[e] = static_cast<Q>(acc[j0 * D + e]);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), kv(row), acc(Hq * D), s;
    bool staged = false;  // whether the previous request prefetched this one's rows
    for (int64_t b = begin; b < end; ++b) {
      const Request<T> r = request(b);
      const bool was_staged = staged;
      staged = false;
      Q* o = out + b * Hq * D;
      if (r.total == 0) {  // nothing visible: zeros
        for (int64_t i = 0; i < Hq * D; ++i) o[i] = static_cast<Q>(0.f);
        continue;
      }
      s.resize(Hq * r.total);
      load_row(q + b * Hq * D, qf.data(), Hq * D);
      for (int64_t i = 0; i < Hq * D; ++i) qf[i] *= scale;
#if defined(PDSERVE_SIMD)
      if (D == 64 || D == 128 || D == 32) {
        Stager<T> next;
        const Request<T> after = request(b + 1 < end ? b + 1 : b);
        if (b + 1 < end) {
          next.start(&after);
          staged = true;
        }
        attend_simd<T>(D, r, qf.data(), s.data(), acc.data(), Hq, Hkv, 0, Hkv, was_staged, next);
      } else
#endif
      {
        attend_request(r, qf.data(), s.data(), kv.data(), acc.data(), Hq, Hkv, D);
      }
      for (int64_t i = 0; i < Hq * D; ++i) o[i] = static_cast<Q>(acc[i]);
    }
  });
}

// Extend attention with the decode step's arithmetic (batch-invariant decoding, runtime/determinism.py):
// query i of request b, at position prefix[b] + i, attends over key rows 0 .. prefix[b] + i of the request,
// and every (query, head) gets exactly the operations attend_request_simd / attend_request give that query
// as a decode step: each score one mul + fmadd chain over the head's registers then one horizontal sum,
// each softmax row the same function, each output an fmadd chain over the rows in order. Only the loop
// order differs: a block of kExtendBlock consecutive queries shares every K and V row it reads (and its
// conversion to float), where a decode batch of those queries would read the rows once per query.
constexpr int64_t kExtendBlock = 16;

#if defined(PDSERVE_SIMD)
template <typename V, typename T, int D>
void extend_block_simd(const T* rows, const int64_t* kr, int64_t row, int64_t k_offset, int64_t v_offset,
                       const float* qf, int64_t nq, const int64_t* totals, float* s, float* acc, int64_t Hq,
                       int64_t Hkv, int64_t h) {
  using Reg = typename V::Reg;
  constexpr int NC = D / V::W;
  const int64_t G = Hq / Hkv, tmax = totals[nq - 1];  // totals ascend: consecutive positions
  for (int64_t t = 0; t < tmax; ++t) {
    if (t + kPrefetchAhead < tmax) prefetch_row(rows + (kr[t + kPrefetchAhead] + k_offset) * row + h * D, D);
    const T* k = rows + (kr[t] + k_offset) * row + h * D;
    Reg kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = V::load(k + c * V::W);
    for (int64_t i = 0; i < nq; ++i) {
      if (t >= totals[i]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* qj = qf + (i * Hq + h * G + g) * D;
        Reg a = V::mul(V::load(qj), kv[0]);
        for (int c = 1; c < NC; ++c) a = V::fmadd(V::load(qj + c * V::W), kv[c], a);
        s[(i * G + g) * tmax + t] = V::sum(a);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) softmax_rows(s + (i * G + g) * tmax, 1, totals[i]);
  std::fill(acc, acc + nq * G * D, 0.f);
  for (int64_t t = 0; t < tmax; ++t) {
    if (t + kPrefetchAhead < tmax) prefetch_row(rows + (kr[t + kPrefetchAhead] + v_offset) * row + h * D, D);
    const T* v = rows + (kr[t] + v_offset) * row + h * D;
    Reg vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = V::load(v + c * V::W);
    for (int64_t i = 0; i < nq; ++i) {
      if (t >= totals[i]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const Reg p = V::set1(s[(i * G + g) * tmax + t]);
        float* a = acc + (i * G + g) * D;
        for (int c = 0; c < NC; ++c) V::store(a + c * V::W, V::fmadd(p, vv[c], V::load(a + c * V::W)));
      }
    }
  }
}
#endif

template <typename Q, typename T>
void extend(const Q* q, const T* rows, const int64_t* key_rows, const int64_t* prefix, const int64_t* qo, Q* out,
            int64_t B, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t k_offset, int64_t v_offset,
            float scale) {
  const int64_t row = Hkv * D, G = Hq / Hkv;
  struct Task {
    int64_t b, h, i0, n;
  };
  std::vector<Task> tasks;
#if defined(PDSERVE_SIMD)
  const bool simd = D == 64 || D == 128 || D == 32;
#else
  const bool simd = false;
#endif
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i0 = qo[b]; i0 < qo[b + 1]; i0 += kExtendBlock) {
      const int64_t n = std::min<int64_t>(kExtendBlock, qo[b + 1] - i0);
      if (simd) {
        for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({b, h, i0, n});
      } else {
        tasks.push_back({b, -1, i0, n});
      }
    }
  // A block's work grows with its position (a prompt's attention is a triangle): the biggest first, each
  // thread taking the next task when it is free, so no thread is left with the prompt's end alone (a static
  // split of 2 threads gave one 3/4 of the work).
  std::sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return prefix[a.b] + (a.i0 - qo[a.b]) > prefix[b.b] + (b.i0 - qo[b.b]);
  });
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(n_tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> qf, s, acc, kv(row);
    std::vector<int64_t> totals;
    for (int64_t w = next++; w < n_tasks; w = next++) {
      const Task& task = tasks[w];
      const int64_t* kr = key_rows + task.b * H;
      totals.resize(task.n);
      for (int64_t i = 0; i < task.n; ++i) totals[i] = prefix[task.b] + (task.i0 - qo[task.b]) + i + 1;
      qf.resize(task.n * Hq * D);
      for (int64_t i = 0; i < task.n; ++i) {
        load_row(q + (task.i0 + i) * Hq * D, qf.data() + i * Hq * D, Hq * D);
      }
      for (float& x : qf) x *= scale;
      if (task.h < 0) {  // no vector path: each query as attend_request computes a decode step
        acc.resize(Hq * D);
        for (int64_t i = 0; i < task.n; ++i) {
          const Request<T> r{rows, kr, totals[i], totals[i], row, k_offset, v_offset, nullptr, nullptr};
          s.resize(Hq * totals[i]);
          attend_request(r, qf.data() + i * Hq * D, s.data(), kv.data(), acc.data(), Hq, Hkv, D);
          Q* o = out + (task.i0 + i) * Hq * D;
          for (int64_t e = 0; e < Hq * D; ++e) o[e] = static_cast<Q>(acc[e]);
        }
        continue;
      }
#if defined(PDSERVE_SIMD)
      const int64_t tmax = totals[task.n - 1];
      s.resize(task.n * G * tmax);
      acc.resize(task.n * G * D);
      using V = pdserve_simd::Simd;
#define PDSERVE_EXTEND(DD)                                                                                  \
  extend_block_simd<V, T, DD>(rows, kr, row, k_offset, v_offset, qf.data(), task.n, totals.data(), s.data(), \
                              acc.data(), Hq, Hkv, task.h)
      if (D == 64) PDSERVE_EXTEND(64);
      if (D == 128) PDSERVE_EXTEND(128);
      if (D == 32) PDSERVE_EXTEND(32);
#undef PDSERVE_EXTEND
      for (int64_t i = 0; i < task.n; ++i) {
        Q* o = out + ((task.i0 + i) * Hq + task.h * G) * D;
        for (int64_t e = 0; e < G * D; ++e) o[e] = static_cast<Q>(acc[i * G * D + e]);
      }
#endif
    }
  });
}

// `paged_extend_attention`: q [T, Hq, D] (request-major, qo_indptr [B + 1] bounds request b's queries),
// each request's key rows [B, H] and the number of its positions before its first query, prefix [B]. The
// new keys and values must be in the pool already.
at::Tensor paged_extend_attention(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& key_rows,
                                  const at::Tensor& prefix, const at::Tensor& qo_indptr, int64_t k_offset,
                                  int64_t v_offset, double scale) {
  PDSERVE_CHECK(q.dim() == 3 && rows.dim() == 3, "q must be [T, Hq, D] and rows [N, Hkv, D]");
  PDSERVE_CHECK(q.device().is_cpu() && rows.device().is_cpu() && rows.is_contiguous(),
                "paged_extend_attention runs on CPU over a contiguous pool");
  const bool mixed = q.scalar_type() != rows.scalar_type();
  PDSERVE_CHECK(!mixed || (q.scalar_type() == at::kFloat &&
                           (rows.scalar_type() == at::kHalf || rows.scalar_type() == at::kBFloat16)),
                "the KV rows must share q's dtype, or be float16 / bfloat16 under float32 queries");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), N = rows.size(0), Hkv = rows.size(1);
  PDSERVE_CHECK(rows.size(2) == D && Hkv > 0 && Hq % Hkv == 0, "head counts or sizes do not match");
  PDSERVE_CHECK(key_rows.dim() == 2 && key_rows.scalar_type() == at::kLong, "key_rows must be int64 [B, H]");
  const int64_t B = key_rows.size(0), H = key_rows.size(1);
  PDSERVE_CHECK(prefix.dim() == 1 && prefix.size(0) == B && prefix.scalar_type() == at::kLong,
                "prefix must be int64 [B]");
  PDSERVE_CHECK(qo_indptr.dim() == 1 && qo_indptr.size(0) == B + 1 && qo_indptr.scalar_type() == at::kLong,
                "qo_indptr must be int64 [B + 1]");
  auto kr = key_rows.contiguous();
  auto pf = prefix.contiguous();
  auto qo = qo_indptr.contiguous();
  const int64_t* krp = kr.data_ptr<int64_t>();
  const int64_t* pfp = pf.data_ptr<int64_t>();
  const int64_t* qop = qo.data_ptr<int64_t>();
  PDSERVE_CHECK(qop[0] == 0 && qop[B] == T, "qo_indptr must run from 0 to T");
  // Every row read must lie in the pool: a bad index is an error, never a read out of bounds.
  const int64_t lo = std::min<int64_t>(k_offset, v_offset), hi = std::max<int64_t>(k_offset, v_offset);
  for (int64_t b = 0; b < B; ++b) {
    PDSERVE_CHECK(qop[b + 1] >= qop[b], "qo_indptr must not decrease");
    const int64_t seen = pfp[b] + (qop[b + 1] - qop[b]);
    PDSERVE_CHECK(pfp[b] >= 0 && seen <= H, "request ", b, " sees ", seen, " rows of ", H);
    for (int64_t t = 0; t < seen; ++t) {
      const int64_t r = krp[b * H + t];
      PDSERVE_CHECK(r + lo >= 0 && r + hi < N, "key row ", r, " is outside the pool");
    }
  }
  auto qc = q.contiguous();
  auto out = at::empty({T, Hq, D}, q.options());
  const float sc = static_cast<float>(scale);
#define PDSERVE_EXTEND_CALL(Q, TT)                                                                        \
  extend<Q, TT>(qc.data_ptr<Q>(), rows.data_ptr<TT>(), krp, pfp, qop, out.data_ptr<Q>(), B, H, Hq, Hkv, D, \
                k_offset, v_offset, sc)
  if (mixed && rows.scalar_type() == at::kHalf) {
    PDSERVE_EXTEND_CALL(float, c10::Half);
  } else if (mixed) {
    PDSERVE_EXTEND_CALL(float, c10::BFloat16);
  } else {
    switch (q.scalar_type()) {
      case at::kFloat: PDSERVE_EXTEND_CALL(float, float); break;
      case at::kBFloat16: PDSERVE_EXTEND_CALL(c10::BFloat16, c10::BFloat16); break;
      case at::kHalf: PDSERVE_EXTEND_CALL(c10::Half, c10::Half); break;
      default: PDSERVE_CHECK(false, "paged_extend_attention: unsupported dtype ", q.scalar_type());
    }
  }
#undef PDSERVE_EXTEND_CALL
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& key_rows,
                                  const at::Tensor& lens, int64_t k_offset, int64_t v_offset, double scale,
                                  const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new) {
  PDSERVE_CHECK(q.dim() == 3 && rows.dim() == 3, "q must be [B, Hq, D] and rows [N, Hkv, D]");
  PDSERVE_CHECK(q.device().is_cpu() && rows.device().is_cpu(), "paged_decode_attention runs on CPU");
  const bool mixed = q.scalar_type() != rows.scalar_type();
  PDSERVE_CHECK(!mixed || (q.scalar_type() == at::kFloat &&
                           (rows.scalar_type() == at::kHalf || rows.scalar_type() == at::kBFloat16)),
                "the KV rows must share q's dtype, or be float16 / bfloat16 under float32 queries");
  PDSERVE_CHECK(rows.is_contiguous(), "the KV rows must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t N = rows.size(0), Hkv = rows.size(1);
  PDSERVE_CHECK(rows.size(2) == D && Hkv > 0 && Hq % Hkv == 0, "head counts or sizes do not match");
  PDSERVE_CHECK(key_rows.dim() == 2 && key_rows.size(0) == B && key_rows.scalar_type() == at::kLong,
              "key_rows must be int64 [B, H]");
  PDSERVE_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kLong,
              "lens must be int64 [B]");
  PDSERVE_CHECK(k_new.has_value() == v_new.has_value(), "give both k_new and v_new or neither");
  const int64_t H = key_rows.size(1);
  auto kr = key_rows.contiguous();
  auto ln = lens.contiguous();
  // Every row read must lie in the pool: a bad index is an error, never a read out of bounds.
  const int64_t* krp = kr.data_ptr<int64_t>();
  const int64_t* lnp = ln.data_ptr<int64_t>();
  const int64_t lo = std::min<int64_t>(k_offset, v_offset), hi = std::max<int64_t>(k_offset, v_offset);
  for (int64_t b = 0; b < B; ++b) {
    PDSERVE_CHECK(lnp[b] >= 0 && lnp[b] <= H, "lens[", b, "] = ", lnp[b], " is outside [0, ", H, "]");
    for (int64_t t = 0; t < lnp[b]; ++t) {
      const int64_t r = krp[b * H + t];
      PDSERVE_CHECK(r + lo >= 0 && r + hi < N, "key row ", r, " is outside the pool");
    }
  }
  auto qc = q.contiguous();
  at::Tensor kn, vn;
  if (k_new.has_value()) {
    PDSERVE_CHECK(k_new->scalar_type() == q.scalar_type() && v_new->scalar_type() == q.scalar_type(),
                "k_new and v_new must share q's dtype");
    // attended to in the pool's dtype, as they will be stored
    kn = k_new->to(rows.scalar_type()).contiguous();
    vn = v_new->to(rows.scalar_type()).contiguous();
    PDSERVE_CHECK(kn.sizes() == at::IntArrayRef({B, Hkv, D}) && vn.sizes() == kn.sizes(),
                "k_new and v_new must be [B, Hkv, D]");
  }
  auto out = at::empty({B, Hq, D}, q.options());
  const float sc = static_cast<float>(scale);
#define PDSERVE_ATTEND(Q, T)                                                                                \
  attend<Q, T>(qc.data_ptr<Q>(), rows.data_ptr<T>(), krp, lnp, kn.defined() ? kn.data_ptr<T>() : nullptr, \
               vn.defined() ? vn.data_ptr<T>() : nullptr, out.data_ptr<Q>(), B, H, Hq, Hkv, D, k_offset, \
               v_offset, sc)
  if (mixed && rows.scalar_type() == at::kHalf) {
    PDSERVE_ATTEND(float, c10::Half);
  } else if (mixed) {
    PDSERVE_ATTEND(float, c10::BFloat16);
  } else {
    switch (q.scalar_type()) {
      case at::kFloat: PDSERVE_ATTEND(float, float); break;
      case at::kBFloat16: PDSERVE_ATTEND(c10::BFloat16, c10::BFloat16); break;
      case at::kHalf: PDSERVE_ATTEND(c10::Half, c10::Half); break;
      default: PDSERVE_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
    }
  }
#undef PDSERVE_ATTEND
  return out;
}

// The eager decode step's form: store each request's new K and V in the pool (at its `new_rows` row,
// layer 0's K numbering, plus the layer's offsets), then attend over its lens[b] rows, the new one
// included. One call where the step made three (two index_copy_ and the attention) per layer.
at::Tensor paged_decode_attention_store(const at::Tensor& q, at::Tensor& rows, const at::Tensor& key_rows,
                                        const at::Tensor& lens, int64_t k_offset, int64_t v_offset,
                                        double scale, const at::Tensor& new_rows, const at::Tensor& k,
                                        const at::Tensor& v) {
  PDSERVE_CHECK(rows.dim() == 3 && rows.is_contiguous() && rows.device().is_cpu(), "rows must be a contiguous CPU pool");
  const int64_t B = q.size(0), N = rows.size(0), row = rows.size(1) * rows.size(2);
  PDSERVE_CHECK(new_rows.dim() == 1 && new_rows.size(0) == B && new_rows.scalar_type() == at::kLong,
              "new_rows must be int64 [B]");
  PDSERVE_CHECK(k.dim() == 3 && k.size(0) == B && k.size(1) * k.size(2) == row && v.sizes() == k.sizes(),
              "k and v must be [B, Hkv, D] like the pool's rows");
  PDSERVE_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "k and v must share q's dtype");
  auto nr = new_rows.contiguous();
  const int64_t* nrp = nr.data_ptr<int64_t>();
  const int64_t lo = std::min<int64_t>(k_offset, v_offset), hi = std::max<int64_t>(k_offset, v_offset);
  for (int64_t b = 0; b < B; ++b)
    PDSERVE_CHECK(nrp[b] + lo >= 0 && nrp[b] + hi < N, "new row ", nrp[b], " is outside the pool");
  // A request's K and V heads are one contiguous run in q/k/v views of a fused qkv (row stride aside).
  // (converted first where the pool keeps another dtype, --kv-cache-dtype)
  const at::Tensor ks_in = k.scalar_type() == rows.scalar_type() ? k : k.to(rows.scalar_type());
  const at::Tensor vs_in = v.scalar_type() == rows.scalar_type() ? v : v.to(rows.scalar_type());
  auto kc = ks_in.stride(2) == 1 && ks_in.stride(1) == ks_in.size(2) ? ks_in : ks_in.contiguous();
  auto vc = vs_in.stride(2) == 1 && vs_in.stride(1) == vs_in.size(2) ? vs_in : vs_in.contiguous();
  const int64_t bytes = row * rows.element_size();
  char* base = static_cast<char*>(rows.data_ptr());
  const char* kp = static_cast<const char*>(kc.data_ptr());
  const char* vp = static_cast<const char*>(vc.data_ptr());
  const int64_t ks = kc.stride(0) * kc.element_size(), vs = vc.stride(0) * vc.element_size();
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(base + (nrp[b] + k_offset) * bytes, kp + b * ks, bytes);
    std::memcpy(base + (nrp[b] + v_offset) * bytes, vp + b * vs, bytes);
  }
  return paged_decode_attention(q, rows, key_rows, lens, k_offset, v_offset, scale, std::nullopt, std::nullopt);
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor rows, Tensor key_rows, Tensor lens, int k_offset, "
      "int v_offset, float scale, Tensor? k_new=None, Tensor? v_new=None) -> Tensor");
  m.def(
      "paged_decode_attention_store(Tensor q, Tensor(a!) rows, Tensor key_rows, Tensor lens, int k_offset, "
      "int v_offset, float scale, Tensor new_rows, Tensor k, Tensor v) -> Tensor");
  m.def(
      "paged_extend_attention(Tensor q, Tensor rows, Tensor key_rows, Tensor prefix, Tensor qo_indptr, "
      "int k_offset, int v_offset, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_store", &paged_decode_attention_store);
  m.impl("paged_extend_attention", &paged_extend_attention);
}
