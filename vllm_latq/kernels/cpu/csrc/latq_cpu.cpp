// The CPU fast path's small-M call in C++ (built on first use by vllm_latq/native.py): an
// int4 GEMM for the inliers, then one pass over the output that adds the fp32 outliers and the
// bias and casts — CPUKernel.apply's math (out = dtype(float(y_int4) + Σ val·x[col] + bias))
// without its half-dozen dispatched torch calls per layer and without Python between them.
// Outliers come as the GEMV's tiles (Fin below; whenever the GEMV can run here) or as a CSR,
// summed by a plain loop (MKL's CSR call costs ~5 µs of setup, as much as a small layer's
// whole int4 GEMM) or, for large sets, by MKL.
//
// On AVX-512 BF16 CPUs, and AVX2 + FMA + F16C ones (block_rows_avx2, chosen at run time), the
// int4 GEMM is this file's own GEMV over the same state (gemv::
// below; the op's math up to fp32 summation order): torch's op is compute/latency bound when
// its weights come from DRAM and re-dequantizes them every 4 rows; the GEMV streams them at
// DRAM speed once per call and unpacks each weight once for up to 8 rows (bench/cpu_layer.py
// --sections gemv / large: 30 SmolLM2 blocks at M=1 3.5 → 2.0 ms; 4096² at M=16/64/128
// 4.0/15.8/31.3 → 2.0/8.6/17.0 ms; faster than the dequant + bf16 GEMM path up to M ≈ 700).
// LATQ_CPU_GEMV=0 (read once) keeps torch's op where it reads the GEMV's packed layout; where it
// does not (torch's AVX2 kernel packs 32-row blocks), the GEMV is then off and the state is torch's.
//
//   latq_cpu::small_linear(x2d, packed, scales, crow?, col?, val?, tile_off?, tile_rows?,
//                          tile_col?, tile_val?, row_scale?, bias?, group, planes)
//   latq_cpu::gemv(x [M, K] bf16, packed, scales, group)   the GEMV alone (bench, tests; one plane)
//   latq_cpu::set_gemv_max_m(m), latq_cpu::gemv_max_m()          A/B switch (0: torch's op)
//   latq_cpu::set_prefetch_l2(on)   A/B switch (off: the weights prefetched into L1, 2 KB ahead)
//   latq_cpu::linear(x, tensors, ints, bias, out_features)   the schema of latq::cpu_linear;
//       rows ≥ the large-M threshold go back to latq::cpu_linear (Python: dequant + GEMM); an
//       11th tensor, a rotated layer's signs, rotates x first (latq_hadamard, hadamard.cpp)
//   latq_cpu::plain_linear(x, packed, scales, ints, out_features)   linear() without outliers and bias
//   latq_cpu::rotated_plain_linear(x, packed, scales, ints, out_features, signs)   the same, x rotated first
//   latq_cpu::set_large_m(m), latq_cpu::set_loop_max(n)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <mutex>
#include <type_traits>
#include <utility>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LATQ_HAVE_AVX2 1   // compiled per function (target attribute), taken at run time by cpuid
#else
#define LATQ_HAVE_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define LATQ_HAVE_GEMV 1
#else
#define LATQ_HAVE_GEMV 0
#endif

at::Tensor latq_hadamard(const at::Tensor& x, const at::Tensor& signs);                 // hadamard.cpp
const at::Tensor& latq_hadamard_scratch(const at::Tensor& x, const at::Tensor& signs);

