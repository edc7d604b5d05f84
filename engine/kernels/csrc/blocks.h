// The kernels of every GGUF block type past Q4_K and Q6_K, served as stored (layouts in
// engine/backends/blocks.py). Included by kquant.cpp inside its anonymous namespace, after Rows,
// by_row_blocks and the Q4_K helpers, so each build (native, AVX2, portable) keeps its own copy.
//
// Batch invariance as the Q4_K/Q6_K kernels: integer dot products are exact in any order, and the
// float steps per output lane are one fixed sequence whatever the ISA, rows and threads:
//   legacy (groups of 32): a = dot - c*S (S: the group's activation sum), per group in order
//        step = (sx*d)*(float)a [+ (sx*m)*(float)S for _1], y = y + step, with the activations
//        quantised per group of 32 (sx: that group's scale, as llama.cpp's Q8_0/Q8_1 activations);
//   q5k, q2k (per super-block): y = y + ((sx*d)*(float)a - (sx*dmin)*(float)b), as Q4_K;
//   float kinds: y = y + x[k]*w[k] for k in order (no activation quantisation).
// Q3_K is packed into Q6_K's form and runs Q6_K's kernel.

enum class Kind { Q4K, Q6K, Q5K, Q2K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F32, F16, BF16 };

inline Kind kind_of(const std::string& name) {
  static const std::pair<const char*, Kind> names[] = {
      {"q4k", Kind::Q4K}, {"q6k", Kind::Q6K}, {"q3k", Kind::Q6K}, {"q5k", Kind::Q5K}, {"q2k", Kind::Q2K},
      {"q8_0", Kind::Q8_0}, {"q4_0", Kind::Q4_0}, {"q4_1", Kind::Q4_1}, {"q5_0", Kind::Q5_0},
      {"q5_1", Kind::Q5_1}, {"f32", Kind::F32}, {"f16", Kind::F16}, {"bf16", Kind::BF16}};
  for (const auto& [n, k] : names)
    if (name == n) return k;
  TORCH_CHECK(false, "unknown block kind ", name);
}

constexpr bool is_legacy(Kind k) { return k == Kind::Q8_0 || k == Kind::Q4_0 || k == Kind::Q4_1 || k == Kind::Q5_0 || k == Kind::Q5_1; }
constexpr bool is_float(Kind k) { return k == Kind::F32 || k == Kind::F16 || k == Kind::BF16; }
constexpr bool has_plane(Kind k) { return k == Kind::Q5_0 || k == Kind::Q5_1 || k == Kind::Q5K; }
constexpr bool has_min(Kind k) { return k == Kind::Q4_1 || k == Kind::Q5_1; }
// The offset c of w = d*(q - c) for the _0 types (q8_0's quants are signed: none).
constexpr int legacy_offset(Kind k) { return k == Kind::Q4_0 ? 8 : k == Kind::Q5_0 ? 16 : 0; }
constexpr int64_t GROUP = 32;
constexpr int64_t group_bytes(Kind k) { return k == Kind::Q8_0 ? 512 : 256; }  // a tile's quants of one group

// A weight of a kind served here: pointers read once (see WeightPointers).
struct BlockWeight {
  Kind kind;
  const uint8_t *qs = nullptr, *qh = nullptr, *sc = nullptr, *mn = nullptr;
  const uint16_t *d = nullptr, *m = nullptr;  // fp16 bits: d, and dmin (q5k, q2k) or m (legacy _1)
  const void* w = nullptr;                    // the float kinds' weights [N/16, inputs, 16]
  int64_t groups = 0;                         // legacy: groups of 32 stored a row; float: inputs a row
};

