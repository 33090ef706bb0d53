// Block Babai's sweep and the E8 scale search's errors in C++ (loaded by vllm_latq/native.py; called by
// algorithms/e8.py for fp64 / fp32 CPU problems). In torch each block of 8 columns is a dozen small ops
// around the searches; here the whole sweep is one call, each row's stages searched in registers with
// the searches of e8_search.h (those of e8.cpp's ops, so the same points), and the feed of the later
// targets is torch's GEMMs, called exactly as e8.py::babai_sweep calls them:
//
//   latq_cpu::e8_block_babai(X [c, r] f64, U [c, c], D [K, 8, 8], S [G, r], block_group [K] i64, patterns,
//                            roots, ball, kinds, gains, metric, rounds, tries, chunk) -> (Q [c, r], P, radius)
//     Blocks k = K−1 … 0 (K = c/8, rows of X in Babai's order): each row's target Y_k/s (s its block's
//     group scale) through every stage (VectorCode.points: Euclidean nearest, the radius rule, refined
//     in D_k where `metric`), Q_k = s·Σ p/gain; then Y ← Y + U[:, k]·(X_k − Q_k), lazily: within the
//     chunk of `chunk` blocks at once, above it one GEMM when the chunk is done.
//     P [stages, c, r] f32: each stage's points (code units); radius [K, r]: the certified radius (inf:
//     an overload).
//   latq_cpu::e8_code_errors(W [r, c] f32, S [n, r, G] f32, block_group [K] i64, patterns, kinds, gains)
//     -> [n, r, G]: per candidate scale of each group, Σ over its blocks ‖s·code(w/s) − w‖²
//     (e8.py::code_scales's round-to-nearest error).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "e8_search.h"

