// Batch-invariant CPU kernels for a target kept in its GGUF k-quant blocks.
//
// Every output row is computed by the same instructions in the same order whatever the number of
// rows in the call, so a row of an n-token verification is bit-identical to decoding that token
// alone. Products are integer (8-bit activations x 4/6-bit weights, exact in int32); the float
// work per 256-input super-block is a fixed sequence of IEEE operations (built with
// -ffp-contract=off, so no fused multiply-add changes it).
//
// Layouts (built in engine/kquant.py), per tile of 16 output features and super-block of 256 inputs:
//   q4k: qs [8 sub-blocks][4][64] bytes: byte o*4+i of load l of sub-block j holds input
//        32j+8l+i in its low nibble and 32j+8l+4+i in its high one, for output o of the tile;
//        sc, mn [8][16] uint8 (6-bit scales and mins); d, dmin [16] fp16.
//        w = d*sc*q - dmin*mn, q in 0..15 (GGUF Q4_K, kept exactly).
//   q6k: qs [16 sub-blocks][3][64] bytes (6.75 bits a weight, as GGUF's 6.5625 plus the scales'
//        share): for input 16j+4l+i of output o, q in 0..63 has its low nibble in byte o*4+i of
//        vector l/2 (low nibble for even l, high for odd) and its two high bits at bits 2l, 2l+1
//        of byte o*4+i of vector 2; sc [16][16] int8; d [16] fp16. w = d*sc*(q-32) (GGUF Q6_K).
// Activations: per row and super-block, x ~= sx * xq with xq int8 = round(x * 127 / max|x|).
// Every other GGUF type (legacy Q4_0 .. Q8_0, Q2_K, Q5_K, the float types; Q3_K as Q6_K's form)
// has its kernels in blocks.h, dispatched by PackedLinear's kind (block_linear from Python).
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "fixed_exp.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KQ_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_AVX2 1
#endif

namespace {

constexpr int QK = 256;
constexpr int TILE = 16;
constexpr int64_t TILE_CHUNK = 8;  // tiles a thread takes at a time (8 x 16 outputs)
constexpr int64_t Q4K_BYTES = TILE * QK / 2;      // packed quants of a tile's super-block: 4 bits a weight
constexpr int64_t Q6K_BYTES = TILE * QK * 3 / 4;  // 6 bits a weight
// How far ahead of its reads a kernel asks for the weight stream (software prefetch, 2 KiB: about
// one super-block of a tile). Once a super-block's integer work is long (4 rows and more with VNNI,
// any row count on AVX2) the hardware prefetcher alone lets the stream stall; asked for ahead, the
// loads overlap the arithmetic. The target's linears on the 2-core EPYC, 1 / 4 rows: VNNI 34 / 44
// -> 33 / 38 ms; the AVX2 path built for it, 47 / 81 -> 40 / 64 ms.
constexpr int64_t PREFETCH_AHEAD = 2048;
// Many rows (a prefill chunk) go through a product in panels of up to PANEL_ROWS rows, which share
// each sub-block's unpacked weights (see panel_q4k); fewer than PANEL_FROM rows (decoding, trees)
// keep the register-blocked row kernels. Either way a row's bits are the same. One thread, 64-512
// rows, on a 2-core AVX-512 Xeon (2026-11-28): Q6_K 1536 x 8960 106 -> 119 G multiply-adds/s with
// VNNI, 48 -> 58 on its AVX2 build; Q4_K 8960 x 1536 unchanged with VNNI (124), 62 -> 66 on AVX2.
// Then, with the rows' sums paired once (quantize_rows' p16, p32) and Q6_K's AVX2 scales in madd:
// Q4_K 119-135 -> 138-148 with VNNI, 63-67 -> 88-93 on AVX2; Q6_K 119-127 -> 124-136 and 58 -> 74-76.
// PANEL_FROM: AVX2's row kernels hold only 4 rows' accumulators, and from 5 rows on a panel (one
// unpack for all rows, the weight stream prefetched) wins: the target's forward at 5 / 8 / 10 / 12
// rows 90 / 126 / 151 / 175-180 -> 85 / 108-110 / 126-131 / 144-147 ms (2 threads, 2026-11-28).
// VNNI's row kernels, 8 rows to a block, stay as fast or faster through 12 rows.
constexpr int64_t PANEL_ROWS = 64;
#if defined(KQ_VNNI)
constexpr int64_t PANEL_FROM = 16;
#else
constexpr int64_t PANEL_FROM = 5;
#endif
#if defined(KQ_VNNI) || defined(KQ_AVX2)
inline bool uses_panels(int64_t R) { return R >= PANEL_FROM; }
#else
inline bool uses_panels(int64_t) { return false; }  // the portable path goes one row at a time
#endif

// Two int16 values (each |v| < 2^15) as one int32 lane pattern: lo in the low half, hi in the high
// one, for the int16-pair products (madd_epi16, dpwssd) that take them two at a time.
inline int32_t int16_pair(int32_t lo, int32_t hi) {
  return (int32_t)((uint32_t)(uint16_t)lo | ((uint32_t)(uint16_t)hi << 16));
}

// The super-blocks' scales d and dmin are kept as the fp16 values GGUF stores (2 bytes, not 4); the
// conversion to float is exact, so every path computes with the same float values as before.
inline float half(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

inline const uint16_t* half_bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

// ---- activations ---------------------------------------------------------------------------

// One super-block of 256 inputs: xb -> qb int8, its scale, and the sums of its 16 groups of 16.
// Per element the same IEEE steps on every path (|x|, max, x * inv, clamp to +-127, round to
// nearest even); maxima and integer sums are exact in any order, so the SIMD paths vectorise them.
#if defined(KQ_VNNI)
inline float quantize_block(const float* xb, int8_t* qb, int32_t* sums) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < QK; i += 16) m = _mm512_max_ps(m, _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + i)));
  const float amax = _mm512_reduce_max_ps(m);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int j = 0; j < QK / 16; ++j) {
    const __m512 v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(_mm512_loadu_ps(xb + j * 16), inv)));
    const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i*)(qb + j * 16), _mm512_cvtsepi32_epi8(q));
    sums[j] = _mm512_reduce_add_epi32(q);
  }
  return amax;
}
#elif defined(KQ_AVX2)
// The largest of v's lanes (none NaN). A maximum's bits do not depend on the order it is taken in,
// but for the sign of a zero.
inline float largest_lane(__m256 v) {
  const __m128 four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

// The 8 lanes of each of a[0..7] summed: lane t of the result is a[t]'s sum.
inline __m256i lane_sums8(const __m256i (&a)[8]) {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

inline float quantize_block(const float* xb, int8_t* qb, int32_t* sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < QK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  // fmax over the lanes from 0 (NaN lanes left out), without its library call: NaN lanes as 0
  const float amax = largest_lane(_mm256_and_ps(m, _mm256_cmp_ps(m, m, _CMP_ORD_Q)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i group[8];  // eight groups' 16 quants, summed by lanes
  #pragma GCC unroll 16
  for (int j = 0; j < QK / 16; ++j) {
    __m256i q[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(xb + j * 16 + h * 8), inv)));
      q[h] = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(q[0]), _mm256_extracti128_si256(q[0], 1));
    const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(q[1]), _mm256_extracti128_si256(q[1], 1));
    _mm_storeu_si128((__m128i*)(qb + j * 16), _mm_packs_epi16(w0, w1));
    group[j % 8] = _mm256_add_epi32(q[0], q[1]);
    if (j % 8 == 7) _mm256_storeu_si256((__m256i*)(sums + j - 7), lane_sums8(group));
  }
  return amax;
}
#else
inline float quantize_block(const float* xb, int8_t* qb, int32_t* sums) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < QK; ++i) qb[i] = (int8_t)std::nearbyint(std::fmin(127.f, std::fmax(-127.f, xb[i] * inv)));
  for (int j = 0; j < QK / 16; ++j) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += qb[j * 16 + i];
    sums[j] = s;
  }
  return amax;
}
#endif

// The legacy kinds' activations (llama.cpp quantises them per 32 too, as Q8_0/Q8_1): one super-block,
// each group of 32 inputs with its own scale ``scales[g] = max|x| / 127``, the sums of 16 as above.
// Written once, in plain C++, for every build: the same IEEE steps per element as quantize_block.
constexpr int FINE = 32;
inline void quantize_groups(const float* xb, int8_t* qb, int32_t* sums, float* scales) {
  for (int g = 0; g < QK / FINE; ++g) {
    const float* xg = xb + g * FINE;
    float amax = 0.f;
    for (int i = 0; i < FINE; ++i) amax = std::fmax(amax, std::fabs(xg[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < FINE; ++i)
      qb[g * FINE + i] = (int8_t)std::nearbyint(std::fmin(127.f, std::fmax(-127.f, xg[i] * inv)));
    scales[g] = amax / 127.f;
  }
  for (int j = 0; j < QK / 16; ++j) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += qb[j * 16 + i];
    sums[j] = s;
  }
}

// Where row r's super-block b of activations lies, in super-blocks (256 int8 in xq, 16 sums in s16).
// Row-major: row after row. Panel-major (a product of PANEL_FROM rows or more): a panel's rows of one
// super-block lie together, so that a panel reads its activations in order, not as PANEL_ROWS
// streams a row apart (which the hardware prefetcher cannot follow once K is wide).
inline int64_t block_slot(int64_t r, int64_t b, int64_t nb, bool panel_major) {
  return panel_major ? (r / PANEL_ROWS * nb + b) * PANEL_ROWS + r % PANEL_ROWS : r * nb + b;
}

// x [R, K] float -> at block_slot: xq int8, s16 int32 (sums of 16 xq), and the same sums two at a
// time as int16 pairs (int16_pair) for the products that take pairs: p16 (8 a super-block, adjacent
// sums of 16: a Q6_K offset) and p32 (4, adjacent sums of 32, |.| <= 32 * 127: a Q4_K mins' term);
// sx [R, K/256] float. The pairs are made once here, not again for every tile of outputs. With
// ``fine``, each group of 32 has its own scale instead: sx [R, K/32], no pairs (the legacy kinds).
void quantize_rows(const float* x, int64_t R, int64_t K, bool panel_major, bool fine, int8_t* xq, float* sx,
                   int32_t* s16, int32_t* p16, int32_t* p32) {
  const int64_t nb = K / QK;
  // Each block on its own, so the threads split them (a prefill chunk's 256 x 8,960 inputs: 2 ms on
  // one AVX2 core, a tenth of the product after it); small batches stay on the calling thread.
  at::parallel_for(0, R * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb, slot = block_slot(r, b, nb, panel_major);
      int32_t* sums = s16 + slot * 16;
      if (fine) {
        quantize_groups(x + r * K + b * QK, xq + slot * QK, sums, sx + (r * nb + b) * (QK / FINE));
        continue;
      }
      sx[r * nb + b] = quantize_block(x + r * K + b * QK, xq + slot * QK, sums) / 127.f;
      for (int k = 0; k < 8; ++k) p16[slot * 8 + k] = int16_pair(sums[2 * k], sums[2 * k + 1]);
      for (int k = 0; k < 4; ++k)
        p32[slot * 4 + k] = int16_pair(sums[4 * k] + sums[4 * k + 1], sums[4 * k + 2] + sums[4 * k + 3]);
    }
  });
}

struct Rows {
  const int8_t* xq;
  const float* sx;      // [R, K/256], or [R, K/32] when ``fine`` (quantize_rows)
  const int32_t* s16;
  const int32_t* p16;  // per super-block 8 and 4 int16 pairs of the sums (quantize_rows)
  const int32_t* p32;
  int64_t K;
  bool panel_major;  // the layout quantize_rows wrote (block_slot)
  bool fine;         // a scale per 32 inputs (the legacy kinds' products) rather than per 256
  // Panel-major rows: super-block blk of the panel starting at row r0 (a multiple of PANEL_ROWS), its
  // rows QK bytes (their pairs 8 and 4 int32) apart.
  const int8_t* panel_x(int64_t r0, int64_t blk) const { return xq + block_slot(r0, blk, K / QK, true) * QK; }
  const int32_t* panel_p16(int64_t r0, int64_t blk) const { return p16 + block_slot(r0, blk, K / QK, true) * 8; }
  const int32_t* panel_p32(int64_t r0, int64_t blk) const { return p32 + block_slot(r0, blk, K / QK, true) * 4; }
};

// A Q4_K weight's tensors. Its quants are tile-major: a tile's super-blocks one after the other, each
// of 8 sub-blocks (Q4K_BYTES), except that with ``half_tail`` the last one keeps only its first 4: a
// layer of 896 inputs is 3.5 super-blocks, and the zero half of the fourth is neither stored nor read
// (its products are 0: the padded activations are 0). The scales and mins keep all 8 (zeros).
struct Q4KWeight {
  const uint8_t *qs, *sc, *mn;
  const uint16_t *d, *dmin;  // fp16 bits
  bool half_tail;
  const uint8_t* quants(int64_t tile, int64_t nb, int64_t blk) const {
    return qs + tile * (nb * Q4K_BYTES - (half_tail ? Q4K_BYTES / 2 : 0)) + blk * Q4K_BYTES;
  }
  // Sub-blocks stored for super-block ``blk`` of ``nb``: those not stored add 0.
  int subblocks(int64_t nb, int64_t blk) const { return half_tail && blk == nb - 1 ? 4 : 8; }
};

// Rows in blocks of up to MAX (4 or 8; the last block smaller): ``rows_of(block, r)`` runs rows
// r .. r+block-1, with ``block`` a compile-time std::integral_constant so each block size gets its
// own unrolled code. A block shares each sub-block's unpacked weights among its rows; AVX-512's 32
// registers hold eight rows' accumulators, AVX2's 16 four.
template <int MAX, typename F>
void by_row_blocks(int64_t R, F rows_of) {
  int64_t r = 0;
  for (; r + MAX <= R; r += MAX) rows_of(std::integral_constant<int, MAX>{}, r);
  if constexpr (MAX == 8) {
    switch (R - r) {
      case 7: rows_of(std::integral_constant<int, 7>{}, r); return;
      case 6: rows_of(std::integral_constant<int, 6>{}, r); return;
      case 5: rows_of(std::integral_constant<int, 5>{}, r); return;
      case 4: rows_of(std::integral_constant<int, 4>{}, r); return;
      default: break;
    }
  }
  if (R - r == 3) rows_of(std::integral_constant<int, 3>{}, r);
  else if (R - r == 2) rows_of(std::integral_constant<int, 2>{}, r);
  else if (R - r == 1) rows_of(std::integral_constant<int, 1>{}, r);
}

