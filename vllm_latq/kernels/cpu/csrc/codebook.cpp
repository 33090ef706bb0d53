// A codebook layer (method e8, vllm_latq/format/codebook.py) on the CPU straight from its codes:
// y = x · Wᵀ (+ bias), W's 8-column blocks decoded as the rows are read, never stored. A block's
// point is Σ stages: E8P (16 bits: byte 0 the pattern, byte 1 seven signs and the ±¼ shift), the
// 3-bit ball's point / 2, or a second E8P / 4; times its group's scale.
//
// The decode is tables addressed by the code's bytes as they are (kernels/cpu/codebook.py,
// decode_table): the scalar path reads its fp32 rows (the pattern row, byte 0 · 32, its parity folded
// into lane 7's sign; byte 1 · 64: the sign mask of its seven signs, lane 7 by their parity, and the
// shift; the ball row, byte 2 · 32, pre-halved); the row path (row_tables) makes a block's 8 lanes in
// the bytes of one 64-bit word; the 64-row tiles look the bytes up across rows. No branch.
//
// Scales are read as the checkpoint stores them: fp16 [N, G], or coded (format/scale_codes.py)
// as int32 words [ceil(N/16), G, 3] — per 16 rows and group, fp16 min | fp16 step << 16 and 16
// 4-bit codes — decoded a band of 16 rows at a time to fp16(min + code·step), the format's one
// rounding. Point × scale is exact in fp32 (a point ≤ 7 significant bits, a scale 11), so the
// result is the reference's up to fp32 summation order.
//
// Small M: per output row, each block decoded once into 8 fp32 lanes, scaled and FMA'd into up to
// 8 rows of x (AVX2 + FMA + F16C: two FMA chains a row up to 4 rows, one from 5; AVX-512VL's 32
// registers: two); on AVX-512 VBMI + GFNI, 64-row tiles decoded across rows (below): bf16 x's dots in
// bf16 where the CPU has them (AVX-512 BF16), else any x's in fp32. Large M (≥ set_codebook_large_m):
// tiles of rows decoded to fp32, then one GEMM per tile.
//
//   latq_cpu::codebook_linear(x [..., K] bf16/fp16/fp32, tensors = (codes uint8 [N, K/8, B],
//       scales fp16 [N, G] or int32 [ceil(N/16), G, 3], table fp32 [1024, 8][, signs fp32 [K]]),
//       ints = (bits, group_size, in_features), bias?, out_features)   the schema of
//       latq::cpu_e8_linear; a 4th tensor, a rotated layer's signs, rotates x first (hadamard.cpp)
//   latq_cpu::codebook_isa() / set_codebook_isa(name)   which path runs ("avx512", "avx2", "")
//   latq_cpu::set_codebook_large_m(m) / codebook_large_m()   rows from which tiles + GEMM run (0: each path's)
//   latq_cpu::codebook_bf16_dots() / set_codebook_bf16_dots(on)   whether bf16 x's dots run in bf16

#include "codebook.h"

namespace latq_cb {

inline float half_bits(uint32_t h) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(h & 0xFFFF), c10::Half::from_bits()));
}

// the scales of band t (rows 16t..16t+15) into s [G][16] fp32, even rows first (row r at
// (r % 2)·8 + r / 2, as the codes' nibbles pair them): fp16(min + code·step), the format's
// decode_scales (code·step is exact in fp32, so an FMA rounds as its mul + add)
void band_scales_scalar(const Layer& L, int64_t t, float* s) {
  for (int64_t g = 0; g < L.G; ++g) {
    const int32_t* w = L.coded + (t * L.G + g) * 3;
    const float mn = half_bits(static_cast<uint32_t>(w[0])), st = half_bits(static_cast<uint32_t>(w[0]) >> 16);
    const uint8_t* c = reinterpret_cast<const uint8_t*>(w + 1);
    for (int j = 0; j < kBand / 2; ++j) {
      s[g * kBand + j] = static_cast<float>(c10::Half(mn + static_cast<float>(c[j] & 15) * st));
      s[g * kBand + 8 + j] = static_cast<float>(c10::Half(mn + static_cast<float>(c[j] >> 4) * st));
    }
  }
}

#if LATQ_CB_X86
__attribute__((target("avx2,fma,f16c"))) void band_scales_avx2(const Layer& L, int64_t t, float* s) {
  constexpr int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int32_t* w = L.coded + t * L.G * 3;
  for (int64_t g = 0; g < L.G; ++g, w += 3) {
    const __m256 mn = _mm256_set1_ps(_cvtsh_ss(static_cast<uint16_t>(w[0] & 0xFFFF)));
    const __m256 st = _mm256_set1_ps(_cvtsh_ss(static_cast<uint16_t>(static_cast<uint32_t>(w[0]) >> 16)));
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 1)));
    const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15))), st, mn);
    const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), st, mn);
    _mm256_storeu_ps(s + g * kBand, _mm256_cvtph_ps(_mm256_cvtps_ph(lo, rne)));
    _mm256_storeu_ps(s + g * kBand + 8, _mm256_cvtph_ps(_mm256_cvtps_ph(hi, rne)));
  }
}
#endif

#if LATQ_CB_AVX512
// the same, a group's 16 scales in one register: codes c[j] & 15 then c[j] >> 4 (its bytes twice, shifted 0 or 4)
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void band_scales_avx512(const Layer& L, int64_t t,
                                                                                           float* s) {
  constexpr int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0), lo4 = _mm512_set1_epi32(15);
  const int32_t* w = L.coded + t * L.G * 3;
  for (int64_t g = 0; g < L.G; ++g, w += 3) {
    const __m512 mn = _mm512_set1_ps(_cvtsh_ss(static_cast<uint16_t>(w[0] & 0xFFFF)));
    const __m512 st = _mm512_set1_ps(_cvtsh_ss(static_cast<uint16_t>(static_cast<uint32_t>(w[0]) >> 16)));
    const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 1));
    const __m512i c = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(c8, c8)), shift), lo4);
    _mm512_storeu_ps(s + g * kBand, _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_fmadd_ps(_mm512_cvtepi32_ps(c), st, mn), rne)));
  }
}
#endif

// fp16 scales of band t in the same order (the tiles' path reads every layer's scales by bands)
void band_scales_fp16(const Layer& L, int64_t t, float* s) {
  for (int j = 0; j < kBand; ++j) {
    const at::Half* h = L.scales + (t * kBand + j) * L.G;
    for (int64_t g = 0; g < L.G; ++g) s[g * kBand + (j % 2) * 8 + j / 2] = static_cast<float>(h[g]);
  }
}

void band_scales(const Layer& L, int64_t t, float* s, int isa) {
  if (!L.coded) return band_scales_fp16(L, t, s);
#if LATQ_CB_AVX512
  if (isa == 2) return band_scales_avx512(L, t, s);
#endif
#if LATQ_CB_X86
  if (isa >= 1) return band_scales_avx2(L, t, s);
#endif
  band_scales_scalar(L, t, s);
}

// a row's scale reader: fp16 scales of the row, or its column of the band's decoded [G][16]
struct RowScales {
  const at::Half* h;   // or null:
  const float* f;      // stride kBand
  float operator()(int64_t g) const { return h ? static_cast<float>(h[g]) : f[g * kBand]; }
};

inline RowScales row_scales(const Layer& L, int64_t n, const float* band) {
  return L.coded ? RowScales{nullptr, band + (n % 2) * 8 + n % kBand / 2} : RowScales{L.scales + n * L.G, nullptr};
}

// ------------------------------------------------------------------ scalar: the definition's steps