namespace {

std::atomic<int64_t> g_large_m{128};
// outliers up to which the loop sums them at M = 1; above, MKL's threaded CSR mv (~5 µs of
// setup per call) is faster. Measured: the loop 0.7–1.5 ns per outlier on one thread; MKL's
// mv 32 µs for 4096² at 1% (168k) on 2 threads; on SmolLM2's 1–9k-outlier layers the loop
// saves 3–8 µs per layer. Set from vllm_latq.native.LOOP_MAX.
std::atomic<int64_t> g_loop_max{16384};

constexpr int64_t kMB = 16;  // activation rows per pass of the outlier loop (M ≤ kMB: loop)

// acc[0..MB) = Σ_k val[k]·xT[col[k]·MB + m]: xT is [K, MB] fp32 (rows padded with zeros),
// so the inner loop over m is one vector FMA
template <int MB>
inline void row_dot(const int32_t* col, const float* val, int32_t a, int32_t b, const float* xT, float* acc) {
  if constexpr (MB == 1) {  // four chains: one fp32 add chain would wait on its latency
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int32_t k = a;
    for (; k + 4 <= b; k += 4) {
      s0 += val[k] * xT[col[k]];
      s1 += val[k + 1] * xT[col[k + 1]];
      s2 += val[k + 2] * xT[col[k + 2]];
      s3 += val[k + 3] * xT[col[k + 3]];
    }
    for (; k < b; ++k) s0 += val[k] * xT[col[k]];
    acc[0] = (s0 + s1) + (s2 + s3);
  } else {
    float s[MB] = {};
    for (int32_t k = a; k < b; ++k) {
      const float v = val[k];
      const float* xr = xT + static_cast<int64_t>(col[k]) * MB;
      for (int m = 0; m < MB; ++m) s[m] += v * xr[m];
    }
    for (int m = 0; m < MB; ++m) acc[m] = s[m];
  }
}

template <typename T>
void finish(const at::BFloat16* y, const float* ys, const float* bias, int64_t M, int64_t N, const int32_t* crow,
            const int32_t* col, const float* val, const T* x, int64_t K, T* out) {
  // out[m, r] = T(float(y[m, r]) + outliers[m, r] + bias[r]); outliers from ys (MKL, [M, N]),
  // from the loop over the CSR (crow != null), or none
  std::vector<float> xT;
  for (int64_t m0 = 0; m0 < M; m0 += kMB) {
    const int64_t mb = std::min(kMB, M - m0);
    const int MB = mb == 1 ? 1 : mb <= 4 ? 4 : mb <= 8 ? 8 : 16;
    if (crow) {
      xT.assign(K * MB, 0.f);
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t k = 0; k < K; ++k) xT[k * MB + m] = static_cast<float>(x[(m0 + m) * K + k]);
    }
    for (int64_t r = 0; r < N; ++r) {
      float acc[kMB] = {};
      if (crow) {
        switch (MB) {
          case 1: row_dot<1>(col, val, crow[r], crow[r + 1], xT.data(), acc); break;
          case 4: row_dot<4>(col, val, crow[r], crow[r + 1], xT.data(), acc); break;
          case 8: row_dot<8>(col, val, crow[r], crow[r + 1], xT.data(), acc); break;
          default: row_dot<16>(col, val, crow[r], crow[r + 1], xT.data(), acc); break;
        }
      }
      const float b = bias ? bias[r] : 0.f;
      for (int64_t m = 0; m < mb; ++m) {
        const int64_t i = (m0 + m) * N + r;
        float o = static_cast<float>(y[i]) + (ys ? ys[i] : acc[m]);
        if (bias) o += b;
        out[i] = static_cast<T>(o);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// An int4 GEMV over the op's own state (same packed weights, same bf16 scales_zeros),
// the op's math up to fp32 summation order: y[n] = bf16(Σ_g s_gn·Σ_{k∈g} x_k·(u_nk − 8)
// + z_gn·Σ_{k∈g} x_k), x in bf16, products exact, sums in fp32.
//
// The GEMV's layout is torch's AVX-512 int4pack layout (layouts.pack_gemv builds it on any CPU;
// where _convert_weight_to_int4pack_for_cpu packs the same, torch's op reads it too):
// blocks of 64 rows, K-major; the 32 bytes of (block, k) hold row j (low nibble) and row j+32
// (high nibble); a tail block of R < 64 rows holds R/2 bytes per k, rows 2j / 2j+1.
// One 64-byte load = k and k+1 of a block. vpermb gathers byte j of k and of k+1 into the two
// words of dword j (16 rows per zmm), vpermw maps each word's low nibble (after a shift: the
// high nibble) to bf16(u − 8) from a 16-entry table (duplicated: vpermw reads 5 index bits),
// and vdpbf16ps adds x_k·w_k + x_{k+1}·w_{k+1} (exact products, fp32 sums) into 16 rows.
// Per 128 weights: 1 load, 2 vpermb, 2 shifts, 4 vpermw, 4 vdpbf16ps. Per group the 4×16 row
// sums are folded: y += s·acc + z·Σx_g. Blocks are split across threads (one region a call).
// M > 1: blocks_m below.
//
// Scales: the op's (s, z) bf16 pairs, or — the CPU kernel's layout wherever this GEMV runs —
// bf16 scales alone, half the bytes: the zero of an int4pack group is 0, or 8·s on the low plane
// of a two-plane (5–8-bit) layer, so it need not be streamed; a one-scale (HPTQ) layer then has
// one group per plane (g = K): 2 bytes a row instead of 4 per 32–256 weights. Or coded, as the
// checkpoint stores them (format/scale_codes.py; CPUKernel.prepare's words, one-plane layers):
// per group and 16 rows, fp16 min and step and 16 4-bit codes, 12 bytes instead of 32; decoded
// where they are read to bf16(fp16(min + code·step)), the bf16 of the format's fp16 scale, so
// a coded state computes exactly what the same layer's decoded scales compute.
namespace gemv {

inline float bf(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Scales {
  const uint32_t* sz = nullptr;  // [G, N] (s, z) pairs, or null:
  const uint16_t* s = nullptr;   // [G, N] scales; z = 8·s in groups < zlow, else 0
  int64_t zlow = 0;
  const int32_t* coded = nullptr;  // or [G, N/16, 3]: fp16 min | fp16 step << 16, then the 16 rows'
                                   // codes (row 2j: low nibble of byte j, 2j+1: high); z = 0
};

inline bool is_coded(const at::Tensor& scales) { return scales.scalar_type() == at::kInt; }

#if LATQ_HAVE_AVX2
// The scales of 64-row block b into L1: one short run per group, N rows apart, which the
// hardware's stream prefetchers do not follow — each group's first read would wait on memory.
inline void prefetch_scales(const Scales& sc, int64_t G, int64_t N, int64_t b) {
  const char* p;
  int64_t row, bytes;
  if (sc.coded) {
    p = reinterpret_cast<const char*>(sc.coded + b * 4 * 3), row = N / 16 * 12, bytes = 48;
  } else if (sc.sz) {
    p = reinterpret_cast<const char*>(sc.sz + b * 64), row = 4 * N, bytes = 256;
  } else {
    p = reinterpret_cast<const char*>(sc.s + b * 64), row = 2 * N, bytes = 128;
  }
  for (int64_t gi = 0; gi < G; ++gi, p += row)   // every line the run touches, aligned or not
    for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a < reinterpret_cast<uintptr_t>(p) + bytes; a += 64)
      _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}

// at block b of a thread's blocks [b0, b1): the next block's scales (and, at b0, its own)
inline void prefetch_scales_ahead(const Scales& sc, int64_t G, int64_t N, int64_t b, int64_t b0, int64_t b1) {
  if (b == b0) prefetch_scales(sc, G, N, b);
  if (b + 1 < b1) prefetch_scales(sc, G, N, b + 1);
}
#endif

inline float half_bits(uint32_t h) { return static_cast<float>(c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits())); }

// the scale of row j (< 16) of one 16-row block's words w: bf16(fp16(min + code·step)), the
// product exact in fp32 (11-bit mantissa × 4-bit code), so the sum is the format's one rounding
inline float coded_scale(const int32_t* w, int64_t j) {
  const uint32_t ms = static_cast<uint32_t>(w[0]);
  const int c = (reinterpret_cast<const uint8_t*>(w + 1)[j / 2] >> (4 * (j % 2))) & 15;
  const float s16 = static_cast<float>(c10::Half(half_bits(ms & 0xFFFF) + static_cast<float>(c) * half_bits(ms >> 16)));
  return static_cast<float>(c10::BFloat16(s16));
}

// scales [G, N, 2] (pairs), [G, N] (alone, ``planes`` planes along K: the first half of the
// groups is the low plane) or int32 [G, N/16, 3] (coded, one plane)
inline Scales scales_of(const at::Tensor& t, int64_t planes) {
  Scales sc;
  if (is_coded(t)) {
    TORCH_CHECK(planes == 1, "latq_cpu: coded scales on a ", planes, "-plane layer");
    sc.coded = t.data_ptr<int32_t>();
  } else if (t.dim() == 3) {
    sc.sz = reinterpret_cast<const uint32_t*>(t.data_ptr<at::BFloat16>());
  } else {
    sc.s = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    sc.zlow = planes == 2 ? t.size(0) / 2 : 0;
  }
  return sc;
}

// s, z of group gi, row r
inline void scale_zero(const Scales& sc, int64_t gi, int64_t N, int64_t r, float& s, float& z) {
  if (sc.coded) {
    s = coded_scale(sc.coded + (gi * (N / 16) + r / 16) * 3, r % 16);
    z = 0.f;
  } else if (sc.sz) {
    const uint32_t v = sc.sz[gi * N + r];
    s = bf(v & 0xFFFF);
    z = bf(v >> 16);
  } else {
    s = bf(sc.s[gi * N + r]);
    z = gi < sc.zlow ? 8.f * s : 0.f;
  }
}

// LATQ_CPU_GEMV=0 or false (any case), read once: torch's op instead of the GEMV; the package refuses
// any other value but 1, true and empty before it loads this library (vllm_latq/env.py's flag rule)
const bool g_env_off = [] {
  const char* e = std::getenv("LATQ_CPU_GEMV");
  return e && (std::strcmp(e, "0") == 0 || strcasecmp(e, "false") == 0);
}();

// rows up to which small_linear takes the GEMV: by default every M it is given (the large-M
// path takes over from cpu.large_m() = 640 rows, near where dequant + bf16 GEMM gets faster)
std::atomic<int64_t> g_max_m{g_env_off ? int64_t{0} : int64_t{1} << 30};

// The weights stream through once a call. Where memory bounds the GEMV (1 or 2 rows of x), they
// are prefetched into L2 8 KB ahead: enough lines in flight for one core's memory bandwidth, where
// prefetches into L1 queue on its few miss buffers; from 4 rows the arithmetic bounds it and the
// L1 prefetch 2 KB ahead stays (docs/KERNELS.md, "Streaming the weights"). Off: L1 everywhere
// (the bench's A/B).
std::atomic<bool> g_prefetch_l2{true};

#if LATQ_HAVE_GEMV
class Prefetch {
 public:
  explicit Prefetch(bool memory_bound) : l2_(memory_bound && g_prefetch_l2.load(std::memory_order_relaxed)) {}
  // the line 64·line bytes past p, ahead of the loop that reads it
  inline void operator()(const uint8_t* p, int line = 0) const {
    const char* a = reinterpret_cast<const char*>(p) + 64 * line;
    if (l2_) _mm_prefetch(a + 8192, _MM_HINT_T1);
    else _mm_prefetch(a + 2048, _MM_HINT_T0);
  }

 private:
  bool l2_;
};
#endif

// 1: torch's packer lays weights out as the GEMV reads them, 0: not (its AVX2/scalar kernels),
// -1: not probed yet
std::atomic<int> g_layout{-1};

// whether torch's op can read the GEMV's packed weights (an A/B switch to it is then possible)
bool op_layout_ok() {
  int s = g_layout.load();
  if (s >= 0) return s == 1;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_layout.load() < 0) {
    const int64_t N = 80, K = 8;  // one full block + a 16-row tail
    at::Tensor u = at::empty({N, K}, at::kInt);
    int32_t* up = u.data_ptr<int32_t>();
    for (int64_t i = 0; i < N * K; ++i) up[i] = static_cast<int32_t>((i * 7 + i / 5) % 16);
    at::Tensor p = at::_convert_weight_to_int4pack_for_cpu(u, 1).contiguous();
    bool ok = p.scalar_type() == at::kByte && p.numel() == N * K / 2;
    if (ok) {
      const uint8_t* b = p.data_ptr<uint8_t>();
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < 32; ++j)
          ok &= b[k * 32 + j] == (up[j * K + k] | (up[(j + 32) * K + k] << 4));
        for (int64_t j = 0; j < 8; ++j)
          ok &= b[64 * K / 2 + k * 8 + j] == (up[(64 + 2 * j) * K + k] | (up[(65 + 2 * j) * K + k] << 4));
      }
    }
    g_layout.store(ok ? 1 : 0);
  }
  return g_layout.load() == 1;
}

#if LATQ_HAVE_GEMV
inline __m512 dp(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }

// s, z of group gi, rows r .. r + 15
inline void scale_zero16(const Scales& sc, int64_t gi, int64_t N, int64_t r, __m512& s, __m512& z) {
  if (sc.coded) {   // r is a multiple of 16: one block's words, coded_scale for 16 rows at once
    const int32_t* w = sc.coded + (gi * (N / 16) + r / 16) * 3;
    int64_t c8;
    std::memcpy(&c8, w + 1, 8);
    const __m128i b = _mm_cvtsi64_si128(c8), m4 = _mm_set1_epi8(15);
    const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));   // row j: byte j
    const __m128 grid = _mm_cvtph_ps(_mm_cvtsi32_si128(w[0]));   // min, step
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c)),
                                     _mm512_broadcastss_ps(_mm_movehdup_ps(grid)), _mm512_broadcastss_ps(grid));
    const __m512 s16 = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s16)), 16));
    z = _mm512_setzero_ps();
  } else if (sc.sz) {
    const __m512i v = _mm512_loadu_si512(sc.sz + gi * N + r);
    s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc.s + gi * N + r));
    s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    z = gi < sc.zlow ? _mm512_mul_ps(s, _mm512_set1_ps(8.f)) : _mm512_setzero_ps();   // exact
  }
}

// full 64-row blocks [b0, b1): x bf16 [K] (as raw bits), xs fp32 [K/g] group sums,
// sc the scales [K/g, N], y bf16 [N]
// the vpermb indices and the nibble → bf16(u − 8) table, built once (blocks() runs per 64-row block)
struct Tables {
  alignas(64) uint8_t i1[64], i2[64];
  alignas(64) uint16_t t[32];
};

const Tables& tables() {
  static const Tables tb = [] {
    Tables x;
    for (int i = 0; i < 16; ++i) {
      x.i1[4 * i] = x.i1[4 * i + 1] = i;
      x.i1[4 * i + 2] = x.i1[4 * i + 3] = 32 + i;
      x.i2[4 * i] = x.i2[4 * i + 1] = 16 + i;
      x.i2[4 * i + 2] = x.i2[4 * i + 3] = 48 + i;
    }
    for (int i = 0; i < 32; ++i) {
      const float f = static_cast<float>((i & 15) - 8);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      x.t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
    }
    return x;
  }();
  return tb;
}

