// The input rotation of a rotated latq layer on the CPU (vllm_latq/format/rotation.py):
// y = x·R, R block-diagonal with R_b = diag(s)·H_b/√b, H_b the Sylvester Hadamard matrix —
// per row, the signs and 1/√b applied while loading into fp32, then log2(b) butterfly passes
// per block, then one cast back to x's dtype. Butterflies at a distance of a whole vector or
// more are vector adds between vectors; the shorter ones stay in one register: its lanes
// permuted so each meets its partner, then one FMA with ±1 (low lanes add, high lanes take the
// partner minus themselves), exactly a + c and a − c. AVX-512F, AVX2 + FMA or scalar, chosen at
// run time.
//
//   latq_cpu::hadamard(x [..., n] bf16/fp16/fp32, signs fp32 [b]) -> x·R in x's dtype
//   latq_cpu::hadamard_isa() / set_hadamard_isa(name)    which path runs ("avx512", "avx2", "")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LATQ_HADAMARD_X86 1
#else
#define LATQ_HADAMARD_X86 0
#endif
// AVX-512 paths only where the build targets AVX-512 (an x86-64-v3 build holds no AVX-512 code)
#if LATQ_HADAMARD_X86 && defined(__AVX512F__) && defined(__AVX512BW__)
#define LATQ_HADAMARD_AVX512 1
#else
#define LATQ_HADAMARD_AVX512 0
#endif

namespace {

void butterflies_scalar(float* v, int64_t b, int64_t h0) {
  for (int64_t h = h0; h < b; h *= 2)
    for (int64_t i = 0; i < b; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = v[j], c = v[j + h];
        v[j] = a + c;
        v[j + h] = a - c;
      }
}

#if LATQ_HADAMARD_X86
// ±1 per lane: +1 where lane bit h is clear (the pair's low element), −1 where it is set
template <int W>
inline void lane_signs(float* out, int h) {
  for (int j = 0; j < W; ++j) out[j] = (j & h) ? -1.f : 1.f;
}

__attribute__((target("avx2,fma"))) void butterflies_avx2(float* v, int64_t b) {
  if (b < 8) return butterflies_scalar(v, b, 1);
  alignas(32) float s1[8], s2[8], s4[8];
  lane_signs<8>(s1, 1);
  lane_signs<8>(s2, 2);
  lane_signs<8>(s4, 4);
  const __m256 g1 = _mm256_load_ps(s1), g2 = _mm256_load_ps(s2), g4 = _mm256_load_ps(s4);
  for (int64_t i = 0; i < b; i += 8) {
    __m256 x = _mm256_loadu_ps(v + i);
    x = _mm256_fmadd_ps(x, g1, _mm256_permute_ps(x, 0xB1));
    x = _mm256_fmadd_ps(x, g2, _mm256_permute_ps(x, 0x4E));
    x = _mm256_fmadd_ps(x, g4, _mm256_permute2f128_ps(x, x, 0x01));
    _mm256_storeu_ps(v + i, x);
  }
  for (int64_t h = 8; h < b; h *= 2)
    for (int64_t i = 0; i < b; i += 2 * h)
      for (int64_t j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(v + j), c = _mm256_loadu_ps(v + j + h);
        _mm256_storeu_ps(v + j, _mm256_add_ps(a, c));
        _mm256_storeu_ps(v + j + h, _mm256_sub_ps(a, c));
      }
}

#if LATQ_HADAMARD_AVX512
__attribute__((target("avx512f"))) void butterflies_avx512(float* v, int64_t b) {
  if (b < 16) return butterflies_avx2(v, b);
  alignas(64) float s1[16], s2[16], s4[16], s8[16];
  lane_signs<16>(s1, 1);
  lane_signs<16>(s2, 2);
  lane_signs<16>(s4, 4);
  lane_signs<16>(s8, 8);
  const __m512 g1 = _mm512_load_ps(s1), g2 = _mm512_load_ps(s2), g4 = _mm512_load_ps(s4), g8 = _mm512_load_ps(s8);
  for (int64_t i = 0; i < b; i += 16) {
    __m512 x = _mm512_loadu_ps(v + i);
    x = _mm512_fmadd_ps(x, g1, _mm512_permute_ps(x, 0xB1));
    x = _mm512_fmadd_ps(x, g2, _mm512_permute_ps(x, 0x4E));
    x = _mm512_fmadd_ps(x, g4, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_fmadd_ps(x, g8, _mm512_shuffle_f32x4(x, x, 0x4E));
    _mm512_storeu_ps(v + i, x);
  }
  for (int64_t h = 16; h < b; h *= 2)
    for (int64_t i = 0; i < b; i += 2 * h)
      for (int64_t j = i; j < i + h; j += 16) {
        const __m512 a = _mm512_loadu_ps(v + j), c = _mm512_loadu_ps(v + j + h);
        _mm512_storeu_ps(v + j, _mm512_add_ps(a, c));
        _mm512_storeu_ps(v + j + h, _mm512_sub_ps(a, c));
      }
}
#endif
#endif

// fp32 → bf16 bits, round to nearest even, NaN → 0x7FC0: c10::BFloat16's rounding, 8 or 16 at a time
inline uint16_t bf16_bits(float f) { return c10::BFloat16(f).x; }

__attribute__((target("avx2,fma"))) void store_bf16_avx2(const float* v, uint16_t* y, int64_t n) {
  int64_t k = 0;
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
  for (; k + 8 <= n; k += 8) {
    const __m256 f = _mm256_loadu_ps(v + k);
    const __m256i b = _mm256_castps_si256(f);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + k),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  for (; k < n; ++k) y[k] = bf16_bits(v[k]);
}

#if LATQ_HADAMARD_AVX512
__attribute__((target("avx512f,avx512bw"))) void store_bf16_avx512(const float* v, uint16_t* y, int64_t n) {
  int64_t k = 0;
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), qnan = _mm512_set1_epi32(0x7FC0);
  for (; k + 16 <= n; k += 16) {
    const __m512 f = _mm512_loadu_ps(v + k);
    const __m512i b = _mm512_castps_si512(f);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(b, 16), one))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + k), _mm512_cvtepi32_epi16(r));
  }
  store_bf16_avx2(v + k, y + k, n - k);
}
#endif