inline const float* row(const Layer& L, int64_t off) { return reinterpret_cast<const float*>(L.table + off); }

inline void e8p_scalar(const Layer& L, uint32_t p, uint32_t s, float gain, float* v) {
  const float *a = row(L, p << 5), *m = row(L, kSignOff + (s << 6));
  for (int j = 0; j < 8; ++j) v[j] += (std::signbit(m[j]) ? -a[j] : a[j]) * gain + m[8 + j] * gain;
}

template <int BITS>
inline void block_scalar(const Layer& L, const uint8_t* c, float* v) {
  const int64_t T = L.T;
  for (int j = 0; j < 8; ++j) v[j] = 0.f;
  e8p_scalar(L, c[0], c[T], 1.f, v);
  if constexpr (BITS == 3) {
    const float* p = row(L, kBallOff + (c[2 * T] << 5));
    for (int j = 0; j < 8; ++j) v[j] += p[j];
  } else if constexpr (BITS == 4) {
    e8p_scalar(L, c[2 * T], c[3 * T], 0.25f, v);
  }
}

template <int BITS>
void decode_rows_scalar(const Layer& L, int64_t n0, int64_t n1, const float* band, float* w) {
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sc = row_scales(L, n, band);
    for (int64_t b = 0; b < L.nb; ++b) {
      const float s = sc(b / L.bpg);
      float* o = w + (n - n0) * L.K + b * 8;
      block_scalar<BITS>(L, L.block(n, b), o);
      for (int j = 0; j < 8; ++j) o[j] *= s;
    }
  }
}

template <int BITS>
void rows_scalar(const Layer& L, const float* x, int64_t M, int64_t n0, int64_t n1, const float* band, float* y) {
  float v[8];
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sc = row_scales(L, n, band);
    float acc[kMaxRows] = {};
    for (int64_t b = 0; b < L.nb; ++b) {
      const float s = sc(b / L.bpg);
      block_scalar<BITS>(L, L.block(n, b), v);
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < 8; ++j) acc[m] += x[m * L.K + b * 8 + j] * (v[j] * s);
    }
    for (int64_t m = 0; m < M; ++m) y[m * L.N + n] = acc[m];
  }
}

#if LATQ_CB_X86
// ------------------------------------------------------------------ AVX2 + FMA + F16C: a block a register

#define LATQ_CB_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

// The row path's byte tables (from decode_table, once a process): a block's point times 4 (16 at 4 bits)
// is an integer of at most 8 bits, made lane by lane in the bytes of one 64-bit word by scalar loads, an
// XOR and adds — no vector op — then widened to 8 fp32 lanes: p4 = the pattern's 4u_j, u_j = a_j + 7/2 (its
// parity in lane 7's sign), s4 = a sign byte's 28 on each flipped lane (4u xor 28 = 4(7 − u): a negation)
// | 2 where its shift is +¼, so p4 ^ s4 = 4(point + 15/4); bb = 4·ball/2 + 113.
struct RowTables {
  uint64_t p4[256], s4[256], bb[256];
};

const RowTables& row_tables(const char* table) {
  static RowTables rt;
  static std::atomic<const void*> made{nullptr};   // read without the lock: every band of every call asks
  static std::mutex mu;
  if (made.load(std::memory_order_acquire) == table) return rt;
  std::lock_guard<std::mutex> lock(mu);
  if (made.load(std::memory_order_relaxed) == table) return rt;
  const float* T = reinterpret_cast<const float*>(table);
  const float* S = reinterpret_cast<const float*>(table + kSignOff);
  auto byte = [](float v, int at) {
    TORCH_CHECK(v >= 0.f && v < 256.f && v == std::nearbyint(v), "latq_cpu: the decode table is not E8's");
    return static_cast<uint64_t>(v) << (8 * at);
  };
  for (int i = 0; i < 256; ++i) {
    rt.p4[i] = rt.s4[i] = rt.bb[i] = 0;
    for (int j = 0; j < 8; ++j) {
      rt.p4[i] |= byte(4.f * T[i * 8 + j] + 14.f, j);
      rt.s4[i] |= byte((std::signbit(S[2 * i * 8 + j]) ? 28.f : 0.f) + (S[(2 * i + 1) * 8 + j] > 0.f ? 2.f : 0.f), j);
      rt.bb[i] |= byte(4.f * T[(256 + i) * 8 + j] + 113.f, j);
    }
  }
  made.store(table, std::memory_order_release);
  return rt;
}

// a block's point × 4 (16 at 4 bits) + 128 in 8 fp32 lanes, from its code bytes c[0], c[st], … (st: the
// layout's rows a tile). Each byte stays in [53, 203], so no sum carries into the next.
template <int BITS>
LATQ_CB_INLINE __m256 block_avx2(const RowTables& R, const uint8_t* c, int64_t st) {
  constexpr uint64_t ones = 0x0101010101010101ull;
  uint64_t v = R.p4[c[0]] ^ R.s4[c[st]];                          // 4·point + 15
  if constexpr (BITS == 2) v += 113 * ones;
  if constexpr (BITS == 3) v += R.bb[c[2 * st]];                  // + 4·ball/2 − 15 + 128
  if constexpr (BITS == 4) v = (v << 2) + (R.p4[c[2 * st]] ^ R.s4[c[3 * st]]) + 53 * ones;   // 16·(point + ¼ point₂) + 128
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(v))));
}

// block_avx2's lanes times a scale s over their gain, exactly: (lanes − 128)·s in one FMA (s128 = 128·s)
LATQ_CB_INLINE __m256 scaled(__m256 lanes, __m256 s, __m256 s128) { return _mm256_fmsub_ps(lanes, s, s128); }

LATQ_CB_INLINE __m256 times128(__m256 s) { return _mm256_mul_ps(s, _mm256_set1_ps(128.f)); }

// what a decoded block's lanes are times the point (block_avx2's, and the tiles' fp32 dots')
template <int BITS>
constexpr float kBlockGain = BITS == 4 ? 16.f : 4.f;

LATQ_CB_INLINE float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// a row's group scales over block_avx2's gain q, broadcast: fp16 [G], or its column of a band's decoded [G][16]
struct HalfScales {
  const uint16_t* h;
  float q;
  LATQ_CB_INLINE __m256 operator()(int64_t g) const { return _mm256_set1_ps(_cvtsh_ss(h[g]) * q); }
};
struct BandScales {
  const float* f;
  float q;
  LATQ_CB_INLINE __m256 operator()(int64_t g) const { return _mm256_set1_ps(f[g * kBand] * q); }
};

LATQ_CB_INLINE __m256 scale_at(const RowScales& sc, int64_t g, float q) {
  return sc.h ? HalfScales{reinterpret_cast<const uint16_t*>(sc.h), q}(g) : BandScales{sc.f, q}(g);
}

// blocks b and b + 1 of a row (codes c) times s into MR rows of x's two accumulators
template <int BITS, int MR>
LATQ_CB_INLINE void pair_avx2(const Layer& L, const RowTables& R, const uint8_t* c, int64_t st, const float* x,
                              int64_t b, __m256 s, __m256* a0, __m256* a1) {
  const __m256 s128 = times128(s);
  const __m256 w0 = scaled(block_avx2<BITS>(R, c, st), s, s128);
  const __m256 w1 = scaled(block_avx2<BITS>(R, c + L.B * st, st), s, s128);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * L.K + b * 8), a0[m]);
    a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * L.K + b * 8 + 8), a1[m]);
  }
}