inline const uint8_t* bytes_of(const torch::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

// The tensors of ``kind`` (PACKED_NAMES order) checked against n x k (k: the padded inputs).
inline BlockWeight block_weight(Kind kind, const std::vector<torch::Tensor>& t, int64_t n, int64_t k) {
  BlockWeight w{kind};
  const int64_t tiles = n / TILE, nb = k / QK;
  auto check = [&](size_t i, int64_t elements, int64_t size, const char* what) {
    TORCH_CHECK(i < t.size() && t[i].numel() == elements && t[i].element_size() == size, what,
                " do not match ", n, " x ", k);
  };
  if (is_float(kind)) {
    TORCH_CHECK(t.size() == 1, "a float kind takes w");
    const int64_t size = kind == Kind::F32 ? 4 : 2;
    w.groups = t[0].numel() / n;
    TORCH_CHECK(w.groups > 0 && w.groups <= k && w.groups * n == t[0].numel() && t[0].element_size() == size,
                "float weights do not match ", n, " x ", k);
    w.w = t[0].data_ptr();
    return w;
  }
  if (is_legacy(kind)) {
    const size_t count = 2 + has_plane(kind) + has_min(kind);
    TORCH_CHECK(t.size() == count, "the legacy kind takes qs, [qh,] d[, m]");
    const size_t di = has_plane(kind) ? 2 : 1;
    w.groups = t[di].numel() / n;
    TORCH_CHECK(w.groups > (nb - 1) * (QK / GROUP) && w.groups <= nb * (QK / GROUP) && w.groups * n == t[di].numel(),
                "scales do not match ", n, " x ", k);
    check(0, tiles * w.groups * group_bytes(kind), 1, "quants");
    if (has_plane(kind)) check(1, tiles * w.groups * 64, 1, "fifth bits");
    check(di, n * w.groups, 2, "scales");
    if (has_min(kind)) check(di + 1, n * w.groups, 2, "mins' scales");
    w.qs = bytes_of(t[0]);
    w.qh = has_plane(kind) ? bytes_of(t[1]) : nullptr;
    w.d = reinterpret_cast<const uint16_t*>(t[di].data_ptr());
    w.m = has_min(kind) ? reinterpret_cast<const uint16_t*>(t[di + 1].data_ptr()) : nullptr;
    return w;
  }
  // q5k (qs, qh, sc, mn, d, dmin) or q2k (qs, sc, mn, d, dmin)
  const bool q5 = kind == Kind::Q5K;
  TORCH_CHECK(t.size() == (q5 ? 6u : 5u), q5 ? "q5k takes qs, qh, sc, mn, d, dmin" : "q2k takes qs, sc, mn, d, dmin");
  const size_t s = q5 ? 2 : 1;
  const int64_t subs = q5 ? 8 : 16;
  check(0, tiles * nb * (q5 ? Q4K_BYTES : TILE * QK / 4), 1, "quants");
  if (q5) check(1, tiles * nb * TILE * QK / 8, 1, "fifth bits");
  check(s, n * nb * subs, 1, "scales");
  check(s + 1, n * nb * subs, 1, "mins");
  check(s + 2, n * nb, 2, "super-block scales");
  check(s + 3, n * nb, 2, "super-block scales");
  w.qs = bytes_of(t[0]);
  w.qh = q5 ? bytes_of(t[1]) : nullptr;
  w.sc = bytes_of(t[s]);
  w.mn = bytes_of(t[s + 1]);
  w.d = reinterpret_cast<const uint16_t*>(t[s + 2].data_ptr());
  w.m = reinterpret_cast<const uint16_t*>(t[s + 3].data_ptr());
  return w;
}

// Where row r's super-block blk of quantised activations lies (row- or panel-major, quantize_rows).
inline int64_t row_slot(const Rows& rows, int64_t r, int64_t blk) {
  return block_slot(r, blk, rows.K / QK, rows.panel_major);
}

// ---- portable pieces (every build runs them for Q2_K; the portable build for everything) --------

// dot[o] = sum of the 32 inputs x of one group of nibbles (and fifth bits, when h) times q[o].
inline void dot_nibbles(const uint8_t* q, const uint8_t* h, const int8_t* x, int32_t* dot) {
  for (int o = 0; o < TILE; ++o) {
    int32_t s = 0;
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = q[l * 64 + o * 4 + i];
        int lo = byte & 0x0F, hi = byte >> 4;
        if (h) {
          lo |= ((h[o * 4 + i] >> l) & 1) << 4;
          hi |= ((h[o * 4 + i] >> (4 + l)) & 1) << 4;
        }
        s += lo * x[l * 8 + i] + hi * x[l * 8 + 4 + i];
      }
    dot[o] = s;
  }
}

