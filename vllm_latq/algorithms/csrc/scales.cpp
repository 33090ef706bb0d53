// The MSE scale search of algorithms/scales.py::mse_scales in C++ (loaded by vllm_latq/native.py).
// In torch each of the 18 candidate scales is five elementwise passes and a reduction over the
// whole matrix (~0.15 s at 4096², paid by every GPTQ/Babai/SSQR/HPTQ run); here one group at a
// time, all its candidates while its weights sit in L1, rows in parallel (at::parallel_for: an
// OpenMP pragma in ATen's headers, serial unless the library is built with -fopenmp). The loops
// run over 16 lanes so that g++ -O3 vectorizes them (checked with -fopt-info-vec: zmm with
// AVX-512): ~8 cycles per 16 weights and candidate on Zen 4, mostly the exact fp32 division
// and the clip.
// Same math as torch: factors and scales in fp32 (the Python scalars rounded to fp32 first, as
// torch does), scales clamped at FP16_TINY then fp16-rounded, w/s in fp32, round-half-even,
// clip, ·s, −w; a candidate replaces the best only if strictly better. Only the error's
// summation order differs (16 fp32 lanes), so a near-tie may resolve differently.
//
//   latq_cpu::mse_scales(W, bits, group_size, coarse, fine, min_shrink) -> S [r, ceil(c/g)]
// A group whose scale fp16 cannot hold (non-finite weights, |s| > 65504) gets NaN: the caller
// raises on it (to_fp16_grid).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr float FP16_MAX = 65504.f, FP16_TINY = 1.f / 16384.f;  // 2^-14, as scales.py
constexpr int L = 16;  // lanes: per-lane partial results keep the loops vectorizable (a single
                       // fp32 accumulator is a serial chain the compiler may not reorder)

inline float fp16(float s) { return static_cast<float>(c10::Half(std::max(s, FP16_TINY))); }

// max, min and Σ w·0 (NaN iff a weight is not finite) of a group's n ≥ 1 weights
float group_stats(const float* w, int64_t n, float& amin, float& chk) {
  float mx[L], mn[L], ck[L] = {};
  for (int l = 0; l < L; ++l) mx[l] = mn[l] = w[0];
  for (int64_t i = 0; i < n; i += L)
    for (int l = 0; l < L; ++l) {
      const float x = i + l < n ? w[i + l] : w[0];  // ragged tail: repeat w[0]
      mx[l] = mx[l] < x ? x : mx[l];
      mn[l] = mn[l] > x ? x : mn[l];
      ck[l] += x * 0.f;
    }
#pragma GCC unroll 4
  for (int h = L / 2; h > 0; h /= 2)
    for (int l = 0; l < h; ++l) {
      mx[l] = mx[l] < mx[l + h] ? mx[l + h] : mx[l];
      mn[l] = mn[l] > mn[l + h] ? mn[l + h] : mn[l];
      ck[l] += ck[l + h];
    }
  amin = mn[0], chk = ck[0];
  return mx[0];
}

// err[k] = Σ (clip(round(w/s[k]))·s[k] − w)² over a group's n weights, k < K: torch's
// fl(fl(z·s) − w), not an FMA (hence fp-contract=off and two statements); the accumulation is one.
__attribute__((optimize("fp-contract=off"))) void group_errors(const float* w, int64_t n, const float* s, int K,
                                                                 float qmin, float qmax, float* err) {
  for (int k = 0; k < K; ++k) {
    const float sk = s[k];
    float acc[L] = {};
    auto term = [&](int l, float x) {
      const float z = std::min(std::max(std::nearbyint(x / sk), qmin), qmax);  // half to even
      const float q = z * sk;
      const float d = q - x;
      acc[l] = std::fma(d, d, acc[l]);
    };
    int64_t i = 0;
    for (; i + L <= n; i += L)
      for (int l = 0; l < L; ++l) term(l, w[i + l]);
    for (int l = 0; i < n; ++i, ++l) term(l, w[i]);  // ragged tail
#pragma GCC unroll 4
    for (int h = L / 2; h > 0; h /= 2)  // unrolled, the halvings are vector adds (-10% overall)
      for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
    err[k] = acc[0];
  }
}