#ifdef KQ_VNNI
// 16 fp16 scales as float lanes (exact).
inline __m512 half16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// Bytes a[0], b[0], a[1], b[1], ... a[15], b[15]: widened to int16, lane l holds the pair (a[l], b[l]).
inline __m256i interleave_bytes(__m128i a, __m128i b) {
  return _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
}

// One Q4_K sub-block's 32 inputs x 16 outputs: w[2l] holds inputs 8l .. 8l+3 and w[2l+1] inputs
// 8l+4 .. 8l+7, four bytes an output lane (dpbusd's layout).
inline void unpack_q4k(const uint8_t* q, __m512i (&w)[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  #pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {
    const __m512i raw = _mm512_loadu_si512(q + l * 64);
    w[2 * l] = _mm512_and_si512(raw, low);
    w[2 * l + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
  }
}

// One Q6_K sub-block's 16 inputs x 16 outputs, w[l] inputs 4l .. 4l+3: (low nibble) | (two high bits
// << 4), each as one ternary-logic op, A | (B & C).
inline void unpack_q6k(const uint8_t* q, __m512i (&w)[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  const __m512i lo01 = _mm512_loadu_si512(q), lo23 = _mm512_loadu_si512(q + 64), hb = _mm512_loadu_si512(q + 128);
  w[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(lo01, low), _mm512_slli_epi16(hb, 4), high, 0xF8);
  w[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(lo01, 4), low), _mm512_slli_epi16(hb, 2), high, 0xF8);
  w[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(lo23, low), hb, high, 0xF8);
  w[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(lo23, 4), low), _mm512_srli_epi16(hb, 2), high, 0xF8);
}

// Sub-block j of a super-block (q: its packed quants, sc: its scales): the weights unpacked into w,
// the weight stream asked for PREFETCH_AHEAD bytes on, the 16 outputs' scales widened to int32.
inline __m512i subblock_q4k(const uint8_t* q, const uint8_t* sc, int j, __m512i (&w)[8]) {
  #pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)(q + j * 256 + l * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
  unpack_q4k(q + j * 256, w);
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sc + j * 16)));
}

inline __m512i subblock_q6k(const uint8_t* q, const int8_t* sc, int j, __m512i (&w)[4]) {
  #pragma GCC unroll 3
  for (int l = 0; l < 3; ++l) _mm_prefetch((const char*)(q + j * 192 + l * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
  unpack_q6k(q + j * 192, w);
  return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sc + j * 16)));
}

// One row's integer products with an unpacked sub-block (xq: its 32 or 16 inputs), 16 output lanes.
inline __m512i dot_q4k(const __m512i (&w)[8], const int8_t* xq) {
  __m512i dot = _mm512_setzero_si512();
  #pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {
    int32_t x0, x1;
    std::memcpy(&x0, xq + l * 8, 4);
    std::memcpy(&x1, xq + l * 8 + 4, 4);
    dot = _mm512_dpbusd_epi32(dot, w[2 * l], _mm512_set1_epi32(x0));
    dot = _mm512_dpbusd_epi32(dot, w[2 * l + 1], _mm512_set1_epi32(x1));
  }
  return dot;
}

inline __m512i dot_q6k(const __m512i (&w)[4], const int8_t* xq) {
  __m512i dot = _mm512_setzero_si512();
  #pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {
    int32_t x0;
    std::memcpy(&x0, xq + l * 4, 4);
    dot = _mm512_dpbusd_epi32(dot, w[l], _mm512_set1_epi32(x0));
  }
  return dot;
}

// The scaled products sum_j sc_j * (q_j . xq_j) of one super-block's first NSUB sub-blocks (8, or 4
// for a half tail) for NR rows, added to a[0..NR-1].
template <int NR, int NSUB>
__attribute__((always_inline)) inline void products_q4k(const uint8_t* q, const uint8_t* sct, const Rows& rows,
                                                        int64_t r0, int64_t blk, __m512i* a) {
  for (int j = 0; j < NSUB; ++j) {
    __m512i w[8];
    const __m512i scv = subblock_q4k(q, sct, j, w);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr)
      a[rr] = _mm512_add_epi32(a[rr], _mm512_mullo_epi32(dot_q4k(w, rows.xq + (r0 + rr) * rows.K + blk * QK + j * 32), scv));
  }
}

// Per-sub-block bytes of 16 outputs (2K sub-blocks of 16 bytes) as K vectors of int16 pairs for
// dpwssd: lane l of pairs[k] holds (bytes_2k[l], bytes_2k+1[l]), widened as signed or unsigned.
template <int K, bool SIGNED>
inline void byte_pairs(const void* bytes, __m512i (&pairs)[K]) {
  const auto* b = static_cast<const uint8_t*>(bytes);
  #pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    const __m256i both = interleave_bytes(_mm_loadu_si128((const __m128i*)(b + 2 * k * 16)),
                                          _mm_loadu_si128((const __m128i*)(b + (2 * k + 1) * 16)));
    pairs[k] = SIGNED ? _mm512_cvtepi8_epi16(both) : _mm512_cvtepu8_epi16(both);
  }
}

// The mins' term sum_j mn_j * S_j of one super-block (S_j: the sub-block's activation sum, |S_j| <=
// 32 * 127) as four int16-pair dot products a row: lane l of mp[k] holds (mn_2k[l], mn_2k+1[l]).
inline void mins_pairs(const uint8_t* mn, __m512i (&mp)[4]) { byte_pairs<4, false>(mn, mp); }

// One row's mins' term (p32: its 4 pairs of 32-input sums in the super-block).
inline __m512i mins_q4k(const __m512i (&mp)[4], const int32_t* p32) {
  __m512i b = _mm512_setzero_si512();
  #pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) b = _mm512_dpwssd_epi32(b, mp[k], _mm512_set1_epi32(p32[k]));
  return b;
}

// The VNNI path: NR rows share each sub-block's unpacked weights; per lane, the same operations
// as the portable path below (integer sums are exact in any order, the float steps are identical).
template <int NR>
void rows_q4k(const Q4KWeight& w, const Rows& rows, int64_t r0, float* out, int64_t N, int64_t tile) {
  const int64_t nb = rows.K / QK;
  const uint8_t *sc = w.sc, *mn = w.mn;
  const uint16_t *d = w.d, *dmin = w.dmin;
  __m512 y[NR];
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = w.quants(tile, nb, blk);
    __m512i a[NR];
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) a[rr] = _mm512_setzero_si512();
    if (w.subblocks(nb, blk) == 4)
      products_q4k<NR, 4>(q, sc + t * 128, rows, r0, blk, a);
    else
      products_q4k<NR, 8>(q, sc + t * 128, rows, r0, blk, a);
    // The mins' term, made after the products so that the rows' accumulators and the unpacked
    // weights stay in registers.
    __m512i mp[4], b[NR];
    mins_pairs(mn + t * 128, mp);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) b[rr] = mins_q4k(mp, rows.p32 + ((r0 + rr) * nb + blk) * 4);
    const __m512 dv = half16(d + t * TILE), dminv = half16(dmin + t * TILE);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) {
      const __m512 sx = _mm512_set1_ps(rows.sx[(r0 + rr) * nb + blk]);
      const __m512 step = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(sx, dv), _mm512_cvtepi32_ps(a[rr])),
                                        _mm512_mul_ps(_mm512_mul_ps(sx, dminv), _mm512_cvtepi32_ps(b[rr])));
      y[rr] = _mm512_add_ps(y[rr], step);
    }
  }
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) _mm512_storeu_ps(out + (r0 + rr) * N + tile * TILE, y[rr]);
}

// Q6_K: sum_j sc_j * (dot_j - 32 s_j) = sum_j sc_j * dot_j - 32 * sum_j sc_j * s_j (exact in int32).
// The second sum, as eight int16-pair dot products a row: lane l of sp[k] holds (sc_2k[l], sc_2k+1[l]).
inline void scale_pairs(const int8_t* sc, __m512i (&sp)[8]) { byte_pairs<8, true>(sc, sp); }

// -32 * sum_j sc_j * s_j for one row (p16: its 8 pairs of sub-block sums), where its products start.
inline __m512i offsets_q6k(const __m512i (&sp)[8], const int32_t* p16) {
  __m512i a = _mm512_setzero_si512();
  #pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) a = _mm512_dpwssd_epi32(a, sp[k], _mm512_set1_epi32(p16[k]));
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(a, 5));
}

template <int NR>
void rows_q6k(const uint8_t* qs, const int8_t* sc, const uint16_t* d, const Rows& rows, int64_t r0, float* out,
              int64_t N, int64_t tile) {
  const int64_t nb = rows.K / QK;
  __m512 y[NR];
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = qs + t * Q6K_BYTES;
    __m512i a[NR], sp[8];
    scale_pairs(sc + t * 256, sp);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) a[rr] = offsets_q6k(sp, rows.p16 + ((r0 + rr) * nb + blk) * 8);
    for (int j = 0; j < 16; ++j) {
      __m512i w[4];
      const __m512i scv = subblock_q6k(q, sc + t * 256, j, w);
      #pragma GCC unroll 8
      for (int rr = 0; rr < NR; ++rr)
        a[rr] = _mm512_add_epi32(a[rr], _mm512_mullo_epi32(dot_q6k(w, rows.xq + (r0 + rr) * rows.K + blk * QK + j * 16), scv));
    }
    const __m512 dv = half16(d + t * TILE);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) {
      const __m512 sx = _mm512_set1_ps(rows.sx[(r0 + rr) * nb + blk]);
      y[rr] = _mm512_add_ps(y[rr], _mm512_mul_ps(_mm512_mul_ps(sx, dv), _mm512_cvtepi32_ps(a[rr])));
    }
  }
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) _mm512_storeu_ps(out + (r0 + rr) * N + tile * TILE, y[rr]);
}

// Many rows (a prefill chunk), as the AVX2 path below: a panel of up to PANEL_ROWS rows goes through
// each sub-block while its unpacked weights stay in registers, instead of unpacking them again for
// every 8 rows. A row's integer sums are the same exact integers and its float steps rows_q4k's in
// the same order (its output starts at 0 and gains each super-block's step), so its bits do not
// depend on which path ran it.
void panel_q4k(const Q4KWeight& wt, const Rows& rows, int64_t r0, int64_t np, float* out, int64_t N, int64_t tile) {
  const int64_t nb = rows.K / QK;
  alignas(64) int32_t sums[PANEL_ROWS * TILE];  // per row: the super-block's sc-weighted integer sums
  for (int64_t r = 0; r < np; ++r) _mm512_storeu_ps(out + (r0 + r) * N + tile * TILE, _mm512_setzero_ps());
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = wt.quants(tile, nb, blk);
    for (int64_t r = 0; r < np; ++r) _mm512_store_si512(sums + r * TILE, _mm512_setzero_si512());
    for (int j = 0, subs = wt.subblocks(nb, blk); j < subs; ++j) {
      __m512i w[8];
      const __m512i scv = subblock_q4k(q, wt.sc + t * 128, j, w);
      const int8_t* x0 = rows.panel_x(r0, blk) + j * 32;
      #pragma GCC unroll 2
      for (int64_t r = 0; r < np; ++r) {
        int32_t* a = sums + r * TILE;
        _mm512_store_si512(a, _mm512_add_epi32(_mm512_load_si512(a), _mm512_mullo_epi32(dot_q4k(w, x0 + r * QK), scv)));
      }
    }
    __m512i mp[4];
    mins_pairs(wt.mn + t * 128, mp);
    const __m512 dv = half16(wt.d + t * TILE), dminv = half16(wt.dmin + t * TILE);
    for (int64_t r = 0; r < np; ++r) {
      const __m512i b = mins_q4k(mp, rows.panel_p32(r0, blk) + r * 4);
      const __m512 sx = _mm512_set1_ps(rows.sx[(r0 + r) * nb + blk]);
      const __m512 step = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(sx, dv), _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * TILE))),
                                        _mm512_mul_ps(_mm512_mul_ps(sx, dminv), _mm512_cvtepi32_ps(b)));
      float* y = out + (r0 + r) * N + tile * TILE;
      _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), step));
    }
  }
}

// One tile of 16 outputs for rows r0 .. r0+nr-1: one panel when the rows are panel-major, else every
// row (r0 = 0) in register blocks.
void tile_q4k(const Q4KWeight& w, const Rows& rows, int64_t r0, int64_t nr, bool panel, float* out, int64_t N,
              int64_t tile) {
  if (panel) return panel_q4k(w, rows, r0, nr, out, N, tile);
  by_row_blocks<8>(nr, [&](auto block, int64_t r) { rows_q4k<decltype(block)::value>(w, rows, r, out, N, tile); });
}

// A panel of Q6_K rows, as panel_q4k: rows_q6k's integers and float steps for each row.
void panel_q6k(const uint8_t* qs, const int8_t* sc, const uint16_t* d, const Rows& rows, int64_t r0, int64_t np,
               float* out, int64_t N, int64_t tile) {
  const int64_t nb = rows.K / QK;
  alignas(64) int32_t sums[PANEL_ROWS * TILE];
  for (int64_t r = 0; r < np; ++r) _mm512_storeu_ps(out + (r0 + r) * N + tile * TILE, _mm512_setzero_ps());
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = qs + t * Q6K_BYTES;
    __m512i sp[8];
    scale_pairs(sc + t * 256, sp);
    for (int64_t r = 0; r < np; ++r)
      _mm512_store_si512(sums + r * TILE, offsets_q6k(sp, rows.panel_p16(r0, blk) + r * 8));
    for (int j = 0; j < 16; ++j) {
      __m512i w[4];
      const __m512i scv = subblock_q6k(q, sc + t * 256, j, w);
      const int8_t* x0 = rows.panel_x(r0, blk) + j * 16;
      #pragma GCC unroll 2
      for (int64_t r = 0; r < np; ++r) {
        int32_t* a = sums + r * TILE;
        _mm512_store_si512(a, _mm512_add_epi32(_mm512_load_si512(a), _mm512_mullo_epi32(dot_q6k(w, x0 + r * QK), scv)));
      }
    }
    const __m512 dv = half16(d + t * TILE);
    for (int64_t r = 0; r < np; ++r) {
      const __m512 sx = _mm512_set1_ps(rows.sx[(r0 + r) * nb + blk]);
      float* y = out + (r0 + r) * N + tile * TILE;
      _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), _mm512_mul_ps(_mm512_mul_ps(sx, dv),
                                                                          _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * TILE)))));
    }
  }
}