// 2: AVX-512F, 1: AVX2 + FMA, 0: scalar
bool isa_runs(int isa) {
#if LATQ_HADAMARD_X86
#if LATQ_HADAMARD_AVX512
  if (isa == 2) return __builtin_cpu_supports("avx512f");
#endif
  if (isa == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == 0;
}

int isa_detect() {
  for (int isa = 2; isa > 0; --isa)
    if (isa_runs(isa)) return isa;
  return 0;
}
std::atomic<int> g_isa{isa_detect()};

void butterflies(float* v, int64_t b, int isa) {
#if LATQ_HADAMARD_X86
#if LATQ_HADAMARD_AVX512
  if (isa == 2) return butterflies_avx512(v, b);
#endif
  if (isa == 1) return butterflies_avx2(v, b);
#endif
  butterflies_scalar(v, b, 1);
}

template <typename T>
void store_row(const float* v, T* y, int64_t n, int isa) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    uint16_t* yb = reinterpret_cast<uint16_t*>(y);
#if LATQ_HADAMARD_X86
#if LATQ_HADAMARD_AVX512
    if (isa == 2 && __builtin_cpu_supports("avx512bw")) return store_bf16_avx512(v, yb, n);
#endif
    if (isa >= 1) return store_bf16_avx2(v, yb, n);
#endif
    for (int64_t k = 0; k < n; ++k) yb[k] = bf16_bits(v[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) y[k] = static_cast<T>(v[k]);
  }
}

