// Logits to a sampling distribution in one pass per step: softmax at a temperature, then the
// top-p nucleus (engine/core/sampling.py, logits_to_probs, is the contract).
//
// torch takes about ten passes and a dozen operator calls for this over a 151,936-token row, about
// 2 ms a decoding step at temperature 0.6 / top-p 0.9 in the engine. Here a row is one max pass,
// one exponential pass (which also sums), one division pass, one listing of the likely tokens,
// and a small sort. Every path (AVX-512, AVX2 or portable) computes the same bits: the exponential
// is one fixed sequence of IEEE float operations (range reduction by ln 2, a degree-6 polynomial,
// the exponent put back as an integer), built without fused multiply-adds; the sum runs in double
// over 16 lanes in index order (lane = index % 16), halved as a tree; each probability is one
// double division rounded to float; the nucleus is sorted by (probability descending, index
// ascending), a total order, and its prefix sums are double. So the kept set is the exact
// nucleus of these probabilities, which are within a few float roundings of the exact softmax.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "fixed_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define NUCLEUS_AVX512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define NUCLEUS_AVX2 1
#endif

namespace {

using fixed_exp::exp_scalar;
using fixed_exp::halving;
#if defined(NUCLEUS_AVX512)
using fixed_exp::exp_lanes;
#elif defined(NUCLEUS_AVX2)
using fixed_exp::exp_lanes8;
#endif

constexpr float LIKELY = 1e-3f;     // the nucleus is first looked for among tokens at least this likely
constexpr float POSSIBLE = 1e-7f;   // then among these, then (rarely) every token with mass

// e[i] = exp(z_i), z_i = (x_i - top) / temperature (x_i - top when temperature is 0; a NaN z, from
// 0 / 0, taken as 0); returns the sum of e in double, over 16 lanes in index order (lane = index %
// 16) halved as a tree. A float sum of 151,936 terms drifts by up to 1e-5 of the total, enough to
// move a wide nucleus's edge by tens of tokens; the double sum keeps the law within float roundings.
double exponentials(const float* x, float* e, int64_t V, float top, float temperature) {
  double lanes[16] = {0};
  int64_t i = 0;
#if defined(NUCLEUS_AVX512)
  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();  // lanes 0-7 and 8-15
  const __m512 shift = _mm512_set1_ps(top), divisor = _mm512_set1_ps(temperature);
  for (; i + 16 <= V; i += 16) {
    __m512 z = _mm512_sub_ps(_mm512_loadu_ps(x + i), shift);
    if (temperature > 0.f) z = _mm512_div_ps(z, divisor);
    z = _mm512_mask_mov_ps(z, _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q), _mm512_setzero_ps());
    const __m512 v = exp_lanes(z);
    _mm512_storeu_ps(e + i, v);
    low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  _mm512_storeu_pd(lanes, low);
  _mm512_storeu_pd(lanes + 8, high);
#elif defined(NUCLEUS_AVX2)
  __m256d sums[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  const __m256 shift = _mm256_set1_ps(top), divisor = _mm256_set1_ps(temperature);
  for (; i + 16 <= V; i += 16) {
    for (int h = 0; h < 2; ++h) {
      __m256 z = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * h), shift);
      if (temperature > 0.f) z = _mm256_div_ps(z, divisor);
      z = _mm256_blendv_ps(z, _mm256_setzero_ps(), _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
      const __m256 v = exp_lanes8(z);
      _mm256_storeu_ps(e + i + 8 * h, v);
      sums[2 * h] = _mm256_add_pd(sums[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      sums[2 * h + 1] = _mm256_add_pd(sums[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
  }
  for (int j = 0; j < 4; ++j) _mm256_storeu_pd(lanes + 4 * j, sums[j]);
#endif
  for (; i < V; ++i) {
    float z = x[i] - top;
    if (temperature > 0.f) z = z / temperature;
    if (std::isnan(z)) z = 0.f;
    e[i] = exp_scalar(z);
    lanes[i % 16] = lanes[i % 16] + static_cast<double>(e[i]);
  }
  return halving(lanes);
}

// The row's largest entry (NaN entries aside) and whether it has a NaN.
void row_max(const float* x, int64_t V, float& top, bool& nan) {
  top = -INFINITY;
  nan = false;
  int64_t i = 0;
#if defined(NUCLEUS_AVX512)
  __m512 tops = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    tops = _mm512_max_ps(v, tops);  // a NaN v leaves tops alone
  }
  top = _mm512_reduce_max_ps(tops);
  nan = unordered != 0;
#endif
  for (; i < V; ++i) {
    nan = nan || std::isnan(x[i]);
    top = x[i] > top ? x[i] : top;
  }
}

// p[i] = e[i] / total in place (divided in double, rounded once to float); returns the indices
// (increasing) with p >= threshold.
void divide_and_list(float* p, int64_t V, double total, float threshold, std::vector<int64_t>& likely) {
  for (int64_t i = 0; i < V; ++i) p[i] = static_cast<float>(static_cast<double>(p[i]) / total);
  likely.clear();
  if (!(threshold <= 1.f)) return;
  int64_t i = 0;
#if defined(NUCLEUS_AVX512)
  const __m512 bar = _mm512_set1_ps(threshold);
  for (; i + 16 <= V; i += 16)
    for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), bar, _CMP_GE_OQ); m; m &= m - 1)
      likely.push_back(i + __builtin_ctz(m));
#endif
  for (; i < V; ++i)
    if (p[i] >= threshold) likely.push_back(i);
}

// Among ``ranked`` (sorted most likely first), the nucleus: entries whose preceding mass
// (inclusive prefix sum minus the entry, as torch computes it) is below top_p. Returns how many,
// or 0 when the listed mass never reaches top_p (the nucleus may reach further).
int64_t nucleus_size(const float* p, const std::vector<int64_t>& ranked, double top_p, bool whole) {
  double mass = 0.0;  // prefix sums in double, as torch's cumsum accumulates float32 on CPU
  int64_t kept = 0;
  for (int64_t index : ranked) {
    mass = mass + p[index];
    if (mass - p[index] < top_p) ++kept;
  }
  return (mass >= top_p || whole) ? kept : 0;
}

// p [V] (a distribution) -> its top_p nucleus renormalised, zero elsewhere. ranked: the indices
// with p >= LIKELY, in increasing order (divide_and_list); used as scratch.
void keep_nucleus(float* p, int64_t V, double top_p, std::vector<int64_t>& ranked) {
  auto by_mass = [p](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  int64_t kept = 0;
  for (float threshold : {LIKELY, POSSIBLE, 0.f}) {
    if (threshold < LIKELY) {  // a wide nucleus: list again with a lower bar (0: every token with mass)
      ranked.clear();
      for (int64_t i = 0; i < V; ++i)
        if (p[i] >= threshold && (threshold > 0.f || p[i] > 0.f)) ranked.push_back(i);
    }
    std::sort(ranked.begin(), ranked.end(), by_mass);
    kept = nucleus_size(p, ranked, top_p, threshold == 0.f);
    if (kept > 0) break;
  }
  double mass = 0.0;
  std::vector<float> values(kept);
  for (int64_t k = 0; k < kept; ++k) {
    values[k] = p[ranked[k]];
    mass = mass + values[k];
  }
  const float total = static_cast<float>(mass);
  std::fill(p, p + V, 0.f);
  for (int64_t k = 0; k < kept; ++k) p[ranked[k]] = values[k] / total;
}

}  // namespace

// logits [..., V] float32 -> (probabilities [..., V], ok): softmax of logits / temperature (the
// plain softmax at temperature 0), restricted to the top-p nucleus and renormalised when top_p < 1.
// ok is false when a row's maximum is NaN or +inf (the caller raises); a row of -inf only is
// uniform.
std::tuple<torch::Tensor, bool> nucleus_probs(const torch::Tensor& logits, double temperature, double top_p) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(), "float32 CPU logits");
  const torch::Tensor x = logits.reshape({-1, logits.size(-1)}).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R, V}, torch::kFloat32);
  bool ok = true;
  std::vector<int64_t> likely;
  // A positive temperature below float's range (under about 7e-46) would round to 0, the plain
  // softmax; the smallest float divisor keeps it the limit it is: all mass on the largest logits.
  const float divisor = temperature > 0.0 ? std::max(static_cast<float>(temperature),
                                                     std::numeric_limits<float>::denorm_min()) : 0.f;
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * V;
    float* p = out.data_ptr<float>() + r * V;
    float top;
    bool nan;
    row_max(row, V, top, nan);
    if (nan || top == INFINITY) {
      ok = false;
      continue;
    }
    double total;
    if (top == -INFINITY) {  // every logit -inf: each z is NaN, taken as 0, so each exponential is 1
      std::fill(p, p + V, 1.f);
      total = static_cast<double>(V);
    } else {
      total = exponentials(row, p, V, top, divisor);
    }
    divide_and_list(p, V, total, top_p < 1.0 ? LIKELY : INFINITY, likely);
    if (top_p < 1.0) keep_nucleus(p, V, top_p, likely);
  }
  return {out.reshape(logits.sizes()), ok};
}

