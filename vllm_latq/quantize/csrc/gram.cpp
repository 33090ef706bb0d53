// Calibration statistics (loaded by vllm_latq/native.py; used by quantize/hessian.py): fp32
// products of activations added *exactly* into an fp64 pair (hi, lo). A product of two bf16 values
// is exact in fp32, so XᵀX of a bf16 X summed in fp32 is what an fp32 GEMM of the upcast X computes —
// but MKL's bf16 GEMM runs it on the CPU's bf16 units (AMX, AVX512-BF16).
//
//   latq_cpu::exact_add(P [p, q] fp32, hi [p, q] fp64, lo [p, q] fp64, inexact bool[]) -> ()
//       hi + lo += P with no rounding: TwoSum puts hi's rounding error into lo; an addition to lo
//       that rounds (the pair no longer the exact sum) sets inexact
//   latq_cpu::bf16_tn_add(a [n, p] bf16, b [n, q] bf16, hi, lo, inexact) -> ()   exact_add(aᵀb)
//   latq_cpu::has_bf16_gemm() -> bool
//
// a, b, P, hi and lo may be column slices (last dimension contiguous). MKL's routine is looked up
// in the process (torch links MKL): where it is absent the op reports so and callers keep fp32 GEMMs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>

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

void check_operand(const at::Tensor& t, const char* op, const char* what, int64_t dim, at::ScalarType dtype) {
  // rows must not overlap (an expanded tensor's stride 0): the loops and MKL step whole rows
  TORCH_CHECK(t.device().is_cpu() && t.dim() == dim && t.scalar_type() == dtype && t.stride(-1) == 1 &&
                  (dim < 2 || t.size(0) <= 1 || t.stride(0) >= std::max<int64_t>(t.size(1), 1)),
              op, ": ", what, " must be a CPU ", dim, "-d ", c10::toString(dtype),
              " tensor with a contiguous last dimension and rows apart, got ", t.scalar_type(), " ", t.sizes(),
              " strides ", t.strides());
}

// s + e == a + b exactly (Knuth's TwoSum; no multiplication, so nothing for the compiler to fuse)
inline void two_sum(double a, double b, double& s, double& e) {
  s = a + b;
  const double t = s - a;
  e = (a - (s - t)) + (b - t);
}

void add_rows(const float* P, int64_t ldp, double* hi, int64_t ldh, double* lo, int64_t ldl, int64_t p, int64_t q,
              bool* inexact) {
  std::atomic<bool> lost{false};
  at::parallel_for(0, p, 16, [&](int64_t r0, int64_t r1) {
    bool mine = false;
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = P + r * ldp;
      double* h = hi + r * ldh;
      double* l = lo + r * ldl;
      for (int64_t j = 0; j < q; ++j) {
        double s, e, s2, e2;
        two_sum(h[j], double(src[j]), s, e);
        two_sum(l[j], e, s2, e2);
        h[j] = s;
        l[j] = s2;
        mine |= e2 != 0.0;
      }
    }
    if (mine) lost = true;
  });
  if (lost) *inexact = true;
}

void check_pair(const char* op, const at::Tensor& P, const at::Tensor& hi, const at::Tensor& lo,
                const at::Tensor& inexact) {
  check_operand(hi, op, "hi", 2, at::kDouble);
  check_operand(lo, op, "lo", 2, at::kDouble);
  TORCH_CHECK(hi.sizes() == P.sizes() && lo.sizes() == P.sizes(), op, ": hi ", hi.sizes(), " and lo ",
              lo.sizes(), " must have the product's shape ", P.sizes());
  TORCH_CHECK(inexact.device().is_cpu() && inexact.scalar_type() == at::kBool && inexact.numel() == 1 &&
                  inexact.is_contiguous(), op, ": inexact must be a CPU bool tensor of one element");
}

void exact_add(const at::Tensor& P, at::Tensor hi, at::Tensor lo, at::Tensor inexact) {
  check_operand(P, "exact_add", "P", 2, at::kFloat);
  check_pair("exact_add", P, hi, lo, inexact);
  add_rows(P.data_ptr<float>(), P.stride(0), hi.data_ptr<double>(), hi.stride(0), lo.data_ptr<double>(),
           lo.stride(0), P.size(0), P.size(1), inexact.data_ptr<bool>());
}

void bf16_tn_add(const at::Tensor& a, const at::Tensor& b, at::Tensor hi, at::Tensor lo, at::Tensor inexact) {
  TORCH_CHECK(has_bf16_gemm(), "bf16_tn_add: MKL's cblas_gemm_bf16bf16f32 is not in this process");
  check_operand(a, "bf16_tn_add", "a", 2, at::kBFloat16);
  check_operand(b, "bf16_tn_add", "b", 2, at::kBFloat16);
  const int64_t n = a.size(0), p = a.size(1), q = b.size(1);
  TORCH_CHECK(b.size(0) == n && hi.dim() == 2 && hi.size(0) == p && hi.size(1) == q, "bf16_tn_add: shapes a ",
              a.sizes(), ", b ", b.sizes(), ", hi ", hi.sizes(), " do not make hi += aᵀb");
  TORCH_CHECK(n < INT32_MAX && p < INT32_MAX && q < INT32_MAX && a.stride(0) < INT32_MAX &&
                  b.stride(0) < INT32_MAX, "bf16_tn_add: sizes beyond MKL's 32-bit integers");
  TORCH_CHECK(a.stride(0) >= std::max<int64_t>(p, 1) && b.stride(0) >= std::max<int64_t>(q, 1),
              "bf16_tn_add: a's and b's row strides must be at least their widths (MKL's leading dimensions)");
  at::Tensor prod = at::empty({p, q}, at::kFloat);
  check_pair("bf16_tn_add", prod, hi, lo, inexact);
  if (n == 0 || p == 0 || q == 0) return;   // nothing to add; MKL refuses leading dimensions of 0
  gemm()(kRowMajor, kTrans, kNoTrans, int(p), int(q), int(n), 1.0f,
         reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()), int(a.stride(0)),
         reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()), int(b.stride(0)), 0.0f,
         prod.data_ptr<float>(), int(q));
  exact_add(prod, hi, lo, inexact);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("exact_add(Tensor P, Tensor(a!) hi, Tensor(b!) lo, Tensor(c!) inexact) -> ()");
  m.def("bf16_tn_add(Tensor a, Tensor b, Tensor(a!) hi, Tensor(b!) lo, Tensor(c!) inexact) -> ()");
  m.def("has_bf16_gemm() -> bool");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) {
  m.impl("exact_add", &exact_add);
  m.impl("bf16_tn_add", &bf16_tn_add);
}

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) { m.impl("has_bf16_gemm", &has_bf16_gemm); }