void tile_q6k(const uint8_t* qs, const int8_t* sc, const uint16_t* d, const Rows& rows, int64_t r0, int64_t nr,
              bool panel, float* out, int64_t N, int64_t tile) {
  if (panel) return panel_q6k(qs, sc, d, rows, r0, nr, out, N, tile);
  by_row_blocks<8>(nr, [&](auto block, int64_t r) { rows_q6k<decltype(block)::value>(qs, sc, d, rows, r, out, N, tile); });
}
#elif defined(KQ_AVX2)
// The AVX2 path: a tile's 16 outputs as two halves of 8 int32 lanes. maddubs (u8 x s8 -> pairs
// summed in int16) then madd with ones (-> int32) gives the same integer dot products as VNNI's
// dpbusd: no saturation is reachable (|q4 * x| pairs <= 2*15*127, q6 pairs <= 2*63*127, and the
// int16 sums below stay under 2^15), and integer sums are exact in any order. The float steps per
// lane are the portable path's, in the same order.

inline __m256i bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// 8 fp16 scales as float lanes (exact; F16C).
inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

inline __m256i widen8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// 8 unsigned bytes -> 8 int32 lanes each holding the byte twice as int16 (v | v << 16), so that
// madd_epi16(pairs, v2) = (pair0 + pair1) * v exactly: one instruction for "widen, then multiply".
inline __m256i twice16(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

// The mins' term sum_j mn_j * S_j of one super-block for outputs 8h .. 8h+7 (mn offset by 8h): lane o
// of mp[k] holds (mn_2k, mn_2k+1) of output o as int16, the pairs of quantize_rows' p32.
inline void mins_pairs(const uint8_t* mn, __m256i (&mp)[4]) {
  #pragma GCC unroll 4
  for (int k = 0; k < 4; ++k)
    mp[k] = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mn + 2 * k * 16))),
                            _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(mn + (2 * k + 1) * 16))), 16));
}

// One row's mins' term (p32: its 4 pairs of 32-input sums in the super-block; a half tail's are 0).
inline __m256i mins_q4k(const __m256i (&mp)[4], const int32_t* p32) {
  return _mm256_add_epi32(
      _mm256_add_epi32(_mm256_madd_epi16(mp[0], _mm256_set1_epi32(p32[0])), _mm256_madd_epi16(mp[1], _mm256_set1_epi32(p32[1]))),
      _mm256_add_epi32(_mm256_madd_epi16(mp[2], _mm256_set1_epi32(p32[2])), _mm256_madd_epi16(mp[3], _mm256_set1_epi32(p32[3]))));
}

// Outputs 8h .. 8h+7 of a tile (byte offset 32h of each 64-byte load) for rows r0 .. r0+NR-1.
template <int NR>
void rows_q4k(const Q4KWeight& wt, const Rows& rows, int64_t r0, float* out, int64_t N, int64_t tile, int h) {
  const int64_t nb = rows.K / QK;
  const uint8_t *sc = wt.sc, *mn = wt.mn;
  const uint16_t *d = wt.d, *dmin = wt.dmin;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 y[NR];
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = wt.quants(tile, nb, blk) + h * 32;
    __m256i a[NR];
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) a[rr] = _mm256_setzero_si256();
    for (int j = 0, subs = wt.subblocks(nb, blk); j < subs; ++j) {
      __m256i acc[NR];
      #pragma GCC unroll 8
      for (int rr = 0; rr < NR; ++rr) acc[rr] = _mm256_setzero_si256();
      #pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)(q + j * 256 + l * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
      #pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {  // int16 lanes: at most 8 pairs of 2*15*127 = 30480 < 2^15
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(q + j * 256 + l * 64));
        const __m256i w0 = _mm256_and_si256(raw, low), w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        #pragma GCC unroll 8
        for (int rr = 0; rr < NR; ++rr) {
          const int8_t* xq = rows.xq + (r0 + rr) * rows.K + blk * QK + j * 32 + l * 8;
          acc[rr] = _mm256_add_epi16(acc[rr], _mm256_maddubs_epi16(w0, bcast4(xq)));
          acc[rr] = _mm256_add_epi16(acc[rr], _mm256_maddubs_epi16(w1, bcast4(xq + 4)));
        }
      }
      const __m256i scv = twice16(sc + t * 128 + j * 16 + h * 8);  // sc * (pair sums): exact in int32
      #pragma GCC unroll 8
      for (int rr = 0; rr < NR; ++rr) a[rr] = _mm256_add_epi32(a[rr], _mm256_madd_epi16(acc[rr], scv));
    }
    // The mins' term, made after the products so that the rows' accumulators stay in registers.
    __m256i mp[4], b[NR];
    mins_pairs(mn + t * 128 + h * 8, mp);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) b[rr] = mins_q4k(mp, rows.p32 + ((r0 + rr) * nb + blk) * 4);
    const __m256 dv = half8(d + t * TILE + h * 8), dminv = half8(dmin + t * TILE + h * 8);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) {
      const __m256 sx = _mm256_set1_ps(rows.sx[(r0 + rr) * nb + blk]);
      const __m256 step = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(sx, dv), _mm256_cvtepi32_ps(a[rr])),
                                        _mm256_mul_ps(_mm256_mul_ps(sx, dminv), _mm256_cvtepi32_ps(b[rr])));
      y[rr] = _mm256_add_ps(y[rr], step);
    }
  }
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) _mm256_storeu_ps(out + (r0 + rr) * N + tile * TILE + h * 8, y[rr]);
}

// Outputs 8h .. 8h+7 of one Q6_K sub-block (q: its 192 bytes, offset by 32h), w[l] inputs 4l .. 4l+3:
// (low nibble) | (two high bits << 4).
inline void unpack_q6k(const uint8_t* q, __m256i (&w)[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
  const __m256i lo01 = _mm256_loadu_si256((const __m256i*)q), lo23 = _mm256_loadu_si256((const __m256i*)(q + 64));
  const __m256i hb = _mm256_loadu_si256((const __m256i*)(q + 128));
  w[0] = _mm256_or_si256(_mm256_and_si256(lo01, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), high));
  w[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo01, 4), low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), high));
  w[2] = _mm256_or_si256(_mm256_and_si256(lo23, low), _mm256_and_si256(hb, high));
  w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo23, 4), low), _mm256_and_si256(_mm256_srli_epi16(hb, 2), high));
}

// Sub-block j of a Q6_K super-block for outputs 8h .. 8h+7 (q and sc offset by h): the weights
// unpacked into w, the weight stream asked for PREFETCH_AHEAD bytes on, the 8 scales widened.
inline __m256i subblock_q6k(const uint8_t* q, const int8_t* sc, int j, __m256i (&w)[4]) {
  #pragma GCC unroll 3
  for (int l = 0; l < 3; ++l) _mm_prefetch((const char*)(q + j * 192 + l * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
  unpack_q6k(q + j * 192, w);
  return widen8(sc + j * 16);
}

// 8 int32 lanes (signed, |v| < 2^15) -> each lane's value twice as int16 (v, v), for madd_epi16.
inline __m256i twice16_signed(__m256i v) { return _mm256_blend_epi16(v, _mm256_slli_epi32(v, 16), 0xAA); }

// A Q6_K super-block's integers sum_j sc_j * (dot_j - 32 s_j) are made (exactly, in int32) as
// -32 * sum_j sc_j s_j, where a row's sums start (offsets_q6k), plus sum_j sc_j * dot_j (scaled_q6k):
// no widening, offsetting or 32-bit multiply per sub-block.
// Lane o of sp[k]: (sc_2k, sc_2k+1) of output 8h + o (sc offset by 8h), as the pairs of p16.
inline void scale_pairs(const int8_t* sc, __m256i (&sp)[8]) {
  #pragma GCC unroll 8
  for (int k = 0; k < 8; ++k)
    sp[k] = _mm256_blend_epi16(widen8(sc + 2 * k * 16), _mm256_slli_epi32(widen8(sc + (2 * k + 1) * 16), 16), 0xAA);
}

// -32 * sum_j sc_j * s_j for one row (p16: its 8 pairs of sub-block sums).
inline __m256i offsets_q6k(const __m256i (&sp)[8], const int32_t* p16) {
  __m256i o = _mm256_setzero_si256();
  #pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) o = _mm256_add_epi32(o, _mm256_madd_epi16(sp[k], _mm256_set1_epi32(p16[k])));
  return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(o, 5));
}

// One row's sc_j * dot_j for a Q6_K sub-block (xq: its 16 inputs; sc2: twice16_signed of the scales).
inline __m256i scaled_q6k(const __m256i (&w)[4], const int8_t* xq, __m256i sc2) {
  // int16 lanes: 2 pairs of 2*63*127 = 32004 < 2^15 at most, then each half scaled in one madd
  const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast4(xq)), _mm256_maddubs_epi16(w[1], bcast4(xq + 4)));
  const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast4(xq + 8)), _mm256_maddubs_epi16(w[3], bcast4(xq + 12)));
  return _mm256_add_epi32(_mm256_madd_epi16(lo, sc2), _mm256_madd_epi16(hi, sc2));
}

template <int NR>
void rows_q6k(const uint8_t* qs, const int8_t* sc, const uint16_t* d, const Rows& rows, int64_t r0, float* out,
              int64_t N, int64_t tile, int h) {
  const int64_t nb = rows.K / QK;
  __m256 y[NR];
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = qs + t * Q6K_BYTES + h * 32;
    const int8_t* scb = sc + t * 256 + h * 8;
    __m256i a[NR];
    {
      __m256i sp[8];
      scale_pairs(scb, sp);
      #pragma GCC unroll 8
      for (int rr = 0; rr < NR; ++rr) a[rr] = offsets_q6k(sp, rows.p16 + ((r0 + rr) * nb + blk) * 8);
    }
    for (int j = 0; j < 16; ++j) {
      __m256i w[4];
      const __m256i sc2 = twice16_signed(subblock_q6k(q, scb, j, w));
      #pragma GCC unroll 8
      for (int rr = 0; rr < NR; ++rr)
        a[rr] = _mm256_add_epi32(a[rr], scaled_q6k(w, rows.xq + (r0 + rr) * rows.K + blk * QK + j * 16, sc2));
    }
    const __m256 dv = half8(d + t * TILE + h * 8);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) {
      const __m256 sx = _mm256_set1_ps(rows.sx[(r0 + rr) * nb + blk]);
      y[rr] = _mm256_add_ps(y[rr], _mm256_mul_ps(_mm256_mul_ps(sx, dv), _mm256_cvtepi32_ps(a[rr])));
    }
  }
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) _mm256_storeu_ps(out + (r0 + rr) * N + tile * TILE + h * 8, y[rr]);
}

// Many rows (a prefill chunk): a panel of up to PANEL_ROWS rows goes through each sub-block's weights
// while they are unpacked in registers, instead of unpacking them again for every 4 rows. Each
// row's integer sums are the same exact integers and its float steps per super-block are rows_q4k's
// in the same order (its output starts at 0 and gains each super-block's step), so a row's bits do
// not depend on which path ran it. On the 2-core AVX2 EPYC, one thread, 1536 x 8960, 64 rows:
// 16.2 -> 13.9 ms (min of 6 alternating runs, 2026-11-27).
void panel_q4k(const Q4KWeight& wt, const Rows& rows, int64_t r0, int64_t np, float* out, int64_t N, int64_t tile,
               int h) {
  const int64_t nb = rows.K / QK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) int32_t sums[PANEL_ROWS * 8];  // per row: the super-block's sc-weighted integer sums
  for (int64_t r = 0; r < np; ++r) _mm256_storeu_ps(out + (r0 + r) * N + tile * TILE + h * 8, _mm256_setzero_ps());
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = wt.quants(tile, nb, blk) + h * 32;
    const int subs = wt.subblocks(nb, blk);
    for (int64_t r = 0; r < np; ++r) _mm256_store_si256((__m256i*)(sums + r * 8), _mm256_setzero_si256());
    for (int j = 0; j < subs; ++j) {
      __m256i w[8];  // inputs 8l .. 8l+3 (w[2l]) and 8l+4 .. 8l+7 (w[2l+1]) of the sub-block
      #pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {
        _mm_prefetch((const char*)(q + j * 256 + l * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(q + j * 256 + l * 64));
        w[2 * l] = _mm256_and_si256(raw, low);
        w[2 * l + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      }
      const __m256i scv = twice16(wt.sc + t * 128 + j * 16 + h * 8);
      const int8_t* x0 = rows.panel_x(r0, blk) + j * 32;
      for (int64_t r = 0; r < np; ++r) {
        const int8_t* xq = x0 + r * QK;
        __m256i acc = _mm256_maddubs_epi16(w[0], bcast4(xq));  // int16: as rows_q4k, at most 8 pairs
        #pragma GCC unroll 7
        for (int k = 1; k < 8; ++k) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w[k], bcast4(xq + 4 * k)));
        __m256i* a = (__m256i*)(sums + r * 8);
        _mm256_store_si256(a, _mm256_add_epi32(_mm256_load_si256(a), _mm256_madd_epi16(acc, scv)));
      }
    }
    __m256i mp[4];
    mins_pairs(wt.mn + t * 128 + h * 8, mp);
    const __m256 dv = half8(wt.d + t * TILE + h * 8), dminv = half8(wt.dmin + t * TILE + h * 8);
    for (int64_t r = 0; r < np; ++r) {
      const __m256i b = mins_q4k(mp, rows.panel_p32(r0, blk) + r * 4);
      const __m256 sx = _mm256_set1_ps(rows.sx[(r0 + r) * nb + blk]);
      const __m256i a = _mm256_load_si256((const __m256i*)(sums + r * 8));
      const __m256 step = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(sx, dv), _mm256_cvtepi32_ps(a)),
                                        _mm256_mul_ps(_mm256_mul_ps(sx, dminv), _mm256_cvtepi32_ps(b)));
      float* y = out + (r0 + r) * N + tile * TILE + h * 8;
      _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), step));
    }
  }
}