template <typename T>
void rotate_rows(const T* x, T* y, const float* ss, int64_t r0, int64_t r1, int64_t n, int64_t b, int isa) {
  thread_local std::vector<float> buf;
  buf.resize(n);
  float* v = buf.data();
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    for (int64_t k0 = 0; k0 < n; k0 += b)
      for (int64_t j = 0; j < b; ++j) v[k0 + j] = static_cast<float>(xr[k0 + j]) * ss[j];
    for (int64_t k0 = 0; k0 < n; k0 += b) butterflies(v + k0, b, isa);
    store_row(v, y + r * n, n, isa);
  }
}

}  // namespace

namespace {

// y ← x·R; x contiguous, y of x's shape and dtype, contiguous
void rotate_into(const at::Tensor& x, const at::Tensor& signs, at::Tensor& y) {
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.dim() == 1 && signs.is_contiguous(),
              "latq_cpu::hadamard: signs must be fp32 [b], contiguous");
  const int64_t b = signs.numel(), n = x.size(-1);
  TORCH_CHECK(b > 0 && (b & (b - 1)) == 0, "latq_cpu::hadamard: the block (", b, ") must be a power of two");
  TORCH_CHECK(n % b == 0, "latq_cpu::hadamard: ", n, " columns are not a multiple of the block ", b);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kHalf,
              "latq_cpu::hadamard: activations must be bf16/fp16/fp32, got ", dtype);
  thread_local std::vector<float> ss;   // signs / √b (no allocation per call)
  ss.resize(b);
  const float inv = 1.f / std::sqrt(static_cast<float>(b));
  const float* sp = signs.data_ptr<float>();
  for (int64_t j = 0; j < b; ++j) ss[j] = sp[j] * inv;
  const int64_t M = n ? x.numel() / n : 0;
  const int isa = g_isa.load();
  // rows per task: ~16k values, so a decode step's one row stays on its thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "latq_cpu_hadamard", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const float* ssp = ss.data();   // the caller's thread_local: its name means another vector in a worker
    at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) { rotate_rows(xp, yp, ssp, r0, r1, n, b, isa); });
  });
}

}  // namespace

// x·R (see the top of the file), a new tensor
at::Tensor latq_hadamard(const at::Tensor& x, const at::Tensor& signs) {
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  rotate_into(xc, signs, y);
  return y;
}

// x·R into this thread's scratch tensor, valid until the thread's next call: latq_cpu::linear's
// small-M path reads it during the call only, and a decode step then allocates nothing for it
const at::Tensor& latq_hadamard_scratch(const at::Tensor& x, const at::Tensor& signs) {
  thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.scalar_type() != x.scalar_type())
    scratch = at::empty(x.sizes(), x.options());
  else if (scratch.sizes() != x.sizes())
    scratch.resize_(x.sizes());
  rotate_into(x.contiguous(), signs, scratch);
  return scratch;
}

namespace {

std::string hadamard_isa() { return g_isa == 2 ? "avx512" : g_isa == 1 ? "avx2" : ""; }

void set_hadamard_isa(const std::string& name) {
  const int isa = name == "avx512" ? 2 : name == "avx2" ? 1 : name.empty() ? 0 : -1;
  TORCH_CHECK(isa >= 0, "latq_cpu::set_hadamard_isa: unknown instruction set '", name, "' (avx512, avx2 or '')");
  TORCH_CHECK(isa_runs(isa), "latq_cpu::set_hadamard_isa: ", name, " does not run here");
  g_isa.store(isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("hadamard(Tensor x, Tensor signs) -> Tensor");
  m.def("hadamard_isa() -> str");
  m.def("set_hadamard_isa(str name) -> ()");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) { m.impl("hadamard", &latq_hadamard); }

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) {
  m.impl("hadamard_isa", &hadamard_isa);
  m.impl("set_hadamard_isa", &set_hadamard_isa);
}