// The token an inverse-CDF draw picks from probs [V] (float32, non-negative): the first index whose
// prefix sum exceeds u01 * total, the prefix sums and the total accumulated in double in index
// order (torch.cumsum(probs, dtype=float64) computes the same values, so the same u01 picks the same
// token); -1 when u01 * total rounds up to the total (draw again), -2 when the total is not a
// positive finite number (nothing can be drawn). Zeros add nothing to a double sum, so they are skipped.
int64_t draw_index(const torch::Tensor& probs, double u01) {
  TORCH_CHECK(probs.dim() == 1 && probs.scalar_type() == torch::kFloat32 && probs.device().is_cpu(), "float32 CPU [V]");
  const torch::Tensor row = probs.contiguous();
  const float* p = row.data_ptr<float>();
  const int64_t V = row.size(0);
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i)
    if (p[i] != 0.f) total = total + static_cast<double>(p[i]);
  if (!(total > 0.0) || std::isinf(total)) return -2;
  const double u = u01 * total;
  double mass = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    if (p[i] == 0.f) continue;
    mass = mass + static_cast<double>(p[i]);
    if (mass > u) return i;
  }
  return -1;
}

// The indices [R, k] of the k largest values of each row of x [R, V] (float32, CPU), largest first,
// equal values in index order: for k = 1 torch.argmax's first maximum. One pass a row, 16 values
// compared at a time against the k-th best so far; a row holding a NaN gives -1 in its first column
// (the caller falls back to torch, whose argmax takes NaN as the maximum).
torch::Tensor top_indices(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "float32 CPU [R, V]");
  const torch::Tensor rows = x.contiguous();
  const int64_t R = rows.size(0), V = rows.size(1);
  TORCH_CHECK(k >= 1 && k <= V && k <= 64, "k must be in 1..min(V, 64)");
  auto out = torch::empty({R, k}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const float* v = rows.data_ptr<float>() + r * V;
    std::vector<float> best;  // descending, ties in index order
    std::vector<int64_t> where;
    bool nan = false;
    auto offer = [&](int64_t i) {
      if (std::isnan(v[i])) { nan = true; return; }
      if ((int64_t)best.size() == k && !(v[i] > best.back())) return;
      const auto at = std::upper_bound(best.begin(), best.end(), v[i], std::greater<float>()) - best.begin();
      best.insert(best.begin() + at, v[i]);
      where.insert(where.begin() + at, i);
      if ((int64_t)best.size() > k) { best.pop_back(); where.pop_back(); }
    };
    int64_t i = 0;
    for (; i < k; ++i) offer(i);
#if defined(NUCLEUS_AVX512)
    for (; i + 16 <= V && !nan; i += 16) {
      const __m512 lanes = _mm512_loadu_ps(v + i);
      __mmask16 m = _mm512_cmp_ps_mask(lanes, _mm512_set1_ps(best.back()), _CMP_NLE_UQ);  // > or NaN
      while (m) {
        const int lane = __builtin_ctz(m);
        m &= m - 1;
        offer(i + lane);
      }
    }
#endif
    for (; i < V && !nan; ++i) offer(i);
    for (int64_t j = 0; j < k; ++j) o[r * k + j] = nan ? -1 : where[j];
  }
  return out;
}