void blocks(const uint16_t* x, const float* xs, const uint8_t* P, const Scales& sc, int64_t N, int64_t K,
            int64_t g, int64_t b0, int64_t b1, uint16_t* y) {
  const Tables& tb = tables();
  const __m512i idx1 = _mm512_load_si512(tb.i1), idx2 = _mm512_load_si512(tb.i2), T = _mm512_load_si512(tb.t);
  const int64_t G = K / g;
  const Prefetch prefetch(true);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = P + b * K * 32;
    __m512 y0 = _mm512_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
    for (int64_t gi = 0; gi < G; ++gi) {
      const uint8_t* p = wb + gi * g * 32;
      const uint16_t* xg = x + gi * g;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
      for (int64_t k = 0; k < g; k += 4, p += 128) {
        prefetch(p);
        prefetch(p, 1);
        int32_t xa, xb;
        std::memcpy(&xa, xg + k, 4);
        std::memcpy(&xb, xg + k + 2, 4);
        const __m512i va = _mm512_loadu_si512(p), vb = _mm512_loadu_si512(p + 64);
        const __m512i xva = _mm512_set1_epi32(xa), xvb = _mm512_set1_epi32(xb);
        const __m512i za1 = _mm512_permutexvar_epi8(idx1, va), za2 = _mm512_permutexvar_epi8(idx2, va);
        const __m512i zb1 = _mm512_permutexvar_epi8(idx1, vb), zb2 = _mm512_permutexvar_epi8(idx2, vb);
        a0 = dp(a0, _mm512_permutexvar_epi16(za1, T), xva);
        a1 = dp(a1, _mm512_permutexvar_epi16(za2, T), xva);
        a2 = dp(a2, _mm512_permutexvar_epi16(_mm512_srli_epi16(za1, 4), T), xva);
        a3 = dp(a3, _mm512_permutexvar_epi16(_mm512_srli_epi16(za2, 4), T), xva);
        c0 = dp(c0, _mm512_permutexvar_epi16(zb1, T), xvb);
        c1 = dp(c1, _mm512_permutexvar_epi16(zb2, T), xvb);
        c2 = dp(c2, _mm512_permutexvar_epi16(_mm512_srli_epi16(zb1, 4), T), xvb);
        c3 = dp(c3, _mm512_permutexvar_epi16(_mm512_srli_epi16(zb2, 4), T), xvb);
      }
      const __m512 xsg = _mm512_set1_ps(xs[gi]);
      auto fold = [&](__m512 yv, __m512 acc, int r) {
        __m512 s, z;
        scale_zero16(sc, gi, N, b * 64 + r, s, z);
        return _mm512_fmadd_ps(xsg, z, _mm512_fmadd_ps(acc, s, yv));
      };
      y0 = fold(y0, _mm512_add_ps(a0, c0), 0);
      y1 = fold(y1, _mm512_add_ps(a1, c1), 16);
      y2 = fold(y2, _mm512_add_ps(a2, c2), 32);
      y3 = fold(y3, _mm512_add_ps(a3, c3), 48);
    }
    uint16_t* yb = y + b * 64;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb), (__m256i)_mm512_cvtneps_pbh(y0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + 16), (__m256i)_mm512_cvtneps_pbh(y1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + 32), (__m256i)_mm512_cvtneps_pbh(y2));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + 48), (__m256i)_mm512_cvtneps_pbh(y3));
  }
}

// MB = 2..8 activation rows: one unpack serves every row (per 128 weights: 2 vpermb, 2 shifts,
// 4 vpermw, 4·MB vdpbf16ps). 4·MB accumulators would not fit in 32 registers, so a block is
// done in two halves — vpermb with i1 gives rows 0–15 (low nibbles) and 32–47 (high), i2 rows
// 16–31 and 48–63 — each with 2·MB accumulators; the second half re-reads the group's bytes
// from L1. U = 2 interleaves two k-pairs at MB ≤ 4 so that ≥ 8 vdpbf16ps chains hide latency.
template <int MB>
void blocks_m(const uint16_t* x, int64_t ldx, const float* xs, const uint8_t* P, const Scales& sc, int64_t N,
              int64_t K, int64_t g, int64_t b, uint16_t* y, int64_t ldy) {
  constexpr int U = MB <= 4 ? 2 : 1;
  const Tables& tb = tables();
  const __m512i T = _mm512_load_si512(tb.t);
  const int64_t G = K / g;
  const uint8_t* wb = P + b * K * 32;
  const Prefetch prefetch(MB <= 2);
  alignas(64) float yv[MB][64] = {};
  for (int64_t gi = 0; gi < G; ++gi) {
    for (int h = 0; h < 2; ++h) {
      const __m512i idx = _mm512_load_si512(h ? tb.i2 : tb.i1);
      __m512 acc[U][MB][2];
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u)
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) acc[u][m][0] = acc[u][m][1] = _mm512_setzero_ps();
      const uint8_t* p = wb + gi * g * 32;
      for (int64_t k = gi * g; k < (gi + 1) * g; k += 2 * U, p += 64 * U) {
        if (h == 0) prefetch(p);
        if (h == 0 && U == 2) prefetch(p, 1);
#pragma GCC unroll 16
        for (int u = 0; u < U; ++u) {
          const __m512i z = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(p + 64 * u));
          const __m512i wlo = _mm512_permutexvar_epi16(z, T), whi = _mm512_permutexvar_epi16(_mm512_srli_epi16(z, 4), T);
#pragma GCC unroll 16
          for (int m = 0; m < MB; ++m) {
            int32_t xv;
            std::memcpy(&xv, x + m * ldx + k + 2 * u, 4);
            const __m512i xb = _mm512_set1_epi32(xv);
            acc[u][m][0] = dp(acc[u][m][0], wlo, xb);
            acc[u][m][1] = dp(acc[u][m][1], whi, xb);
          }
        }
      }
      __m512 s[2], zz[2];   // once for the MB rows (coded scales are decoded here)
      scale_zero16(sc, gi, N, b * 64 + 16 * h, s[0], zz[0]);
      scale_zero16(sc, gi, N, b * 64 + 32 + 16 * h, s[1], zz[1]);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const __m512 xsg = _mm512_set1_ps(xs[m * G + gi]);
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
          const int r = 32 * e + 16 * h;
          __m512 a = acc[0][m][e];
          if (U == 2) a = _mm512_add_ps(a, acc[U - 1][m][e]);
          _mm512_store_ps(yv[m] + r, _mm512_fmadd_ps(xsg, zz[e], _mm512_fmadd_ps(a, s[e], _mm512_load_ps(yv[m] + r))));
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    uint16_t* yb = y + m * ldy + b * 64;
    for (int r = 0; r < 64; r += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + r), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(yv[m] + r)));
  }
}

// rows m0 .. m0 + mb of x (mb ≤ 8) through one 64-row block
void block_rows(const uint16_t* x, int64_t K, const float* xs, const uint8_t* P, const Scales& sc, int64_t N,
                int64_t g, int64_t b, uint16_t* y, int64_t mb) {
  switch (mb) {
    case 1: blocks(x, xs, P, sc, N, K, g, b, b + 1, y); break;
    case 2: blocks_m<2>(x, K, xs, P, sc, N, K, g, b, y, N); break;
    case 3: blocks_m<3>(x, K, xs, P, sc, N, K, g, b, y, N); break;
    case 4: blocks_m<4>(x, K, xs, P, sc, N, K, g, b, y, N); break;
    case 5: blocks_m<5>(x, K, xs, P, sc, N, K, g, b, y, N); break;
    case 6: blocks_m<6>(x, K, xs, P, sc, N, K, g, b, y, N); break;
    case 7: blocks_m<7>(x, K, xs, P, sc, N, K, g, b, y, N); break;
    default: blocks_m<8>(x, K, xs, P, sc, N, K, g, b, y, N); break;
  }
}
#endif


// The same GEMV for CPUs with AVX2 + FMA but no AVX-512 BF16: one 64-row block, mb ≤ 8 rows of
// x (as fp32, xf). A k's 32 bytes are 8 lanes of 8 nibbles: nibble j of lane l is row
// nibble_row(j, l), read as u·16^j by masking it in place (the top one, j = 7, by a shift: it
// would overflow int32) — one integer op per 8 weights besides the conversion and the FMA, which
// share two ports. Accumulator j sums x·u·16^j (exact products, each row's k in order); the scale
// takes the 16^−j back (exact), and u − 8's 8 moves into the zero term, s·Σx·u + (z − 8s)·Σx: the
// op's math, rounded in fp32 a little differently from blocks() — far below the bf16 output's rounding.
#if LATQ_HAVE_AVX2
inline int nibble_row(int j, int l) { return 4 * l + j / 2 + 32 * (j & 1); }

// u·16^j of nibble j in every lane (u for j = 7)
template <int J>
__attribute__((target("avx2,fma,f16c"))) inline __m256 nibble_u(__m256i v) {
  if constexpr (J == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(15u << (4 * J)))));
}

template <int... J>
__attribute__((target("avx2,fma,f16c"))) inline void fma_nibbles(std::integer_sequence<int, J...>, __m256i v,
                                                                  __m256 xk, __m256* a) {
  ((a[J] = _mm256_fmadd_ps(xk, nibble_u<J>(v), a[J])), ...);
}

// MB rows of x through nibble J over one group: acc[m][J] = Σ_k x[m][k]·u·16^J
template <int MB, int J>
__attribute__((target("avx2,fma,f16c"))) inline void nibble_pass(const uint8_t* pg, int64_t g, const float* xg,
                                                                  int64_t K, __m256 (*acc)[8]) {
  __m256 a[MB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) a[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < g; ++k) {
    if constexpr (J == 0) _mm_prefetch(reinterpret_cast<const char*>(pg + k * 32 + 1024), _MM_HINT_T0);
    const __m256 w = nibble_u<J>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + k * 32)));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) a[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(xg + m * K + k), w, a[m]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) acc[m][J] = a[m];
}