void tile_q4k(const Q4KWeight& w, const Rows& rows, int64_t r0, int64_t nr, bool panel, float* out, int64_t N,
              int64_t tile) {
  for (int h = 0; h < 2; ++h) {
    if (panel)
      panel_q4k(w, rows, r0, nr, out, N, tile, h);
    else
      by_row_blocks<4>(nr, [&](auto block, int64_t r) { rows_q4k<decltype(block)::value>(w, rows, r, out, N, tile, h); });
  }
}

// A panel of Q6_K rows, as panel_q4k: rows_q6k's integers (offsets_q6k, scaled_q6k) and float steps.
void panel_q6k(const uint8_t* qs, const int8_t* sc, const uint16_t* d, const Rows& rows, int64_t r0, int64_t np,
               float* out, int64_t N, int64_t tile, int h) {
  const int64_t nb = rows.K / QK;
  alignas(32) int32_t sums[PANEL_ROWS * 8];
  for (int64_t r = 0; r < np; ++r) _mm256_storeu_ps(out + (r0 + r) * N + tile * TILE + h * 8, _mm256_setzero_ps());
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    const uint8_t* q = qs + t * Q6K_BYTES + h * 32;
    const int8_t* scb = sc + t * 256 + h * 8;
    __m256i sp[8];
    scale_pairs(scb, sp);
    for (int64_t r = 0; r < np; ++r)
      _mm256_store_si256((__m256i*)(sums + r * 8), offsets_q6k(sp, rows.panel_p16(r0, blk) + r * 8));
    for (int j = 0; j < 16; j += 2) {  // two sub-blocks a pass: each row's sums read and written once
      __m256i w0[4], w1[4];
      const __m256i sc0 = twice16_signed(subblock_q6k(q, scb, j, w0)), sc1 = twice16_signed(subblock_q6k(q, scb, j + 1, w1));
      const int8_t* x0 = rows.panel_x(r0, blk) + j * 16;
      for (int64_t r = 0; r < np; ++r) {
        const int8_t* xq = x0 + r * QK;
        const __m256i dots = _mm256_add_epi32(scaled_q6k(w0, xq, sc0), scaled_q6k(w1, xq + 16, sc1));
        __m256i* a = (__m256i*)(sums + r * 8);
        _mm256_store_si256(a, _mm256_add_epi32(_mm256_load_si256(a), dots));
      }
    }
    const __m256 dv = half8(d + t * TILE + h * 8);
    for (int64_t r = 0; r < np; ++r) {
      const __m256 sx = _mm256_set1_ps(rows.sx[(r0 + r) * nb + blk]);
      float* y = out + (r0 + r) * N + tile * TILE + h * 8;
      _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), _mm256_mul_ps(_mm256_mul_ps(sx, dv),
                                                                          _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(sums + r * 8))))));
    }
  }
}

void tile_q6k(const uint8_t* qs, const int8_t* sc, const uint16_t* d, const Rows& rows, int64_t r0, int64_t nr,
              bool panel, float* out, int64_t N, int64_t tile) {
  for (int h = 0; h < 2; ++h) {
    if (panel)
      panel_q6k(qs, sc, d, rows, r0, nr, out, N, tile, h);
    else
      by_row_blocks<4>(nr, [&](auto block, int64_t r) { rows_q6k<decltype(block)::value>(qs, sc, d, rows, r, out, N, tile, h); });
  }
}
#else
// The portable path: the same integers and the same float steps per lane, one row at a time.

// Integer dot products of one sub-block for one row: 16 lanes, one per output.

// q4k: dot[o] = sum over the 32 inputs of sub-block j of q[o][i] * xq[i].
inline void dot_q4(const uint8_t* qs, const int8_t* xq, int32_t* dot) {
  for (int o = 0; o < TILE; ++o) {
    int32_t s = 0;
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = qs[l * 64 + o * 4 + i];
        s += (byte & 0x0F) * xq[l * 8 + i] + (byte >> 4) * xq[l * 8 + 4 + i];
      }
    dot[o] = s;
  }
}

// q6k: dot[o] = sum over the 16 inputs of sub-block j of q[o][i] * xq[i].
inline void dot_q6(const uint8_t* qs, const int8_t* xq, int32_t* dot) {
  for (int o = 0; o < TILE; ++o) {
    int32_t s = 0;
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 4; ++i) {
        const int q = ((qs[(l / 2) * 64 + o * 4 + i] >> (4 * (l % 2))) & 0x0F) |
                      (((qs[128 + o * 4 + i] >> (2 * l)) & 0x03) << 4);
        s += q * xq[l * 4 + i];
      }
    dot[o] = s;
  }
}

// The float part: identical per lane whatever the row count.
inline void accumulate(float* y, const uint16_t* d, float sx, const int32_t* a) {
  for (int o = 0; o < TILE; ++o) y[o] = y[o] + (sx * half(d[o])) * (float)a[o];
}

inline void accumulate_min(float* y, const uint16_t* d, const uint16_t* dmin, float sx, const int32_t* a,
                           const int32_t* b) {
  for (int o = 0; o < TILE; ++o) y[o] = y[o] + ((sx * half(d[o])) * (float)a[o] - (sx * half(dmin[o])) * (float)b[o]);
}

// One tile of 16 outputs for rows r0 .. r0+nr-1: out [R, N] float at column tile*16 (no panels here).
void tile_q4k(const Q4KWeight& w, const Rows& rows, int64_t r0, int64_t nr, bool, float* out, int64_t N, int64_t tile) {
  const int64_t nb = rows.K / QK;
  const uint16_t *d = w.d, *dmin = w.dmin;
  alignas(64) int32_t dot[TILE], a[TILE], b[TILE];
  for (int64_t r = r0; r < r0 + nr; ++r) {
    alignas(64) float y[TILE] = {0};
    const int8_t* xq = rows.xq + r * rows.K;
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int64_t t = tile * nb + blk;
      const uint8_t* q = w.quants(tile, nb, blk);
      const uint8_t* scb = w.sc + t * 128;
      const uint8_t* mnb = w.mn + t * 128;
      const int32_t* s16 = rows.s16 + r * (rows.K / 16) + blk * 16;
      for (int o = 0; o < TILE; ++o) a[o] = b[o] = 0;
      for (int j = 0, subs = w.subblocks(nb, blk); j < subs; ++j) {
        dot_q4(q + j * 256, xq + blk * QK + j * 32, dot);
        const int32_t sum = s16[2 * j] + s16[2 * j + 1];
        for (int o = 0; o < TILE; ++o) {
          a[o] += scb[j * 16 + o] * dot[o];
          b[o] += mnb[j * 16 + o] * sum;
        }
      }
      accumulate_min(y, d + t * TILE, dmin + t * TILE, rows.sx[r * nb + blk], a, b);
    }
    std::memcpy(out + r * N + tile * TILE, y, sizeof(y));
  }
}

void tile_q6k(const uint8_t* qs, const int8_t* sc, const uint16_t* d, const Rows& rows, int64_t r0, int64_t nr, bool,
              float* out, int64_t N, int64_t tile) {
  const int64_t nb = rows.K / QK;
  alignas(64) int32_t dot[TILE], a[TILE];
  for (int64_t r = r0; r < r0 + nr; ++r) {
    alignas(64) float y[TILE] = {0};
    const int8_t* xq = rows.xq + r * rows.K;
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int64_t t = tile * nb + blk;
      const uint8_t* q = qs + t * Q6K_BYTES;
      const int8_t* scb = sc + t * 256;
      const int32_t* s16 = rows.s16 + r * (rows.K / 16) + blk * 16;
      for (int o = 0; o < TILE; ++o) a[o] = 0;
      for (int j = 0; j < 16; ++j) {
        dot_q6(q + j * 192, xq + blk * QK + j * 16, dot);
        for (int o = 0; o < TILE; ++o) a[o] += scb[j * 16 + o] * (dot[o] - 32 * s16[j]);
      }
      accumulate(y, d + t * TILE, rows.sx[r * nb + blk], a);
    }
    std::memcpy(out + r * N + tile * TILE, y, sizeof(y));
  }
}

#endif

#include "blocks.h"

// The calling thread's quantised activations: reused from call to call, so a product allocates
// nothing (a decoder layer runs four; each torch allocation and pad is microseconds of one core
// while the other waits).
struct ActivationScratch {
  std::vector<float> padded;
  std::vector<int8_t> xq;
  std::vector<float> sx;
  std::vector<int32_t> s16;
  std::vector<int32_t> p16;
  std::vector<int32_t> p32;
};

// x [R, width] (rows contiguous) with zeros appended up to K, quantised into this thread's scratch,
// panel-major where the products will run panels; ``fine``: a scale per 32 inputs (quantize_rows).
Rows quantized_rows(const float* x, int64_t R, int64_t width, int64_t K, bool fine) {
  TORCH_CHECK(K % QK == 0 && width <= K, "input features must be a multiple of 256, got ", K);
  thread_local ActivationScratch scratches[2];
  ActivationScratch& scratch = scratches[fine];
  if (width != K) {
    scratch.padded.assign(R * K, 0.f);
    for (int64_t r = 0; r < R; ++r) std::memcpy(scratch.padded.data() + r * K, x + r * width, width * sizeof(float));
    x = scratch.padded.data();
  }
  const bool panel_major = uses_panels(R);
  const int64_t slots = panel_major ? (R + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS : R;  // rows' room
  scratch.xq.resize(slots * K);
  scratch.sx.resize(R * (K / (fine ? FINE : QK)));
  scratch.s16.resize(slots * (K / 16));
  scratch.p16.resize(slots * (K / QK) * 8);
  scratch.p32.resize(slots * (K / QK) * 4);
  quantize_rows(x, R, K, panel_major, fine, scratch.xq.data(), scratch.sx.data(), scratch.s16.data(),
                scratch.p16.data(), scratch.p32.data());
  return Rows{scratch.xq.data(), scratch.sx.data(), scratch.s16.data(), scratch.p16.data(), scratch.p32.data(), K,
              panel_major, fine};
}

torch::Tensor flat_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "activations must be float32");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

torch::Tensor output_like(const torch::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return torch::empty(sizes, torch::kFloat32);
}

// work(i) for i in [0, count), handed out in chunks of ``chunk`` to whichever thread is free: on a
// shared machine one slowed core then costs its share of the time, not the whole call's (a static
// split waits for the slower half). Each item is computed by the same code whichever thread runs it.
template <typename F>
void for_each_dynamic(int64_t count, int64_t chunk, const F& work) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (count + chunk - 1) / chunk);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t start = next.fetch_add(chunk); start < count; start = next.fetch_add(chunk))
      for (int64_t i = start, stop = std::min(start + chunk, count); i < stop; ++i) work(i);
  });
}

// A packed weight's data pointers, read once (data_ptr<T>() checks the dtype: too slow per tile).
// A Q6_K weight keeps qs, sc (int8) and d in the Q4KWeight's qs, sc and d; every other kind its
// BlockWeight (blocks.h).
struct WeightPointers {
  Kind kind;
  Q4KWeight w;
  BlockWeight b;
};

struct PackedLinear {
  Kind kind;                       // Q4_K (qs, sc, mn, d, dmin), Q6_K (qs, sc, d) or a kind of blocks.h
  std::vector<torch::Tensor> t;
  int64_t n, k;                    // outputs; inputs as packed (a multiple of 256, zeros past the model's)
  c10::optional<torch::Tensor> bias;
  WeightPointers p;

  PackedLinear(const std::string& name, std::vector<torch::Tensor> t_, int64_t n_, int64_t k_,
               c10::optional<torch::Tensor> bias_)
      : kind(kind_of(name)), t(std::move(t_)), n(n_), k(k_), bias(std::move(bias_)) {
    TORCH_CHECK(k >= QK && k % QK == 0, "input features must be a multiple of 256, got ", k);
    TORCH_CHECK(n > 0 && n % TILE == 0, "outputs must be a positive multiple of 16, got ", n);
    for (const auto& part : t) TORCH_CHECK(part.is_contiguous() && part.device().is_cpu(), "packed tensors must be contiguous CPU tensors");
    if (kind != Kind::Q4K && kind != Kind::Q6K) {
      p = WeightPointers{kind, {}, block_weight(kind, t, n, k)};
      return;
    }
    const bool q4 = kind == Kind::Q4K;
    TORCH_CHECK(t.size() == (q4 ? 5u : 3u), q4 ? "q4k takes qs, sc, mn, d, dmin" : "q6k takes qs, sc, d");
    const int64_t blocks = n * (k / QK);  // (output, super-block) pairs
    const int64_t scales = q4 ? 8 : 16;  // sub-block scales a super-block
    TORCH_CHECK(t[1].numel() == blocks * scales && (!q4 || t[2].numel() == blocks * scales),
                q4 ? "q4k" : "q6k", " scales do not match ", n, " x ", k);
    TORCH_CHECK(t[q4 ? 3 : 2].numel() == blocks && (!q4 || t[4].numel() == blocks), q4 ? "q4k" : "q6k",
                " super-block scales do not match ", n, " x ", k);
    const int64_t full = n / TILE * (k / QK) * (q4 ? Q4K_BYTES : Q6K_BYTES), stored = t[0].numel();
    const bool half_tail = q4 && stored == full - n / TILE * (Q4K_BYTES / 2);
    TORCH_CHECK(stored == full || half_tail, q4 ? "q4k" : "q6k", " weight does not match ", n, " x ", k);
    p = q4 ? WeightPointers{kind, {t[0].data_ptr<uint8_t>(), t[1].data_ptr<uint8_t>(), t[2].data_ptr<uint8_t>(),
                                   half_bits(t[3]), half_bits(t[4]), half_tail}, {}}
           : WeightPointers{kind, {t[0].data_ptr<uint8_t>(), reinterpret_cast<const uint8_t*>(t[1].data_ptr<int8_t>()),
                                    nullptr, half_bits(t[2]), nullptr, false}, {}};
  }
};