// one row's blocks into a0, a1; scale(g): group g's scale over the blocks' gain, broadcast
template <int BITS, int MR, class Scale>
LATQ_CB_INLINE void row_blocks(const Layer& L, const RowTables& R, const uint8_t* c, const float* x, Scale scale,
                               __m256* a0, __m256* a1) {
  const int64_t st = L.T, bs = L.B * L.T;   // a code's byte stride, a block's
  if (L.bpg == 2 && L.nb % 2 == 0) {          // a pair a group (16 columns): the study's E8 point
    for (int64_t b = 0; b < L.nb; b += 2) pair_avx2<BITS, MR>(L, R, c + b * bs, st, x, b, scale(b / 2), a0, a1);
    return;
  }
  if (L.bpg % 2 == 0 && L.nb % 2 == 0) {
    __m256 s = scale(0);
    for (int64_t b = 0, left = L.bpg, gi = 0; b < L.nb; b += 2) {
      pair_avx2<BITS, MR>(L, R, c + b * bs, st, x, b, s, a0, a1);
      if ((left -= 2) == 0 && b + 2 < L.nb) left = L.bpg, s = scale(++gi);
    }
    return;
  }
  for (int64_t b0 = 0, gi = 0; b0 < L.nb; b0 += L.bpg, ++gi) {
    const __m256 s = scale(gi);
    const int64_t b1 = std::min(L.nb, b0 + L.bpg);
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) pair_avx2<BITS, MR>(L, R, c + b * bs, st, x, b, s, a0, a1);
    if (b < b1) {
      const __m256 w0 = scaled(block_avx2<BITS>(R, c + b * bs, st), s, times128(s));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * L.K + b * 8), a0[m]);
    }
  }
}

// rows [n0, n1) for MR rows of x: each block decoded once and scaled (exact), then FMA'd into MR
// rows; blocks go in pairs, one to each of two accumulators a row, so two FMA chains are in flight.
// Where a group and the row hold even numbers of blocks (groups of a multiple of 16 columns) the pairs
// run as one loop — at 16 columns a pair is a group, its scale read with it; else the scale is re-read
// where a group ends — from a reader chosen once a row: a loop a group cost as much as the two blocks'
// decode at 16 columns.
template <int BITS, int MR>
LATQ_CB_INLINE void rows_body(const Layer& L, const float* x, int64_t n0, int64_t n1, const float* band, float* y) {
  // AVX2's 16 registers hold two sums a row up to 4 rows; from 5, one (its two FMAs a pair in a chain,
  // 8 rows' chains enough to fill the FMA units)
  constexpr bool two = MR <= 4;
  const RowTables& R = row_tables(L.table);
  constexpr float q = 1.f / kBlockGain<BITS>;
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sc = row_scales(L, n, band);
    const uint8_t* c = L.block(n, 0);
    __m256 a0[MR], a1[two ? MR : 1];
    for (int m = 0; m < MR; ++m) a0[m] = _mm256_setzero_ps();
    for (int m = 0; m < (two ? MR : 1); ++m) a1[m] = _mm256_setzero_ps();
    __m256* second = two ? a1 : a0;
    if (sc.h)
      row_blocks<BITS, MR>(L, R, c, x, HalfScales{reinterpret_cast<const uint16_t*>(sc.h), q}, a0, second);
    else
      row_blocks<BITS, MR>(L, R, c, x, BandScales{sc.f, q}, a0, second);
    for (int m = 0; m < MR; ++m) y[m * L.N + n] = hsum_avx2(two ? _mm256_add_ps(a0[m], a1[m]) : a0[m]);
  }
}

template <int BITS, int MR>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Layer& L, const float* x, int64_t n0, int64_t n1,
                                                         const float* band, float* y) {
  rows_body<BITS, MR>(L, x, n0, n1, band, y);
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void decode_rows_avx2(const Layer& L, int64_t n0, int64_t n1, const float* band,
                                                                float* w) {
  const RowTables& R = row_tables(L.table);
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sc = row_scales(L, n, band);
    for (int64_t b = 0; b < L.nb; ++b) {
      const __m256 s = scale_at(sc, b / L.bpg, 1.f / kBlockGain<BITS>);
      _mm256_storeu_ps(w + (n - n0) * L.K + b * 8, scaled(block_avx2<BITS>(R, L.block(n, b), L.T), s, times128(s)));
    }
  }
}
#endif

#if LATQ_CB_BYTES
// ------------------------------------------------------------------ AVX-512 VBMI + GFNI (+ BF16): 64-row tiles
//
// A tile's block is 64 rows' code bytes as planes (pattern, signs[, ball | pattern, signs]), and the
// decode runs across rows, 64 a register: the pattern plane indexes four 256-entry tables (two
// vpermi2b and a blend each), giving each lane's |a| − ½ (k) two lanes a byte; a lane's index
// k | σ << 2 | h << 3 (its sign from the sign plane, lane 7's by the two parities, h the shift; both
// lanes' bits by one GF(2) affine map of the sign byte, e8p_planes) is
// what an E8P stage alone needs; the 3-bit ball's stage looks it up as q = 4w + 15 (vpermb) and adds
// 2·ball (0 ≤ q ≤ 30). Then per pair of lanes and pair of 16-row quarters one vpermi2b interleaves the
// two lanes' planes into words (one quarter's byte low, the other's high) and two vpermw turn them into
// bf16 (every point is exact in bf16); one vdpbf16ps multiplies 16 rows' pair with x's bf16 pair
// (exact products, fp32 sums). Without BF16 dots (or for x not bf16) x is taken in fp32: each lane's q
// bytes, spread to fp32 words by one vpermb a quarter, less their offset, FMA'd with x_j (at 4 bits the two
// stages' q bytes summed first, one FMA a weight). A group's sums are scaled once, 16 rows a
// register. Accumulator lane i holds row rowof(i) of its 16 (even rows, then odd: the coded scales' band order).

inline uint16_t bf16_bits(float f) {   // exact here: the values have ≤ 7 significant bits
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

const TileTables& tile_tables(const float* T) {
  static TileTables tt;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (tt.from == T) return tt;
  for (int p = 0; p < 256; ++p) {
    const float* a = T + p * 8;
    const float* ball = T + (256 + p) * 8;   // ball / 2
    for (int j = 0; j < 4; ++j) {
      const int k0 = static_cast<int>(std::fabs(a[2 * j]) - 0.5f), k1 = static_cast<int>(std::fabs(a[2 * j + 1]) - 0.5f);
      tt.kp[j][p] = static_cast<uint8_t>(k0 | (k1 << 4) | (j == 3 && std::signbit(a[7]) ? 64 : 0));
      tt.bp[j][p] = static_cast<uint8_t>(static_cast<int>(4 * ball[2 * j] + 4) | (static_cast<int>(4 * ball[2 * j + 1] + 4) << 4));
    }
  }
  for (int i = 0; i < 64; ++i) {
    const int k = i & 3, neg = (i >> 2) & 1, minus = (i >> 3) & 1;
    const int q4 = (neg ? -1 : 1) * (2 + 4 * k) + (minus ? -1 : 1);   // 4·(σ(½ + k) ± ¼)
    tt.e15[i] = static_cast<uint8_t>(k == 3 ? 15 : q4 + 15);
    tt.e11[i] = static_cast<uint8_t>(k == 3 ? 11 : q4 + 11);
    tt.e60[i] = static_cast<uint8_t>(4 * tt.e15[i]);
  }
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 64; ++i) tt.spread[r][i] = static_cast<uint8_t>(16 * r + rowof(i / 4));
  for (int q = 0; q < 32; ++q) {
    tt.val[0][q] = bf16_bits((q - 15) / 4.f);
    tt.val[1][q] = bf16_bits((q - 15) / 16.f);
    tt.raw[0][q] = bf16_bits((tt.e15[q] - 15) / 4.f);
    tt.raw[1][q] = bf16_bits((tt.e15[q] - 15) / 16.f);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 16; ++i) {
      const int row = 32 * h + rowof(i);
      tt.sel[h][4 * i] = static_cast<uint8_t>(row);
      tt.sel[h][4 * i + 1] = static_cast<uint8_t>(row + 16);
      tt.sel[h][4 * i + 2] = static_cast<uint8_t>(64 + row);
      tt.sel[h][4 * i + 3] = static_cast<uint8_t>(64 + row + 16);
    }
  tt.from = T;
  return tt;
}

