// A codebook layer (method e8, vllm_latq/format/codebook.py) on the CPU straight from its codes:
// y = x · Wᵀ (+ bias), W's 8-column blocks decoded as the rows are read, never stored. A block's
// point is Σ stages: E8P (16 bits: byte 0 the pattern, byte 1 seven signs and the ±¼ shift), the
// 3-bit ball's point / 2, or a second E8P / 4; times its group's scale.
//
// The decode is table rows addressed by the code's bytes as they are, so a block costs three
// aligned loads, an XOR and an add (kernels/cpu/codebook.py, decode_table): the pattern row
// (byte 0 · 32, its parity folded into lane 7's sign), then two rows addressed by byte 1 · 64,
// the sign mask of its seven signs (lane 7 by their parity) and its shift. No shift-and-mask
// chain, no branch. The ball stage is one more row (byte 2 · 32, pre-halved).
//
// Scales are read as the checkpoint stores them: fp16 [N, G], or coded (format/scale_codes.py)
// as int32 words [ceil(N/16), G, 3] — per 16 rows and group, fp16 min | fp16 step << 16 and 16
// 4-bit codes — decoded a band of 16 rows at a time to fp16(min + code·step), the format's one
// rounding. Point × scale is exact in fp32 (a point ≤ 7 significant bits, a scale 11), so the
// result is the reference's up to fp32 summation order.
//
// Small M: per output row, each block decoded once into 8 fp32 lanes, scaled and FMA'd into up to
// 4 rows of x (AVX2 + FMA + F16C) or 8 (AVX-512VL: 32 registers), two FMA chains per row. Large M
// (≥ set_codebook_large_m): tiles of rows decoded to fp32, then one GEMM per tile.
//
//   latq_cpu::codebook_linear(x [..., K] bf16/fp16/fp32, tensors = (codes uint8 [N, K/8, B],
//       scales fp16 [N, G] or int32 [ceil(N/16), G, 3], table fp32 [1024, 8][, signs fp32 [K]]),
//       ints = (bits, group_size, in_features), bias?, out_features)   the schema of
//       latq::cpu_e8_linear; a 4th tensor, a rotated layer's signs, rotates x first (hadamard.cpp)
//   latq_cpu::codebook_isa() / set_codebook_isa(name)   which path runs ("avx512", "avx2", "")
//   latq_cpu::set_codebook_large_m(m) / codebook_large_m()   rows from which tiles + GEMM run

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LATQ_CB_X86 1
#else
#define LATQ_CB_X86 0
#endif
// AVX-512 only where the build targets it (an x86-64-v3 build holds no AVX-512 code), as hadamard.cpp's
#if LATQ_CB_X86 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LATQ_CB_AVX512 1
#else
#define LATQ_CB_AVX512 0
#endif

const at::Tensor& latq_hadamard_scratch(const at::Tensor& x, const at::Tensor& signs);   // hadamard.cpp
bool latq_isa_runs(int isa);                                                              // hadamard.cpp

namespace {
namespace cb {

// the table (kernels/cpu/codebook.py, decode_table): fp32 rows of 8, byte offsets of each part
constexpr int64_t kRows = 1024;
constexpr int64_t kBallOff = 256 * 32;   // the ball's points / 2
constexpr int64_t kSignOff = 512 * 32;   // per sign byte: its mask row, then its shift row
constexpr int kBand = 16;                // rows sharing a coded scale grid (scale_codes.ROWS)
constexpr int kMaxRows = 8;              // rows of x one pass over the weights serves

struct Layer {
  const uint8_t* codes;     // [N, nb, B]
  const at::Half* scales;   // [N, G], or null:
  const int32_t* coded;     // [ceil(N/16), G, 3]
  const char* table;        // [1024, 8] fp32, 32-byte aligned
  int64_t N, K, nb, B, G, bpg;   // bpg: blocks a group
};

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

void band_scales(const Layer& L, int64_t t, float* s, int isa) {
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
  for (int j = 0; j < 8; ++j) v[j] = 0.f;
  e8p_scalar(L, c[0], c[1], 1.f, v);
  if constexpr (BITS == 3) {
    const float* p = row(L, kBallOff + (c[2] << 5));
    for (int j = 0; j < 8; ++j) v[j] += p[j];
  } else if constexpr (BITS == 4) {
    e8p_scalar(L, c[2], c[3], 0.25f, v);
  }
}

template <int BITS>
void decode_rows_scalar(const Layer& L, int64_t n0, int64_t n1, const float* band, float* w) {
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sc = row_scales(L, n, band);
    for (int64_t b = 0; b < L.nb; ++b) {
      const float s = sc(b / L.bpg);
      float* o = w + (n - n0) * L.K + b * 8;
      block_scalar<BITS>(L, L.codes + (n * L.nb + b) * L.B, o);
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
      block_scalar<BITS>(L, L.codes + (n * L.nb + b) * L.B, v);
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < 8; ++j) acc[m] += x[m * L.K + b * 8 + j] * (v[j] * s);
    }
    for (int64_t m = 0; m < M; ++m) y[m * L.N + n] = acc[m];
  }
}