// q8_0: 8 vectors of 16 outputs x 4 signed bytes (vector k: inputs 4k .. 4k+3).
inline void dot_bytes(const int8_t* q, const int8_t* x, int32_t* dot) {
  for (int o = 0; o < TILE; ++o) {
    int32_t s = 0;
    for (int k = 0; k < 8; ++k)
      for (int i = 0; i < 4; ++i) s += q[k * 64 + o * 4 + i] * x[k * 4 + i];
    dot[o] = s;
  }
}

// q2k: one sub-block of 16 inputs, bits 2l, 2l+1 of byte (o, i): input 4l+i.
inline void dot_crumbs(const uint8_t* q, const int8_t* x, int32_t* dot) {
  for (int o = 0; o < TILE; ++o) {
    int32_t s = 0;
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 4; ++i) s += ((q[o * 4 + i] >> (2 * l)) & 3) * x[l * 4 + i];
    dot[o] = s;
  }
}

// The scale of row r's activations over group g of 32 inputs (the legacy kinds' rows are ``fine``).
inline float group_scale(const Rows& rows, int64_t r, int64_t g) { return rows.sx[r * (rows.K / GROUP) + g]; }

// A group's sum of activations (32 inputs: two sums of 16).
inline int32_t group_sum(const Rows& rows, int64_t slot, int64_t j) {
  return rows.s16[slot * 16 + 2 * j] + rows.s16[slot * 16 + 2 * j + 1];
}

template <Kind KD>
void portable_legacy(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N, int64_t tile) {
  const int64_t G = w.groups;
  alignas(64) int32_t dot[TILE];
  for (int64_t r = r0; r < r0 + nr; ++r) {
    float y[TILE] = {0};
    for (int64_t g = 0; g < G; ++g) {
      const int64_t blk = g / 8, j = g % 8, slot = row_slot(rows, r, blk), base = tile * G + g;
      const int8_t* x = rows.xq + slot * QK + j * GROUP;
      if constexpr (KD == Kind::Q8_0)
        dot_bytes(reinterpret_cast<const int8_t*>(w.qs) + base * 512, x, dot);
      else
        dot_nibbles(w.qs + base * 256, has_plane(KD) ? w.qh + base * 64 : nullptr, x, dot);
      const int32_t S = group_sum(rows, slot, j);
      const float sx = group_scale(rows, r, g);
      const uint16_t* d = w.d + base * TILE;
      for (int o = 0; o < TILE; ++o) {
        float step = (sx * half(d[o])) * (float)(dot[o] - legacy_offset(KD) * S);
        if constexpr (has_min(KD)) step = step + (sx * half(w.m[base * TILE + o])) * (float)S;
        y[o] = y[o] + step;
      }
    }
    std::memcpy(out + r * N + tile * TILE, y, sizeof(y));
  }
}

template <Kind KD>
void portable_kaffine(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N,
                      int64_t tile) {
  constexpr bool q5 = KD == Kind::Q5K;
  constexpr int subs = q5 ? 8 : 16;
  const int64_t nb = rows.K / QK;
  alignas(64) int32_t dot[TILE], a[TILE], b[TILE];
  for (int64_t r = r0; r < r0 + nr; ++r) {
    float y[TILE] = {0};
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int64_t t = tile * nb + blk, slot = row_slot(rows, r, blk);
      const int8_t* x = rows.xq + slot * QK;
      for (int o = 0; o < TILE; ++o) a[o] = b[o] = 0;
      for (int j = 0; j < subs; ++j) {
        int32_t S;
        if constexpr (q5) {
          dot_nibbles(w.qs + t * Q4K_BYTES + j * 256, w.qh + t * 512 + j * 64, x + j * 32, dot);
          S = group_sum(rows, slot, j);
        } else {
          dot_crumbs(w.qs + t * 1024 + j * 64, x + j * 16, dot);
          S = rows.s16[slot * 16 + j];
        }
        for (int o = 0; o < TILE; ++o) {
          a[o] += w.sc[t * subs * TILE + j * TILE + o] * dot[o];
          b[o] += w.mn[t * subs * TILE + j * TILE + o] * S;
        }
      }
      const float sx = rows.sx[r * nb + blk];
      for (int o = 0; o < TILE; ++o)
        y[o] = y[o] + ((sx * half(w.d[t * TILE + o])) * (float)a[o] - (sx * half(w.m[t * TILE + o])) * (float)b[o]);
    }
    std::memcpy(out + r * N + tile * TILE, y, sizeof(y));
  }
}