// one E8P stage of 64 rows (planes P, S) → each lane's q plane (bytes: E[index]), or with E null its index
// plane itself (bits 0–3; bits 4–7 not cleared), for tables that take the index (raw): lane pair j's
// indices are kp[j] XOR its sign bits, the even lane's in bits 0–3, the odd lane's in 4–7
LATQ_CB_BYTES_TARGET inline void e8p_planes(const TileTables& tt, __m512i P, __m512i S, const uint8_t* E, __m512i q[8]) {
  const __mmask64 hi = _mm512_movepi8_mask(P);
  const __m512i e = E ? _mm512_load_si512(E) : _mm512_setzero_si512();
  const auto lookup = [&](__m512i idx) { return E ? _mm512_permutexvar_epi8(idx, e) : idx; };
  for (int j = 0; j < 4; ++j) {
    const __m512i idx = _mm512_xor_si512(lookup256(tt.kp[j], P, hi),
                                         _mm512_gf2p8affine_epi64_epi8(S, _mm512_set1_epi64(sign_bits(j)), 0));
    q[2 * j] = lookup(idx);
    q[2 * j + 1] = lookup(_mm512_srli_epi16(idx, 4));
  }
}

// the q planes of a block's E8P stage at p (and for 3 bits its ball's 2·ball added)
// (3 bits: q planes for val; an E8P stage alone: index planes for raw)
template <int BITS>
LATQ_CB_BYTES_TARGET inline void block_planes(const TileTables& tt, const uint8_t* p, __m512i q[8]) {
  e8p_planes(tt, _mm512_loadu_si512(p), _mm512_loadu_si512(p + kTile), BITS == 3 ? tt.e11 : nullptr, q);
  if constexpr (BITS == 3) {
    const __m512i bl = _mm512_loadu_si512(p + 2 * kTile), lo4 = _mm512_set1_epi8(15);
    const __mmask64 hi = _mm512_movepi8_mask(bl);
    for (int j = 0; j < 4; ++j) {
      const __m512i bp = lookup256(tt.bp[j], bl, hi);
      q[2 * j] = _mm512_add_epi8(q[2 * j], _mm512_and_si512(bp, lo4));
      q[2 * j + 1] = _mm512_add_epi8(q[2 * j + 1], _mm512_gf2p8affine_epi64_epi8(bp, _mm512_set1_epi64(kHighNibble), 0));
    }
  }
}

constexpr int kRowsInRegisters = 4;        // rows of x whose sums the tiles' one-pass loops keep in registers
constexpr int kChunk = 8;                  // blocks a chunk whose weights are made once for every row of x
struct alignas(64) Zmm { float f[16]; };   // a register's worth of scratch (a vector of __m512 loses its alignment)

// The fp32 dots: a block's q planes hold the point × gain + offset — × 4 + 15 at 2 and 3 bits, × 16 + 75
// at 4 (the two stages' bytes added: 4·(4p₁ + 15) + 4p₂ + 15 ≤ 150) — and each lane's 16 rows a quarter go to
// the low byte of fp32 words 2^23 + q (merged into a register of the exponent's constant), less 2^23 + offset:
// exactly the point × gain (kBlockGain, the row path's), so each product is x's own; the gain is undone as y
// is stored
template <int BITS> constexpr float kF32Offset = BITS == 4 ? 75.f : 15.f;

template <int BITS>
LATQ_CB_BYTES_TARGET inline void q_planes_f32(const TileTables& tt, const uint8_t* p, __m512i q[8]) {
  if constexpr (BITS == 3) {
    block_planes<3>(tt, p, q);
  } else {
    e8p_planes(tt, _mm512_loadu_si512(p), _mm512_loadu_si512(p + kTile), BITS == 4 ? tt.e60 : tt.e15, q);
    if constexpr (BITS == 4) {
      __m512i q2[8];
      e8p_planes(tt, _mm512_loadu_si512(p + 2 * kTile), _mm512_loadu_si512(p + 3 * kTile), tt.e15, q2);
      for (int j = 0; j < 8; ++j) q[j] = _mm512_add_epi8(q[j], q2[j]);
    }
  }
}

// quarter r of a lane's q plane as fp32 point × gain (16 rows, rowof order)
template <int BITS>
LATQ_CB_BYTES_TARGET inline __m512 f32_weights(const TileTables& tt, __m512i q, int r) {
  const __m512i v = _mm512_mask_permutexvar_epi8(_mm512_set1_epi32(0x4B000000), 0x1111111111111111ull,
                                                 _mm512_load_si512(tt.spread[r]), q);
  return _mm512_sub_ps(_mm512_castsi512_ps(v), _mm512_set1_ps(8388608.f + kF32Offset<BITS>));
}

// a group's end for MR rows of x's sums p (quarter r of row i): scaled into acc after its last chunk,
// else kept in part for the next
template <int MR>
LATQ_CB_BYTES_TARGET inline void group_end(__m512 (&p)[MR][4], bool last, const float* scale, int64_t G, __m512* part,
                                           __m512* acc) {
  for (int r = 0; r < 4; ++r) {
    const __m512 s = last ? _mm512_loadu_ps(scale + r * G * kBand) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      if (last) acc[4 * i + r] = _mm512_fmadd_ps(p[i][r], s, acc[4 * i + r]);
      else part[4 * i + r] = p[i][r];
    }
  }
}

// y's tile t for M rows from acc (lane i of quarter r: row rowof(i)), times `times`
LATQ_CB_BYTES_TARGET inline void store_tile(const __m512* acc, int64_t M, int64_t N, int64_t t, float times, float* y) {
  const __m512i natural = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r)
      _mm512_storeu_ps(y + m * N + t * kTile + r * kBand,
                       _mm512_mul_ps(_mm512_permutexvar_ps(natural, acc[4 * m + r]), _mm512_set1_ps(times)));
}