#if LATQ_CB_X86
// ------------------------------------------------------------------ AVX2 + FMA + F16C: a block a register

#define LATQ_CB_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

// σ⊙a ± ¼: the pattern row, XOR its sign byte's mask row, plus its shift row (S: the table's sign rows,
// a base of its own so each load is base + index, no add)
LATQ_CB_INLINE __m256 e8p_avx2(const char* T, const char* S, uint32_t p, uint32_t s) {
  const __m256 a = _mm256_load_ps(reinterpret_cast<const float*>(T + (p << 5)));
  return _mm256_add_ps(_mm256_xor_ps(a, _mm256_load_ps(reinterpret_cast<const float*>(S + (s << 6)))),
                       _mm256_load_ps(reinterpret_cast<const float*>(S + 32 + (s << 6))));
}

template <int BITS>
LATQ_CB_INLINE __m256 block_avx2(const char* T, const uint8_t* c) {
  const char* S = T + kSignOff;
  __m256 v = e8p_avx2(T, S, c[0], c[1]);
  if constexpr (BITS == 3) v = _mm256_add_ps(v, _mm256_load_ps(reinterpret_cast<const float*>(T + kBallOff + (c[2] << 5))));
  if constexpr (BITS == 4) v = _mm256_fmadd_ps(e8p_avx2(T, S, c[2], c[3]), _mm256_set1_ps(0.25f), v);
  return v;
}

LATQ_CB_INLINE float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

LATQ_CB_INLINE float scale_at(const RowScales& sc, int64_t g) {
  return sc.h ? _cvtsh_ss(reinterpret_cast<const uint16_t*>(sc.h)[g]) : sc.f[g * kBand];
}

// rows [n0, n1) for MR rows of x: each block decoded once and scaled (exact), then FMA'd into MR
// rows; blocks alternate between two accumulators a row so two FMA chains are in flight
template <int BITS, int MR>
LATQ_CB_INLINE void rows_body(const Layer& L, const float* x, int64_t n0, int64_t n1, const float* band, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sc = row_scales(L, n, band);
    const uint8_t* c = L.codes + n * L.nb * L.B;
    __m256 a0[MR], a1[MR];
    for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t b0 = 0, gi = 0; b0 < L.nb; b0 += L.bpg, ++gi) {
      const __m256 s = _mm256_set1_ps(scale_at(sc, gi));
      const int64_t b1 = std::min(L.nb, b0 + L.bpg);
      int64_t b = b0;
      for (; b + 2 <= b1; b += 2) {
        const __m256 w0 = _mm256_mul_ps(block_avx2<BITS>(L.table, c + b * L.B), s);
        const __m256 w1 = _mm256_mul_ps(block_avx2<BITS>(L.table, c + (b + 1) * L.B), s);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * L.K + b * 8), a0[m]);
          a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * L.K + b * 8 + 8), a1[m]);
        }
      }
      if (b < b1) {
        const __m256 w0 = _mm256_mul_ps(block_avx2<BITS>(L.table, c + b * L.B), s);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * L.K + b * 8), a0[m]);
      }
    }
    for (int m = 0; m < MR; ++m) y[m * L.N + n] = hsum_avx2(_mm256_add_ps(a0[m], a1[m]));
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
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sc = row_scales(L, n, band);
    for (int64_t b = 0; b < L.nb; ++b)
      _mm256_storeu_ps(w + (n - n0) * L.K + b * 8,
                       _mm256_mul_ps(block_avx2<BITS>(L.table, L.codes + (n * L.nb + b) * L.B),
                                     _mm256_set1_ps(scale_at(sc, b / L.bpg))));
  }
}
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
// rows from which decoded tiles + a GEMM beat decoding per call (docs/KERNELS.md, "E8 codebooks")
std::atomic<int64_t> g_large_m{20};

// the rows of x one pass serves on this instruction set
inline int64_t rows_a_pass(int isa) { return isa == 2 ? 8 : 4; }

template <int BITS, int MR>
void rows_fixed(const Layer& L, const float* x, int64_t n0, int64_t n1, const float* band, float* y, int isa) {
#if LATQ_CB_AVX512
  if (isa == 2) return rows_avx512<BITS, MR>(L, x, n0, n1, band, y);
#endif
#if LATQ_CB_X86
  if constexpr (MR <= 4) rows_avx2<BITS, MR>(L, x, n0, n1, band, y);
#endif
}

// rows [n0, n1) of y for rows [0, M) of x (M ≤ rows_a_pass(isa))
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