template <Kind KD>
inline float float_weight(const void* w, int64_t i) {
  if constexpr (KD == Kind::F32) return static_cast<const float*>(w)[i];
  const uint16_t bits = static_cast<const uint16_t*>(w)[i];
  if constexpr (KD == Kind::F16) return half(bits);
  const uint32_t wide = (uint32_t)bits << 16;
  float v;
  std::memcpy(&v, &wide, 4);
  return v;
}

// x [R, width] float (not quantised) times a float weight: per lane, k in order, mul then add.
template <Kind KD>
void portable_float(const BlockWeight& w, const float* x, int64_t width, int64_t r0, int64_t nr, float* out, int64_t N,
                    int64_t tile) {
  const int64_t kf = w.groups;
  for (int64_t r = r0; r < r0 + nr; ++r) {
    float y[TILE] = {0};
    const float* xr = x + r * width;
    for (int64_t k = 0; k < kf; ++k) {
      const float xv = xr[k];
      for (int o = 0; o < TILE; ++o) y[o] = y[o] + xv * float_weight<KD>(w.w, (tile * kf + k) * TILE + o);
    }
    std::memcpy(out + r * N + tile * TILE, y, sizeof(y));
  }
}

// ---- SIMD paths -----------------------------------------------------------------------------

#if defined(KQ_VNNI)
// One group (or Q5_K sub-block) of 32 inputs x 16 outputs: v[k] holds inputs 4k .. 4k+3 of each
// output lane, unsigned (q8_0's signed bytes offset by 128: then c = 128).
template <Kind KD>
inline void unpack_group(const uint8_t* q, const uint8_t* h, __m512i (&v)[8]) {
  #pragma GCC unroll 8
  for (int l = 0; l < (KD == Kind::Q8_0 ? 8 : 4); ++l)
    _mm_prefetch((const char*)(q + l * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
  if constexpr (KD == Kind::Q8_0) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    #pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) v[k] = _mm512_xor_si512(_mm512_loadu_si512(q + k * 64), flip);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F), five = _mm512_set1_epi8(0x10);
    __m512i hb = _mm512_setzero_si512();
    if constexpr (has_plane(KD)) hb = _mm512_loadu_si512(h);
    #pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const __m512i raw = _mm512_loadu_si512(q + l * 64);
      v[2 * l] = _mm512_and_si512(raw, low);
      v[2 * l + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      if constexpr (has_plane(KD)) {  // bit l -> bit 4 (low nibbles), bit 4+l -> bit 4 (high ones)
        v[2 * l] = _mm512_ternarylogic_epi32(v[2 * l], _mm512_sll_epi16(hb, _mm_cvtsi32_si128(4 - l)), five, 0xF8);
        v[2 * l + 1] = _mm512_ternarylogic_epi32(v[2 * l + 1], _mm512_srl_epi16(hb, _mm_cvtsi32_si128(l)), five, 0xF8);
      }
    }
  }
}

inline __m512i dot_group(const __m512i (&v)[8], const int8_t* x) {
  __m512i dot = _mm512_setzero_si512();
  #pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    int32_t x4;
    std::memcpy(&x4, x + 4 * k, 4);
    dot = _mm512_dpbusd_epi32(dot, v[k], _mm512_set1_epi32(x4));
  }
  return dot;
}