template <int MB, int... J>
__attribute__((target("avx2,fma,f16c"))) inline void nibble_passes(std::integer_sequence<int, J...>, const uint8_t* pg,
                                                                    int64_t g, const float* xg, int64_t K,
                                                                    __m256 (*acc)[8]) {
  (nibble_pass<MB, J>(pg, g, xg, K, acc), ...);
}

// of group gi for the rows nibble_row(j, l) of block b: s[j][l]·16^−j (16^0 for j = 7) and
// z[j][l] − 8·s[j][l]
__attribute__((target("avx2,fma,f16c"))) void nibble_scales(const Scales& sc, int64_t gi, int64_t N, int64_t b,
                                                             float (*s)[8], float (*z)[8]) {
  if (sc.s) {   // the usual layout: bf16 scales alone, widened 8 at a time
    alignas(32) float lin[64];
    const uint16_t* src = sc.s + gi * N + b * 64;
    for (int r = 0; r < 64; r += 8)
      _mm256_store_si256(reinterpret_cast<__m256i*>(lin + r), _mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r))), 16));
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 8; ++l) {
        s[j][l] = lin[nibble_row(j, l)];
        z[j][l] = gi < sc.zlow ? 8.f * s[j][l] : 0.f;
      }
  } else {
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 8; ++l) scale_zero(sc, gi, N, b * 64 + nibble_row(j, l), s[j][l], z[j][l]);
  }
  for (int j = 0; j < 8; ++j) {
    const __m256 sj = _mm256_load_ps(s[j]);
    _mm256_store_ps(z[j], _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sj, _mm256_load_ps(z[j])));
    _mm256_store_ps(s[j], _mm256_mul_ps(sj, _mm256_set1_ps(std::ldexp(1.f, j == 7 ? 0 : -4 * j))));
  }
}

// y row block += per group: s'·acc + z'·Σx (nibble_scales), for MB rows of accumulators acc[m][j]
template <int MB>
__attribute__((target("avx2,fma,f16c"))) void block_rows_avx2_m(const float* xf, int64_t K, const float* xs,
                                                                 const uint8_t* P, const Scales& sc, int64_t N,
                                                                 int64_t g, int64_t b, uint16_t* y) {
  const int64_t G = K / g;
  const uint8_t* wb = P + b * K * 32;
  __m256 yv[MB][8];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 8; ++j) yv[m][j] = _mm256_setzero_ps();
  alignas(32) float s[8][8], z[8][8];
  for (int64_t gi = 0; gi < G; ++gi) {
    const uint8_t* pg = wb + gi * g * 32;
    __m256 acc[MB][8];
    if constexpr (MB == 1) {   // every nibble per k: eight independent FMA chains
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[0][j] = _mm256_setzero_ps();
      for (int64_t k = 0; k < g; ++k) {
        const uint8_t* p = pg + k * 32;
        _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
        fma_nibbles(std::make_integer_sequence<int, 8>{}, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                    _mm256_broadcast_ss(xf + gi * g + k), acc[0]);
      }
    } else {   // one nibble at a time over the group: MB chains, x's rows broadcast from L1
      nibble_passes<MB>(std::make_integer_sequence<int, 8>{}, pg, g, xf + gi * g, K, acc);
    }
    nibble_scales(sc, gi, N, b, s, z);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xsg = _mm256_set1_ps(xs[m * G + gi]);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        yv[m][j] = _mm256_fmadd_ps(xsg, _mm256_load_ps(z[j]), _mm256_fmadd_ps(acc[m][j], _mm256_load_ps(s[j]), yv[m][j]));
    }
  }
  alignas(32) float out[8];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 8; ++j) {
      _mm256_store_ps(out, yv[m][j]);
      for (int l = 0; l < 8; ++l) y[m * N + b * 64 + nibble_row(j, l)] = at::BFloat16(out[l]).x;   // nearest even
    }
}

void block_rows_avx2(const float* xf, int64_t K, const float* xs, const uint8_t* P, const Scales& sc, int64_t N,
                     int64_t g, int64_t b, uint16_t* y, int64_t mb) {
  switch (mb) {
    case 1: block_rows_avx2_m<1>(xf, K, xs, P, sc, N, g, b, y); break;
    case 2: block_rows_avx2_m<2>(xf, K, xs, P, sc, N, g, b, y); break;
    case 3: block_rows_avx2_m<3>(xf, K, xs, P, sc, N, g, b, y); break;
    case 4: block_rows_avx2_m<4>(xf, K, xs, P, sc, N, g, b, y); break;
    case 5: block_rows_avx2_m<5>(xf, K, xs, P, sc, N, g, b, y); break;
    case 6: block_rows_avx2_m<6>(xf, K, xs, P, sc, N, g, b, y); break;
    case 7: block_rows_avx2_m<7>(xf, K, xs, P, sc, N, g, b, y); break;
    default: block_rows_avx2_m<8>(xf, K, xs, P, sc, N, g, b, y); break;
  }
}
#endif

// the instruction sets the GEMV can run on here: 2 AVX-512 BF16 (this build and this CPU), 1
// AVX2 + FMA + F16C; the best one runs unless LATQ_CPU_ISA=avx2 (read once) or set_gemv_isa
// picks AVX2 where both run (tests, bench)
bool isa_runs(int isa) {
#if LATQ_HAVE_GEMV
  if (isa == 2) return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
#endif
#if LATQ_HAVE_AVX2
  if (isa == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return isa == 0;
}

int isa_detect() {
  const char* e = std::getenv("LATQ_CPU_ISA");
  const int top = e && std::strcmp(e, "avx2") == 0 ? 1 : 2;
  for (int isa = top; isa > 0; --isa)
    if (isa_runs(isa)) return isa;
  return 0;
}
std::atomic<int> g_isa{isa_detect()};

// the tail block: rows [r0, N) (N − r0 < 64, even), R/2 bytes per k, rows 2j (low) / 2j+1 (high)
void tail(const uint16_t* x, const float* xs, const uint8_t* P, const Scales& sc, int64_t N, int64_t K, int64_t g,
          int64_t r0, uint16_t* y) {
  const int64_t R = N - r0, H = R / 2;
  const uint8_t* pt = P + r0 * K / 2;
  float yv[64] = {}, acc[64];
  for (int64_t gi = 0; gi < K / g; ++gi) {
    std::fill(acc, acc + R, 0.f);
    for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
      const float xk = bf(x[k]);
      const uint8_t* pk = pt + k * H;
      for (int64_t j = 0; j < H; ++j) {
        acc[2 * j] += xk * static_cast<float>((pk[j] & 15) - 8);
        acc[2 * j + 1] += xk * static_cast<float>((pk[j] >> 4) - 8);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float s, z;
      scale_zero(sc, gi, N, r0 + r, s, z);
      yv[r] = std::fma(xs[gi], z, std::fma(acc[r], s, yv[r]));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const at::BFloat16 o(yv[r]);  // round to nearest even, as the op's output
    y[r0 + r] = o.x;
  }
}

// whether the GEMV runs at all: an instruction set for it, and not switched off by the env where
// switching off needs torch's op to read its layout (Python then prepares torch's layout instead)
bool on() { return g_isa.load() > 0 && (!g_env_off || op_layout_ok()); }

// whether gemv() takes this call (the GEMV's layout, supported shapes)
bool usable(const at::Tensor& packed, const at::Tensor& scales, int64_t K, int64_t group_size) {
  if (!on() || packed.dim() != 2 || group_size < 4 || group_size % 4 != 0 || K % group_size != 0) return false;
  const int64_t N = packed.size(0);   // group_size checked first: it divides below
  const bool scales_ok = is_coded(scales) ? scales.dim() == 3 && scales.size(2) == 3 && N % 16 == 0 &&
                                                scales.numel() == K / group_size * (N / 16) * 3
                                          : scales.scalar_type() == at::kBFloat16 &&
                                                scales.numel() == K / group_size * N * (scales.dim() == 3 ? 2 : 1);
  return packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
         packed.size(1) * 2 == K && scales_ok && scales.is_contiguous() &&
         group_size >= 4 && group_size % 4 == 0 && K % group_size == 0 && N % 2 == 0;
}

// The finishing pass, fused into the GEMV's threads right after each 64-row block (or run over
// the blocks after torch's op): out[m, r] = T(float(y[m, r]) + Σ outliers + bias[r]), the math of
// finish() up to the fp32 summation order. The outliers come as tiles (CPUKernel.prepare builds
// them from the CSR, cpu_layouts.tiles_from_csr): a 64-row block's rows, sorted by outlier count, are cut
// into tiles of 16; tile t holds S_t slots (its longest row's count) of 16 lanes, one row per
// lane: a slot is one 16-lane gather of x, one FMA — no per-row loop and no horizontal sum (a
// CSR row holds ~6 outliers at 1% and K = 576; summing CSR rows cost 1.3 ns per outlier at
// M = 1 and 5.2 at M = 8, in situ). Padding: 1.19 slots per outlier on SmolLM2's SSQR layers.
// A slot is an int16 column and a value: fp16 (a layer whose values are all fp16-exact, as SSQR
// stores them), int16 z (a one-scale layer, HPTQ: the value is z·s, s the row's fp16 scale, the
// sum scaled once per row: exact to fp32 rounding) — 32 bits an outlier — or fp32 (else).
struct Fin {
  const int32_t* off = nullptr;   // [T + 1]: tile t's first slot; tiles 4b..4b+3 are block b's
  const int32_t* rows = nullptr;  // [T, 16]: each lane's row within its block (≥ 64: no row)
  const int16_t* col = nullptr;   // [S, 16]: column, -1 = padding (null: no outliers)
  const void* val = nullptr;      // [S, 16]: fp16, int16 (multiples of row_scale) or fp32
  at::ScalarType vtype = at::kFloat;
  const float* row_scale = nullptr;  // [N]: int16 values are z, the outlier z·row_scale[row] (else null)
  const float* xf = nullptr;      // fp32 of the unrounded activations: M = 1: [K]; M > 1: ⌈M/8⌉ ×
  int64_t M = 1, N = 0, K = 0, T = 0;  // [K + 1, 8] (xᵀ of 8 rows, zero-padded, row 0 zero: col + 1)
  const float* bias = nullptr;    // fp32 [N] or null
  void* out = nullptr;            // [M, N] of dtype (may alias y when bf16)
  at::ScalarType dtype = at::kBFloat16;
};

// acc[m][row in block] = Σ outliers of rows m0 + m (m < mb ≤ 8) of x, over tiles [t0, t1)
// (one block's). M = 1: a slot is one 16-lane gather of x and one FMA. M > 1: a gather per row
// would cost ~12 cycles each on Zen 4 (3 ns per outlier at M = 8, warm); instead each lane
// reads the 8 rows of x at its column as one vector of xᵀ and does one 8-wide FMA.
inline float val_at(const float* v, int64_t i) { return v[i]; }
inline float val_at(const at::Half* v, int64_t i) { return static_cast<float>(v[i]); }
inline float val_at(const int16_t* v, int64_t i) { return static_cast<float>(v[i]); }
#if LATQ_HAVE_GEMV
inline __m512 val16_at(const float* v) { return _mm512_loadu_ps(v); }
inline __m512 val16_at(const at::Half* v) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));   // exact: fp16 ⊂ fp32
}
inline __m512 val16_at(const int16_t* v) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))));
}
#endif