namespace {

using namespace latq_e8;

constexpr int E8P_KIND = 0;   // kinds: 0 E8P, 1 the ball (its stage holds the origin: never adds error)

std::vector<at::Tensor> e8_block_babai(const at::Tensor& X, const at::Tensor& U, const at::Tensor& D_,
                                       const at::Tensor& S_, const at::Tensor& block_group_,
                                       const at::Tensor& patterns, const at::Tensor& roots_, const at::Tensor& ball_,
                                       at::IntArrayRef kinds, at::ArrayRef<double> gains, bool metric,
                                       int64_t rounds, int64_t tries, int64_t chunk) {
  TORCH_CHECK(X.dim() == 2 && X.size(0) % D8 == 0 && X.scalar_type() == at::kDouble, "e8_block_babai: X [c, r] fp64");
  const int64_t c = X.size(0), r = X.size(1), K = c / D8;
  TORCH_CHECK(U.sizes() == at::IntArrayRef({c, c}) && U.scalar_type() == at::kDouble, "e8_block_babai: U [c, c] fp64");
  TORCH_CHECK(D_.sizes() == at::IntArrayRef({K, D8, D8}) && D_.scalar_type() == at::kDouble, "e8_block_babai: D [K, 8, 8]");
  TORCH_CHECK(S_.dim() == 2 && S_.size(1) == r && S_.scalar_type() == at::kDouble, "e8_block_babai: S [G, r] fp64");
  TORCH_CHECK(block_group_.numel() == K, "e8_block_babai: a group a block");
  TORCH_CHECK(kinds.size() == gains.size() && !kinds.empty() && chunk >= 1, "e8_block_babai: a kind and a gain a stage");
  const int64_t nst = static_cast<int64_t>(kinds.size());
  const Table tab(patterns);
  const at::Tensor D = D_.contiguous(), S = S_.contiguous(), grp = block_group_.to(at::kLong).contiguous();
  const at::Tensor R = roots_.to(at::kDouble).contiguous(), B = ball_.to(at::kDouble).contiguous();
  TORCH_CHECK(R.dim() == 2 && R.size(1) == D8 && tries >= 1 && tries <= R.size(0), "e8_block_babai: roots [n, 8]");
  at::Tensor Xc = X.contiguous(), Y = Xc.clone(), Q = at::empty_like(Xc), E = at::empty_like(Xc);
  at::Tensor P = at::empty({nst, c, r}, X.options().dtype(at::kFloat));
  at::Tensor radius = at::empty({K, r}, X.options());
  const double *x = Xc.data_ptr<double>(), *Sp = S.data_ptr<double>();
  double *y = Y.data_ptr<double>(), *q = Q.data_ptr<double>(), *e = E.data_ptr<double>(), *rad = radius.data_ptr<double>();
  float* pp = P.data_ptr<float>();
  const int64_t nr = R.size(0), nb = B.size(0);
  for (int64_t k = K - 1; k >= 0; --k) {
    const int64_t j = k * D8;
    const double* Dk = D.data_ptr<double>() + k * D8 * D8;
    const double* s = Sp + grp.data_ptr<int64_t>()[k] * r;
    const RootDescent<double> descent(tab, R.data_ptr<double>(), nr, Dk);
    const MetricBook<double> book(B.data_ptr<double>(), nb, Dk);
    at::parallel_for(0, r, 64, [&](int64_t i0, int64_t i1) {
      std::vector<double> g(std::max(nr, nb)), val(tries);
      std::vector<int64_t> idx(tries);
      for (int64_t i = i0; i < i1; ++i) {
        double xs[D8], v[D8] = {}, t[D8], p[D8];
        double radius_i = std::numeric_limits<double>::infinity();
        for (int a = 0; a < D8; ++a) xs[a] = y[(j + a) * r + i] / s[i];
        for (int64_t st = 0; st < nst; ++st) {
          const double gain = gains[st];
          for (int a = 0; a < D8; ++a) t[a] = (xs[a] - v[a]) * gain;
          const bool e8p = kinds[st] == E8P_KIND;
          if (e8p)
            nearest_e8p_row(tab, t, p);
          else
            ball_row(t, p);
          // within E8's covering radius (1): certified at 1/gain; else the ball keeps the earlier radius
          const bool within = dist2(t, p) <= 1.0 * (1 + 1e-9);
          radius_i = within ? 1.0 / gain : (e8p ? std::numeric_limits<double>::infinity() : radius_i);
          if (metric && e8p) descent.descend(p, t, rounds, tries, g.data(), val.data(), idx.data());
          if (metric && !e8p) book.nearest(t, p, g.data());
          for (int a = 0; a < D8; ++a) {
            pp[(st * c + j + a) * r + i] = static_cast<float>(p[a]);
            v[a] = v[a] + p[a] / gain;
          }
        }
        for (int a = 0; a < D8; ++a) {
          const int64_t at = (j + a) * r + i;
          q[at] = s[i] * v[a];
          e[at] = x[at] - q[at];
        }
        rad[k * r + i] = radius_i;
      }
    });
    const int64_t j0 = k / chunk * chunk * D8;   // the chunk's first column
    if (j > j0) Y.narrow(0, j0, j - j0).addmm_(U.narrow(0, j0, j - j0).narrow(1, j, D8), E.narrow(0, j, D8));
    if (j == j0 && j0 > 0) {
      const int64_t w = std::min(chunk * D8, c - j0);
      Y.narrow(0, 0, j0).addmm_(U.narrow(0, 0, j0).narrow(1, j0, w), E.narrow(0, j0, w));
    }
  }
  return {Q, P, radius};
}

// torch's error, s·v − w then its square, each rounded: no fused multiply-adds here
__attribute__((optimize("fp-contract=off"))) float block_error(const float* w, const float* v, float s) {
  float sum = 0;
  for (int a = 0; a < D8; ++a) {
    const float m = s * v[a];
    const float d = m - w[a];
    const float sq = d * d;
    sum = sum + sq;
  }
  return sum;
}

at::Tensor e8_code_errors(const at::Tensor& W_, const at::Tensor& S_, const at::Tensor& block_group_,
                          const at::Tensor& patterns, at::IntArrayRef kinds, at::ArrayRef<double> gains) {
  TORCH_CHECK(W_.dim() == 2 && W_.size(1) % D8 == 0 && W_.scalar_type() == at::kFloat, "e8_code_errors: W [r, c] fp32");
  const int64_t r = W_.size(0), K = W_.size(1) / D8;
  TORCH_CHECK(S_.dim() == 3 && S_.size(1) == r && S_.scalar_type() == at::kFloat, "e8_code_errors: S [n, r, G] fp32");
  TORCH_CHECK(block_group_.numel() == K && kinds.size() == gains.size() && !kinds.empty(),
              "e8_code_errors: a group a block, a kind and a gain a stage");
  const int64_t n = S_.size(0), G = S_.size(2);
  const Table tab(patterns);
  const at::Tensor W = W_.contiguous(), S = S_.contiguous(), grp = block_group_.to(at::kLong).contiguous();
  at::Tensor out = at::zeros_like(S);
  const float *w = W.data_ptr<float>(), *sp = S.data_ptr<float>();
  const int64_t* gp = grp.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * r, 16, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {   // a = candidate · r + row
      const float* wr = w + (a % r) * K * D8;
      for (int64_t b = 0; b < K; ++b) {
        const float s = sp[a * G + gp[b]];
        float xs[D8], v[D8];
        for (int i = 0; i < D8; ++i) xs[i] = wr[b * D8 + i] / s;
        code_point(tab, xs, kinds, gains, v);
        op[a * G + gp[b]] += block_error(wr + b * D8, v, s);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("e8_block_babai(Tensor X, Tensor U, Tensor D, Tensor S, Tensor block_group, Tensor patterns, Tensor roots, "
        "Tensor ball, int[] kinds, float[] gains, bool metric, int rounds, int tries, int chunk) -> Tensor[]");
  m.def("e8_code_errors(Tensor W, Tensor S, Tensor block_group, Tensor patterns, int[] kinds, float[] gains) -> Tensor");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) {
  m.impl("e8_block_babai", &e8_block_babai);
  m.impl("e8_code_errors", &e8_code_errors);
}