// x [R, width] (rows contiguous, width <= the packed inputs) through ``linears`` side by side into
// out [R, ld] from column 0: the activations padded and quantised once per granularity (per 256 for
// the k-quants, per 32 for the legacy kinds: both when the linears mix them), every output tile of
// every linear in one parallel pass.
void products_into(const std::vector<PackedLinear>& linears, const float* x, int64_t R, int64_t width, float* out,
                   int64_t ld) {
  bool any_legacy = false, any_other = false;
  for (const auto& l : linears) (is_legacy(l.kind) ? any_legacy : any_other) = true;
  const Rows rows = quantized_rows(x, R, width, linears[0].k, !any_other);
  const Rows fine_rows = any_legacy && any_other ? quantized_rows(x, R, width, linears[0].k, true) : rows;
  int64_t column[16], first_tile[17] = {0};  // per linear, then the total
  TORCH_CHECK(linears.size() <= 16, "at most 16 products side by side");
  for (size_t i = 0, c = 0; i < linears.size(); c += linears[i].n, ++i) {
    TORCH_CHECK(linears[i].k == rows.K, "products side by side need one input size");
    column[i] = c;
    first_tile[i + 1] = first_tile[i] + linears[i].n / TILE;
  }
  // With panels, the work goes panel by panel through every tile: a panel's activations stay in the
  // core's cache across the tiles (all rows' activations would not, for wide K and long chunks).
  const bool panels = uses_panels(R);
  const int64_t tiles = first_tile[linears.size()], spans = panels ? (R + PANEL_ROWS - 1) / PANEL_ROWS : 1;
  for_each_dynamic(spans * tiles, TILE_CHUNK, [&](int64_t item) {
    const int64_t k = item % tiles, r0 = panels ? item / tiles * PANEL_ROWS : 0;
    const int64_t nr = panels ? std::min(PANEL_ROWS, R - r0) : R;
    size_t i = 0;
    while (k >= first_tile[i + 1]) ++i;
    const WeightPointers& w = linears[i].p;
    const int64_t t = k - first_tile[i];
    if (w.kind == Kind::Q4K)
      tile_q4k(w.w, rows, r0, nr, panels, out + column[i], ld, t);
    else if (w.kind == Kind::Q6K)
      tile_q6k(w.w.qs, reinterpret_cast<const int8_t*>(w.w.sc), w.w.d, rows, r0, nr, panels, out + column[i], ld, t);
    else
      tile_blocks(w.b, is_legacy(w.kind) ? fine_rows : rows, x, width, r0, nr, out + column[i], ld, t);
  });
  for (size_t i = 0; i < linears.size(); ++i) {
    if (!linears[i].bias.has_value()) continue;
    const float* b = linears[i].bias->data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
      float* o = out + r * ld + column[i];
      for (int64_t c = 0; c < linears[i].n; ++c) o[c] = o[c] + b[c];
    }
  }
}

// x [..., K] -> [..., N] through one packed weight (no bias: KQuantLinear adds it).
torch::Tensor linear(const PackedLinear& weight, const torch::Tensor& x) {
  auto x2 = flat_rows(x);
  TORCH_CHECK(x2.size(1) == weight.k, "input features must be a multiple of 256, got ", x2.size(1));
  auto out = output_like(x, weight.n);
  products_into({weight}, x2.data_ptr<float>(), x2.size(0), weight.k, out.data_ptr<float>(), weight.n);
  return out;
}

}  // namespace

// x [..., K] float32 -> [..., N] float32 with a q4k weight of N outputs.
torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc,
                         const torch::Tensor& mn, const torch::Tensor& d, const torch::Tensor& dmin, int64_t N) {
  return linear(PackedLinear{"q4k", {qs, sc, mn, d, dmin}, N, x.size(-1), c10::nullopt}, x);
}

torch::Tensor q6k_linear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sc,
                         const torch::Tensor& d, int64_t N) {
  return linear(PackedLinear{"q6k", {qs, sc, d}, N, x.size(-1), c10::nullopt}, x);
}

// x [..., K] float32 -> [..., N] float32 with a weight of any kind (engine/backends/blocks.py), its
// tensors in PACKED_NAMES order.
torch::Tensor block_linear(const torch::Tensor& x, const std::string& kind, const std::vector<torch::Tensor>& tensors,
                           int64_t N) {
  return linear(PackedLinear{kind, tensors, N, x.size(-1), c10::nullopt}, x);
}

// ---- attention: one (head, row) at a time, a fixed order over keys and lanes ----------------

// Internal linkage, like the products above: each build of these kernels (the tests load the native,
// AVX2 and portable ones into one process) keeps its own functions and thread-local scratch, which
// as template members of external linkage the dynamic linker would merge across the builds.
namespace {

// Keys or values [KVH, L, D] whose rows are contiguous, any head stride (the leading slots of a
// growing KV cache's buffer are read where they lie); anything else is copied first.
torch::Tensor rows_contiguous(const torch::Tensor& t) {
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

// A key's weight e^(score - top): 0 for a masked key (-inf), NaN kept so that it shows in the output.
inline float key_weight(float score, float top) {
  const float shifted = score - top;
  return score == -INFINITY ? 0.f : std::isnan(shifted) ? shifted : fixed_exp::exp_scalar(shifted);
}

// One (head, row) of attention, the reference order every path computes: for each visible key j in
// order, a 16-lane dot product summed over the head's 16-wide chunks in order then halved as a tree
// (lanes i + i+8, then i + i+4, i + i+2, i + i+1); the score times the scale plus the mask's bias;
// exponentials against the row's maximum (fixed_exp.h's, NaN kept), summed in key order; the
// values weighted in key order (zero weights skipped), each lane divided by the sum. Masked keys
// (-inf) take no part, so a row's bits depend only on the sequence of keys it sees, never on
// where they lie or on the other rows.
void attend_scalar(const float* qv, const float* kp, const float* vp, const float* bias_row, int64_t visible,
                   int64_t D, float scale, float* ov, std::vector<float>& p, std::vector<float>& acc) {
  float top = -INFINITY;
  for (int64_t j = 0; j < visible; ++j) {
    const float bias = bias_row == nullptr ? 0.f : bias_row[j];
    if (bias == -INFINITY) { p[j] = -INFINITY; continue; }
    const float* kv = kp + j * D;
    float lanes[16] = {0};
    for (int64_t c = 0; c < D; c += 16)
      for (int i = 0; i < 16; ++i) lanes[i] = lanes[i] + qv[c + i] * kv[c + i];
    p[j] = fixed_exp::halving(lanes) * scale + bias;
    top = std::fmax(top, p[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < visible; ++j) {
    p[j] = key_weight(p[j], top);
    total = total + p[j];
  }
  for (int64_t c = 0; c < D; ++c) acc[c] = 0.f;
  for (int64_t j = 0; j < visible; ++j) {
    if (p[j] == 0.f) continue;
    const float* vv = vp + j * D;
    for (int64_t c = 0; c < D; ++c) acc[c] = acc[c] + p[j] * vv[c];
  }
  for (int64_t c = 0; c < D; ++c) ov[c] = acc[c] / total;
}

// Rows of a causal chunk read the same keys, 0 .. their own: ATTEND_TILE rows go together, each
// block of keys and values read once for all of them and their G heads while it is in L1, instead of
// once per row and head from a cache level further out (a 3,000-token prompt's keys and values are
// 3 MB a key/value head). Per (row, head), the same operations in the same order as attend_group
// with keys 0 .. n-1 and bias 0, so the same bits.
constexpr int64_t ATTEND_TILE = 8;
constexpr int64_t KEY_BLOCK = 16;    // keys scored per pass
constexpr int64_t VALUE_BLOCK = 32;  // keys whose values are added per pass (16 KB at D = 128)

// The sum in key order of p[0 .. n-1] (attend_scalar's total of the weights).
inline float sum_in_order(const float* p, int64_t n) {
  float total = 0.f;
  for (int64_t m = 0; m < n; ++m) total = total + p[m];
  return total;
}

// totals[i] = sum_in_order(p + i * stride, length(i)) for i < count. Eight sums go side by side over
// the keys they all have, so that each one's chain of additions (the same, one after another)
// overlaps the others' instead of waiting on its own latency; then each sum's own tail.
template <typename Length>
void sums_in_order(const float* p, int64_t stride, int64_t count, const Length& length, float* totals) {
  int64_t i0 = 0;
  for (; i0 + 8 <= count; i0 += 8) {
    int64_t n[8];
    for (int i = 0; i < 8; ++i) n[i] = length(i0 + i);
    const int64_t common = *std::min_element(n, n + 8);
    const float* p0 = p + i0 * stride;
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t m = 0; m < common; ++m) {
      #pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) s[i] = s[i] + p0[i * stride + m];
    }
    for (int i = 0; i < 8; ++i) {
      for (int64_t m = common; m < n[i]; ++m) s[i] = s[i] + p0[i * stride + m];
      totals[i0 + i] = s[i];
    }
  }
  for (; i0 < count; ++i0) totals[i0] = sum_in_order(p + i0 * stride, length(i0));
}

#if defined(KQ_VNNI)
// The scores of 16 keys at once: lanes[t] holds key t's 16 lane sums; lane t of the result is
// attend_scalar's halving sum of lanes[t] (i + i+8, i + i+4, i + i+2, i + i+1: the same additions of
// the same pairs, four keys or more per instruction), then put back in key order.
inline __m512 halving_sums(const __m512 (&lanes)[16]) {
  __m512 eight[8], four[4], two[2];
  #pragma GCC unroll 8
  for (int t = 0; t < 8; ++t)  // [key 2t lanes 0-7 | key 2t+1 lanes 0-7], each lane i summed with i+8
    eight[t] = _mm512_add_ps(_mm512_shuffle_f32x4(lanes[2 * t], lanes[2 * t + 1], 0x44),
                             _mm512_shuffle_f32x4(lanes[2 * t], lanes[2 * t + 1], 0xEE));
  #pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)  // four keys' lanes 0-3, each summed with lane i+4
    four[t] = _mm512_add_ps(_mm512_shuffle_f32x4(eight[2 * t], eight[2 * t + 1], 0x88),
                            _mm512_shuffle_f32x4(eight[2 * t], eight[2 * t + 1], 0xDD));
  #pragma GCC unroll 2
  for (int t = 0; t < 2; ++t)  // lanes 0-1 of eight keys, each summed with lane i+2
    two[t] = _mm512_add_ps(_mm512_shuffle_ps(four[2 * t], four[2 * t + 1], 0x44),
                           _mm512_shuffle_ps(four[2 * t], four[2 * t + 1], 0xEE));
  const __m512 one = _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], 0x88), _mm512_shuffle_ps(two[0], two[1], 0xDD));
  // lane l now holds key 4 * (l % 4) + l / 4 (a 4 x 4 transpose, its own inverse)
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), one);
}

// The scores of keys m0 .. m0+count-1 (count <= 16; slot(m): a key's row) for one query q:
// attend_scalar's lane sums and halving sum, times the scale, plus bias16 (the mask's; 0 past count).
template <int DC, typename Slot>
inline __m512 block_scores(const __m512 (&q)[DC], const float* kp, int64_t m0, int count, const Slot& slot,
                           __m512 scales, __m512 bias16) {
  __m512 lanes[16];
  #pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    lanes[t] = _mm512_setzero_ps();
    if (t < count) {
      const float* kv = kp + static_cast<int64_t>(slot(m0 + t)) * DC * 16;
      #pragma GCC unroll 16
      for (int c = 0; c < DC; ++c) lanes[t] = _mm512_add_ps(lanes[t], _mm512_mul_ps(q[c], _mm512_loadu_ps(kv + 16 * c)));
    }
  }
  return _mm512_add_ps(_mm512_mul_ps(halving_sums(lanes), scales), bias16);
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