template <Kind KD, int NR>
void rows_legacy(const BlockWeight& w, const Rows& rows, int64_t r0, float* out, int64_t N, int64_t tile) {
  constexpr int c = KD == Kind::Q8_0 ? 128 : legacy_offset(KD);
  const int64_t G = w.groups;
  __m512 y[NR];
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t blk = g / 8, j = g % 8, base = tile * G + g;
    __m512i v[8];
    unpack_group<KD>(w.qs + base * group_bytes(KD), has_plane(KD) ? w.qh + base * 64 : nullptr, v);
    const __m512 dv = half16(w.d + base * TILE);
    __m512 mv = _mm512_setzero_ps();
    if constexpr (has_min(KD)) mv = half16(w.m + base * TILE);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) {
      const int64_t slot = row_slot(rows, r0 + rr, blk);
      const int32_t S = group_sum(rows, slot, j);
      const __m512i a = _mm512_sub_epi32(dot_group(v, rows.xq + slot * QK + j * GROUP), _mm512_set1_epi32(c * S));
      const __m512 sx = _mm512_set1_ps(group_scale(rows, r0 + rr, g));
      __m512 step = _mm512_mul_ps(_mm512_mul_ps(sx, dv), _mm512_cvtepi32_ps(a));
      if constexpr (has_min(KD)) step = _mm512_add_ps(step, _mm512_mul_ps(_mm512_mul_ps(sx, mv), _mm512_set1_ps((float)S)));
      y[rr] = _mm512_add_ps(y[rr], step);
    }
  }
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) _mm512_storeu_ps(out + (r0 + rr) * N + tile * TILE, y[rr]);
}

template <int NR>
void rows_q5k(const BlockWeight& w, const Rows& rows, int64_t r0, float* out, int64_t N, int64_t tile) {
  const int64_t nb = rows.K / QK;
  __m512 y[NR];
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    int64_t slot[NR];
    __m512i a[NR];
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) slot[rr] = row_slot(rows, r0 + rr, blk), a[rr] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i v[8];
      unpack_group<Kind::Q5K>(w.qs + t * Q4K_BYTES + j * 256, w.qh + t * 512 + j * 64, v);
      const __m512i scv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w.sc + t * 128 + j * 16)));
      #pragma GCC unroll 8
      for (int rr = 0; rr < NR; ++rr)
        a[rr] = _mm512_add_epi32(a[rr], _mm512_mullo_epi32(dot_group(v, rows.xq + slot[rr] * QK + j * 32), scv));
    }
    __m512i mp[4];
    mins_pairs(w.mn + t * 128, mp);
    const __m512 dv = half16(w.d + t * TILE), dminv = half16(w.m + t * TILE);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) {
      const __m512i b = mins_q4k(mp, rows.p32 + slot[rr] * 4);
      const __m512 sx = _mm512_set1_ps(rows.sx[(r0 + rr) * nb + blk]);
      const __m512 step = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(sx, dv), _mm512_cvtepi32_ps(a[rr])),
                                        _mm512_mul_ps(_mm512_mul_ps(sx, dminv), _mm512_cvtepi32_ps(b)));
      y[rr] = _mm512_add_ps(y[rr], step);
    }
  }
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) _mm512_storeu_ps(out + (r0 + rr) * N + tile * TILE, y[rr]);
}

template <Kind KD>
inline __m512 float_lanes(const void* w, int64_t i) {
  if constexpr (KD == Kind::F32) return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  const __m256i bits = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(w) + i));
  if constexpr (KD == Kind::F16) return _mm512_cvtph_ps(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <Kind KD, int NR>
void rows_float(const BlockWeight& w, const float* x, int64_t width, int64_t r0, float* out, int64_t N, int64_t tile) {
  const int64_t kf = w.groups;
  __m512 y[NR];
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kf; ++k) {
    _mm_prefetch((const char*)w.w + ((tile * kf + k) * TILE) * (KD == Kind::F32 ? 4 : 2) + PREFETCH_AHEAD, _MM_HINT_T0);
    const __m512 wv = float_lanes<KD>(w.w, (tile * kf + k) * TILE);
    #pragma GCC unroll 8
    for (int rr = 0; rr < NR; ++rr) y[rr] = _mm512_add_ps(y[rr], _mm512_mul_ps(_mm512_set1_ps(x[(r0 + rr) * width + k]), wv));
  }
  #pragma GCC unroll 8
  for (int rr = 0; rr < NR; ++rr) _mm512_storeu_ps(out + (r0 + rr) * N + tile * TILE, y[rr]);
}

template <Kind KD>
void tile_legacy(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N, int64_t tile) {
  by_row_blocks<8>(nr, [&](auto block, int64_t r) { rows_legacy<KD, decltype(block)::value>(w, rows, r0 + r, out, N, tile); });
}

inline void tile_q5k(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N, int64_t tile) {
  by_row_blocks<8>(nr, [&](auto block, int64_t r) { rows_q5k<decltype(block)::value>(w, rows, r0 + r, out, N, tile); });
}

