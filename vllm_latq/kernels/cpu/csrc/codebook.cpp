// A codebook layer (method e8, vllm_latq/format/codebook.py) on the CPU straight from its codes:
// y = x · Wᵀ (+ bias), W's 8-column blocks decoded as the rows are read, never stored. A block's
// point is Σ stages: E8P (16 bits: pattern row c & 255 of the table, signs of lanes 0..6 from bits
// 8..14, lane 7's sign fixing the parity, ±¼ from bit 15), the 3-bit ball's point / 2, or a
// second E8P / 4; times its group's fp16 scale. The table (vllm_latq/kernels/cpu/codebook.py,
// decode_table) holds E8P's 256 patterns with each pattern's parity in lane 7's sign, so the
// last sign is lane 7's sign bit XOR the parity of the seven code signs; the ball's 256 points;
// the sign masks of the 128 sign bytes and the two shifts, so a vector decode is three loads, an
// XOR and an add, without a branch. Every product is exact in fp32 (a point has ≤ 7 significant bits, a scale 11): the
// result is the reference's up to fp32 summation order.
//
// Small M: per output row, each block decoded once into 8 fp32 lanes (AVX2: one register; AVX-512F:
// two blocks a register) and FMA'd into up to 8 rows of x. Large M (≥ set_codebook_large_m): tiles
// of rows decoded to fp32, then one GEMM per tile. AVX-512F (where the build targets it), AVX2 +
// FMA + F16C (each function its own target) or scalar, chosen at run time.
//
//   latq_cpu::codebook_linear(x [..., K] bf16/fp16/fp32, tensors = (codes uint8 [N, K/8, B],
//       scales fp16 [N, G], table fp32 [642, 8][, signs fp32 [b]]), ints = (bits, group_size,
//       in_features), bias?, out_features)   the schema of latq::cpu_e8_linear; a 4th tensor,
//       a rotated layer's signs, rotates x first (hadamard.cpp)
//   latq_cpu::codebook_isa() / set_codebook_isa(name)   which path runs ("avx512", "avx2", "")
//   latq_cpu::set_codebook_large_m(m) / codebook_large_m()   rows from which tiles + GEMM run

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LATQ_CB_X86 1
#else
#define LATQ_CB_X86 0
#endif
// AVX-512 only where the build targets it (an x86-64-v3 build holds no AVX-512 code), as hadamard.cpp's
#if LATQ_CB_X86 && defined(__AVX512F__) && defined(__AVX512BW__)
#define LATQ_CB_AVX512 1
#else
#define LATQ_CB_AVX512 0
#endif

const at::Tensor& latq_hadamard_scratch(const at::Tensor& x, const at::Tensor& signs);   // hadamard.cpp
bool latq_isa_runs(int isa);                                                              // hadamard.cpp

namespace {
namespace cb {

// the table's rows (kernels/cpu/codebook.py, decode_table): E8P's patterns, the ball's points, the sign
// masks of a code's seven sign bits (−0.0 where a lane's sign flips, lane 7 by their parity), ±¼
constexpr int64_t kBall = 256, kSigns = 512, kShift = 640, kRows = 642;
constexpr int kMaxRows = 4;      // rows of x one pass over the weights serves (more spill registers)

struct Layer {
  const uint8_t* codes;     // [N, nb, B]
  const at::Half* scales;   // [N, G]
  const float* table;       // [512, 8]
  int64_t N, K, nb, B, G, bpg;   // bpg: blocks a group
};

// the sign byte of an E8P code: bits 8..14 for lanes 0..6, lane 7 the parity of those seven
inline uint32_t sign_bits(uint32_t c) {
  const uint32_t s = (c >> 8) & 127;
  return s | (static_cast<uint32_t>(__builtin_parity(s)) << 7);
}

inline uint32_t e8p_code(const uint8_t* c) { return c[0] | (static_cast<uint32_t>(c[1]) << 8); }

// ------------------------------------------------------------------ scalar: the definition's steps

inline void e8p_scalar(const float* T, uint32_t c, float gain, float* v) {
  const float* a = T + (c & 255) * 8;
  const uint32_t s = sign_bits(c);
  const float shift = (c >> 15) ? -0.25f : 0.25f;
  for (int j = 0; j < 8; ++j) v[j] += ((((s >> j) & 1) ? -a[j] : a[j]) + shift) * gain;
}

template <int BITS>
inline void block_scalar(const float* T, const uint8_t* c, float* v) {
  for (int j = 0; j < 8; ++j) v[j] = 0.f;
  e8p_scalar(T, e8p_code(c), 1.f, v);
  if constexpr (BITS == 3) {
    const float* p = T + (kBall + c[2]) * 8;
    for (int j = 0; j < 8; ++j) v[j] += p[j] * 0.5f;
  } else if constexpr (BITS == 4) {
    e8p_scalar(T, e8p_code(c + 2), 0.25f, v);
  }
}

// rows [n0, n1) of W (decoded, scaled) into w [n1 - n0, K]
template <int BITS>
void decode_rows_scalar(const Layer& L, int64_t n0, int64_t n1, float* w) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < L.nb; ++b) {
      const float s = static_cast<float>(L.scales[n * L.G + b / L.bpg]);
      float* o = w + (n - n0) * L.K + b * 8;
      block_scalar<BITS>(L.table, L.codes + (n * L.nb + b) * L.B, o);
      for (int j = 0; j < 8; ++j) o[j] *= s;
    }
}