// A query head's scores p[0..n-1] -> key_weight's e^(score - top), 16 keys at a time.
inline void weigh_keys(float* p, int64_t n, float top) {
  const __m512 topv = _mm512_set1_ps(top), minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t m0 = 0; m0 < n; m0 += 16) {
    const __mmask16 valid = first_lanes(n - m0);
    const __m512 score = _mm512_maskz_loadu_ps(valid, p + m0), shifted = _mm512_sub_ps(score, topv);
    __m512 w = _mm512_mask_mov_ps(fixed_exp::exp_lanes(shifted), _mm512_cmp_ps_mask(shifted, shifted, _CMP_UNORD_Q),
                                  shifted);
    w = _mm512_mask_mov_ps(w, _mm512_cmp_ps_mask(score, minus_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
    _mm512_mask_storeu_ps(p + m0, valid, w);
  }
}

// acc += p[m] * value(slot(m)) for m in [begin, end), in key order, zero weights skipped.
template <int DC, typename Slot>
inline void add_values(__m512 (&acc)[DC], const float* p, int64_t begin, int64_t end, const float* vp, const Slot& slot) {
  for (int64_t m = begin; m < end; ++m) {
    if (p[m] == 0.f) continue;
    const float* vv = vp + static_cast<int64_t>(slot(m)) * DC * 16;
    const __m512 weight = _mm512_set1_ps(p[m]);
    #pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(weight, _mm512_loadu_ps(vv + 16 * c)));
  }
}

template <int DC>
inline void store_divided(const __m512 (&acc)[DC], float total, float* ov) {
  const __m512 divisor = _mm512_set1_ps(total);
  #pragma GCC unroll 16
  for (int c = 0; c < DC; ++c) _mm512_storeu_ps(ov + 16 * c, _mm512_div_ps(acc[c], divisor));
}

// attend_scalar's operations for the G query heads that share one key/value head, on one row: the
// visible keys listed once (keys[m]: slot, bias[m]: the mask's bias), 16 keys' scores at a time.
// DC = D / 16 chunks a head. scores: scratch [G * n], n rounded up to 16.
template <int DC>
void attend_group(const float* q0, int64_t q_step, int64_t G, const float* kp, const float* vp,
                  const std::vector<int32_t>& keys, const std::vector<float>& bias, float scale,
                  float* o0, int64_t o_step, std::vector<float>& scores) {
  const int64_t n = static_cast<int64_t>(keys.size()), padded = (n + 15) / 16 * 16;
  scores.resize(G * padded);
  const __m512 scales = _mm512_set1_ps(scale);
  const auto slot = [&](int64_t m) { return keys[m]; };
  for (int64_t g = 0; g < G; ++g) {
    const float* qv = q0 + g * q_step;
    __m512 q[DC];
    #pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) q[c] = _mm512_loadu_ps(qv + 16 * c);
    float* p = scores.data() + g * padded;
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (int64_t m0 = 0; m0 < n; m0 += 16) {
      const int count = static_cast<int>(std::min<int64_t>(16, n - m0));
      const __mmask16 valid = first_lanes(count);
      const __m512 s = block_scores(q, kp, m0, count, slot, scales, _mm512_maskz_loadu_ps(valid, bias.data() + m0));
      _mm512_storeu_ps(p + m0, s);
      tops = _mm512_mask_max_ps(tops, valid, s, tops);  // a NaN score leaves the maximum alone, as fmax
    }
    weigh_keys(p, n, _mm512_reduce_max_ps(tops));
    const float total = sum_in_order(p, n);
    __m512 acc[DC];
    #pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) acc[c] = _mm512_setzero_ps();
    add_values(acc, p, 0, n, vp, slot);
    store_divided(acc, total, o0 + g * o_step);
  }
}

// Rows 0 .. T-1 of a tile (row r sees keys 0 .. first + r - 1, first >= 1) for the G query heads of
// one key/value head: query (r, g) at q0 + g * q_head + r * 16 * DC, its output at o0 + r * o_row +
// g * 16 * DC.
template <int DC>
void attend_causal_tile(const float* q0, int64_t q_head, int64_t G, int64_t T, int64_t first, const float* kp,
                        const float* vp, float scale, float* o0, int64_t o_row) {
  const int64_t D = 16 * DC, pairs = T * G, longest = first + T - 1, padded = (longest + 15) / 16 * 16;
  thread_local std::vector<float> scores, totals;
  thread_local std::vector<__m512> tops, accs;
  scores.resize(pairs * padded);
  totals.resize(pairs);
  tops.assign(pairs, _mm512_set1_ps(-INFINITY));
  accs.assign(pairs * DC, _mm512_setzero_ps());
  const __m512 scales = _mm512_set1_ps(scale), zero = _mm512_setzero_ps();
  const auto slot = [](int64_t m) { return m; };
  for (int64_t m0 = 0; m0 < longest; m0 += 16)
    for (int64_t r = 0; r < T; ++r) {
      const int64_t n = first + r;
      if (m0 >= n) continue;
      const int count = static_cast<int>(std::min<int64_t>(16, n - m0));
      for (int64_t g = 0; g < G; ++g) {
        const int64_t pair = r * G + g;
        __m512 q[DC];
        #pragma GCC unroll 16
        for (int c = 0; c < DC; ++c) q[c] = _mm512_loadu_ps(q0 + g * q_head + r * D + 16 * c);
        const __m512 s = block_scores(q, kp, m0, count, slot, scales, zero);  // bias 0: still added, as -0 + 0 = +0
        _mm512_storeu_ps(scores.data() + pair * padded + m0, s);
        tops[pair] = _mm512_mask_max_ps(tops[pair], first_lanes(count), s, tops[pair]);
      }
    }
  const auto visible = [&](int64_t pair) { return first + pair / G; };
  for (int64_t pair = 0; pair < pairs; ++pair)
    weigh_keys(scores.data() + pair * padded, visible(pair), _mm512_reduce_max_ps(tops[pair]));
  sums_in_order(scores.data(), padded, pairs, visible, totals.data());
  for (int64_t m0 = 0; m0 < longest; m0 += VALUE_BLOCK)
    for (int64_t r = 0; r < T; ++r) {
      const int64_t n = first + r;
      if (m0 >= n) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t pair = r * G + g;
        __m512 acc[DC];
        #pragma GCC unroll 16
        for (int c = 0; c < DC; ++c) acc[c] = accs[pair * DC + c];
        add_values(acc, scores.data() + pair * padded, m0, std::min(m0 + VALUE_BLOCK, n), vp, slot);
        #pragma GCC unroll 16
        for (int c = 0; c < DC; ++c) accs[pair * DC + c] = acc[c];
      }
    }
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512 acc[DC];
    #pragma GCC unroll 16
    for (int c = 0; c < DC; ++c) acc[c] = accs[pair * DC + c];
    store_divided(acc, totals[pair], o0 + (pair / G) * o_row + (pair % G) * D);
  }
}
#elif defined(KQ_AVX2)
// attend_scalar's halving sum of 16 lanes after its first step (eight: lanes i + i+8, i = 0..7): the
// same additions of the same pairs (i + i+4, i + i+2, i + i+1).
inline float halving_sum(__m256 eight) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// key_weight on 8 keys: 0 for a masked key (-inf), NaN kept, else fixed_exp's e^(score - top).
inline __m256 key_weights8(__m256 score, __m256 top) {
  const __m256 shifted = _mm256_sub_ps(score, top);
  const __m256 w = _mm256_blendv_ps(fixed_exp::exp_lanes8(shifted), shifted, _mm256_cmp_ps(shifted, shifted, _CMP_UNORD_Q));
  return _mm256_andnot_ps(_mm256_cmp_ps(score, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), w);
}

// attend_scalar's operations for NH (<= 4) query heads that share one key/value head, on one row,
// 8 lanes at a time, in three phases that can go over the keys in pieces (attend_causal_tile). Each
// value is read once for the NH heads; a block of 8 keys once a head, from L1. keys[m]: the visible keys' slots (nullptr: m itself),
// bias[m]: the mask's bias (nullptr: 0, still added). DC = D / 16 chunks a head.

// The scores of 8 keys at once: eight[t] holds key t's lanes i + i+8 (i = 0..7); lane t of the result
// is attend_scalar's halving sum of key t (then i + i+4, i + i+2, i + i+1: the same additions of the
// same pairs, two keys or more per instruction), put back in key order.
inline __m256 halving_sums(const __m256 (&eight)[8]) {
  __m256 four[4], two[2];
  #pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)  // [key 2t lanes 0-3 | key 2t+1 lanes 0-3], each lane i summed with i+4
    four[t] = _mm256_add_ps(_mm256_permute2f128_ps(eight[2 * t], eight[2 * t + 1], 0x20),
                            _mm256_permute2f128_ps(eight[2 * t], eight[2 * t + 1], 0x31));
  #pragma GCC unroll 2
  for (int t = 0; t < 2; ++t)  // lanes 0-1 of four keys, each summed with lane i+2
    two[t] = _mm256_add_ps(_mm256_shuffle_ps(four[2 * t], four[2 * t + 1], 0x44),
                           _mm256_shuffle_ps(four[2 * t], four[2 * t + 1], 0xEE));
  const __m256 one = _mm256_add_ps(_mm256_shuffle_ps(two[0], two[1], 0x88), _mm256_shuffle_ps(two[0], two[1], 0xDD));
  // lanes now hold keys 0, 2, 4, 6, 1, 3, 5, 7
  return _mm256_permutevar8x32_ps(one, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Key m's lane sums for one head (q: its query), lanes i + i+8 added: halving_sum's first step.
template <int DC>
inline __m256 key_lanes(const float* q, const float* kv) {
  __m256 lo = _mm256_setzero_ps(), hi = lo;
  #pragma GCC unroll 8
  for (int c = 0; c < DC; ++c) {
    lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + 16 * c), _mm256_loadu_ps(kv + 16 * c)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + 16 * c + 8), _mm256_loadu_ps(kv + 16 * c + 8)));
  }
  return _mm256_add_ps(lo, hi);
}

// key_lanes of the four keys at k0, k0 + 16 DC, .. into out[0..3]: each the same additions in the
// same order, the query's chunk loaded once for the four.
template <int DC>
inline void key_lanes4(const float* q, const float* k0, __m256* out) {
  __m256 lo[4], hi[4];
  #pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
  #pragma GCC unroll 8
  for (int c = 0; c < DC; ++c) {
    const __m256 qlo = _mm256_loadu_ps(q + 16 * c), qhi = _mm256_loadu_ps(q + 16 * c + 8);
    #pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      lo[t] = _mm256_add_ps(lo[t], _mm256_mul_ps(qlo, _mm256_loadu_ps(k0 + t * DC * 16 + 16 * c)));
      hi[t] = _mm256_add_ps(hi[t], _mm256_mul_ps(qhi, _mm256_loadu_ps(k0 + t * DC * 16 + 16 * c + 8)));
    }
  }
  #pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) out[t] = _mm256_add_ps(lo[t], hi[t]);
}

// Scores of keys [begin, end) into p[h * stride + m], and each head's running maximum top[h]; eight
// keys a pass (halving_sums), the rest one at a time, each score the same bits either way.
template <int DC, int NH>
void score_heads(const float* q0, int64_t q_step, const float* kp, const int32_t* keys, const float* bias,
                 int64_t begin, int64_t end, float scale, float* p, int64_t stride, float* top) {
  const auto key = [&](int64_t m) { return kp + (keys == nullptr ? m : static_cast<int64_t>(keys[m])) * DC * 16; };
  const __m256 scales = _mm256_set1_ps(scale);
  __m256 tops[NH];
  #pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) tops[h] = _mm256_set1_ps(-INFINITY);
  int64_t m = begin;
  for (; m + 8 <= end; m += 8) {
    const __m256 bias8 = bias == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(bias + m);
    #pragma GCC unroll 1
    for (int h = 0; h < NH; ++h) {
      __m256 eight[8];
      if (keys == nullptr) {  // consecutive keys
        key_lanes4<DC>(q0 + h * q_step, key(m), eight);
        key_lanes4<DC>(q0 + h * q_step, key(m + 4), eight + 4);
      } else {
        #pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) eight[t] = key_lanes<DC>(q0 + h * q_step, key(m + t));
      }
      const __m256 s = _mm256_add_ps(_mm256_mul_ps(halving_sums(eight), scales), bias8);
      _mm256_storeu_ps(p + h * stride + m, s);
      tops[h] = _mm256_max_ps(s, tops[h]);  // a NaN score leaves the maximum alone, as fmax
    }
  }
  #pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {  // no NaN here (_mm256_max_ps kept the maximum), so a comparison, not fmax's
    // call; a zero's sign (largest_lane) leaves every e^(score - top) the same
    const float lanes_top = largest_lane(tops[h]);
    if (lanes_top > top[h]) top[h] = lanes_top;
  }
  for (; m < end; ++m) {
    const float* kv = key(m);
    const float b = bias == nullptr ? 0.f : bias[m];
    #pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const float s = halving_sum(key_lanes<DC>(q0 + h * q_step, kv)) * scale + b;
      p[h * stride + m] = s;
      if (s > top[h]) top[h] = s;  // as fmax: a NaN score leaves the maximum alone
    }
  }
}

// One head's scores ph[0..n-1] -> key_weight's weights.
inline void weigh_keys(float* ph, int64_t n, float top) {
  const __m256 topv = _mm256_set1_ps(top);
  int64_t m = 0;
  for (; m + 8 <= n; m += 8) _mm256_storeu_ps(ph + m, key_weights8(_mm256_loadu_ps(ph + m), topv));
  for (; m < n; ++m) ph[m] = key_weight(ph[m], top);
}

// Whether adding w * value for every weight w of heads 0 .. NH-1 over keys [begin, end) gives
// attend_scalar's bits although it skips zero weights: so it does when no weight is 0 (NaN is not),
// and when every value is finite, since then a zero weight adds a signed zero to a sum that is
// never -0 (it starts at +0), which leaves it unchanged.
template <int DC, int NH>
bool zero_weights_harmless(const float* vp, const int32_t* keys, const float* p, int64_t stride, int64_t begin,
                           int64_t end) {
  __m256 zero = _mm256_setzero_ps();
  bool scalar_zero = false;
  #pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    int64_t m = begin;
    for (; m + 8 <= end; m += 8)
      zero = _mm256_or_ps(zero, _mm256_cmp_ps(_mm256_loadu_ps(p + h * stride + m), _mm256_setzero_ps(), _CMP_EQ_OQ));
    for (; m < end; ++m) scalar_zero |= p[h * stride + m] == 0.f;
  }
  if (!scalar_zero && _mm256_testz_ps(zero, zero)) return true;
  __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t m = begin; m < end; ++m) {
    const float* vv = vp + (keys == nullptr ? m : static_cast<int64_t>(keys[m])) * DC * 16;
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * DC; ++c) {  // v - v is 0 for a finite v, NaN for inf and NaN
      const __m256 v = _mm256_loadu_ps(vv + 8 * c);
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_EQ_OQ));
    }
  }
  return _mm256_movemask_ps(finite) == 0xFF;
}

// acc[h * 16 DC ..] += the weighted values of keys [begin, end), in key order, 16 lanes of every
// head at a time so that the accumulators stay in registers over the keys.
template <int DC, int NH>
void value_heads(const float* vp, const int32_t* keys, const float* p, int64_t stride, int64_t begin, int64_t end,
                 float* acc) {
  const bool unchecked = zero_weights_harmless<DC, NH>(vp, keys, p, stride, begin, end);
  #pragma GCC unroll 1
  for (int c = 0; c < DC; ++c) {
    __m256 lo[NH], hi[NH];
    #pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      lo[h] = _mm256_loadu_ps(acc + h * DC * 16 + 16 * c);
      hi[h] = _mm256_loadu_ps(acc + h * DC * 16 + 16 * c + 8);
    }
    const auto add = [&](auto test_zero) {
      for (int64_t m = begin; m < end; ++m) {
        const float* vv = vp + (keys == nullptr ? m : static_cast<int64_t>(keys[m])) * DC * 16 + 16 * c;
        const __m256 vlo = _mm256_loadu_ps(vv), vhi = _mm256_loadu_ps(vv + 8);
        #pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) {
          __m256 weight;
          if constexpr (decltype(test_zero)::value) {
            const float w = p[h * stride + m];
            if (w == 0.f) continue;  // as attend_scalar: a zero weight adds nothing, not even a -0 or NaN
            weight = _mm256_set1_ps(w);
          } else {
            weight = _mm256_broadcast_ss(p + h * stride + m);  // no test, no scalar: straight from memory
          }
          lo[h] = _mm256_add_ps(lo[h], _mm256_mul_ps(weight, vlo));
          hi[h] = _mm256_add_ps(hi[h], _mm256_mul_ps(weight, vhi));
        }
      }
    };
    if (unchecked)
      add(std::false_type{});
    else
      add(std::true_type{});
    #pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      _mm256_storeu_ps(acc + h * DC * 16 + 16 * c, lo[h]);
      _mm256_storeu_ps(acc + h * DC * 16 + 16 * c + 8, hi[h]);
    }
  }
}

