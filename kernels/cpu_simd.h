// The vector registers of the pdserve_cpu kernels, one struct per instruction set, so that a kernel is
// written once as a template and built for AVX-512 (16 floats a register) or AVX2 + FMA + F16C (8 floats).
// `Simd` is the widest this build targets; PDSERVE_SIMD is defined where there is one. Which one a
// build targets is chosen at run time, from the CPU's flags or the PDSERVE_CPU_ISA cap
// (kernels/cpu_isa.py), by the compiler flags the library is built with.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace pdserve_simd {

#if defined(__AVX512F__)
struct Simd512 {
  using Reg = __m512;
  using Idx = __m512i;
  using Mask = __mmask16;
  static constexpr int W = 16;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static Reg load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(Reg v) { return _mm512_reduce_add_ps(v); }
  // argmax: lanes where a > b, lanes holding NaN, and blends taking b's lanes where the mask is set
  static Mask greater(Reg a, Reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Mask nan(Reg a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static Mask either(Mask a, Mask b) { return a | b; }
  static bool any(Mask m) { return m != 0; }
  static Mask none() { return 0; }
  static Reg blend(Mask m, Reg a, Reg b) { return _mm512_mask_blend_ps(m, a, b); }
  static Idx blend(Mask m, Idx a, Idx b) { return _mm512_mask_blend_epi32(m, a, b); }
  static Idx iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static Idx idx_zero() { return _mm512_setzero_si512(); }
  static Idx advance(Idx i) { return _mm512_add_epi32(i, _mm512_set1_epi32(W)); }
  static void store(int32_t* p, Idx v) { _mm512_storeu_si512(p, v); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg clamp(Reg x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, set1(lo)), set1(hi)); }
  static Reg floor(Reg x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // 2^n for integral n in [-126, 127] held as floats
  static Reg pow2(Reg n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
using Simd = Simd512;
#define PDSERVE_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Simd256 {
  using Reg = __m256;
  using Idx = __m256i;
  using Mask = __m256;  // a compare's lanes: all ones where true
  static constexpr int W = 8;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static Reg load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(Reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static Mask greater(Reg a, Reg b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static Mask nan(Reg a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static Mask either(Mask a, Mask b) { return _mm256_or_ps(a, b); }
  static bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
  static Mask none() { return _mm256_setzero_ps(); }
  static Reg blend(Mask m, Reg a, Reg b) { return _mm256_blendv_ps(a, b, m); }
  static Idx blend(Mask m, Idx a, Idx b) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), m));
  }
  static Idx iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static Idx idx_zero() { return _mm256_setzero_si256(); }
  static Idx advance(Idx i) { return _mm256_add_epi32(i, _mm256_set1_epi32(W)); }
  static void store(int32_t* p, Idx v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg clamp(Reg x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, set1(lo)), set1(hi)); }
  static Reg floor(Reg x) { return _mm256_floor_ps(x); }
  static Reg pow2(Reg n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};
using Simd = Simd256;
#define PDSERVE_SIMD 256
#endif

#if defined(PDSERVE_SIMD)
// exp(x) lane by lane (Cephes' single-precision polynomial, within 2 ulp of std::exp over [-87, 88]; below,
// 2^-126 scaled, which a softmax weighs as nothing): each lane's value depends on that lane's input only,
// so a softmax row gives the same probabilities whatever lane or register an entry lands in.
template <typename V>
inline typename V::Reg exp(typename V::Reg x) {
  using Reg = typename V::Reg;
  x = V::clamp(x, -87.3365478515625f, 88.3762626647949f);
  const Reg n = V::floor(V::fmadd(x, V::set1(1.44269504088896341f), V::set1(0.5f)));  // round(x / ln 2)
  x = V::fmadd(n, V::set1(-0.693359375f), x);  // x - n ln 2, in two parts
  x = V::fmadd(n, V::set1(2.12194440e-4f), x);
  Reg y = V::set1(1.9875691500e-4f);
  y = V::fmadd(y, x, V::set1(1.3981999507e-3f));
  y = V::fmadd(y, x, V::set1(8.3334519073e-3f));
  y = V::fmadd(y, x, V::set1(4.1665795894e-2f));
  y = V::fmadd(y, x, V::set1(1.6666665459e-1f));
  y = V::fmadd(y, x, V::set1(5.0000001201e-1f));
  y = V::fmadd(y, V::mul(x, x), V::add(x, V::set1(1.f)));
  return V::mul(y, V::pow2(n));
}
#endif

}  // namespace pdserve_simd