#if LATQ_HAVE_AVX2
// M > 1 (both SIMD builds): rows m0 .. m0 + mb of x, 8 at a time as one vector of xᵀ per lane
template <typename V>
__attribute__((target("avx2,fma,f16c"))) void tile_sums_rows(const Fin& f, int64_t t0, int64_t t1, int64_t m0,
                                                               int64_t mb, float (*acc)[80]) {
  const V* val = static_cast<const V*>(f.val);
  const float* xT = f.xf + (m0 / 8) * (f.K + 1) * 8;
  for (int64_t t = t0; t < t1; ++t) {
    __m256 v[16];
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) v[l] = _mm256_setzero_ps();
    for (int32_t s = f.off[t]; s < f.off[t + 1]; ++s) {
      const int16_t* c = f.col + 16 * s;
      const V* w = val + 16 * s;
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l)
        v[l] = _mm256_fmadd_ps(_mm256_set1_ps(val_at(w, l)), _mm256_loadu_ps(xT + 8 * (c[l] + 1)), v[l]);
    }
    alignas(32) float tmp[16][8];
    for (int l = 0; l < 16; ++l) _mm256_store_ps(tmp[l], v[l]);
    for (int l = 0; l < 16; ++l) {
      const int32_t r = f.rows[16 * t + l];
      for (int64_t m = 0; m < mb; ++m) acc[m][r] = tmp[l][m];
    }
  }
}

// M = 1 on AVX2: a slot is two 8-lane gathers of x and two FMAs, each lane summing its slots in
// the AVX-512 path's order
__attribute__((target("avx2,fma,f16c"))) inline __m256 val8_at(const float* v) { return _mm256_loadu_ps(v); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 val8_at(const at::Half* v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));   // exact: fp16 ⊂ fp32
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 val8_at(const int16_t* v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
}

template <typename V>
__attribute__((target("avx2,fma,f16c"))) void tile_sums_avx2(const Fin& f, int64_t t0, int64_t t1, float (*acc)[80]) {
  const V* val = static_cast<const V*>(f.val);
  const __m256i none = _mm256_set1_epi32(-1);
  for (int64_t t = t0; t < t1; ++t) {
    __m256 v[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int32_t s = f.off[t]; s < f.off[t + 1]; ++s)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i c = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.col + 16 * s + 8 * h)));
        const __m256 k = _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, none));   // padding (-1) is not read
        const __m256 x = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), f.xf, c, k, 4);
        v[h] = _mm256_fmadd_ps(x, val8_at(val + 16 * s + 8 * h), v[h]);
      }
    alignas(32) float tmp[16];
    _mm256_store_ps(tmp, v[0]);
    _mm256_store_ps(tmp + 8, v[1]);
    for (int l = 0; l < 16; ++l) acc[0][f.rows[16 * t + l]] = tmp[l];
  }
}
#endif

// acc[m][row in block] over tiles [t0, t1) on the GEMV's instruction set: AVX-512, AVX2, or
// scalar where the GEMV does not run
template <typename V>
void tile_sums(const Fin& f, int64_t t0, int64_t t1, int64_t m0, int64_t mb, float (*acc)[80]) {
  const int isa = g_isa.load();
#if LATQ_HAVE_GEMV
  if (isa == 2 && f.M == 1) {
    const V* val = static_cast<const V*>(f.val);
    for (int64_t t = t0; t < t1; ++t) {
      __m512 v = _mm512_setzero_ps();
      for (int32_t s = f.off[t]; s < f.off[t + 1]; ++s) {
        const __m512i c = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f.col + 16 * s)));
        const __mmask16 k = _mm512_cmpge_epi32_mask(c, _mm512_setzero_si512());
        v = _mm512_fmadd_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, c, f.xf, 4), val16_at(val + 16 * s), v);
      }
      _mm512_i32scatter_ps(acc[0], _mm512_loadu_si512(f.rows + 16 * t), v, 4);
    }
    return;
  }
#endif
#if LATQ_HAVE_AVX2
  if (isa > 0) {
    if (f.M == 1)
      tile_sums_avx2<V>(f, t0, t1, acc);
    else
      tile_sums_rows<V>(f, t0, t1, m0, mb, acc);
    return;
  }
#endif
  const V* val = static_cast<const V*>(f.val);
  for (int64_t t = t0; t < t1; ++t) {
    float v[8][16] = {};
    for (int32_t s = f.off[t]; s < f.off[t + 1]; ++s)
      for (int l = 0; l < 16; ++l) {
        const int32_t c = f.col[16 * s + l];
        if (c < 0) continue;
        const float* xc = f.M == 1 ? f.xf + c : f.xf + ((m0 / 8) * (f.K + 1) + c + 1) * 8;
        for (int64_t m = 0; m < mb; ++m) v[m][l] += val_at(val, 16 * s + l) * xc[m];
      }
    for (int64_t m = 0; m < mb; ++m)
      for (int l = 0; l < 16; ++l) acc[m][f.rows[16 * t + l]] = v[m][l];
  }
}

template <typename T>
void fin_rows(const Fin& f, const uint16_t* y, int64_t r0, int64_t r1) {
  T* out = static_cast<T*>(f.out);
  const int64_t R = r1 - r0, N = f.N;  // R ≤ 64; r0 = 64·block
  const int64_t t0 = r0 / 16, t1 = std::min(f.T, t0 + 4);
  alignas(64) float acc[8][80];
  for (int64_t m0 = 0; m0 < f.M; m0 += 8) {
    const int64_t mb = std::min<int64_t>(8, f.M - m0);
    if (f.col) {
      switch (f.vtype) {
        case at::kHalf: tile_sums<at::Half>(f, t0, t1, m0, mb, acc); break;
        case at::kShort: tile_sums<int16_t>(f, t0, t1, m0, mb, acc); break;
        default: tile_sums<float>(f, t0, t1, m0, mb, acc); break;
      }
      if (f.row_scale)   // int16 values: Σ z·x per row, times the row's scale
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t r = 0; r < R; ++r) acc[m][r] *= f.row_scale[r0 + r];
    } else {
      for (int64_t m = 0; m < mb; ++m) std::fill(acc[m], acc[m] + R, 0.f);
    }
    for (int64_t m = 0; m < mb; ++m) {
      const int64_t i0 = (m0 + m) * N + r0;
      int64_t r = 0;
#if LATQ_HAVE_GEMV
      if constexpr (std::is_same_v<T, at::BFloat16>) {  // the usual case: 16 rows at a time
        for (; r + 16 <= R; r += 16) {
          const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + i0 + r));
          __m512 o = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(yv), 16));
          o = _mm512_add_ps(o, _mm512_load_ps(acc[m] + r));
          if (f.bias) o = _mm512_add_ps(o, _mm512_loadu_ps(f.bias + r0 + r));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i0 + r), (__m256i)_mm512_cvtneps_pbh(o));
        }
      }
#endif
      for (; r < R; ++r) {
        float o = bf(y[i0 + r]) + acc[m][r];
        if (f.bias) o += f.bias[r0 + r];
        out[i0 + r] = static_cast<T>(o);
      }
    }
  }
}