// The one-pass loop of the tiles' paths for MR ≤ kRowsInRegisters rows of x, every sum in registers: each
// block of tile t (its code bytes at p, its columns from 8b) handed to Dots::block to add into part, a group's
// sums scaled into the totals as it ends, y stored over Dots' gain. With the bf16 dots built, so is this loop.
#if LATQ_CB_TILES
#define LATQ_CB_PASS_TARGET LATQ_CB_TILE_TARGET
#else
#define LATQ_CB_PASS_TARGET LATQ_CB_BYTES_TARGET
#endif
template <int BITS, int MR, class Dots>
LATQ_CB_PASS_TARGET inline void tile_pass(const Layer& L, const TileTables& tt0, const typename Dots::X* x, int64_t t,
                                          const float* band, float* y) {
  __m512 acc[4 * MR];
  for (int i = 0; i < 4 * MR; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* c = L.codes + t * L.nb * L.B * kTile;
  for (int64_t b0 = 0, gi = 0; b0 < L.nb; b0 += L.bpg, ++gi) {
    __m512 part[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < 4; ++r) part[i][r] = _mm512_setzero_ps();
    for (int64_t b = b0; b < std::min(L.nb, b0 + L.bpg); ++b) {
      const uint8_t* p = c + b * L.B * kTile;
      prefetch_codes(p, L.B);
      Dots::template block<BITS, MR>(from_l1(tt0), p, x + b * 8, L.K, part);
    }
    group_end<MR>(part, true, band + gi * kBand, L.G, nullptr, acc);
  }
  store_tile(acc, MR, L.N, t, 1.f / Dots::template gain<BITS>(), y);
}

// The loop of the tiles' paths for more rows of x than registers hold: a chunk's blocks (up to kChunk of a
// scale group) made once into L1 by Dots::make, Dots::words() registers' worth a block, then every row of x
// takes its dots from there (Dots::dots, 4 rows a pass; part, acc: [M][4] registers' worth of scratch), so
// the decode is shared by the M rows
template <int BITS, class Dots>
LATQ_CB_PASS_TARGET void tile_chunks(const Layer& L, const TileTables& tt0, const typename Dots::X* x, int64_t M,
                                     int64_t t, const float* band, float* y, __m512i* w, __m512* part, __m512* acc) {
  for (int64_t i = 0; i < 4 * M; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* c = L.codes + t * L.nb * L.B * kTile;
  for (int64_t b0 = 0, gi = 0; b0 < L.nb; b0 += L.bpg, ++gi) {
    const int64_t b1 = std::min(L.nb, b0 + L.bpg);
    for (int64_t c0 = b0; c0 < b1; c0 += kChunk) {
      const int64_t nb = std::min<int64_t>(kChunk, b1 - c0);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = c + (c0 + b) * L.B * kTile;
        prefetch_codes(p, L.B);
        Dots::template make<BITS>(from_l1(tt0), p, w + b * Dots::template words<BITS>());
      }
      const bool first = c0 == b0, last = c0 + nb == b1;
      const float* scale = band + gi * kBand;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsInRegisters) {   // 4 rows a pass: 16 sums in registers
        const typename Dots::X* xm = x + m0 * L.K + c0 * 8;
        __m512 *pm = part + 4 * m0, *am = acc + 4 * m0;
        static_assert(kRowsInRegisters == 4, "a case each");
        switch (std::min<int64_t>(kRowsInRegisters, M - m0)) {
          case 1: Dots::template dots<BITS, 1>(w, nb, xm, L.K, first, last, scale, L.G, pm, am); break;
          case 2: Dots::template dots<BITS, 2>(w, nb, xm, L.K, first, last, scale, L.G, pm, am); break;
          case 3: Dots::template dots<BITS, 3>(w, nb, xm, L.K, first, last, scale, L.G, pm, am); break;
          default: Dots::template dots<BITS, 4>(w, nb, xm, L.K, first, last, scale, L.G, pm, am);
        }
      }
    }
  }
  store_tile(acc, M, L.N, t, 1.f / Dots::template gain<BITS>(), y);
}

// rows i < MR of x · the fp32 weights of nb blocks (a chunk of a scale group; [block][lane][quarter]), summed
// in p[i][r]: MR rows and the four quarters at once, each x_j broadcast once for the four; then group_end
template <int MR>
LATQ_CB_BYTES_TARGET inline void dot_weights_f32(const __m512i* w, int64_t nb, const float* x, int64_t K, bool first,
                                                 bool last, const float* scale, int64_t G, __m512* part, __m512* acc) {
  __m512 p[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < 4; ++r) p[i][r] = first ? _mm512_setzero_ps() : part[4 * i + r];
  for (int64_t k = 0; k < nb * 8; ++k) {   // k: block · 8 + lane
    __m512 xk[MR];
    for (int i = 0; i < MR; ++i) xk[i] = _mm512_set1_ps(x[i * K + k]);
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < MR; ++i) p[i][r] = _mm512_fmadd_ps(_mm512_castsi512_ps(w[k * 4 + r]), xk[i], p[i][r]);
  }
  group_end<MR>(p, last, scale, G, part, acc);
}

// the fp32 dots (x of any dtype as fp32: no BF16 dots, or x not bf16): block makes a block's lanes' weights in
// registers and FMAs them into MR rows' sums for tile_pass; make puts them in L1 for dots (tile_chunks)
struct F32Dots {
  using X = float;
  template <int BITS> static constexpr float gain() { return kBlockGain<BITS>; }
  template <int BITS> static constexpr int words() { return 32; }   // [lane][quarter]
  template <int BITS>
  LATQ_CB_BYTES_TARGET __attribute__((always_inline)) static inline void make(const TileTables& tt, const uint8_t* p, __m512i* w) {
    __m512i q[8];
    q_planes_f32<BITS>(tt, p, q);
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < 4; ++r) w[j * 4 + r] = _mm512_castps_si512(f32_weights<BITS>(tt, q[j], r));
  }
  template <int BITS, int MR>
  LATQ_CB_BYTES_TARGET __attribute__((always_inline)) static inline void dots(const __m512i* w, int64_t nb, const float* x,
                                                                              int64_t K, bool first, bool last,
                                                                              const float* scale, int64_t G, __m512* part,
                                                                              __m512* acc) {
    dot_weights_f32<MR>(w, nb, x, K, first, last, scale, G, part, acc);
  }
  template <int BITS, int MR>
  LATQ_CB_BYTES_TARGET static inline void block(const TileTables& tt, const uint8_t* p, const float* x, int64_t K,
                                                __m512 (&part)[MR][4]) {
    __m512i q[8];
    q_planes_f32<BITS>(tt, p, q);
    for (int j = 0; j < 8; ++j) {
      __m512 xj[MR];
      for (int i = 0; i < MR; ++i) xj[i] = _mm512_set1_ps(x[i * K + j]);
      for (int r = 0; r < 4; ++r) {
        const __m512 w = f32_weights<BITS>(tt, q[j], r);
        for (int i = 0; i < MR; ++i) part[i][r] = _mm512_fmadd_ps(w, xj[i], part[i][r]);
      }
    }
  }
};

#endif

#if LATQ_CB_TILES
// quarters 2h and 2h + 1's bf16 weights of lanes 2j, 2j+1 (16 rows each, a pair a row): one vpermi2b
// interleaves the two lanes' planes into words holding quarter 2h's byte low and 2h + 1's high (into the
// selector loaded afresh: with the intrinsic the compiler keeps the selectors in registers and copies one
// a lookup, since vpermi2b overwrites it), then vpermw turns the low bytes into bf16 (the table v, its
// index the low 5 bits), and again after a shift the high ones
LATQ_CB_TILE_TARGET inline void pair_words(const TileTables& tt, __m512i q0, __m512i q1, int h, __m512i v, __m512i w[2]) {
  __m512i ix;
  asm("vmovdqa64 %1, %0\n\tvpermi2b %3, %2, %0"
      : "=&v"(ix) : "m"(*reinterpret_cast<const __m512i*>(tt.sel[h])), "v"(q0), "v"(q1));
  w[0] = _mm512_permutexvar_epi16(ix, v);
  w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(ix, 8), v);
}

// part[i][r] += each lane pair's bf16 weights · row i of x's pairs, 16 rows a quarter r
template <int MR>
LATQ_CB_TILE_TARGET inline void dot_planes(const TileTables& tt, const __m512i q[8], const uint16_t* val, const uint16_t* x,
                                           int64_t K, __m512 (&part)[MR][4]) {
  const __m512i v = _mm512_load_si512(val);
  for (int j = 0; j < 4; ++j) {
    __m512bh xj[MR];
    for (int i = 0; i < MR; ++i) {
      int32_t xp;
      std::memcpy(&xp, x + i * K + 2 * j, 4);
      xj[i] = (__m512bh)_mm512_set1_epi32(xp);
    }
    for (int h = 0; h < 2; ++h) {
      __m512i w[2];
      pair_words(tt, q[2 * j], q[2 * j + 1], h, v, w);
      for (int i = 0; i < MR; ++i) {
        part[i][2 * h] = _mm512_dpbf16_ps(part[i][2 * h], (__m512bh)w[0], xj[i]);
        part[i][2 * h + 1] = _mm512_dpbf16_ps(part[i][2 * h + 1], (__m512bh)w[1], xj[i]);
      }
    }
  }
}

