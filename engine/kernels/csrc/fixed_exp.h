// e^x for x <= 0 as one fixed sequence of IEEE float operations, SiLU built on it, and the 16-lane
// halving sum: shared by the sampling kernels (nucleus.cpp), attention and the MLP (kquant.cpp), so
// that every build (AVX-512, AVX2, portable) and every thread count computes the same bits. Range reduction by ln 2, a degree-6
// polynomial, the exponent put back as an integer; the including file is built without fused
// multiply-adds (-ffp-contract=off), which keeps the vector and scalar versions identical.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fixed_exp {

constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;  // ln 2 in 9 bits: n * LN2_HI is exact for |n| < 2^15
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float EXP_UNDERFLOW = -87.3365447f;  // below: 0 (2^n would leave the normal range)
// The classic single-precision minimax polynomial for e^r - 1 - r on |r| <= ln2 / 2, over r^2.
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

// e^x for x <= 0 (the shifted logits); about 1 ulp. The vector version below is the same
// operations lane by lane.
inline float exp_scalar(float x) {
  if (!(x >= EXP_UNDERFLOW)) return 0.f;  // -inf and the underflow range
  const float n = std::nearbyint(x * LOG2E);
  const float r = (x - n * LN2_HI) - n * LN2_LO;
  const float r2 = r * r;
  float p = P0;
  p = p * r + P1;
  p = p * r + P2;
  p = p * r + P3;
  p = p * r + P4;
  p = p * r + P5;
  p = p * r2 + r;
  p = p + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX512F__)
inline __m512 exp_lanes(__m512 x) {
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_UNDERFLOW), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 p = _mm512_set1_ps(P0);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P1));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P2));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P3));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P4));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P5));
  p = _mm512_add_ps(_mm512_mul_ps(p, r2), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(kept, p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(__AVX2__)
// exp_lanes on 8 lanes: the same operations as exp_scalar, lane by lane.
inline __m256 exp_lanes8(__m256 x) {
  const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_UNDERFLOW), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 p = _mm256_set1_ps(P0);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P1));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P2));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P3));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P4));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P5));
  p = _mm256_add_ps(_mm256_mul_ps(p, r2), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(kept, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// sigmoid_scalar on 8 lanes, the same operations lane by lane.
inline __m256 sigmoid_lanes8(__m256 z) {
  const __m256 e = exp_lanes8(_mm256_or_ps(z, _mm256_set1_ps(-0.f)));  // e^-|z|
  const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.f), e);
  const __m256 positive = _mm256_div_ps(_mm256_set1_ps(1.f), denominator), negative = _mm256_div_ps(e, denominator);
  return _mm256_blendv_ps(negative, positive, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
}
// silu_scalar on 8 lanes, the same operations lane by lane.
inline __m256 silu_lanes8(__m256 x) { return _mm256_mul_ps(x, sigmoid_lanes8(x)); }
#endif

// The logistic sigmoid from e^-|z| (exp_scalar's range): 1 / (1 + e) for z >= 0, e / (1 + e) below.
inline float sigmoid_scalar(float z) {
  const float e = exp_scalar(-std::fabs(z));
  const float denominator = 1.f + e;
  return z >= 0.f ? 1.f / denominator : e / denominator;
}
// SiLU, x * sigmoid(x). NaN stays NaN; +inf gives +inf and -inf NaN, as torch's silu. Unlike ATen's
// silu (vectorised Sleef on whole vectors, libm on each parallel chunk's tail, the chunk edges set
// by the thread count), every element gets these operations whoever computes it.
inline float silu_scalar(float x) { return x * sigmoid_scalar(x); }



// GELU with the tanh approximation (Gemma's gelu_pytorch_tanh), written as x * sigmoid(z) with
// z = 2 sqrt(2/pi) (x + 0.044715 x^3), since (1 + tanh(z/2)) / 2 = sigmoid(z): no cancellation near
// 0. NaN stays NaN, +inf gives +inf and -inf NaN, as torch's gelu. Every element gets these
// operations whoever computes it (ATen's gelu does not).
constexpr float GELU_C = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
constexpr float GELU_CUBIC = 0.044715f;
inline float gelu_scalar(float x) { return x * sigmoid_scalar(GELU_C * (x + GELU_CUBIC * ((x * x) * x))); }
#if defined(__AVX2__)
// gelu_scalar on 8 lanes, the same operations lane by lane.
inline __m256 gelu_lanes8(__m256 x) {
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(GELU_C), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_CUBIC), cube)));
  return _mm256_mul_ps(x, sigmoid_lanes8(z));
}
#endif
// y[i] = act(g[i]) * u[i] for i < n (the gated MLP's product; act(g[i]) alone when u is null), 8 lanes
// at a time where the CPU has them: ``lanes`` and ``scalar`` the same function (silu or gelu).
#if defined(__AVX2__)
template <__m256 (*lanes)(__m256), float (*scalar)(float)>
#else
template <float (*scalar)(float)>
#endif
inline void activation_times(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256 s = lanes(_mm256_loadu_ps(g + i));
    _mm256_storeu_ps(y + i, u ? _mm256_mul_ps(s, _mm256_loadu_ps(u + i)) : s);
  }
#endif
  for (; i < n; ++i) y[i] = u ? scalar(g[i]) * u[i] : scalar(g[i]);
}
#if defined(__AVX2__)
inline void silu_times(const float* g, const float* u, float* y, int64_t n) {
  activation_times<silu_lanes8, silu_scalar>(g, u, y, n);
}
inline void gelu_times(const float* g, const float* u, float* y, int64_t n) {
  activation_times<gelu_lanes8, gelu_scalar>(g, u, y, n);
}
#else
inline void silu_times(const float* g, const float* u, float* y, int64_t n) { activation_times<silu_scalar>(g, u, y, n); }
inline void gelu_times(const float* g, const float* u, float* y, int64_t n) { activation_times<gelu_scalar>(g, u, y, n); }
#endif
// lanes[0..15] halved as a tree: i + i+8, i + i+4, i + i+2, i + i+1.
template <typename T>
inline T halving(T* lanes) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) lanes[i] = lanes[i] + lanes[i + w];
  return lanes[0];
}

}  // namespace fixed_exp