// the tiles of [t0, t1) towards L2 (their ~3 KB per block at 1% would otherwise be read cold,
// after the block's GEMV)
void prefetch_tiles(const Fin& f, int64_t t0, int64_t t1) {
#if LATQ_HAVE_AVX2
  const int32_t s0 = f.off[t0], s1 = f.off[t1];
  const char* c = reinterpret_cast<const char*>(f.col + 16 * s0);
  const int64_t vb = f.vtype == at::kFloat ? 64 : 32;   // value bytes per slot
  const char* v = static_cast<const char*>(f.val) + vb * s0;
  for (int64_t i = 0; i < 32 * (s1 - s0); i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
  for (int64_t i = 0; i < vb * (s1 - s0); i += 64) _mm_prefetch(v + i, _MM_HINT_T1);
#endif
}

void fin(const Fin* f, const uint16_t* y, int64_t r0, int64_t r1) {
  if (!f) return;
  switch (f->dtype) {
    case at::kBFloat16: fin_rows<at::BFloat16>(*f, y, r0, r1); break;
    case at::kHalf: fin_rows<at::Half>(*f, y, r0, r1); break;
    default: fin_rows<float>(*f, y, r0, r1); break;
  }
}

// y = the op: x bf16 [M, K] (K = the packed width) → bf16 [M, N]; with f, each thread also
// finishes its rows into f->out (y is then scratch, or f->out itself for bf16). Each thread
// takes whole 64-row blocks and runs all M rows through a block (8 at a time) while its bytes
// are in L1/L2: the weights stream from memory once per call.
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t g, int64_t planes,
               const Fin* f = nullptr, at::Tensor y = at::Tensor()) {
  const int64_t N = packed.size(0), M = x.size(0), K = x.size(1), G = K / g;
  at::Tensor xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const Scales sc = scales_of(scales, planes);
  const int isa = g_isa.load();
  // [M, G] group sums of x for the fold's z·Σx_g, summed only where a group's zero can be nonzero
  // ((s, z) pairs; a two-plane layer's low plane; every group for the AVX2 GEMV, whose nibbles are
  // unsigned): elsewhere z = 0 and they stay 0, so a one-plane or coded layer (the default's) makes
  // no serial pass over x for them on AVX-512
  const int64_t zgroups = isa == 1 || sc.sz ? G : sc.s ? sc.zlow : 0;
  std::vector<float> xs(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < zgroups; ++gi) {
      const uint16_t* xg = xp + m * K + gi * g;
      float s = 0.f;
      for (int64_t k = 0; k < g; ++k) s += bf(xg[k]);
      xs[m * G + gi] = s;
    }
  std::vector<float> xf(isa == 1 ? M * K : 0);   // the AVX2 GEMV broadcasts x from fp32
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf(xp[i]);
  if (!y.defined()) y = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint8_t* P = packed.data_ptr<uint8_t>();
  const int64_t nb = N / 64, units = nb + (N % 64 ? 1 : 0);
  auto work = [&](int64_t u0, int64_t u1) {
#if LATQ_HAVE_AVX2
    if (isa == 1)
      for (int64_t b = u0; b < std::min(u1, nb); ++b) {
        if (f && f->col) prefetch_tiles(*f, 4 * b, std::min(f->T, 4 * b + 4));
        prefetch_scales_ahead(sc, G, N, b, u0, std::min(u1, nb));
        for (int64_t m0 = 0; m0 < M; m0 += 8)
          block_rows_avx2(xf.data() + m0 * K, K, xs.data() + m0 * G, P, sc, N, g, b, yp + m0 * N,
                          std::min<int64_t>(8, M - m0));
        fin(f, yp, b * 64, b * 64 + 64);
      }
#endif
#if LATQ_HAVE_GEMV
    for (int64_t b = u0; isa == 2 && b < std::min(u1, nb); ++b) {
      if (f && f->col) prefetch_tiles(*f, 4 * b, std::min(f->T, 4 * b + 4));   // in flight during the GEMV
      prefetch_scales_ahead(sc, G, N, b, u0, std::min(u1, nb));
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        block_rows(xp + m0 * K, K, xs.data() + m0 * G, P, sc, N, g, b, yp + m0 * N, std::min<int64_t>(8, M - m0));
      fin(f, yp, b * 64, b * 64 + 64);
    }
#endif
    if (u1 > nb) {
      for (int64_t m = 0; m < M; ++m) tail(xp + m * K, xs.data() + m * G, P, sc, N, K, g, nb * 64, yp + m * N);
      fin(f, yp, nb * 64, N);
    }
  };
  at::parallel_for(0, units, 1, work);
  return y;
}

}  // namespace gemv

// torch's op takes (s, z) pairs per op group of 256/128/64/32: scales alone (at group g, along a
// packed width Kp of `planes` planes) → those, built per call (only where torch's op replaces the GEMV)
std::pair<at::Tensor, int64_t> op_scales_zeros(const at::Tensor& scales, int64_t g, int64_t planes, int64_t Kp) {
  TORCH_CHECK(!gemv::is_coded(scales), "latq_cpu: coded scales are read by the GEMV only");
  if (scales.dim() == 3) return {scales, g};
  int64_t go = 0;
  for (int64_t c : {256, 128, 64, 32})
    if (Kp % c == 0 && g % c == 0) {
      go = c;
      break;
    }
  TORCH_CHECK(go > 0, "latq_cpu: no op group divides the scale group ", g);
  at::Tensor s = scales.repeat_interleave(g / go, 0);   // [Kp/go, N]
  at::Tensor z = at::zeros_like(s);
  if (planes == 2) z.narrow(0, 0, s.size(0) / 2).copy_(s.narrow(0, 0, s.size(0) / 2) * 8);
  return {at::stack({s, z}, -1).contiguous(), go};
}

at::Tensor int4_op(const at::Tensor& xb, const at::Tensor& packed, const at::Tensor& scales, int64_t g, int64_t planes) {
  auto [sz, go] = op_scales_zeros(scales, g, planes, xb.size(1));
  return at::_weight_int4pack_mm_for_cpu(xb, packed, go, sz);
}

at::Tensor gemv_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16,
              "latq_cpu::gemv: x must be bf16 [M, K] on the CPU, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.device().is_cpu() && scales.device().is_cpu(), "latq_cpu::gemv: packed and scales must be on the CPU");
  TORCH_CHECK(gemv::usable(packed, scales, x.size(1), group_size),
              "latq_cpu::gemv: not available for this build/layout/shape");
  return gemv::run(x, packed, scales, group_size, 1);
}

void set_gemv_max_m(int64_t m) {
  TORCH_CHECK(m >= 0, "latq_cpu::set_gemv_max_m: m must be >= 0, got ", m);
  gemv::g_max_m.store(m);
}
void set_prefetch_l2(bool on) { gemv::g_prefetch_l2.store(on); }
// the M up to which small_linear takes the GEMV (0: off or not here; every M where torch's op
// cannot read the GEMV's layout, whatever set_gemv_max_m says)
int64_t gemv_max_m() {
  return !gemv::on() ? 0 : gemv::op_layout_ok() ? gemv::g_max_m.load() : int64_t{1} << 30;
}
// whether the GEMV runs here, on its own layout (whatever set_gemv_max_m says)
bool has_gemv() { return gemv::on(); }
// whether torch's op reads the GEMV's layout here (AVX-512 torch), so set_gemv_max_m can switch to it
bool op_reads_gemv_layout() { return gemv::op_layout_ok(); }
// what this build compiled in: the AVX-512 GEMV (1/0) and the target's own AVX-512F / AVX2
std::string build_isa() {
  std::string s = "gemv512=" + std::to_string(LATQ_HAVE_GEMV) + " avx2fn=" + std::to_string(LATQ_HAVE_AVX2);
#ifdef __AVX512F__
  s += " avx512f=1";
#else
  s += " avx512f=0";
#endif
#ifdef __AVX2__
  s += " avx2=1";
#else
  s += " avx2=0";
#endif
  return s;
}
// the instruction set the GEMV takes: "avx512", "avx2" or "" (none)
std::string gemv_isa() { return gemv::g_isa == 2 ? "avx512" : gemv::g_isa == 1 ? "avx2" : ""; }
void set_gemv_isa(const std::string& name) {
  const int isa = name == "avx512" ? 2 : name == "avx2" ? 1 : name.empty() ? 0 : -1;
  TORCH_CHECK(isa >= 0, "latq_cpu::set_gemv_isa: unknown instruction set '", name, "' (avx512, avx2 or '')");
  TORCH_CHECK(gemv::isa_runs(isa), "latq_cpu::set_gemv_isa: the GEMV cannot run on ", name, " here");
  TORCH_CHECK(isa > 0 || gemv::op_layout_ok(), "latq_cpu::set_gemv_isa: torch's op cannot read the GEMV's "
              "layout here, so the GEMV cannot be switched off");
  gemv::g_isa.store(isa);
}