at::Tensor mse_scales(const at::Tensor& W, int64_t bits, int64_t group_size, int64_t coarse, int64_t fine,
                      double min_shrink) {
  TORCH_CHECK(W.scalar_type() == at::kFloat && W.is_contiguous() && W.dim() == 2, "W: contiguous fp32 [r, c]");
  TORCH_CHECK(W.device().is_cpu(), "mse_scales: W must be on the CPU");
  // coarse and fine size the candidate buffers: bounded so a typo is an error, not an allocation
  TORCH_CHECK(2 <= bits && bits <= 8 && group_size > 0 && 2 <= coarse && coarse <= 4096 && 0 <= fine && fine <= 4096,
              "mse_scales: bits ", bits, " (2..8), group_size ", group_size, " (> 0), coarse ", coarse,
              " (2..4096), fine ", fine, " (0..4096)");
  TORCH_CHECK(std::isfinite(min_shrink), "mse_scales: min_shrink ", min_shrink, " must be finite");
  const int64_t r = W.size(0), c = W.size(1), G = (c + group_size - 1) / group_size;
  const float qmin = -static_cast<float>(1 << (bits - 1)), qmax = static_cast<float>((1 << (bits - 1)) - 1);
  // the factors as torch sees them: Python doubles rounded to fp32
  const double step = (1.0 - min_shrink) / static_cast<double>(coarse - 1);
  std::vector<float> fc(coarse), off;
  for (int64_t k = 0; k < coarse; ++k) fc[k] = static_cast<float>(1.0 - k * step);
  for (int64_t k = 1; k <= fine; ++k) {  // offsets strictly between the best coarse factor's neighbours
    const double o = step * (2.0 * k / static_cast<double>(fine + 1) - 1.0);
    if (std::abs(o) > 1e-12) off.push_back(static_cast<float>(o));
  }
  const float lo = static_cast<float>(min_shrink);
  at::Tensor S = at::empty({r, G}, W.options());
  const float* Wp = W.data_ptr<float>();
  float* Sp = S.data_ptr<float>();

  at::parallel_for(0, r, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> cf(coarse + off.size()), cs(cf.size()), ce(cf.size());  // candidates: f, s, error
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t j = 0; j < G; ++j) {
        const float* w = Wp + i * c + j * group_size;
        const int64_t n = std::min(group_size, c - j * group_size);
        float amin, chk;  // torch's zero padding of a ragged group changes neither max(amax/qmax, amin/qmin)
        const float amax = group_stats(w, n, amin, chk);
        const float base_raw = std::max(amax / qmax, amin / qmin);
        if (chk != 0.f || !(std::abs(base_raw) <= FP16_MAX)) {
          Sp[i * G + j] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const float base = fp16(base_raw);
        // Candidates in torch's order. One whose scale repeats the previous one's or the best
        // coarse one's (clamped fine factors, fp16 rounding, all-zero groups) is dropped: same
        // error, never strictly better.
        float f0 = 0.f, best_s = 0.f, best_e = 0.f;
        bool bad = false;
        int m = 0, m0 = m;
        auto add = [&](float f) {
          const float s0 = base * f;
          bad |= !(std::abs(s0) <= FP16_MAX);  // to_fp16_grid's check (only min_shrink > 1 can fail it)
          const float s = fp16(s0);
          if (m > 0 && (cs[m - 1] == s || (m0 > 0 && best_s == s))) return;
          cf[m] = f, cs[m++] = s;
        };
        auto pick = [&] {  // errors of the new candidates, then strictly-better updates in order
          group_errors(w, n, cs.data() + m0, m - m0, qmin, qmax, ce.data() + m0);
          for (int t = m0; t < m; ++t)
            if (t == 0 || ce[t] < best_e) f0 = cf[t], best_s = cs[t], best_e = ce[t];
        };
        for (int64_t k = 0; k < coarse; ++k) add(fc[k]);
        pick();
        m0 = m;
        const float f1 = f0;  // the fine factors are around the best coarse one
        for (float o : off) add(std::min(std::max(f1 + o, lo), 1.f));
        pick();
        Sp[i * G + j] = bad ? std::numeric_limits<float>::quiet_NaN() : best_s;
      }
  });
  return S;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("mse_scales(Tensor W, int bits, int group_size, int coarse, int fine, float min_shrink) -> Tensor");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) { m.impl("mse_scales", &mse_scales); }