// rows i < MR of x · the words of nw blocks' stages (a chunk of a scale group), quarter r, summed in
// p[i][r]: MR rows and the four quarters at once (4·MR chains: vdpbf16ps' latency is six of its issue
// slots), each x pair broadcast once for the four quarters. The sums start at 0 in a group's first
// chunk (else from part) and after its last go scaled into acc (else back to part): scale: the
// group's 16-row scales of quarter r at scale + r·G·16.
template <int MR>
LATQ_CB_TILE_TARGET inline void dot_words(const __m512i* w, int64_t nw, const uint16_t* x, int64_t K, int64_t S,
                                          bool first, bool last, const float* scale, int64_t G, __m512* part,
                                          __m512* acc) {
  __m512 p[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < 4; ++r) p[i][r] = first ? _mm512_setzero_ps() : part[4 * i + r];
  for (int64_t k = 0; k < nw; ++k) {   // k: block · S + stage
    for (int j = 0; j < 4; ++j) {
      __m512bh xb[MR];
      for (int i = 0; i < MR; ++i) {
        int32_t xp;
        std::memcpy(&xp, x + i * K + k / S * 8 + 2 * j, 4);
        xb[i] = (__m512bh)_mm512_set1_epi32(xp);
      }
      for (int r = 0; r < 4; ++r) {
        const __m512bh wj = (__m512bh)w[k * 16 + r * 4 + j];
        for (int i = 0; i < MR; ++i) p[i][r] = _mm512_dpbf16_ps(p[i][r], wj, xb[i]);
      }
    }
  }
  group_end<MR>(p, last, scale, G, part, acc);
}

// the bf16 dots (bf16 x): block makes a block's lane pairs' words in registers and dots them with MR rows (at
// 4 bits a stage at a time) for tile_pass; make puts them in L1 for dots (tile_chunks)
struct Bf16Dots {
  using X = uint16_t;
  template <int BITS> static constexpr float gain() { return 1.f; }
  template <int BITS> static constexpr int stages() { return BITS == 4 ? 2 : 1; }   // E8P stages a block
  template <int BITS> static constexpr int words() { return 16 * stages<BITS>(); }   // [stage][quarter][lane pair]
  // stage st's planes (its code bytes 2·st planes on from p) → q, and the bf16 values they index
  template <int BITS>
  LATQ_CB_TILE_TARGET __attribute__((always_inline)) static inline const uint16_t* stage(const TileTables& tt,
                                                                                        const uint8_t* p, int st,
                                                                                        __m512i q[8]) {
    block_planes<BITS == 4 ? 2 : BITS>(tt, p + 2 * st * kTile, q);
    return BITS == 3 ? tt.val[0] : tt.raw[st];
  }
  template <int BITS>
  LATQ_CB_TILE_TARGET __attribute__((always_inline)) static inline void make(const TileTables& tt, const uint8_t* p, __m512i* w) {
    __m512i q[8];
    for (int st = 0; st < stages<BITS>(); ++st, w += 16) {
      const __m512i v = _mm512_load_si512(stage<BITS>(tt, p, st, q));
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j) {
          __m512i pw[2];
          pair_words(tt, q[2 * j], q[2 * j + 1], h, v, pw);
          w[2 * h * 4 + j] = pw[0];
          w[(2 * h + 1) * 4 + j] = pw[1];
        }
    }
  }
  template <int BITS, int MR>
  LATQ_CB_TILE_TARGET __attribute__((always_inline)) static inline void dots(const __m512i* w, int64_t nb, const uint16_t* x,
                                                                             int64_t K, bool first, bool last,
                                                                             const float* scale, int64_t G, __m512* part,
                                                                             __m512* acc) {
    dot_words<MR>(w, nb * stages<BITS>(), x, K, stages<BITS>(), first, last, scale, G, part, acc);
  }
  template <int BITS, int MR>
  LATQ_CB_TILE_TARGET static inline void block(const TileTables& tt, const uint8_t* p, const uint16_t* x, int64_t K,
                                               __m512 (&part)[MR][4]) {
    __m512i q[8];
    for (int st = 0; st < stages<BITS>(); ++st) {
      const uint16_t* val = stage<BITS>(tt, p, st, q);
      dot_planes<MR>(tt, q, val, x, K, part);
    }
  }
};

#endif

#if LATQ_CB_AVX512
// the same body with AVX-512VL's 32 registers: up to 8 rows of x a pass
template <int BITS, int MR>
__attribute__((target("avx512f,avx512vl,avx2,fma,f16c"))) void rows_avx512(const Layer& L, const float* x, int64_t n0,
                                                                            int64_t n1, const float* band, float* y) {
  rows_body<BITS, MR>(L, x, n0, n1, band, y);
}
#endif

// ------------------------------------------------------------------ dispatch

int isa_detect() {
  const char* e = std::getenv("LATQ_CPU_ISA");
  for (int isa = e && std::strcmp(e, "avx2") == 0 ? 1 : 2; isa > 0; --isa)
    if (latq_isa_runs(isa) && (isa < 2 || __builtin_cpu_supports("avx512vl"))) return isa;
  return 0;
}
std::atomic<int> g_isa{isa_detect()};

// whether the 64-row tiles run here (on the best instruction set only): the byte decode (VBMI, GFNI), with
// BF16 bf16 x's dots in bf16 (Bf16Dots), and every other x's in fp32 (F32Dots)
bool tiles_run() {
#if LATQ_CB_BYTES
  static const bool cpu = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
  return cpu && g_isa.load() == 2;
#else
  return false;
#endif
}

// whether bf16 x's dots run as bf16 (set_codebook_bf16_dots turns them off, as on a CPU without them)
bool bf16_dots_cpu() {
#if LATQ_CB_TILES
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}
std::atomic<bool> g_bf16_dots{bf16_dots_cpu()};
bool bf16_dots_run() { return g_bf16_dots.load() && tiles_run(); }

// rows from which decoded tiles + a GEMM beat decoding per call, each path's (docs/KERNELS.md, "CPU kernel
// (cpu-e8)"): the tiles' paths share their decode across rows (the fp32 dots at half the bf16 dots' rate),
// the row path does not; set_codebook_large_m(m ≥ 1) puts every path's at m, 0 back to these
constexpr int64_t kLargeMBf16 = 1024, kLargeMF32 = 256, kLargeMRows = 20;
std::atomic<int64_t> g_large_m{0};
int64_t large_m(int64_t path_default) {
  const int64_t m = g_large_m.load();
  return m > 0 ? m : path_default;
}

// the rows of x one pass of the row path serves (AVX2 with one sum a row from 5: rows_body)
constexpr int64_t kRowsAPass = 8;

template <int BITS, int MR>
void rows_fixed(const Layer& L, const float* x, int64_t n0, int64_t n1, const float* band, float* y, int isa) {
#if LATQ_CB_AVX512
  if (isa == 2) return rows_avx512<BITS, MR>(L, x, n0, n1, band, y);
#endif
#if LATQ_CB_X86
  rows_avx2<BITS, MR>(L, x, n0, n1, band, y);
#endif
}