template <Kind KD>
void tile_float(const BlockWeight& w, const float* x, int64_t width, int64_t r0, int64_t nr, float* out, int64_t N,
                int64_t tile) {
  by_row_blocks<8>(nr, [&](auto block, int64_t r) { rows_float<KD, decltype(block)::value>(w, x, width, r0 + r, out, N, tile); });
}
#elif defined(KQ_AVX2)
// The AVX2 path: outputs 8h .. 8h+7 (byte offset 32h of each 64-byte vector), v[k] inputs 4k .. 4k+3.
template <Kind KD>
inline void unpack_group(const uint8_t* q, const uint8_t* h, __m256i (&v)[8]) {
  #pragma GCC unroll 8
  for (int l = 0; l < (KD == Kind::Q8_0 ? 8 : 4); ++l)
    _mm_prefetch((const char*)(q + l * 64 + PREFETCH_AHEAD), _MM_HINT_T0);
  if constexpr (KD == Kind::Q8_0) {
    #pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) v[k] = _mm256_loadu_si256((const __m256i*)(q + k * 64));  // signed
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F), five = _mm256_set1_epi8(0x10);
    __m256i hb = _mm256_setzero_si256();
    if constexpr (has_plane(KD)) hb = _mm256_loadu_si256((const __m256i*)h);
    #pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(q + l * 64));
      v[2 * l] = _mm256_and_si256(raw, low);
      v[2 * l + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      if constexpr (has_plane(KD)) {
        v[2 * l] = _mm256_or_si256(v[2 * l], _mm256_and_si256(_mm256_sll_epi16(hb, _mm_cvtsi32_si128(4 - l)), five));
        v[2 * l + 1] = _mm256_or_si256(v[2 * l + 1], _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(l)), five));
      }
    }
  }
}

// One row's dot products with an unpacked group, 8 int32 lanes: int16 sums stay under 2^15 (4-bit:
// 16 products of 15*127; 5-bit: two halves of 8 products of 31*127; q8_0: |q| x sign-moved x, one
// pair of 128*127 a lane, widened every time).
template <Kind KD>
inline __m256i dot_group(const __m256i (&v)[8], const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (KD == Kind::Q8_0) {
    __m256i dot = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int k = 0; k < 8; ++k)
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v[k]), _mm256_sign_epi8(bcast4(x + 4 * k), v[k])), ones));
    return dot;
  } else if constexpr (has_plane(KD)) {
    __m256i lo = _mm256_maddubs_epi16(v[0], bcast4(x)), hi = _mm256_maddubs_epi16(v[4], bcast4(x + 16));
    #pragma GCC unroll 3
    for (int k = 1; k < 4; ++k) {
      lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(v[k], bcast4(x + 4 * k)));
      hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(v[4 + k], bcast4(x + 16 + 4 * k)));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
  } else {
    __m256i acc = _mm256_maddubs_epi16(v[0], bcast4(x));
    #pragma GCC unroll 7
    for (int k = 1; k < 8; ++k) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(v[k], bcast4(x + 4 * k)));
    return _mm256_madd_epi16(acc, ones);
  }
}

template <Kind KD, int NR>
void rows_legacy(const BlockWeight& w, const Rows& rows, int64_t r0, float* out, int64_t N, int64_t tile, int h) {
  constexpr int c = legacy_offset(KD);
  const int64_t G = w.groups;
  __m256 y[NR];
  #pragma GCC unroll 4
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t blk = g / 8, j = g % 8, base = tile * G + g;
    __m256i v[8];
    unpack_group<KD>(w.qs + base * group_bytes(KD) + h * 32, has_plane(KD) ? w.qh + base * 64 + h * 32 : nullptr, v);
    const __m256 dv = half8(w.d + base * TILE + h * 8);
    #pragma GCC unroll 4
    for (int rr = 0; rr < NR; ++rr) {
      const int64_t slot = row_slot(rows, r0 + rr, blk);
      const int32_t S = group_sum(rows, slot, j);
      const __m256i a = _mm256_sub_epi32(dot_group<KD>(v, rows.xq + slot * QK + j * GROUP), _mm256_set1_epi32(c * S));
      const __m256 sx = _mm256_set1_ps(group_scale(rows, r0 + rr, g));
      __m256 step = _mm256_mul_ps(_mm256_mul_ps(sx, dv), _mm256_cvtepi32_ps(a));
      if constexpr (has_min(KD))
        step = _mm256_add_ps(step, _mm256_mul_ps(_mm256_mul_ps(sx, half8(w.m + base * TILE + h * 8)), _mm256_set1_ps((float)S)));
      y[rr] = _mm256_add_ps(y[rr], step);
    }
  }
  #pragma GCC unroll 4
  for (int rr = 0; rr < NR; ++rr) _mm256_storeu_ps(out + (r0 + rr) * N + tile * TILE + h * 8, y[rr]);
}