// ---- argument checks: one TORCH_CHECK (a Python RuntimeError) for every call the loops below
// could not compute; O(1) or O(rows) per call — index contents (CSR columns, tile columns) are
// checked once at load (format.validate_layer, layouts.tiles_from_csr), O(outliers) per call
bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void expect(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(), op,
              ": ", name, " must be a contiguous CPU ", c10::toString(dtype), " tensor of shape ", shape, ", got ",
              t.device(), " ", t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

void check_small_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& crow, const std::optional<at::Tensor>& col,
                        const std::optional<at::Tensor>& val, const std::optional<at::Tensor>& tile_off,
                        const std::optional<at::Tensor>& tile_rows, const std::optional<at::Tensor>& tile_col,
                        const std::optional<at::Tensor>& tile_val, const std::optional<at::Tensor>& row_scale,
                        const std::optional<at::Tensor>& bias, int64_t group_size, int64_t planes) {
  constexpr const char* op = "latq_cpu::small_linear";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, op, ": x must be a 2-D CPU tensor, got ", x.device(), " ", x.sizes());
  TORCH_CHECK(planes == 1 || planes == 2, op, ": planes must be 1 or 2, got ", planes);
  TORCH_CHECK(packed.dim() == 2, op, ": packed must be 2-D [N, K·planes/2], got ", packed.sizes());
  const int64_t K = x.size(1), N = packed.size(0), Kp = K * planes;
  TORCH_CHECK(K > 0 && N > 0 && N % 16 == 0, op, ": the layer must have K > 0 columns and N > 0 rows, N a multiple "
              "of 16, got K ", K, ", N ", N);
  expect(packed, op, "packed", at::kByte, {N, Kp / 2});
  TORCH_CHECK(Kp % 2 == 0, op, ": K·planes (", Kp, ") must be even");
  TORCH_CHECK(group_size > 0 && Kp % group_size == 0, op, ": group_size ", group_size,
              " must be positive and divide K·planes = ", Kp);
  const int64_t G = Kp / group_size;
  if (gemv::is_coded(scales)) {
    TORCH_CHECK(planes == 1, op, ": coded scales on a ", planes, "-plane layer");
    expect(scales, op, "coded scales", at::kInt, {G, N / 16, 3});
  } else if (scales.dim() == 3) {
    expect(scales, op, "scales (s, z pairs)", at::kBFloat16, {G, N, 2});
  } else {
    expect(scales, op, "scales", at::kBFloat16, {G, N});
  }
  const bool csr = given(crow) || given(col) || given(val);
  if (csr) {
    TORCH_CHECK(given(crow) && given(col) && given(val), op, ": crow, col and val come together");
    expect(*crow, op, "crow", at::kInt, {N + 1});
    const int64_t nnz = col->numel();
    expect(*col, op, "col", at::kInt, {nnz});
    expect(*val, op, "val", at::kFloat, {nnz});
    const int32_t* cp = crow->data_ptr<int32_t>();
    TORCH_CHECK(cp[0] == 0 && cp[N] == nnz, op, ": crow must start at 0 and end at nnz = ", nnz);
  }
  const bool tiles = given(tile_off) || given(tile_rows) || given(tile_col) || given(tile_val);
  if (tiles) {
    TORCH_CHECK(given(tile_off) && given(tile_rows) && given(tile_col) && given(tile_val), op,
                ": tile_off, tile_rows, tile_col and tile_val come together");
    TORCH_CHECK(K <= 32767, op, ": tile columns are int16, K ", K, " is too wide for tiles");
    const int64_t T = (N + 15) / 16, S = tile_col->dim() == 2 ? tile_col->size(0) : -1;
    expect(*tile_off, op, "tile_off", at::kInt, {T + 1});
    expect(*tile_rows, op, "tile_rows", at::kInt, {T, 16});
    TORCH_CHECK(S >= 0, op, ": tile_col must be [S, 16], got ", tile_col->sizes());
    expect(*tile_col, op, "tile_col", at::kShort, {S, 16});
    expect(*tile_val, op, "tile_val", tile_val->scalar_type(), {S, 16});
    const int32_t* off = tile_off->data_ptr<int32_t>();
    const int32_t* rows = tile_rows->data_ptr<int32_t>();
    TORCH_CHECK(off[0] == 0 && off[T] == S, op, ": tile_off must start at 0 and end at S = ", S);
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(off[t] <= off[t + 1], op, ": tile_off is not monotone at tile ", t);
    for (int64_t i = 0; i < T * 16; ++i)   // a lane's row within its 64-row block; 64..79: no row
      TORCH_CHECK(rows[i] >= 0 && rows[i] < 80, op, ": tile_rows[", i, "] = ", rows[i], " is not in [0, 80)");
  } else {
    TORCH_CHECK(!given(row_scale), op, ": row_scale without tiles");
  }
  if (given(row_scale)) expect(*row_scale, op, "row_scale", at::kFloat, {N});
  if (given(bias)) {
    const auto bt = bias->scalar_type();
    TORCH_CHECK(bt == at::kBFloat16 || bt == at::kHalf || bt == at::kFloat, op, ": bias must be bf16/fp16/fp32, got ", bt);
    TORCH_CHECK(bias->device().is_cpu() && bias->sizes() == at::IntArrayRef{N}, op, ": bias must be a CPU [", N,
                "] tensor, got ", bias->device(), " ", bias->sizes());
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& crow, const std::optional<at::Tensor>& col,
                        const std::optional<at::Tensor>& val, const std::optional<at::Tensor>& tile_off,
                        const std::optional<at::Tensor>& tile_rows, const std::optional<at::Tensor>& tile_col,
                        const std::optional<at::Tensor>& tile_val, const std::optional<at::Tensor>& row_scale,
                        const std::optional<at::Tensor>& bias,
                        int64_t group_size, int64_t planes) {
  check_small_linear(x, packed, scales, crow, col, val, tile_off, tile_rows, tile_col, tile_val, row_scale, bias,
                     group_size, planes);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kHalf,
              "latq_cpu::small_linear: activations must be bf16/fp16/fp32, got ", dtype);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  at::Tensor xb = (dtype == at::kBFloat16 && x.is_contiguous()) ? x : x.to(at::kBFloat16).contiguous();
  if (planes == 2) xb = at::cat({xb, xb}, 1);
  const bool tiles = tile_col.has_value() && tile_col->defined();   // outliers as the GEMV's tiles
  const bool outl = !tiles && crow.has_value() && crow->defined() && col->numel() > 0;   // as a CSR
  const bool has_bias = bias.has_value() && bias->defined();
  // coded scales: always the GEMV (CPUKernel.prepare codes them only where it runs; torch's op
  // cannot read them, and group 16 has no op group)
  // (and every M where torch's op cannot read the GEMV's layout)
  const bool use_gemv = (M <= gemv::g_max_m.load() || gemv::is_coded(scales) || !gemv::op_layout_ok()) &&
                        gemv::usable(packed, scales, xb.size(1), group_size);
  if (tiles || (use_gemv && !outl)) {
    // outliers (tiles) + bias + cast per 64-row block: in the GEMV's threads, or after torch's op
    at::Tensor y = at::empty({M, N}, x.options().dtype(at::kBFloat16));
    if (!tiles && !has_bias && dtype == at::kBFloat16)
      return gemv::run(xb, packed, scales, group_size, planes, nullptr, y);
    // fp32 of the unrounded x as Fin::xf wants it, and of the bias: converted here, into buffers
    // kept per calling thread (dispatched x.to(float) + allocation cost ~4 µs a call, ×120 a step)
    thread_local std::vector<float> xbuf, bbuf;
    if (tiles) {
      const bool t8 = M > 1;
      xbuf.assign(t8 ? (M + 7) / 8 * (K + 1) * 8 : K, 0.f);
      at::Tensor xc = x.contiguous();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "latq_cpu_xf", [&] {
        const scalar_t* xp = xc.data_ptr<scalar_t>();
        for (int64_t m = 0; m < M; ++m) {
          float* d = t8 ? xbuf.data() + ((m / 8) * (K + 1) + 1) * 8 + m % 8 : xbuf.data();
          const int64_t step = t8 ? 8 : 1;
          const scalar_t* src = xp + m * K;
          for (int64_t k = 0; k < K; ++k) d[step * k] = static_cast<float>(src[k]);
        }
      });
    }
    if (has_bias) {
      bbuf.resize(N);
      at::Tensor bc = bias->contiguous();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bc.scalar_type(), "latq_cpu_bias", [&] {
        const scalar_t* bp = bc.data_ptr<scalar_t>();
        for (int64_t r = 0; r < N; ++r) bbuf[r] = static_cast<float>(bp[r]);
      });
    }
    at::Tensor out = dtype == at::kBFloat16 ? y : at::empty({M, N}, x.options());
    gemv::Fin f;
    if (tiles) {
      f.off = tile_off->data_ptr<int32_t>();
      f.rows = tile_rows->data_ptr<int32_t>();
      f.col = tile_col->data_ptr<int16_t>();
      f.vtype = tile_val->scalar_type();
      const bool scaled = row_scale.has_value() && row_scale->defined();
      TORCH_CHECK(f.vtype == at::kHalf || f.vtype == at::kFloat || (f.vtype == at::kShort && scaled),
                  "latq_cpu::small_linear: tile_val must be fp16, fp32 or int16 with row_scale, got ", f.vtype);
      TORCH_CHECK(!scaled || (row_scale->scalar_type() == at::kFloat && row_scale->numel() == N),
                  "latq_cpu::small_linear: row_scale must be fp32 [N]");
      f.val = tile_val->data_ptr();
      f.row_scale = scaled ? row_scale->data_ptr<float>() : nullptr;
      f.xf = xbuf.data();
      f.T = tile_rows->size(0);
    }
    f.M = M;
    f.N = N;
    f.K = K;
    f.bias = has_bias ? bbuf.data() : nullptr;
    f.out = out.data_ptr();
    f.dtype = dtype;
    if (use_gemv) {
      gemv::run(xb, packed, scales, group_size, planes, &f, y);
    } else {
      y = int4_op(xb, packed, scales, group_size, planes).contiguous();
      const uint16_t* yp = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
      if (dtype == at::kBFloat16) f.out = y.data_ptr(), out = y;
      at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) gemv::fin(&f, yp, b * 64, std::min(N, b * 64 + 64));
      });
    }
    return out;
  }
  // bf16 [M, N]: the GEMV or torch's op; then the CSR outliers (loop or MKL), bias and cast
  at::Tensor y = use_gemv ? gemv::run(xb, packed, scales, group_size, planes)
                          : int4_op(xb, packed, scales, group_size, planes);
  if (!outl && !has_bias && dtype == at::kBFloat16) return y;
  y = y.contiguous();
  at::Tensor xc = x.contiguous();
  at::Tensor ys;  // fp32 [M, N] outliers from MKL when the loop would be slower
  // the loop's vector FMA over up to 16 rows beats MKL's SpMM at every M ≤ 16; at M = 1 MKL's
  // threaded mv wins once its setup is paid for (bench/cpu_layer.py --sections profile)
  if (outl && (M == 1 ? col->numel() > g_loop_max.load() : M > kMB)) {
    // unchecked: the invariants were checked at load; checking costs O(nnz) per call
    at::Tensor csr = at::_sparse_csr_tensor_unsafe(*crow, *col, *val, {N, K}, val->options().layout(at::kSparseCsr));
    at::Tensor xf = xc.to(at::kFloat);
    ys = M == 1 ? at::mv(csr, xf[0]).unsqueeze(0) : at::mm(csr, xf.t()).t().contiguous();
  }
  const bool loop = outl && !ys.defined();
  at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  // bf16 out: in place (each element is read before it is written)
  at::Tensor out = dtype == at::kBFloat16 ? y : at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "latq_cpu_small_linear", [&] {
    finish<scalar_t>(y.data_ptr<at::BFloat16>(), ys.defined() ? ys.data_ptr<float>() : nullptr,
                     has_bias ? bf.data_ptr<float>() : nullptr, M, N, loop ? crow->data_ptr<int32_t>() : nullptr,
                     loop ? col->data_ptr<int32_t>() : nullptr, loop ? val->data_ptr<float>() : nullptr,
                     xc.data_ptr<scalar_t>(), K, out.data_ptr<scalar_t>());
  });
  return out;
}