// ov = acc / total, D = 16 * DC lanes.
inline void store_divided(const float* acc, float total, float* ov, int64_t D) {
  const __m256 divisor = _mm256_set1_ps(total);
  for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(ov + c, _mm256_div_ps(_mm256_loadu_ps(acc + c), divisor));
}

// The three phases over all n visible keys of one row.
template <int DC, int NH>
void attend_heads(const float* q0, int64_t q_step, const float* kp, const float* vp, const int32_t* keys,
                  const float* bias, int64_t n, float scale, float* o0, int64_t o_step, float* p) {
  float top[NH];
  alignas(32) float acc[NH * DC * 16] = {};
  #pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) top[h] = -INFINITY;
  score_heads<DC, NH>(q0, q_step, kp, keys, bias, 0, n, scale, p, n, top);
  float total[NH];
  #pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    weigh_keys(p + h * n, n, top[h]);
    total[h] = sum_in_order(p + h * n, n);
  }
  value_heads<DC, NH>(vp, keys, p, n, 0, n, acc);
  #pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) store_divided(acc + h * DC * 16, total[h], o0 + h * o_step, DC * 16);
}

// The G query heads sharing a key/value head, at most four at a time (attend_heads), in groups as
// even as they go (6 = 3 + 3: two values and six accumulators in registers, not 4 + 2).
// f(NH) for the query heads g0 .. g0+NH-1 of G, NH <= 4 a compile-time constant.
template <typename F>
void by_head_groups(int64_t G, const F& f) {
  const int64_t groups = (G + 3) / 4;
  for (int64_t i = 0, g0 = 0; i < groups; g0 += (G - g0) / (groups - i), ++i) switch ((G - g0) / (groups - i)) {
      case 4: f(g0, std::integral_constant<int, 4>{}); break;
      case 3: f(g0, std::integral_constant<int, 3>{}); break;
      case 2: f(g0, std::integral_constant<int, 2>{}); break;
      default: f(g0, std::integral_constant<int, 1>{});
    }
}

// attend_causal_tile on AVX2 (see the AVX-512 one): attend_heads' phases for each (row, head), over
// blocks of keys that every row of the tile reads while they are in L1.
template <int DC>
void attend_causal_tile(const float* q0, int64_t q_head, int64_t G, int64_t T, int64_t first, const float* kp,
                        const float* vp, float scale, float* o0, int64_t o_row) {
  const int64_t D = 16 * DC, longest = first + T - 1, stride = longest;
  thread_local std::vector<float> scores, tops, accs, totals;
  scores.resize(T * G * stride);
  tops.assign(T * G, -INFINITY);
  accs.assign(T * G * D, 0.f);
  for (int64_t m0 = 0; m0 < longest; m0 += KEY_BLOCK)
    for (int64_t r = 0; r < T; ++r) {
      const int64_t n = first + r;
      if (m0 < n)
        by_head_groups(G, [&](int64_t g0, auto heads) {
          score_heads<DC, decltype(heads)::value>(q0 + g0 * q_head + r * D, q_head, kp, nullptr, nullptr, m0,
                                                  std::min(m0 + KEY_BLOCK, n), scale,
                                                  scores.data() + (r * G + g0) * stride, stride, tops.data() + r * G + g0);
        });
    }
  totals.resize(T * G);
  const auto visible = [&](int64_t pair) { return first + pair / G; };
  for (int64_t pair = 0; pair < T * G; ++pair) weigh_keys(scores.data() + pair * stride, visible(pair), tops[pair]);
  sums_in_order(scores.data(), stride, T * G, visible, totals.data());
  for (int64_t m0 = 0; m0 < longest; m0 += VALUE_BLOCK)
    for (int64_t r = 0; r < T; ++r) {
      const int64_t n = first + r;
      if (m0 < n)
        by_head_groups(G, [&](int64_t g0, auto heads) {
          value_heads<DC, decltype(heads)::value>(vp, nullptr, scores.data() + (r * G + g0) * stride, stride, m0,
                                                  std::min(m0 + VALUE_BLOCK, n), accs.data() + (r * G + g0) * D);
        });
    }
  for (int64_t pair = 0; pair < T * G; ++pair)
    store_divided(accs.data() + pair * D, totals[pair], o0 + (pair / G) * o_row + (pair % G) * D, D);
}

template <int DC>
void attend_group(const float* q0, int64_t q_step, int64_t G, const float* kp, const float* vp,
                  const std::vector<int32_t>& keys, const std::vector<float>& bias, float scale,
                  float* o0, int64_t o_step, std::vector<float>& scores) {
  const int64_t n = static_cast<int64_t>(keys.size());
  scores.resize(4 * n);
  by_head_groups(G, [&](int64_t g0, auto heads) {
    attend_heads<DC, decltype(heads)::value>(q0 + g0 * q_step, q_step, kp, vp, keys.data(), bias.data(), n, scale,
                                             o0 + g0 * o_step, o_step, scores.data());
  });
}
#endif

// Attention of one sequence on raw rows: q [H, R, D], keys and values of head h from kp + h * k_head
// and vp + h * v_head, L rows of D floats each, mask [R, L] additive (nullptr: causal, row i sees
// keys 0 .. L-R+i), out [R, H, D]. With AVX-512 or AVX2 and D of 64 or 128, a causal chunk goes by
// tiles of rows (attend_causal_tile). Otherwise each (key/value head, row) is one item of work: with AVX-512 or
// AVX2 and D of 64 or 128 its G = H / KVH query heads go together (attend_group), otherwise one
// head at a time (attend_scalar); the bits are the same.
void attend(const float* qp, int64_t H, int64_t R, int64_t D, const float* kp, int64_t k_head, const float* vp,
            int64_t v_head, int64_t KVH, int64_t L, const float* mp, float scale, float* op) {
  TORCH_CHECK(D % 16 == 0 && H % KVH == 0, "attention needs D % 16 == 0 and H % KVH == 0");
  const int64_t G = H / KVH;
  const bool causal = mp == nullptr;
#if defined(KQ_VNNI) || defined(KQ_AVX2)
  if (causal && (D == 64 || D == 128)) {
    const int64_t tiles = (R + ATTEND_TILE - 1) / ATTEND_TILE;
    for_each_dynamic(KVH * tiles, 1, [&](int64_t item) {
      const int64_t kvh = item / tiles, r0 = item % tiles * ATTEND_TILE, T = std::min(ATTEND_TILE, R - r0);
      const float* q0 = qp + (kvh * G * R + r0) * D;
      float* o0 = op + (r0 * H + kvh * G) * D;
      if (D == 64)
        attend_causal_tile<4>(q0, R * D, G, T, L - R + r0 + 1, kp + kvh * k_head, vp + kvh * v_head, scale, o0, H * D);
      else
        attend_causal_tile<8>(q0, R * D, G, T, L - R + r0 + 1, kp + kvh * k_head, vp + kvh * v_head, scale, o0, H * D);
    });
    return;
  }
#endif
#if defined(KQ_VNNI) || defined(KQ_AVX2)
  if (D == 64 || D == 128) {
    at::parallel_for(0, KVH * R, 1, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> keys;
      std::vector<float> bias, scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kvh = item / R, r = item % R;
        keys.clear();
        bias.clear();
        for (int64_t j = 0, visible = causal ? L - R + r + 1 : L; j < visible; ++j) {
          const float b = causal ? 0.f : mp[r * L + j];
          if (b == -INFINITY) continue;
          keys.push_back(static_cast<int32_t>(j));
          bias.push_back(b);
        }
        const float* q0 = qp + (kvh * G * R + r) * D;
        float* o0 = op + (r * H + kvh * G) * D;
        if (D == 64)
          attend_group<4>(q0, R * D, G, kp + kvh * k_head, vp + kvh * v_head, keys, bias, scale, o0, D, scores);
        else
          attend_group<8>(q0, R * D, G, kp + kvh * k_head, vp + kvh * v_head, keys, bias, scale, o0, D, scores);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, H * R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(L), acc(D);
    for (int64_t hr = begin; hr < end; ++hr) {
      const int64_t h = hr / R, r = hr % R, kvh = h / G;
      attend_scalar(qp + (h * R + r) * D, kp + kvh * k_head, vp + kvh * v_head, causal ? nullptr : mp + r * L,
                    causal ? L - R + r + 1 : L, D, scale, op + (r * H + h) * D, p, acc);
    }
  });
}

}  // namespace

// q [H, R, D] (contiguous), k and v [KVH, L, D] float32 (see rows_contiguous), mask [R, L]
// additive (or empty: causal). Returns [R, H, D] (see attend).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k_in, const torch::Tensor& v_in,
                        const torch::Tensor& mask, double scaling) {
  const torch::Tensor k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2), KVH = k.size(0), L = k.size(1);
  const bool causal = mask.numel() == 0;
  TORCH_CHECK(causal || (mask.size(0) == R && mask.size(1) == L), "mask must be [R, L]");
  auto out = torch::empty({R, H, D}, torch::kFloat32);
  attend(q.data_ptr<float>(), H, R, D, k.data_ptr<float>(), k.stride(0), v.data_ptr<float>(), v.stride(0), KVH, L,
         causal ? nullptr : mask.data_ptr<float>(), (float)scaling, out.data_ptr<float>());
  return out;
}

// ---- a whole decoder layer's glue (engine/backends/lean.py) -----------------------------------
//
// The lean forward spends as long in Python and torch dispatch as in arithmetic on 2 cores once
// the matrices are 4-bit. A LeanLayer holds one llama-style layer's packed matrices and runs
// everything but the KV-cache update in two calls. Its operations are the model's own, per
// element in the same order (the norms through the same ATen kernel, SiLU through fixed_exp.h's as
// the model's FixedSiLU; adds, products and rotary by hand, which with -ffp-contract=off are the
// same IEEE operations), so its output equals
// the model's own forward bit for bit; tests/test_lean.py checks it.

// (kind, packed tensors in PACKED_NAMES order, outputs, packed inputs, bias) from Python.
using LinearSpec = std::tuple<std::string, std::vector<torch::Tensor>, int64_t, int64_t, c10::optional<torch::Tensor>>;

std::vector<PackedLinear> packed_linears(const std::vector<LinearSpec>& specs) {
  std::vector<PackedLinear> out;
  for (const auto& [kind, tensors, n, k, bias] : specs) {
    TORCH_CHECK(n % TILE == 0 && k % QK == 0, "outputs must be a multiple of 16, inputs of 256");
    TORCH_CHECK(out.empty() || out[0].k == k, "products side by side need one input size");
    out.push_back(PackedLinear{kind, tensors, n, k, bias});
  }
  return out;
}

// x (R rows of ``in`` values, any shape) -> [R, sum of n], with zero inputs appended up to the packed
// width (as KQuantLinear).
torch::Tensor products(const std::vector<PackedLinear>& linears, const torch::Tensor& x, int64_t R) {
  const torch::Tensor x2 = x.is_contiguous() ? x : x.contiguous();
  int64_t total = 0;
  for (const auto& L : linears) total += L.n;
  auto out = torch::empty({R, total}, torch::kFloat32);
  if (R > 0) products_into(linears, x2.data_ptr<float>(), R, x2.numel() / R, out.data_ptr<float>(), total);
  return out;
}

// The model's RMSNorm (Qwen2RMSNorm / LlamaRMSNorm on float32: weight * (x * rsqrt(mean(x^2) + eps)))
// with the same IEEE operations per element: the squares are exact products, their sum over a row
// goes through ATen's own sum (whose order sets the bits), and mean's division by the width, the
// epsilon, 1 / sqrt and both products are single roundings whoever computes them. One ATen call
// instead of six (each costs microseconds of dispatch a layer, where the arithmetic costs less).
torch::Tensor rms_norm(const torch::Tensor& hidden, const torch::Tensor& weight, double eps) {
  const torch::Tensor x = hidden.contiguous(), w = weight.contiguous();
  const int64_t E = x.size(-1), R = x.numel() / E;
  TORCH_CHECK(w.numel() == E, "the norm's weight does not match the hidden size");
  auto squares = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* sq = squares.data_ptr<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) sq[i] = xp[i] * xp[i];
  const torch::Tensor sums = at::sum(squares, {-1}, true);  // mean = sum / width, as ATen's mean on CPU
  auto out = torch::empty_like(x);
  const float *sp = sums.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float width = static_cast<float>(E), epsilon = static_cast<float>(eps);
  for (int64_t r = 0; r < R; ++r) {
    const float inverse = 1.f / std::sqrt(sp[r] / width + epsilon);
    for (int64_t i = 0; i < E; ++i) op[r * E + i] = wp[i] * (xp[r * E + i] * inverse);
  }
  return out;
}

class LeanLayer {
 public:
  LeanLayer(torch::Tensor norm1, double eps1, torch::Tensor norm2, double eps2, std::vector<LinearSpec> qkv,
            std::vector<LinearSpec> o, std::vector<LinearSpec> gate_up, std::vector<LinearSpec> down, int64_t heads,
            int64_t kv_heads, int64_t head_dim, double scaling)
      : norm1_(norm1), norm2_(norm2), eps1_(eps1), eps2_(eps2), qkv_(packed_linears(qkv)), o_(packed_linears(o)),
        gate_up_(packed_linears(gate_up)), down_(packed_linears(down)), heads_(heads), kv_heads_(kv_heads),
        dim_(head_dim), scaling_(scaling) {}