template <int NR>
void rows_q5k(const BlockWeight& w, const Rows& rows, int64_t r0, float* out, int64_t N, int64_t tile, int h) {
  const int64_t nb = rows.K / QK;
  __m256 y[NR];
  #pragma GCC unroll 4
  for (int rr = 0; rr < NR; ++rr) y[rr] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int64_t t = tile * nb + blk;
    int64_t slot[NR];
    __m256i a[NR];
    #pragma GCC unroll 4
    for (int rr = 0; rr < NR; ++rr) slot[rr] = row_slot(rows, r0 + rr, blk), a[rr] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i v[8];
      unpack_group<Kind::Q5K>(w.qs + t * Q4K_BYTES + j * 256 + h * 32, w.qh + t * 512 + j * 64 + h * 32, v);
      const __m256i scv = twice16(w.sc + t * 128 + j * 16 + h * 8);  // sc * (pair sums): exact in int32
      #pragma GCC unroll 4
      for (int rr = 0; rr < NR; ++rr) {
        const int8_t* x = rows.xq + slot[rr] * QK + j * 32;
        __m256i lo = _mm256_maddubs_epi16(v[0], bcast4(x)), hi = _mm256_maddubs_epi16(v[4], bcast4(x + 16));
        #pragma GCC unroll 3
        for (int k = 1; k < 4; ++k) {
          lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(v[k], bcast4(x + 4 * k)));
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(v[4 + k], bcast4(x + 16 + 4 * k)));
        }
        a[rr] = _mm256_add_epi32(a[rr], _mm256_add_epi32(_mm256_madd_epi16(lo, scv), _mm256_madd_epi16(hi, scv)));
      }
    }
    __m256i mp[4];
    mins_pairs(w.mn + t * 128 + h * 8, mp);
    const __m256 dv = half8(w.d + t * TILE + h * 8), dminv = half8(w.m + t * TILE + h * 8);
    #pragma GCC unroll 4
    for (int rr = 0; rr < NR; ++rr) {
      const __m256i b = mins_q4k(mp, rows.p32 + slot[rr] * 4);
      const __m256 sx = _mm256_set1_ps(rows.sx[(r0 + rr) * nb + blk]);
      const __m256 step = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(sx, dv), _mm256_cvtepi32_ps(a[rr])),
                                        _mm256_mul_ps(_mm256_mul_ps(sx, dminv), _mm256_cvtepi32_ps(b)));
      y[rr] = _mm256_add_ps(y[rr], step);
    }
  }
  #pragma GCC unroll 4
  for (int rr = 0; rr < NR; ++rr) _mm256_storeu_ps(out + (r0 + rr) * N + tile * TILE + h * 8, y[rr]);
}

template <Kind KD>
inline __m256 float_lanes(const void* w, int64_t i) {
  if constexpr (KD == Kind::F32) return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  const __m128i bits = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(w) + i));
  if constexpr (KD == Kind::F16) return _mm256_cvtph_ps(bits);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Both halves of a tile at once: NR rows x 2 accumulators.