// y [M, N] fp32 = xf [M, K] fp32 · Wᵀ
template <int BITS>
void gemm(const Layer& L, const at::Tensor& xf, at::Tensor& y) {
  const int64_t M = xf.size(0);
  const int isa = g_isa.load();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M < g_large_m.load()) {
    const int64_t R = isa == 0 ? kMaxRows : rows_a_pass(isa);
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

}  // namespace cb

// every argument checked against the others before any pointer is read: a direct call raises
at::Tensor codebook_linear(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                           at::IntArrayRef ints, const std::optional<at::Tensor>& bias, int64_t out_features) {
  // CodebookState, flattened: tensors = (codes, scales, table[, rotation signs]), ints = (bits, group_size,
  // in_features)
  constexpr const char* op = "latq_cpu::codebook_linear: ";
  TORCH_CHECK((tensors.size() == 3 || tensors.size() == 4) && ints.size() == 3, op, "not a CodebookState");
  for (size_t i = 0; i < 3; ++i)
    TORCH_CHECK(tensors.get(i).has_value() && tensors.get(i)->defined(), op, "tensor ", i, " is missing");
  const at::Tensor codes = *tensors.get(0), scales = *tensors.get(1), table = *tensors.get(2);
  const int64_t bits = ints[0], group = ints[1], K = ints[2], N = out_features;
  TORCH_CHECK(bits >= 2 && bits <= 4, op, bits, "-bit codes (2, 3 or 4)");
  TORCH_CHECK(K > 0 && K % 8 == 0, op, "in_features ", K, " must be a positive multiple of 8");
  TORCH_CHECK(group > 0 && group % 8 == 0, op, "group size ", group, " must be a positive multiple of 8");
  TORCH_CHECK(N >= 0, op, "out_features ", N, " is negative");
  const int64_t G = (K + group - 1) / group;
  for (const at::Tensor* t : {&x, &codes, &scales, &table})
    TORCH_CHECK(t->device().is_cpu(), op, "every tensor must be on the CPU, got ", t->device());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == N &&
                  codes.size(1) * 8 == K && codes.size(2) == bits,   // a code's bytes: 8 weights × bits
              op, "codes must be uint8 [out, in/8, bits], contiguous, got ", codes.scalar_type(), " ", codes.sizes());
  const bool coded = scales.scalar_type() == at::kInt;
  if (coded) {
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == (N + cb::kBand - 1) / cb::kBand &&
                    scales.size(1) == G && scales.size(2) == 3,
                op, "coded scales must be int32 [ceil(out/16), ceil(in/group), 3], contiguous, got ", scales.sizes());
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                    scales.size(0) == N && scales.size(1) == G,
                op, "scales must be fp16 [out, ceil(in/group)] (or coded int32), contiguous, got ",
                scales.scalar_type(), " ", scales.sizes());
  }
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.numel() == cb::kRows * 8 &&
                  reinterpret_cast<uintptr_t>(table.data_ptr()) % 32 == 0,
              op, "table must be fp32 [1024, 8], contiguous, 32-byte aligned (decode_table())");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, "x must be fp32, bf16 or fp16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, "x has ", x.dim() ? x.size(-1) : 0, " columns, the layer ", K);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N && bias->is_floating_point(), op,
                "bias must be a floating [out] tensor on the CPU, got ", bias->sizes());
  }
  const std::optional<at::Tensor> signs = tensors.size() == 4 ? tensors.get(3) : std::nullopt;
  const bool rotated = signs.has_value() && signs->defined();
  if (rotated) {
    TORCH_CHECK(signs->device().is_cpu() && signs->dim() == 1 && signs->size(0) == K, op,
                "rotation signs must be a [in] tensor on the CPU, got ", signs->sizes());
  }
  const at::Tensor& xr = rotated ? latq_hadamard_scratch(x, *signs) : x;
  const int64_t M = x.numel() / K;
  const at::Tensor xf = xr.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, xf.options());
  const cb::Layer L{codes.data_ptr<uint8_t>(), coded ? nullptr : scales.data_ptr<at::Half>(),
                    coded ? scales.data_ptr<int32_t>() : nullptr, static_cast<const char*>(table.data_ptr()),
                    N, K, K / 8, codes.size(2), G, group / 8};
  if (M > 0 && N > 0) {
    if (bits == 2) cb::gemm<2>(L, xf, y);
    else if (bits == 3) cb::gemm<3>(L, xf, y);
    else cb::gemm<4>(L, xf, y);
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.to(x.scalar_type()).reshape(shape);
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

void set_codebook_large_m(int64_t m) {
  TORCH_CHECK(m >= 1, "latq_cpu::set_codebook_large_m: ", m, " rows (at least 1)");
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
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) { m.impl("codebook_linear", &codebook_linear); }

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) {
  m.impl("codebook_isa", &codebook_isa);
  m.impl("set_codebook_isa", &set_codebook_isa);
  m.impl("set_codebook_large_m", &set_codebook_large_m);
  m.impl("codebook_large_m", &codebook_large_m);
}
