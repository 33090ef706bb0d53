// The input rotation of a rotated latq layer on the CPU (vllm_latq/format/rotation.py):
// y = x·R, R block-diagonal with R_b = diag(s)·H_b/√b, H_b the Sylvester Hadamard matrix —
// per row, the signs and 1/√b applied while loading into fp32, then log2(b) butterfly passes
// per block, then one cast back to x's dtype. A block (b ≤ 256, the format's largest) lives in
// registers from its load to its store: butterflies at a distance of a whole vector or more are
// adds between registers; the shorter ones stay in one register: its lanes permuted so each meets
// its partner, then one FMA with ±1 (low lanes add, high lanes take the partner minus themselves),
// exactly a + c and a − c. AVX-512F, AVX2 + FMA + F16C or scalar, chosen at run time.
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

void butterflies_scalar(float* v, int64_t b) {
  for (int64_t h = 1; h < b; h *= 2)
    for (int64_t i = 0; i < b; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = v[j], c = v[j + h];
        v[j] = a + c;
        v[j + h] = a - c;
      }
}

template <typename T>
constexpr bool kVectorLoads = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

#if LATQ_HADAMARD_X86
// ---------------------------------------------------------------- AVX2 + FMA + F16C: 8 lanes

// 8 values of x as fp32 (exact: bf16 and fp16 widen without rounding)
template <typename T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// 8 fp32 values into y in T: bf16 rounded to nearest even with NaN → 0x7FC0 (c10::BFloat16's
// rounding), fp16 element by element (c10's, NaNs included)
template <typename T>
__attribute__((target("avx2,fma,f16c"))) inline void store8(__m256 f, T* y) {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(y, f);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
    const __m256i b = _mm256_castps_si256(f);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, f);
    for (int j = 0; j < 8; ++j) y[j] = static_cast<T>(t[j]);
  }
}

// the butterflies at distances 1, 2, 4 inside one register
__attribute__((target("avx2,fma"))) inline __m256 near_avx2(__m256 x) {
  alignas(32) static const float g1[8] = {1, -1, 1, -1, 1, -1, 1, -1}, g2[8] = {1, 1, -1, -1, 1, 1, -1, -1},
                                 g4[8] = {1, 1, 1, 1, -1, -1, -1, -1};
  x = _mm256_fmadd_ps(x, _mm256_load_ps(g1), _mm256_permute_ps(x, 0xB1));
  x = _mm256_fmadd_ps(x, _mm256_load_ps(g2), _mm256_permute_ps(x, 0x4E));
  return _mm256_fmadd_ps(x, _mm256_load_ps(g4), _mm256_permute2f128_ps(x, x, 0x01));
}

// the butterflies between registers r[j] and r[j + H], H = 1, 2, … < V
template <int V, int H = 1>
__attribute__((target("avx2,fma"))) inline void far_avx2(__m256* r) {
  if constexpr (H < V) {
#pragma GCC unroll 32
    for (int j = 0; j < V; ++j)
      if (!(j & H)) {
        const __m256 a = r[j], c = r[j + H];
        r[j] = _mm256_add_ps(a, c);
        r[j + H] = _mm256_sub_ps(a, c);
      }
    far_avx2<V, 2 * H>(r);
  }
}

// a row's blocks of b = 8·V columns
template <typename T, int V>
__attribute__((target("avx2,fma,f16c"))) void row_avx2(const T* x, const float* signs, float inv, T* y, int64_t n) {
  const __m256 scale = _mm256_set1_ps(inv);
  __m256 ss[V];   // ±1/√b: each lane's sign times 1/√b, exact
#pragma GCC unroll 32
  for (int i = 0; i < V; ++i) ss[i] = _mm256_mul_ps(_mm256_loadu_ps(signs + 8 * i), scale);
  for (int64_t k0 = 0; k0 < n; k0 += 8 * V) {
    __m256 r[V];
#pragma GCC unroll 32
    for (int i = 0; i < V; ++i) r[i] = near_avx2(_mm256_mul_ps(load8(x + k0 + 8 * i), ss[i]));
    far_avx2<V>(r);
#pragma GCC unroll 32
    for (int i = 0; i < V; ++i) store8(r[i], y + k0 + 8 * i);
  }
}

#if LATQ_HADAMARD_AVX512
// ---------------------------------------------------------------- AVX-512F: 16 lanes

template <typename T>
__attribute__((target("avx512f"))) inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

template <typename T>
__attribute__((target("avx512f"))) inline void store16(__m512 f, T* y) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(y, f);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), qnan = _mm512_set1_epi32(0x7FC0);
    const __m512i b = _mm512_castps_si512(f);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(b, 16), one))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(r));
  } else {
    alignas(64) float t[16];
    _mm512_store_ps(t, f);
    for (int j = 0; j < 16; ++j) y[j] = static_cast<T>(t[j]);
  }
}

// the butterflies at distances 1, 2, 4, 8 inside one register
__attribute__((target("avx512f"))) inline __m512 near_avx512(__m512 x) {
  alignas(64) static const float g1[16] = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1},
                                 g2[16] = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1},
                                 g4[16] = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1},
                                 g8[16] = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
  x = _mm512_fmadd_ps(x, _mm512_load_ps(g1), _mm512_permute_ps(x, 0xB1));
  x = _mm512_fmadd_ps(x, _mm512_load_ps(g2), _mm512_permute_ps(x, 0x4E));
  x = _mm512_fmadd_ps(x, _mm512_load_ps(g4), _mm512_shuffle_f32x4(x, x, 0xB1));
  return _mm512_fmadd_ps(x, _mm512_load_ps(g8), _mm512_shuffle_f32x4(x, x, 0x4E));
}