// rows [n0, n1) of y for rows [0, M) of x (M ≤ kRowsAPass)
template <int BITS>
void rows(const Layer& L, const float* x, int64_t M, int64_t n0, int64_t n1, const float* band, float* y, int isa) {
  if (isa == 0) return rows_scalar<BITS>(L, x, M, n0, n1, band, y);
  switch (M) {
    case 1: return rows_fixed<BITS, 1>(L, x, n0, n1, band, y, isa);
    case 2: return rows_fixed<BITS, 2>(L, x, n0, n1, band, y, isa);
    case 3: return rows_fixed<BITS, 3>(L, x, n0, n1, band, y, isa);
    case 4: return rows_fixed<BITS, 4>(L, x, n0, n1, band, y, isa);
    case 5: return rows_fixed<BITS, 5>(L, x, n0, n1, band, y, isa);
    case 6: return rows_fixed<BITS, 6>(L, x, n0, n1, band, y, isa);
    case 7: return rows_fixed<BITS, 7>(L, x, n0, n1, band, y, isa);
    default: return rows_fixed<BITS, 8>(L, x, n0, n1, band, y, isa);
  }
}

template <int BITS>
void decode_rows(const Layer& L, int64_t n0, int64_t n1, const float* band, float* w, int isa) {
#if LATQ_CB_X86
  if (isa >= 1) return decode_rows_avx2<BITS>(L, n0, n1, band, w);
#endif
  decode_rows_scalar<BITS>(L, n0, n1, band, w);
}

// fn(n0, n1, band) over bands of 16 rows of [r0, r1) split across threads, each band's coded scales
// decoded once into the task's own [G][16] buffer
template <class F>
void for_bands(const Layer& L, int64_t r0, int64_t r1, int64_t grain_rows, const F& fn) {
  const int64_t t0 = r0 / kBand, t1 = (r1 + kBand - 1) / kBand;
  at::parallel_for(t0, t1, std::max<int64_t>(1, grain_rows / kBand), [&](int64_t a, int64_t b) {
    std::vector<float> band(L.coded ? L.G * kBand : 0);
    for (int64_t t = a; t < b; ++t) {
      if (L.coded) band_scales(L, t, band.data(), g_isa.load());
      fn(std::max(r0, t * kBand), std::min(r1, (t + 1) * kBand), band.data());
    }
  });
}

// fn(std::integral_constant<int, B>{}) for a layer's bits B, so a kernel's template takes them
template <class F>
void with_bits(int64_t bits, const F& fn) {
  if (bits == 2) fn(std::integral_constant<int, 2>{});
  else if (bits == 3) fn(std::integral_constant<int, 3>{});
  else fn(std::integral_constant<int, 4>{});
}

#if LATQ_CB_BYTES
// fn(t, band) for each 64-row tile t, tiles split across threads: band its 4 bands' scales decoded ([4][G][16])
template <class F>
void for_tiles(const Layer& L, const F& fn) {
  at::parallel_for(0, L.N / kTile, 1, [&](int64_t a, int64_t b) {
    std::vector<float> band(4 * L.G * kBand);
    for (int64_t t = a; t < b; ++t) {
      for (int r = 0; r < 4; ++r) band_scales(L, 4 * t + r, band.data() + r * L.G * kBand, 2);
      fn(t, band.data());
    }
  });
}

// fn(std::integral_constant<int, M>{}) for M ≤ kRowsInRegisters rows of x
template <class F>
void rows_in_registers(int64_t M, const F& fn) {
  static_assert(kRowsInRegisters == 4, "a case each");
  switch (M) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, kRowsInRegisters>{});
  }
}

// y [M, N] fp32 = x [M, K] · Wᵀ on Dots (x as Dots takes it), M < the large-M rows
template <int BITS, class Dots>
void tiles(const Layer& L, const typename Dots::X* x, int64_t M, float* y) {
  const TileTables& tt = tile_tables(reinterpret_cast<const float*>(L.table));
  for_tiles(L, [&](int64_t t, const float* band) {
    if (M <= kRowsInRegisters)
      return rows_in_registers(M, [&](auto mr) { tile_pass<BITS, decltype(mr)::value, Dots>(L, tt, x, t, band, y); });
    std::vector<Zmm> w(kChunk * Dots::template words<BITS>()), part(4 * M), acc(4 * M);
    tile_chunks<BITS, Dots>(L, tt, x, M, t, band, y, reinterpret_cast<__m512i*>(w.data()),
                            reinterpret_cast<__m512*>(part.data()), reinterpret_cast<__m512*>(acc.data()));
  });
}
#endif

// y [M, N] fp32 = xf [M, K] fp32 · Wᵀ
template <int BITS>
void gemm(const Layer& L, const at::Tensor& xf, at::Tensor& y) {
  const int64_t M = xf.size(0);
  const int isa = g_isa.load();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M < large_m(kLargeMRows)) {
    const int64_t R = isa == 0 ? kMaxRows : kRowsAPass;
    const int64_t grain = std::max<int64_t>(1, 16384 / L.K);   // rows a task: ≥ 16k weights
    for_bands(L, 0, L.N, grain, [&](int64_t n0, int64_t n1, const float* band) {
      for (int64_t m0 = 0; m0 < M; m0 += R)
        rows<BITS>(L, xp + m0 * L.K, std::min(R, M - m0), n0, n1, band, yp + m0 * L.N, isa);
    });
    return;
  }
  // tiles of rows ≤ 4 MB of fp32, whole bands, 16 rows at least
  const int64_t tile = std::max<int64_t>(kBand, (int64_t{1} << 20) / L.K / kBand * kBand);
  at::Tensor w = at::empty({std::min(tile, L.N), L.K}, xf.options());
  for (int64_t r0 = 0; r0 < L.N; r0 += tile) {
    const int64_t R = std::min(tile, L.N - r0);
    float* wp = w.data_ptr<float>();
    for_bands(L, r0, r0 + R, 1, [&](int64_t n0, int64_t n1, const float* band) {
      decode_rows<BITS>(L, n0, n1, band, wp + (n0 - r0) * L.K, isa);
    });
    y.narrow(1, r0, R).copy_(at::mm(xf, w.narrow(0, 0, R).t()));
  }
}