template <int BITS>
void rows_scalar(const Layer& L, const float* x, int64_t M, int64_t n0, int64_t n1, float* y) {
  float v[8];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[kMaxRows] = {};
    for (int64_t b = 0; b < L.nb; ++b) {
      const float s = static_cast<float>(L.scales[n * L.G + b / L.bpg]);
      block_scalar<BITS>(L.table, L.codes + (n * L.nb + b) * L.B, v);
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < 8; ++j) acc[m] += x[m * L.K + b * 8 + j] * (v[j] * s);
    }
    for (int64_t m = 0; m < M; ++m) y[m * L.N + n] = acc[m];
  }
}

#if LATQ_CB_X86
// ------------------------------------------------------------------ AVX2 + FMA + F16C: a block a register

// σ⊙a ± ¼: the pattern, XOR its sign mask (the table's −0.0 lanes), plus the shift's row; no branch
// (byte offsets of the three rows: each a shift and a mask of c, rows being 32 bytes)
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 e8p_avx2(const float* T, uint32_t c) {
  const char* t = reinterpret_cast<const char*>(T);
  const __m256 a = _mm256_load_ps(reinterpret_cast<const float*>(t + ((c << 5) & 0x1FE0)));
  const __m256 m = _mm256_load_ps(reinterpret_cast<const float*>(t + kSigns * 32 + ((c >> 3) & 0xFE0)));
  const __m256 h = _mm256_load_ps(reinterpret_cast<const float*>(t + kShift * 32 + ((c >> 10) & 0x20)));
  return _mm256_add_ps(_mm256_xor_ps(a, m), h);
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 block_avx2(const float* T, const uint8_t* c) {
  __m256 v = e8p_avx2(T, e8p_code(c));
  if constexpr (BITS == 3) v = _mm256_fmadd_ps(_mm256_load_ps(T + (kBall + c[2]) * 8), _mm256_set1_ps(0.5f), v);
  if constexpr (BITS == 4) v = _mm256_fmadd_ps(e8p_avx2(T, e8p_code(c + 2)), _mm256_set1_ps(0.25f), v);
  return v;
}

__attribute__((target("avx2,fma"), always_inline)) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// rows [n0, n1) for MR ≤ 4 rows of x: each block decoded once, a group's sums scaled once at its end
// (two sets, even and odd blocks, for two FMA chains in flight up to 2 rows)
template <int BITS, int MR>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Layer& L, const float* x, int64_t n0, int64_t n1,
                                                         float* y) {
  constexpr int U = MR <= 2 ? 2 : 1;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MR], part[U][MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    const uint8_t* c = L.codes + n * L.nb * L.B;
    const at::Half* sr = L.scales + n * L.G;
    for (int64_t b0 = 0, gi = 0; b0 < L.nb; b0 += L.bpg, ++gi) {
      const __m256 s = _mm256_set1_ps(static_cast<float>(sr[gi]));
      const int64_t b1 = std::min(L.nb, b0 + L.bpg);
      for (int u = 0; u < U; ++u)
        for (int m = 0; m < MR; ++m) part[u][m] = _mm256_setzero_ps();
      int64_t b = b0;
      for (; b + U <= b1; b += U)
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) {
          const __m256 w = block_avx2<BITS>(L.table, c + (b + u) * L.B);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m)
            part[u][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * L.K + (b + u) * 8), part[u][m]);
        }
      for (; b < b1; ++b) {
        const __m256 w = block_avx2<BITS>(L.table, c + b * L.B);
        for (int m = 0; m < MR; ++m) part[0][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * L.K + b * 8), part[0][m]);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 sum = U == 2 ? _mm256_add_ps(part[0][m], part[U - 1][m]) : part[0][m];
        acc[m] = _mm256_fmadd_ps(sum, s, acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) y[m * L.N + n] = hsum_avx2(acc[m]);
  }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void decode_rows_avx2(const Layer& L, int64_t n0, int64_t n1, float* w) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < L.nb; ++b) {
      const __m256 s = _mm256_set1_ps(static_cast<float>(L.scales[n * L.G + b / L.bpg]));
      _mm256_storeu_ps(w + (n - n0) * L.K + b * 8,
                       _mm256_mul_ps(block_avx2<BITS>(L.table, L.codes + (n * L.nb + b) * L.B), s));
    }
}
#endif