// a CPUState's ints (out_features, in_features, group_size, planes, layout_block, layout_halves)
// against x and the packed weights: K divides x's size below, and the large-M path (Python)
// reads them as given; small_linear checks the tensors against each other
void check_state(const char* op, const at::Tensor& x, const at::Tensor& packed, at::IntArrayRef ints,
                 int64_t out_features) {
  const int64_t N = ints[0], K = ints[1];
  TORCH_CHECK(N > 0 && K > 0 && out_features == N, op, ": out_features ", out_features, " and the state's sizes [",
              N, ", ", K, "] must agree and be positive");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, ": x must end in the layer's ", K, " columns, got ", x.sizes());
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == N, op, ": packed must have the layer's ", N, " rows, got ",
              packed.sizes());
  TORCH_CHECK(ints[4] >= 0 && ints[5] >= 0, op, ": layout_block and layout_halves must be >= 0");
}

// x's shape with its last dimension out_features
std::vector<int64_t> out_shape(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return shape;
}

at::Tensor linear(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
                  const std::optional<at::Tensor>& bias, int64_t out_features) {
  // CPUState, flattened: tensors = (packed, scales, crow, col, val, tile_off, tile_rows,
  // tile_col, tile_val, row_scale[, rotation signs]), ints = (out_features, in_features, group_size, planes,
  // layout_block, layout_halves)
  TORCH_CHECK((tensors.size() == 10 || tensors.size() == 11) && ints.size() == 6, "latq_cpu::linear: not a CPUState");
  TORCH_CHECK(given(tensors.get(0)) && given(tensors.get(1)), "latq_cpu::linear: the state has no packed weights "
              "or scales");
  check_state("latq_cpu::linear", x, *tensors.get(0), ints, out_features);
  const std::optional<at::Tensor> signs = tensors.size() == 11 ? tensors.get(10) : std::nullopt;
  const bool rotated = signs.has_value() && signs->defined();
  const int64_t K = ints[1];
  const int64_t M = x.numel() / K;
  if (M >= g_large_m.load() && ints[4] != 0) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("latq::cpu_linear", "")
                         .typed<at::Tensor(const at::Tensor&, const c10::List<std::optional<at::Tensor>>&,
                                           at::IntArrayRef, const std::optional<at::Tensor>&, int64_t)>();
    if (!rotated) return op.call(x, tensors, ints, bias, out_features);
    c10::List<std::optional<at::Tensor>> state;   // CPUState's own 10 tensors, x rotated
    for (size_t i = 0; i < 10; ++i) state.push_back(tensors.get(i));
    return op.call(latq_hadamard(x, *signs), state, ints, bias, out_features);
  }
  // small M: x·R in this thread's scratch (read during this call only)
  const at::Tensor& xr = rotated ? latq_hadamard_scratch(x, *signs) : x;
  const bool flat = xr.dim() == 2;   // vLLM's usual [tokens, in]: no reshape (two dispatched views a call)
  at::Tensor y = small_linear(flat ? xr : xr.reshape({M, K}), *tensors.get(0), *tensors.get(1), tensors.get(2),
                              tensors.get(3), tensors.get(4), tensors.get(5), tensors.get(6), tensors.get(7),
                              tensors.get(8), tensors.get(9), bias, ints[2], ints[3]);
  return flat ? y : y.reshape(out_shape(x, out_features));
}

// linear() for a state without outliers, called without bias (every layer of a GPTQ or RTN
// checkpoint): its two tensors instead of the list of ten optional ones, whose parsing is a
// fifth of a small layer's call from vLLM's compiled graph at M = 1 (cpu_layer.py --sections
// calls); a rotated layer's signs (nullptr: none) rotate x first, as linear()'s 11th tensor does
at::Tensor lean_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, at::IntArrayRef ints,
                       int64_t out_features, const at::Tensor* signs) {
  TORCH_CHECK(ints.size() == 6, "latq_cpu::plain_linear: not a CPUState");
  check_state("latq_cpu::plain_linear", x, packed, ints, out_features);
  const int64_t K = ints[1];
  const int64_t M = x.numel() / K;
  const std::optional<at::Tensor> none;
  if (M >= g_large_m.load() && ints[4] != 0) {
    c10::List<std::optional<at::Tensor>> tensors({packed, scales, none, none, none, none, none, none, none, none});
    if (signs) tensors.push_back(*signs);
    return linear(x, tensors, ints, none, out_features);
  }
  // small M: x·R in this thread's scratch (read during this call only)
  const at::Tensor& xr = signs ? latq_hadamard_scratch(x, *signs) : x;
  const bool flat = xr.dim() == 2;
  at::Tensor y = small_linear(flat ? xr : xr.reshape({M, K}), packed, scales, none, none, none, none, none, none, none,
                              none, none, ints[2], ints[3]);
  return flat ? y : y.reshape(out_shape(x, out_features));
}

at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, at::IntArrayRef ints,
                        int64_t out_features) {
  return lean_linear(x, packed, scales, ints, out_features, nullptr);
}

// plain_linear() of a rotated layer: a sibling op, so the unrotated call parses no extra argument
at::Tensor rotated_plain_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                at::IntArrayRef ints, int64_t out_features, const at::Tensor& signs) {
  return lean_linear(x, packed, scales, ints, out_features, &signs);
}

void set_large_m(int64_t m) {
  TORCH_CHECK(m >= 0, "latq_cpu::set_large_m: m must be >= 0, got ", m);
  g_large_m.store(m);
}
void set_loop_max(int64_t n) {
  TORCH_CHECK(n >= 0, "latq_cpu::set_loop_max: n must be >= 0, got ", n);
  g_loop_max.store(n);
}

}  // namespace

TORCH_LIBRARY(latq_cpu, m) {
  m.def("small_linear(Tensor x, Tensor packed, Tensor scales, Tensor? crow, Tensor? col, Tensor? val, "
        "Tensor? tile_off, Tensor? tile_rows, Tensor? tile_col, Tensor? tile_val, Tensor? row_scale, Tensor? bias, "
        "int group_size, int planes) -> Tensor");
  m.def("linear(Tensor x, Tensor?[] tensors, int[] ints, Tensor? bias, int out_features) -> Tensor");
  m.def("plain_linear(Tensor x, Tensor packed, Tensor scales, int[] ints, int out_features) -> Tensor");
  m.def("rotated_plain_linear(Tensor x, Tensor packed, Tensor scales, int[] ints, int out_features, Tensor signs) "
        "-> Tensor");
  m.def("set_large_m(int m) -> ()");
  m.def("set_loop_max(int n) -> ()");
  m.def("gemv(Tensor x, Tensor packed, Tensor scales, int group_size) -> Tensor");
  m.def("set_gemv_max_m(int m) -> ()");
  m.def("set_prefetch_l2(bool on) -> ()");
  m.def("gemv_max_m() -> int");
  m.def("has_gemv() -> bool");
  m.def("gemv_isa() -> str");
  m.def("set_gemv_isa(str name) -> ()");
  m.def("op_reads_gemv_layout() -> bool");
  m.def("build_isa() -> str");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("linear", &linear);
  m.impl("plain_linear", &plain_linear);
  m.impl("rotated_plain_linear", &rotated_plain_linear);
  m.impl("gemv", &gemv_op);
}

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) {
  m.impl("set_large_m", &set_large_m);
  m.impl("set_loop_max", &set_loop_max);
  m.impl("set_gemv_max_m", &set_gemv_max_m);
  m.impl("set_prefetch_l2", &set_prefetch_l2);
  m.impl("gemv_max_m", &gemv_max_m);
  m.impl("has_gemv", &has_gemv);
  m.impl("gemv_isa", &gemv_isa);
  m.impl("set_gemv_isa", &set_gemv_isa);
  m.impl("op_reads_gemv_layout", &op_reads_gemv_layout);
  m.impl("build_isa", &build_isa);
}