Args check_args(const char* op, const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                at::IntArrayRef ints, const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK((tensors.size() == 3 || tensors.size() == 4) && (ints.size() == 3 || ints.size() == 4), op,
              "not a CodebookState");
  for (size_t i = 0; i < 3; ++i)
    TORCH_CHECK(tensors.get(i).has_value() && tensors.get(i)->defined(), op, "tensor ", i, " is missing");
  Args a{*tensors.get(0), *tensors.get(1), *tensors.get(2), tensors.size() == 4 ? tensors.get(3) : std::nullopt,
         ints[0], ints[1], ints[2], out_features, ints.size() == 4 ? ints[3] : 1, 0, false};
  const at::Tensor &codes = a.codes, &scales = a.scales, &table = a.table;
  const int64_t bits = a.bits, group = a.group, K = a.K, N = a.N;
  TORCH_CHECK(bits >= 2 && bits <= 4, op, bits, "-bit codes (2, 3 or 4)");
  TORCH_CHECK(K > 0 && K % 8 == 0, op, "in_features ", K, " must be a positive multiple of 8");
  TORCH_CHECK(group > 0 && group % 8 == 0, op, "group size ", group, " must be a positive multiple of 8");
  TORCH_CHECK(N >= 0, op, "out_features ", N, " is negative");
  a.G = (K + group - 1) / group;
  for (const at::Tensor* t : {&x, &codes, &scales, &table})
    TORCH_CHECK(t->device().is_cpu(), op, "every tensor must be on the CPU, got ", t->device());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), op, "codes must be uint8, contiguous, got ",
              codes.scalar_type());
  a.coded = scales.scalar_type() == at::kInt;
  if (a.coded) {
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == (N + kBand - 1) / kBand &&
                    scales.size(1) == a.G && scales.size(2) == 3,
                op, "coded scales must be int32 [ceil(out/16), ceil(in/group), 3], contiguous, got ", scales.sizes());
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                    scales.size(0) == N && scales.size(1) == a.G,
                op, "scales must be fp16 [out, ceil(in/group)] (or coded int32), contiguous, got ",
                scales.scalar_type(), " ", scales.sizes());
  }
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.numel() == kRows * 8 &&
                  reinterpret_cast<uintptr_t>(table.data_ptr()) % 32 == 0,
              op, "table must be fp32 [1024, 8], contiguous, 32-byte aligned (decode_table())");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, "x must be fp32, bf16 or fp16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, "x has ", x.dim() ? x.size(-1) : 0, " columns, the layer ", K);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N && bias->is_floating_point(), op,
                "bias must be a floating [out] tensor on the CPU, got ", bias->sizes());
  }
  if (a.rotated()) {
    TORCH_CHECK(a.signs->device().is_cpu() && a.signs->dim() == 1 && a.signs->numel() > 0 &&
                    K % a.signs->numel() == 0,
                op, "rotation signs must be one block [b] (b dividing in_features) on the CPU, got ", a.signs->sizes());
  }
  return a;
}

Layer Args::layer() const {
  return Layer{codes.data_ptr<uint8_t>(), coded ? nullptr : scales.data_ptr<at::Half>(),
               coded ? scales.data_ptr<int32_t>() : nullptr, static_cast<const char*>(table.data_ptr()),
               N, K, K / 8, bits, G, group / 8, T};
}

at::Tensor finish(at::Tensor y, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = y.size(1);
  return y.to(x.scalar_type()).reshape(shape);
}

}  // namespace latq_cb

namespace {
namespace cb = latq_cb;

at::Tensor codebook_linear(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                           at::IntArrayRef ints, const std::optional<at::Tensor>& bias, int64_t out_features) {
  constexpr const char* op = "latq_cpu::codebook_linear: ";
  const cb::Args a = cb::check_args(op, x, tensors, ints, bias, out_features);
  const at::Tensor& codes = a.codes;
  const int64_t bits = a.bits, K = a.K, N = a.N, T = a.T;
  TORCH_CHECK(T == 1 || (T == cb::kTile && N % cb::kTile == 0), op, "tile rows ", T, " (1, or 64 dividing out_features ",
              N, ")");
  // a code's bytes: 8 weights × bits, as rows [out, in/8, bits] or 64-row tiles [out/64, in/8, bits, 64]
  TORCH_CHECK(T == 1 ? codes.dim() == 3 && codes.size(0) == N && codes.size(1) * 8 == K && codes.size(2) == bits
                     : codes.dim() == 4 && codes.size(0) * T == N && codes.size(1) * 8 == K && codes.size(2) == bits &&
                           codes.size(3) == T,
              op, "codes must be uint8 [out, in/8, bits] (or tiled [out/64, in/8, bits, 64]), contiguous, got ",
              codes.sizes());
  const at::Tensor& xr = a.rotated() ? latq_hadamard_scratch(x, *a.signs) : x;
  const int64_t M = x.numel() / K;
  const cb::Layer L = a.layer();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#if LATQ_CB_TILES
  // rows of bf16 x on a tiled layer, fewer than the large-M rows: the tiles' bf16 dots (x's bf16 as it is: exact products)
  if (M >= 1 && M < cb::large_m(cb::kLargeMBf16) && N > 0 && T == cb::kTile && xr.scalar_type() == at::kBFloat16 &&
      cb::bf16_dots_run()) {
    const at::Tensor xb = xr.reshape({M, K}).contiguous();
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    cb::with_bits(bits, [&](auto b) { cb::tiles<decltype(b)::value, cb::Bf16Dots>(L, xp, M, y.data_ptr<float>()); });
  } else
#endif
#if LATQ_CB_BYTES
  // rows of any other x on a tiled layer, fewer than the large-M rows: the tiles' decode, x as fp32
  if (M >= 1 && M < cb::large_m(cb::kLargeMF32) && N > 0 && T == cb::kTile && cb::tiles_run()) {
    const at::Tensor xf = xr.reshape({M, K}).to(at::kFloat).contiguous();
    cb::with_bits(bits, [&](auto b) { cb::tiles<decltype(b)::value, cb::F32Dots>(L, xf.data_ptr<float>(), M, y.data_ptr<float>()); });
  } else
#endif
  if (M > 0 && N > 0) {
    const at::Tensor xf = xr.reshape({M, K}).to(at::kFloat).contiguous();
    cb::with_bits(bits, [&](auto b) { cb::gemm<decltype(b)::value>(L, xf, y); });
  }
  return cb::finish(y, x, bias);
}

std::string codebook_isa() { return cb::g_isa == 2 ? "avx512" : cb::g_isa == 1 ? "avx2" : ""; }

void set_codebook_isa(const std::string& name) {
  const int isa = name == "avx512" ? 2 : name == "avx2" ? 1 : name.empty() ? 0 : -1;
  TORCH_CHECK(isa >= 0, "latq_cpu::set_codebook_isa: unknown instruction set '", name, "' (avx512, avx2 or '')");
  TORCH_CHECK(latq_isa_runs(isa) && (isa < 2 || (LATQ_CB_AVX512 && __builtin_cpu_supports("avx512vl"))),
              "latq_cpu::set_codebook_isa: ", name,
              " does not run here");
  cb::g_isa.store(isa);
}

// the tile rows prepare lays a layer out in: 64 where the tiles' path runs here, else 1 (rows)
int64_t codebook_tile_rows() { return cb::tiles_run() ? cb::kTile : 1; }

bool codebook_bf16_dots() { return cb::bf16_dots_run(); }

void set_codebook_bf16_dots(bool on) {
  TORCH_CHECK(!on || cb::bf16_dots_cpu(), "latq_cpu::set_codebook_bf16_dots: this CPU (or build) has no AVX-512 BF16 dots");
  cb::g_bf16_dots.store(on);
}

void set_codebook_large_m(int64_t m) {
  TORCH_CHECK(m >= 0, "latq_cpu::set_codebook_large_m: ", m, " rows (at least 1, or 0: each path's own)");
  cb::g_large_m.store(m);
}
int64_t codebook_large_m() { return cb::g_large_m.load(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("codebook_linear(Tensor x, Tensor?[] tensors, int[] ints, Tensor? bias, int out_features) -> Tensor");
  m.def("codebook_isa() -> str");
  m.def("set_codebook_isa(str name) -> ()");
  m.def("set_codebook_large_m(int m) -> ()");
  m.def("codebook_large_m() -> int");
  m.def("codebook_tile_rows() -> int");
  m.def("codebook_bf16_dots() -> bool");
  m.def("set_codebook_bf16_dots(bool on) -> ()");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) { m.impl("codebook_linear", &codebook_linear); }

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) {
  m.impl("codebook_isa", &codebook_isa);
  m.impl("set_codebook_isa", &set_codebook_isa);
  m.impl("set_codebook_large_m", &set_codebook_large_m);
  m.impl("codebook_large_m", &codebook_large_m);
  m.impl("codebook_tile_rows", &codebook_tile_rows);
  m.impl("codebook_bf16_dots", &codebook_bf16_dots);
  m.impl("set_codebook_bf16_dots", &set_codebook_bf16_dots);
}