template <Kind KD, int NR>
void rows_float(const BlockWeight& w, const float* x, int64_t width, int64_t r0, float* out, int64_t N, int64_t tile) {
  const int64_t kf = w.groups;
  __m256 y[NR][2];
  #pragma GCC unroll 4
  for (int rr = 0; rr < NR; ++rr) y[rr][0] = y[rr][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kf; ++k) {
    const int64_t i = (tile * kf + k) * TILE;
    _mm_prefetch((const char*)w.w + i * (KD == Kind::F32 ? 4 : 2) + PREFETCH_AHEAD, _MM_HINT_T0);
    const __m256 w0 = float_lanes<KD>(w.w, i), w1 = float_lanes<KD>(w.w, i + 8);
    #pragma GCC unroll 4
    for (int rr = 0; rr < NR; ++rr) {
      const __m256 xv = _mm256_set1_ps(x[(r0 + rr) * width + k]);
      y[rr][0] = _mm256_add_ps(y[rr][0], _mm256_mul_ps(xv, w0));
      y[rr][1] = _mm256_add_ps(y[rr][1], _mm256_mul_ps(xv, w1));
    }
  }
  #pragma GCC unroll 4
  for (int rr = 0; rr < NR; ++rr) {
    _mm256_storeu_ps(out + (r0 + rr) * N + tile * TILE, y[rr][0]);
    _mm256_storeu_ps(out + (r0 + rr) * N + tile * TILE + 8, y[rr][1]);
  }
}

template <Kind KD>
void tile_legacy(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N, int64_t tile) {
  for (int h = 0; h < 2; ++h)
    by_row_blocks<4>(nr, [&](auto block, int64_t r) { rows_legacy<KD, decltype(block)::value>(w, rows, r0 + r, out, N, tile, h); });
}

inline void tile_q5k(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N, int64_t tile) {
  for (int h = 0; h < 2; ++h)
    by_row_blocks<4>(nr, [&](auto block, int64_t r) { rows_q5k<decltype(block)::value>(w, rows, r0 + r, out, N, tile, h); });
}

template <Kind KD>
void tile_float(const BlockWeight& w, const float* x, int64_t width, int64_t r0, int64_t nr, float* out, int64_t N,
                int64_t tile) {
  by_row_blocks<4>(nr, [&](auto block, int64_t r) { rows_float<KD, decltype(block)::value>(w, x, width, r0 + r, out, N, tile); });
}
#else
template <Kind KD>
void tile_legacy(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N, int64_t tile) {
  portable_legacy<KD>(w, rows, r0, nr, out, N, tile);
}

inline void tile_q5k(const BlockWeight& w, const Rows& rows, int64_t r0, int64_t nr, float* out, int64_t N, int64_t tile) {
  portable_kaffine<Kind::Q5K>(w, rows, r0, nr, out, N, tile);
}

template <Kind KD>
void tile_float(const BlockWeight& w, const float* x, int64_t width, int64_t r0, int64_t nr, float* out, int64_t N,
                int64_t tile) {
  portable_float<KD>(w, x, width, r0, nr, out, N, tile);
}
#endif

// One tile of 16 outputs of a kind served here, rows r0 .. r0+nr-1 (x, width: the float rows, for
// the float kinds; rows: their quantised form, for the others).
inline void tile_blocks(const BlockWeight& w, const Rows& rows, const float* x, int64_t width, int64_t r0, int64_t nr,
                        float* out, int64_t N, int64_t tile) {
  switch (w.kind) {
    case Kind::Q8_0: return tile_legacy<Kind::Q8_0>(w, rows, r0, nr, out, N, tile);
    case Kind::Q4_0: return tile_legacy<Kind::Q4_0>(w, rows, r0, nr, out, N, tile);
    case Kind::Q4_1: return tile_legacy<Kind::Q4_1>(w, rows, r0, nr, out, N, tile);
    case Kind::Q5_0: return tile_legacy<Kind::Q5_0>(w, rows, r0, nr, out, N, tile);
    case Kind::Q5_1: return tile_legacy<Kind::Q5_1>(w, rows, r0, nr, out, N, tile);
    case Kind::Q5K: return tile_q5k(w, rows, r0, nr, out, N, tile);
    case Kind::Q2K: return portable_kaffine<Kind::Q2K>(w, rows, r0, nr, out, N, tile);
    case Kind::F32: return tile_float<Kind::F32>(w, x, width, r0, nr, out, N, tile);
    case Kind::F16: return tile_float<Kind::F16>(w, x, width, r0, nr, out, N, tile);
    case Kind::BF16: return tile_float<Kind::BF16>(w, x, width, r0, nr, out, N, tile);
    default: TORCH_CHECK(false, "not a block kind");
  }
}