#if LATQ_CB_AVX512
// ------------------------------------------------------------------ AVX-512F: two blocks a register

__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 two(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

template <int BITS>
__attribute__((target("avx512f,avx2,fma,f16c"))) void rows_avx512(const Layer& L, const float* x, int64_t M, int64_t n0, int64_t n1,
                                                    float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[kMaxRows];
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* c = L.codes + n * L.nb * L.B;
    const at::Half* sr = L.scales + n * L.G;
    int64_t b = 0;
    for (; b + 2 <= L.nb; b += 2) {   // the two blocks may lie in two groups
      const __m512 s = two(_mm256_set1_ps(static_cast<float>(sr[b / L.bpg])),
                           _mm256_set1_ps(static_cast<float>(sr[(b + 1) / L.bpg])));
      const __m512 w = _mm512_mul_ps(two(block_avx2<BITS>(L.table, c + b * L.B), block_avx2<BITS>(L.table, c + (b + 1) * L.B)), s);
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * L.K + b * 8), acc[m]);
    }
    float tail[kMaxRows] = {};
    if (b < L.nb) {
      const __m256 w = _mm256_mul_ps(block_avx2<BITS>(L.table, c + b * L.B),
                                     _mm256_set1_ps(static_cast<float>(sr[b / L.bpg])));
      for (int64_t m = 0; m < M; ++m) tail[m] = hsum_avx2(_mm256_mul_ps(w, _mm256_loadu_ps(x + m * L.K + b * 8)));
    }
    for (int64_t m = 0; m < M; ++m) y[m * L.N + n] = _mm512_reduce_add_ps(acc[m]) + tail[m];
  }
}
#endif

// ------------------------------------------------------------------ dispatch

// the best one, or AVX2 where LATQ_CPU_ISA=avx2 (read once, as the GEMV reads it)
int isa_detect() {
  const char* e = std::getenv("LATQ_CPU_ISA");
  for (int isa = e && std::strcmp(e, "avx2") == 0 ? 1 : 2; isa > 0; --isa)
    if (latq_isa_runs(isa)) return isa;
  return 0;
}
std::atomic<int> g_isa{isa_detect()};
// rows from which decoded tiles + a GEMM beat decoding per call (docs/KERNELS.md, "E8 codebooks")
std::atomic<int64_t> g_large_m{20};

template <int BITS, int MR>
void rows_fixed(const Layer& L, const float* x, int64_t n0, int64_t n1, float* y) {
#if LATQ_CB_X86
  rows_avx2<BITS, MR>(L, x, n0, n1, y);
#endif
}

// rows [n0, n1) of y for rows [0, M) of x (M ≤ kMaxRows) on this instruction set
template <int BITS>
void rows(const Layer& L, const float* x, int64_t M, int64_t n0, int64_t n1, float* y, int isa) {
#if LATQ_CB_AVX512
  if (isa == 2) return rows_avx512<BITS>(L, x, M, n0, n1, y);
#endif
  if (isa == 0) return rows_scalar<BITS>(L, x, M, n0, n1, y);
  switch (M) {
    case 1: return rows_fixed<BITS, 1>(L, x, n0, n1, y);
    case 2: return rows_fixed<BITS, 2>(L, x, n0, n1, y);
    case 3: return rows_fixed<BITS, 3>(L, x, n0, n1, y);
    default: return rows_fixed<BITS, 4>(L, x, n0, n1, y);
  }
}

