// The CPU fast path's small-M call in C++ (built on first use by vllm_latq/native.py):
// torch's fused int4 GEMM for the inliers, then one pass over the output that adds the fp32
// CSR outliers and the bias and casts — CPUKernel.apply's math (out = dtype(float(y_int4) +
// Σ val·x[col] + bias)) without its half-dozen dispatched torch calls per layer and without
// Python between them. Small outlier sets are summed by a plain loop here (MKL's CSR call
// costs ~5 µs of setup, as much as a small layer's whole int4 GEMM); large ones by MKL.
//
//   latq_cpu::small_linear(x2d, packed, scales_zeros, crow?, col?, val?, bias?, group, planes)
//   latq_cpu::linear(x, tensors, ints, bias, out_features)   the schema of latq::cpu_linear;
//       rows ≥ the large-M threshold go back to latq::cpu_linear (Python: dequant + GEMM)
//   latq_cpu::set_large_m(m), latq_cpu::set_loop_max(n)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

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

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                        const std::optional<at::Tensor>& crow, const std::optional<at::Tensor>& col,
                        const std::optional<at::Tensor>& val, const std::optional<at::Tensor>& bias,
                        int64_t group_size, int64_t planes) {
  TORCH_CHECK(x.dim() == 2, "latq_cpu::small_linear: x must be 2-D, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kHalf,
              "latq_cpu::small_linear: activations must be bf16/fp16/fp32, got ", dtype);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xb = (dtype == at::kBFloat16 && x.is_contiguous()) ? x : x.to(at::kBFloat16).contiguous();
  if (planes == 2) xb = at::cat({xb, xb}, 1);
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(xb, packed, group_size, scales_zeros);  // bf16 [M, N]
  const bool outl = crow.has_value() && crow->defined() && col->numel() > 0;
  const bool has_bias = bias.has_value() && bias->defined();
  if (!outl && !has_bias && dtype == at::kBFloat16) return y;
  y = y.contiguous();
  const int64_t N = y.size(1);
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

at::Tensor linear(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef ints,
                  const std::optional<at::Tensor>& bias, int64_t out_features) {
  // CPUState, flattened: tensors = (packed, scales_zeros, crow, col, val),
  // ints = (out_features, in_features, group_size, planes, layout_block, layout_halves)
  TORCH_CHECK(tensors.size() == 5 && ints.size() == 6, "latq_cpu::linear: not a CPUState");
  const int64_t K = ints[1];
  const int64_t M = x.numel() / K;
  if (M >= g_large_m.load() && ints[4] != 0) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("latq::cpu_linear", "")
                         .typed<at::Tensor(const at::Tensor&, const c10::List<std::optional<at::Tensor>>&,
                                           at::IntArrayRef, const std::optional<at::Tensor>&, int64_t)>();
    return op.call(x, tensors, ints, bias, out_features);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor x2 = x.reshape({M, K});
  const std::optional<at::Tensor> crow = tensors.get(2), col = tensors.get(3), val = tensors.get(4);
  at::Tensor y = small_linear(x2, *tensors.get(0), *tensors.get(1), crow, col, val, bias, ints[2], ints[3]);
  return y.reshape(shape);
}

void set_large_m(int64_t m) { g_large_m.store(m); }
void set_loop_max(int64_t n) { g_loop_max.store(n); }

}  // namespace

TORCH_LIBRARY(latq_cpu, m) {
  m.def("small_linear(Tensor x, Tensor packed, Tensor scales_zeros, Tensor? crow, Tensor? col, Tensor? val, "
        "Tensor? bias, int group_size, int planes) -> Tensor");
  m.def("linear(Tensor x, Tensor?[] tensors, int[] ints, Tensor? bias, int out_features) -> Tensor");
  m.def("set_large_m(int m) -> ()");
  m.def("set_loop_max(int n) -> ()");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("linear", &linear);
}

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) {
  m.impl("set_large_m", &set_large_m);
  m.impl("set_loop_max", &set_loop_max);
}
