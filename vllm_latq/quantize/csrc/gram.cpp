// Calibration statistics from bf16 activations (loaded by vllm_latq/native.py; used by
// quantize/hessian.py). A product of two bf16 values is exact in fp32, so XᵀX of a bf16 X summed
// in fp32 is what an fp32 GEMM of the upcast X computes — but MKL's bf16 GEMM runs it on the
// CPU's bf16 units (AMX, AVX512-BF16). The fp32 product is then added to the fp64 sum.
//
//   latq_cpu::bf16_tn_add(a [n, p] bf16, b [n, q] bf16, S [p, q] fp64) -> ()   S += aᵀb
//   latq_cpu::has_bf16_gemm() -> bool
//
// a, b and S may be column slices (last dimension contiguous). MKL's routine is looked up in the
// process (torch links MKL): where it is absent the op reports so and callers keep fp32 GEMMs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <dlfcn.h>

namespace {

using Bf16Gemm = void (*)(int layout, int transa, int transb, int m, int n, int k, float alpha,
                          const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                          int ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS enum values

Bf16Gemm find_gemm() {
  void* self = dlopen(nullptr, RTLD_LAZY);
  void* f = self ? dlsym(self, "cblas_gemm_bf16bf16f32") : nullptr;
  if (!f) {
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    f = torch_cpu ? dlsym(torch_cpu, "cblas_gemm_bf16bf16f32") : nullptr;
  }
  return reinterpret_cast<Bf16Gemm>(f);
}

Bf16Gemm gemm() {
  static const Bf16Gemm f = find_gemm();
  return f;
}

bool has_bf16_gemm() { return gemm() != nullptr; }

void check_operand(const at::Tensor& t, const char* what, int64_t dim, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == dim && t.scalar_type() == dtype && t.stride(-1) == 1,
              "bf16_tn_add: ", what, " must be a CPU ", dim, "-d ", c10::toString(dtype),
              " tensor with a contiguous last dimension, got ", t.scalar_type(), " ", t.sizes(),
              " strides ", t.strides());
}

void bf16_tn_add(const at::Tensor& a, const at::Tensor& b, at::Tensor S) {
  TORCH_CHECK(has_bf16_gemm(), "bf16_tn_add: MKL's cblas_gemm_bf16bf16f32 is not in this process");
  check_operand(a, "a", 2, at::kBFloat16);
  check_operand(b, "b", 2, at::kBFloat16);
  check_operand(S, "S", 2, at::kDouble);
  const int64_t n = a.size(0), p = a.size(1), q = b.size(1);
  TORCH_CHECK(b.size(0) == n && S.size(0) == p && S.size(1) == q, "bf16_tn_add: shapes a ", a.sizes(), ", b ",
              b.sizes(), ", S ", S.sizes(), " do not make S += aᵀb");
  TORCH_CHECK(n < INT32_MAX && p < INT32_MAX && q < INT32_MAX && a.stride(0) < INT32_MAX &&
                  b.stride(0) < INT32_MAX, "bf16_tn_add: sizes beyond MKL's 32-bit integers");
  at::Tensor prod = at::empty({p, q}, at::kFloat);
  gemm()(kRowMajor, kTrans, kNoTrans, int(p), int(q), int(n), 1.0f,
         reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()), int(a.stride(0)),
         reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()), int(b.stride(0)), 0.0f,
         prod.data_ptr<float>(), int(q));
  const float* P = prod.data_ptr<float>();
  double* D = S.data_ptr<double>();
  const int64_t ld = S.stride(0);
  at::parallel_for(0, p, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = P + r * q;
      double* dst = D + r * ld;
      for (int64_t j = 0; j < q; ++j) dst[j] += double(src[j]);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("bf16_tn_add(Tensor a, Tensor b, Tensor(a!) S) -> ()");
  m.def("has_bf16_gemm() -> bool");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) { m.impl("bf16_tn_add", &bf16_tn_add); }

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) { m.impl("has_bf16_gemm", &has_bf16_gemm); }