template <int V, int H = 1>
__attribute__((target("avx512f"))) inline void far_avx512(__m512* r) {
  if constexpr (H < V) {
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j)
      if (!(j & H)) {
        const __m512 a = r[j], c = r[j + H];
        r[j] = _mm512_add_ps(a, c);
        r[j + H] = _mm512_sub_ps(a, c);
      }
    far_avx512<V, 2 * H>(r);
  }
}

template <typename T, int V>
__attribute__((target("avx512f"))) void row_avx512(const T* x, const float* signs, float inv, T* y, int64_t n) {
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t k0 = 0; k0 < n; k0 += 16 * V) {
    __m512 r[V];
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i)
      r[i] = near_avx512(_mm512_mul_ps(load16(x + k0 + 16 * i), _mm512_mul_ps(_mm512_loadu_ps(signs + 16 * i), scale)));
    far_avx512<V>(r);
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) store16(r[i], y + k0 + 16 * i);
  }
}
#endif
#endif

// 2: AVX-512F, 1: AVX2 + FMA + F16C, 0: scalar
bool isa_runs(int isa) {
#if LATQ_HADAMARD_X86
#if LATQ_HADAMARD_AVX512
  if (isa == 2) return __builtin_cpu_supports("avx512f");
#endif
  if (isa == 1)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return isa == 0;
}

int isa_detect() {
  for (int isa = 2; isa > 0; --isa)
    if (isa_runs(isa)) return isa;
  return 0;
}
std::atomic<int> g_isa{isa_detect()};

template <typename T>
using RowFn = void (*)(const T*, const float*, float, T*, int64_t);

// the vector row transform for blocks of b columns on this instruction set; nullptr: scalar
template <typename T>
RowFn<T> row_fn(int64_t b, int isa) {
  if constexpr (kVectorLoads<T>) {
#if LATQ_HADAMARD_X86
#if LATQ_HADAMARD_AVX512
    if (isa == 2) {
      switch (b) {
        case 16: return row_avx512<T, 1>;
        case 32: return row_avx512<T, 2>;
        case 64: return row_avx512<T, 4>;
        case 128: return row_avx512<T, 8>;
        case 256: return row_avx512<T, 16>;
      }
    }
#endif
    if (isa >= 1) {
      switch (b) {
        case 8: return row_avx2<T, 1>;
        case 16: return row_avx2<T, 2>;
        case 32: return row_avx2<T, 4>;
        case 64: return row_avx2<T, 8>;
        case 128: return row_avx2<T, 16>;
        case 256: return row_avx2<T, 32>;
      }
    }
#endif
  }
  return nullptr;
}

template <typename T>
void rotate_rows(const T* x, T* y, const float* signs, int64_t r0, int64_t r1, int64_t n, int64_t b, int isa) {
  const float inv = 1.f / std::sqrt(static_cast<float>(b));
  if (const RowFn<T> row = row_fn<T>(b, isa)) {
    for (int64_t r = r0; r < r1; ++r) row(x + r * n, signs, inv, y + r * n, n);
    return;
  }
  thread_local std::vector<float> buf;   // scalar: the row in fp32
  buf.resize(n);
  float* v = buf.data();
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    for (int64_t k0 = 0; k0 < n; k0 += b) {
      for (int64_t j = 0; j < b; ++j) v[k0 + j] = static_cast<float>(xr[k0 + j]) * (signs[j] * inv);
      butterflies_scalar(v + k0, b);
    }
    for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<T>(v[k]);
  }
}

}  // namespace

namespace {

// y ← x·R; x contiguous, y of x's shape and dtype, contiguous
void rotate_into(const at::Tensor& x, const at::Tensor& signs, at::Tensor& y) {
  TORCH_CHECK(x.device().is_cpu() && signs.device().is_cpu() && x.dim() >= 1,
              "latq_cpu::hadamard: x (at least 1-D) and signs must be on the CPU");
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.dim() == 1 && signs.is_contiguous(),
              "latq_cpu::hadamard: signs must be fp32 [b], contiguous");
  const int64_t b = signs.numel(), n = x.size(-1);
  TORCH_CHECK(b > 0 && (b & (b - 1)) == 0, "latq_cpu::hadamard: the block (", b, ") must be a power of two");
  TORCH_CHECK(n % b == 0, "latq_cpu::hadamard: ", n, " columns are not a multiple of the block ", b);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kHalf,
              "latq_cpu::hadamard: activations must be bf16/fp16/fp32, got ", dtype);
  const float* sp = signs.data_ptr<float>();
  const int64_t M = n ? x.numel() / n : 0;
  const int isa = g_isa.load();
  // rows per task: ~16k values, so a decode step's one row stays on its thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "latq_cpu_hadamard", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) { rotate_rows(xp, yp, sp, r0, r1, n, b, isa); });
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
// small-M path reads it during the call only, and a decode step then allocates nothing for it.
// Layers of other input sizes take turns in a step: the scratch keeps its largest storage and
// takes x's shape in place (no dispatched resize_ per call)
const at::Tensor& latq_hadamard_scratch(const at::Tensor& x, const at::Tensor& signs) {
  thread_local at::Tensor scratch;
  const size_t bytes = static_cast<size_t>(x.numel()) * x.element_size();
  if (!scratch.defined() || scratch.scalar_type() != x.scalar_type() || scratch.storage().nbytes() < bytes)
    scratch = at::empty(x.sizes(), x.options());
  else if (scratch.sizes() != x.sizes())
    scratch.unsafeGetTensorImpl()->set_sizes_contiguous(x.sizes());
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

// whether an instruction set (2: AVX-512F and BW where the build targets them, 1: AVX2 + FMA + F16C,
// 0: scalar) runs here: the codebook op (codebook.cpp) takes the same ones
bool latq_isa_runs(int isa) { return isa_runs(isa); }

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