template <int BITS>
void decode_rows(const Layer& L, int64_t n0, int64_t n1, float* w, int isa) {
#if LATQ_CB_X86
  if (isa >= 1) return decode_rows_avx2<BITS>(L, n0, n1, w);
#endif
  decode_rows_scalar<BITS>(L, n0, n1, w);
}

// y [M, N] fp32 = xf [M, K] fp32 · Wᵀ
template <int BITS>
void gemm(const Layer& L, const at::Tensor& xf, at::Tensor& y) {
  const int64_t M = xf.size(0), isa = g_isa.load();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M < g_large_m.load()) {
    const int64_t grain = std::max<int64_t>(1, 16384 / L.K);   // rows a task: ≥ 16k weights
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      at::parallel_for(0, L.N, grain, [&](int64_t n0, int64_t n1) {
        rows<BITS>(L, xp + m0 * L.K, std::min<int64_t>(kMaxRows, M - m0), n0, n1, yp + m0 * L.N, isa);
      });
    return;
  }
  // tiles of rows ≤ 4 MB of fp32, 16 rows at least
  const int64_t tile = std::max<int64_t>(16, (int64_t{1} << 20) / L.K / 16 * 16);
  at::Tensor w = at::empty({std::min(tile, L.N), L.K}, xf.options());
  for (int64_t r0 = 0; r0 < L.N; r0 += tile) {
    const int64_t R = std::min(tile, L.N - r0);
    float* wp = w.data_ptr<float>();
    at::parallel_for(r0, r0 + R, 1, [&](int64_t n0, int64_t n1) { decode_rows<BITS>(L, n0, n1, wp + (n0 - r0) * L.K, isa); });
    y.narrow(1, r0, R).copy_(at::mm(xf, w.narrow(0, 0, R).t()));
  }
}

}  // namespace cb

at::Tensor codebook_linear(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                           at::IntArrayRef ints, const std::optional<at::Tensor>& bias, int64_t out_features) {
  // CodebookState, flattened: tensors = (codes, scales, table[, rotation signs]), ints = (bits, group_size,
  // in_features)
  TORCH_CHECK((tensors.size() == 3 || tensors.size() == 4) && ints.size() == 3,
              "latq_cpu::codebook_linear: not a CodebookState");
  const at::Tensor codes = *tensors.get(0), scales = *tensors.get(1), table = *tensors.get(2);
  const int64_t bits = ints[0], group = ints[1], K = ints[2], N = out_features;
  TORCH_CHECK(bits >= 2 && bits <= 4, "latq_cpu::codebook_linear: ", bits, "-bit codes (2, 3 or 4)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == N &&
                  codes.size(1) * 8 == K && codes.size(2) == bits,   // a code's bytes: 8 weights × bits
              "latq_cpu::codebook_linear: codes must be uint8 [out, in/8, bytes], contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == N &&
                  group % 8 == 0 && scales.size(1) == (K + group - 1) / group,
              "latq_cpu::codebook_linear: scales must be fp16 [out, ceil(in/group)], contiguous, group a multiple of 8");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.numel() == cb::kRows * 8 &&
                  reinterpret_cast<uintptr_t>(table.data_ptr()) % 32 == 0,
              "latq_cpu::codebook_linear: table must be fp32 [642, 8], contiguous, 32-byte aligned");
  TORCH_CHECK(x.size(-1) == K, "latq_cpu::codebook_linear: x has ", x.size(-1), " columns, the layer ", K);
  const std::optional<at::Tensor> signs = tensors.size() == 4 ? tensors.get(3) : std::nullopt;
  const at::Tensor& xr = signs.has_value() && signs->defined() ? latq_hadamard_scratch(x, *signs) : x;
  const int64_t M = K ? x.numel() / K : 0;
  const at::Tensor xf = xr.reshape({M, K}).to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, xf.options());
  const cb::Layer L{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), table.data_ptr<float>(),
                    N, K, K / 8, codes.size(2), scales.size(1), group / 8};
  if (M > 0) {
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
  TORCH_CHECK(latq_isa_runs(isa), "latq_cpu::set_codebook_isa: ", name, " does not run here");
  cb::g_isa.store(isa);
}

void set_codebook_large_m(int64_t m) { cb::g_large_m.store(m); }
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