  // What sets a layer apart from Llama's (Qwen3, Gemma 3); undefined or empty tensors leave a step out:
  // per-head RMSNorms of q and k before the rotary (their weights as the model multiplies them: Gemma's
  // ``1 + w`` already added), norms of the attention's and the MLP's outputs before their residuals,
  // GELU-tanh for SiLU, and whether the layer attends through a sliding window (forward_layers then
  // gives it the local rotary and mask).
  void extras(torch::Tensor q_norm, torch::Tensor k_norm, double qk_eps, torch::Tensor post_attention_norm,
              torch::Tensor post_mlp_norm, double post_eps, bool gelu, bool sliding) {
    TORCH_CHECK(q_norm.numel() == 0 || (q_norm.numel() == dim_ && k_norm.numel() == dim_), "q/k norms take head_dim");
    q_norm_ = q_norm, k_norm_ = k_norm, qk_eps_ = qk_eps, post_attention_norm_ = post_attention_norm;
    post_mlp_norm_ = post_mlp_norm, post_eps_ = post_eps, gelu_ = gelu, sliding_ = sliding;
  }

  bool sliding() const { return sliding_; }

  // hidden [1, R, E], cos and sin [1, R, D] -> (query [H, R, D], key and value [1, KVH, R, D]), rotated.
  std::vector<torch::Tensor> attention_in(const torch::Tensor& hidden, const torch::Tensor& cos,
                                          const torch::Tensor& sin) const {
    const int64_t R = hidden.size(1);
    auto key = torch::empty({1, kv_heads_, R, dim_}, torch::kFloat32);
    auto value = torch::empty({1, kv_heads_, R, dim_}, torch::kFloat32);
    return {project(hidden, cos, sin, key.data_ptr<float>(), value.data_ptr<float>(), R), key, value};
  }

  // Whether ``buffer`` is a KV-cache buffer [1, KVH, slots, D] of this layer's heads.
  bool fits(const torch::Tensor& buffer) const {
    return buffer.dim() == 4 && buffer.size(0) == 1 && buffer.size(1) == kv_heads_ && buffer.size(3) == dim_;
  }

  // attention_in's query; its keys and values go straight to kp, vp: row r of key/value head h at
  // (h * slots + r) * D (a cache buffer [1, KVH, slots, D] from its first new slot, or [1, KVH, R, D]).
  torch::Tensor project(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin, float* kp,
                        float* vp, int64_t slots) const {
    const int64_t R = hidden.size(1), D = dim_, half = D / 2, H = heads_, KVH = kv_heads_;
    const torch::Tensor qkv = products(qkv_, rms_norm(hidden, norm1_, eps1_), R);
    TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "q/k/v outputs do not match the heads");
    if (q_norm_.numel() > 0) {  // each head's q and k through its norm, as the model's q_norm/k_norm
      qkv.narrow(1, 0, H * D).copy_(rms_norm(qkv.narrow(1, 0, H * D).reshape({R, H, D}), q_norm_, qk_eps_).reshape({R, H * D}));
      qkv.narrow(1, H * D, KVH * D)
          .copy_(rms_norm(qkv.narrow(1, H * D, KVH * D).reshape({R, KVH, D}), k_norm_, qk_eps_).reshape({R, KVH * D}));
    }
    auto query = torch::empty({H, R, D}, torch::kFloat32);
    const torch::Tensor c = cos.contiguous(), s = sin.contiguous();
    const float *src = qkv.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
    float* qp = query.data_ptr<float>();
    const int64_t width = qkv.size(1);
    for (int64_t r = 0; r < R; ++r) {
      const float *cr = cp + r * D, *sr = sp + r * D;
      for (int64_t h = 0; h < H + KVH; ++h) {  // x*cos + rotate_half(x)*sin, as apply_rotary_pos_emb
        const float* x = src + r * width + h * D;
        float* y = h < H ? qp + (h * R + r) * D : kp + ((h - H) * slots + r) * D;
        for (int64_t i = 0; i < D; ++i) {
          const float rotated = i < half ? -x[i + half] : x[i - half];
          y[i] = x[i] * cr[i] + rotated * sr[i];
        }
      }
      for (int64_t h = 0; h < KVH; ++h)
        std::memcpy(vp + (h * slots + r) * D, src + r * width + (H + KVH + h) * D, D * sizeof(float));
    }
    return query;
  }

  // The rest of the layer: attention over key/value [1, KVH, L, D] under ``mask`` (as attention()),
  // the output projection, the residual, the MLP and its residual. hidden [1, R, E] -> [1, R, E].
  torch::Tensor attention_out(const torch::Tensor& hidden, const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const torch::Tensor& mask) const {
    return after_attention(hidden, attention(query, key[0], value[0], mask, scaling_));
  }

  // attention_out on keys and values where a growing cache keeps them: head h's L rows at
  // kp + h * slots * D and vp + h * slots * D; mask [R, L] additive or empty (causal).
  torch::Tensor attention_out_cached(const torch::Tensor& hidden, const torch::Tensor& query, const float* kp,
                                     const float* vp, int64_t slots, int64_t L, const torch::Tensor& mask) const {
    const int64_t R = hidden.size(1);
    TORCH_CHECK(mask.numel() == 0 || (mask.size(0) == R && mask.size(1) == L && mask.is_contiguous()),
                "mask must be [R, L] and contiguous");
    auto attended = torch::empty({R, heads_, dim_}, torch::kFloat32);
    attend(query.data_ptr<float>(), heads_, R, dim_, kp, slots * dim_, vp, slots * dim_, kv_heads_, L,
           mask.numel() == 0 ? nullptr : mask.data_ptr<float>(), (float)scaling_, attended.data_ptr<float>());
    return after_attention(hidden, attended);
  }

 private:
  // The output projection of attended [R, H, D], the residual, the MLP and its residual.
  torch::Tensor after_attention(const torch::Tensor& hidden, const torch::Tensor& attended) const {
    const int64_t R = hidden.size(1), E = hidden.size(2);
    torch::Tensor h1 = products(o_, attended, R).reshape({1, R, E});
    if (post_attention_norm_.numel() > 0) h1 = rms_norm(h1, post_attention_norm_, post_eps_);
    add_into(h1, hidden);
    const torch::Tensor gate_up = products(gate_up_, rms_norm(h1, norm2_, eps2_), R);
    const int64_t mid = gate_up.size(1) / 2;
    auto product = torch::empty({R, mid}, torch::kFloat32);
    const float* gu = gate_up.data_ptr<float>();
    float* p = product.data_ptr<float>();
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {  // act(gate) * up: the same bits on any thread
      for (int64_t r = begin; r < end; ++r) {
        const float *g = gu + r * 2 * mid, *u = g + mid;
        gelu_ ? fixed_exp::gelu_times(g, u, p + r * mid, mid) : fixed_exp::silu_times(g, u, p + r * mid, mid);
      }
    });
    torch::Tensor out = products(down_, product, R).reshape({1, R, E});
    if (post_mlp_norm_.numel() > 0) out = rms_norm(out, post_mlp_norm_, post_eps_);
    add_into(out, h1);
    return out;
  }

  // y = x + y (the residual first, as ``residual + f(x)``), in place; both contiguous [1, R, E].
  static void add_into(torch::Tensor& y, const torch::Tensor& x) {
    const torch::Tensor xc = x.contiguous();
    const float* a = xc.data_ptr<float>();
    float* b = y.data_ptr<float>();
    for (int64_t i = 0, n = y.numel(); i < n; ++i) b[i] = a[i] + b[i];
  }

  torch::Tensor norm1_, norm2_;
  double eps1_, eps2_;
  std::vector<PackedLinear> qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, dim_;
  double scaling_;
  torch::Tensor q_norm_ = torch::empty(0), k_norm_ = torch::empty(0);  // extras(): none by default
  torch::Tensor post_attention_norm_ = torch::empty(0), post_mlp_norm_ = torch::empty(0);
  double qk_eps_ = 0, post_eps_ = 0;
  bool gelu_ = false, sliding_ = false;
};

// Every decoder layer of one forward in one call (no Python between layers): layer i writes its
// new keys and values [1, KVH, R, D] into its cache buffers key_buffers[i], value_buffers[i]
// [1, KVH, slots, D] at slots filled .. filled+R-1 and attends over slots 0 .. filled+R-1 under
// ``mask`` (as attention()). The same operations as attention_in, a cache update, attention_out; the
// new keys and values are written where the cache keeps them, never copied.
torch::Tensor forward_layers(const std::vector<LeanLayer*>& layers, torch::Tensor hidden, const torch::Tensor& cos,
                             const torch::Tensor& sin, const std::vector<torch::Tensor>& key_buffers,
                             const std::vector<torch::Tensor>& value_buffers, int64_t filled, const torch::Tensor& mask,
                             const torch::Tensor& local_cos, const torch::Tensor& local_sin,
                             const torch::Tensor& local_mask) {
  TORCH_CHECK(key_buffers.size() == layers.size() && value_buffers.size() == layers.size(), "one buffer pair a layer");
  const int64_t R = hidden.size(1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const torch::Tensor &keys = key_buffers[i], &values = value_buffers[i];
    TORCH_CHECK(layers[i]->fits(keys) && keys.is_contiguous() && values.is_contiguous() &&
                    keys.sizes() == values.sizes() && keys.scalar_type() == torch::kFloat32 &&
                    values.scalar_type() == torch::kFloat32,
                "cache buffers must be contiguous float32 [1, KVH, slots, D], keys and values alike");
    TORCH_CHECK(keys.size(2) >= filled + R, "cache buffer too short");
    const int64_t slots = keys.size(2), first = filled * keys.size(3);
    const bool local = layers[i]->sliding();  // a sliding-window layer: its own rotary and mask
    const torch::Tensor query = layers[i]->project(hidden, local ? local_cos : cos, local ? local_sin : sin,
                                                   keys.data_ptr<float>() + first, values.data_ptr<float>() + first,
                                                   slots);
    hidden = layers[i]->attention_out_cached(hidden, query, keys.data_ptr<float>(), values.data_ptr<float>(), slots,
                                             filled + R, local ? local_mask : mask);
  }
  return hidden;
}

// ``times`` (fixed_exp.h: silu_times, gelu_times) of float32 x, elementwise: each element's bits
// depend on nothing but itself, whatever the batch, the threads and the ISA.
torch::Tensor elementwise(const torch::Tensor& x, void (*times)(const float*, const float*, float*, int64_t)) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "float32 CPU activations");
  const torch::Tensor in = x.contiguous();
  auto out = torch::empty_like(in);
  const float* g = in.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, in.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    times(g + begin, nullptr, y + begin, end - begin);
  });
  return out;
}

// SiLU, the Llama family's activation in both the k-quant models' own forward and the lean one.
torch::Tensor silu(const torch::Tensor& x) { return elementwise(x, fixed_exp::silu_times); }

// GELU-tanh, Gemma's activation, as silu() is the Llama family's.
torch::Tensor gelu_tanh(const torch::Tensor& x) { return elementwise(x, fixed_exp::gelu_times); }

// nucleus.cpp: logits to a softmax restricted to its top-p nucleus, and whether the logits were finite.
std::tuple<torch::Tensor, bool> nucleus_probs(const torch::Tensor& logits, double temperature, double top_p);
// nucleus.cpp: the token an inverse-CDF draw with uniform u01 picks from probs [V] (-1: draw again).
int64_t draw_index(const torch::Tensor& probs, double u01);
// nucleus.cpp: each row's k largest values' indices, largest first, ties in index order.
torch::Tensor top_indices(const torch::Tensor& x, int64_t k);

// Which integer path was compiled: "avx512-vnni", "avx2" or "portable".
std::string simd_path() {
#if defined(KQ_VNNI)
  return "avx512-vnni";
#elif defined(KQ_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto unlocked = pybind11::call_guard<pybind11::gil_scoped_release>();  // other Python threads run meanwhile
  m.def("q4k_linear", &q4k_linear, "x @ W.T for a Q4_K weight (batch-invariant)", unlocked);
  m.def("q6k_linear", &q6k_linear, "x @ W.T for a Q6_K weight (batch-invariant)", unlocked);
  m.def("block_linear", &block_linear, "x @ W.T for a weight of any served kind (batch-invariant)", unlocked);
  m.def("attention", &attention, "batch-invariant attention for one sequence", unlocked);
  m.def("nucleus_probs", &nucleus_probs, "softmax at a temperature, restricted to the top-p nucleus", unlocked);
  m.def("draw_index", &draw_index, "the token an inverse-CDF draw picks (float64 prefix sums)", unlocked);
  m.def("top_indices", &top_indices, "each row's k largest values' indices, ties in index order", unlocked);
  m.def("silu", &silu, "SiLU with the same bits for every element whatever the batch and threads", unlocked);
  m.def("gelu_tanh", &gelu_tanh, "GELU (tanh) with the same bits for every element whatever the batch and threads",
        unlocked);
  m.def("rms_norm", &rms_norm, "the models' RMSNorm on float32 (exposed for tests)");
  m.def("simd_path", &simd_path, "which integer path was compiled (avx512-vnni, avx2, portable)");
  pybind11::class_<LeanLayer>(m, "LeanLayer", pybind11::module_local())
      .def(pybind11::init<torch::Tensor, double, torch::Tensor, double, std::vector<LinearSpec>, std::vector<LinearSpec>,
                          std::vector<LinearSpec>, std::vector<LinearSpec>, int64_t, int64_t, int64_t, double>())
      .def("attention_in", &LeanLayer::attention_in, "hidden [1,R,E], cos, sin [1,R,D] -> query, key, value", unlocked)
      .def("attention_out", &LeanLayer::attention_out, "the rest of the layer: [1,R,E] -> [1,R,E]", unlocked)
      .def("extras", &LeanLayer::extras, "q/k norms, post-attention and post-MLP norms, GELU, sliding window")
      .def_property_readonly("sliding", &LeanLayer::sliding);
  m.def("forward_layers", &forward_layers, "every layer of a forward, keys and values written into the cache's buffers",
        unlocked);
}
