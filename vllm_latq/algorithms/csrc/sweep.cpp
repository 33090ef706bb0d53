// The solvers' per-column work in C++ (loaded by vllm_latq/native.py; used by solvers.py for
// fp32 problems). GPTQ and Babai are one back-substitution (solvers.back_substitution); inside a
// 16-row sub-block each row is: gather the sub-block's later propagated rows (a ≤15-term update),
// round on its scales, write z (int32) / q / outlier / ω/s to its output row. In torch that is six
// or seven small dispatched ops per column — a quarter of a 4096² GPTQ run; here one call per
// sub-block. The GEMM updates between sub-blocks stay in torch. Rounding is torch's: ω/s in
// fp32, round-half-even, outliers stored as fp16(ω).
//
//   latq_cpu::back_substitution_subblock(X, B, M, S, gidx, rows, Zt, Qt?, Ot?, Rt?, j0, k1, k2, mode, qmin, qmax)
// mode: 0 unclipped, 1 clipped to [qmin, qmax], 2 SSQR (off-grid → outlier, z = 0, q = fp16(ω))

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct Rounder {
  int64_t mode;
  float qmin, qmax;
  const float* S;  // [G, r] or [G, 1]
  int64_t s_cols;
  const int64_t* gidx;
  const int64_t* rows;
  int32_t* Z;  // [c, r] output tables (Q may be null: Babai writes q to its block buffer)
  float* Q;
  bool* O;
  float* R;
  int64_t r;

  // round column j (processing index) from w into its output row; q also to q_out
  void operator()(int64_t j, const float* w, float* q_out) const {
    const int64_t row = rows[j];
    const float* s = S + gidx[j] * s_cols;
    const bool vec = s_cols > 1;
    int32_t* z = Z + row * r;
    float* q = Q ? Q + row * r : nullptr;
    bool* o = O ? O + row * r : nullptr;
    float* rho = R ? R + row * r : nullptr;
    for (int64_t i = 0; i < r; ++i) {
      const float si = vec ? s[i] : s[0];
      const float x = w[i] / si;
      if (rho) rho[i] = x;
      float zi = std::nearbyint(x);  // default rounding mode: half to even, as torch.round
      float qi;
      if (mode == 1) {
        zi = std::min(std::max(zi, qmin), qmax);
        qi = zi * si;
      } else if (mode == 2) {
        const bool out = zi < qmin || zi > qmax;
        if (out) zi = 0.f;
        qi = out ? static_cast<float>(c10::Half(w[i])) : zi * si;
        o[i] = out;
      } else {
        qi = zi * si;
      }
      z[i] = static_cast<int32_t>(zi);
      if (q) q[i] = qi;
      q_out[i] = qi;
    }
  }
};

Rounder make_rounder(const at::Tensor& S, const at::Tensor& gidx, const at::Tensor& rows, const at::Tensor& Zt,
                     float* Q, const std::optional<at::Tensor>& Ot, const std::optional<at::Tensor>& Rt, int64_t mode,
                     double qmin, double qmax) {
  TORCH_CHECK(S.scalar_type() == at::kFloat && S.is_contiguous() && S.dim() == 2, "S: contiguous fp32 [G, r|1]");
  TORCH_CHECK(Zt.is_contiguous() && Zt.scalar_type() == at::kInt, "Zt: contiguous int32");
  const bool has_o = Ot.has_value() && Ot->defined(), has_r = Rt.has_value() && Rt->defined();
  TORCH_CHECK(mode != 2 || has_o, "SSQR mode needs the outlier table");
  return Rounder{mode, static_cast<float>(qmin), static_cast<float>(qmax), S.data_ptr<float>(), S.size(1),
                 gidx.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), Zt.data_ptr<int32_t>(), Q,
                 has_o ? Ot->data_ptr<bool>() : nullptr, has_r ? Rt->data_ptr<float>() : nullptr, Zt.size(1)};
}

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void expect(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(),
              "back_substitution_subblock: ", name, " must be a contiguous CPU ", c10::toString(dtype),
              " tensor of shape ", shape, ", got ", t.device(), " ", t.scalar_type(), " ", t.sizes(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

// every tensor against X [c, r] and the rows [j0 + k1, j0 + k2) this call reads, whose table
// indices (gidx, rows) are checked too: O(sub-block) per call, the loop below trusts them
void check_subblock(const at::Tensor& X, const at::Tensor& B, const at::Tensor& M, const at::Tensor& S,
                    const at::Tensor& gidx, const at::Tensor& rows, const at::Tensor& Zt,
                    const std::optional<at::Tensor>& Qt, const std::optional<at::Tensor>& Ot,
                    const std::optional<at::Tensor>& Rt, int64_t j0, int64_t k1, int64_t k2, int64_t mode) {
  constexpr const char* op = "back_substitution_subblock";
  TORCH_CHECK(X.dim() == 2 && B.dim() == 2 && Zt.dim() == 2, op, ": X, B and Zt must be 2-D");
  const int64_t c = X.size(0), r = X.size(1), nb = B.size(0), out_rows = Zt.size(0);
  expect(X, "X", at::kFloat, {c, r});
  expect(B, "B", at::kFloat, {nb, r});
  expect(Zt, "Zt", at::kInt, {out_rows, r});
  TORCH_CHECK(M.device().is_cpu() && M.scalar_type() == at::kFloat && M.dim() == 2 && M.size(0) == c &&
              M.size(1) == c, op, ": M must be a CPU fp32 [", c, ", ", c, "] tensor, got ", M.scalar_type(), " ",
              M.sizes());
  TORCH_CHECK(S.dim() == 2 && S.size(0) >= 1 && (S.size(1) == r || S.size(1) == 1), op,
              ": S must be [G, ", r, "] or [G, 1], got ", S.sizes());
  expect(S, "S", at::kFloat, {S.size(0), S.size(1)});
  expect(gidx, "gidx", at::kLong, {c});
  expect(rows, "rows", at::kLong, {c});
  if (given(Qt)) expect(*Qt, "Qt", at::kFloat, {out_rows, r});
  if (given(Ot)) expect(*Ot, "Ot", at::kBool, {out_rows, r});
  if (given(Rt)) expect(*Rt, "Rt", at::kFloat, {out_rows, r});
  TORCH_CHECK(mode >= 0 && mode <= 2, op, ": mode must be 0, 1 or 2, got ", mode);
  TORCH_CHECK(0 <= k1 && k1 <= k2 && k2 <= nb && j0 >= 0 && j0 <= c - k2, op, ": rows j0 + [k1, k2) = ", j0,
              " + [", k1, ", ", k2, ") must lie in X's ", c, " rows and B's ", nb);
  const int64_t* g = gidx.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t j = j0 + k1; j < j0 + k2; ++j) {
    TORCH_CHECK(g[j] >= 0 && g[j] < S.size(0), op, ": gidx[", j, "] = ", g[j], " is not a row of S's ", S.size(0));
    TORCH_CHECK(rw[j] >= 0 && rw[j] < out_rows, op, ": rows[", j, "] = ", rw[j], " is not a row of the tables' ",
                out_rows);
  }
}

// Rows j0+k2-1 down to j0+k1 of the back-substitution both solvers are: ω = X[j] − Σ_t M[j, j0+t] B[t]
// over the sub-block's later rows, round, then B[k] = q (Babai) or, given Qt, q → Qt and B[k] = ω − q
// (GPTQ, propagating errors).
void back_substitution_subblock(const at::Tensor& X, const at::Tensor& B, const at::Tensor& M, const at::Tensor& S,
                                const at::Tensor& gidx, const at::Tensor& rows, const at::Tensor& Zt,
                                const std::optional<at::Tensor>& Qt, const std::optional<at::Tensor>& Ot,
                                const std::optional<at::Tensor>& Rt, int64_t j0, int64_t k1, int64_t k2, int64_t mode,
                                double qmin, double qmax) {
  check_subblock(X, B, M, S, gidx, rows, Zt, Qt, Ot, Rt, j0, k1, k2, mode);
  const bool errors = Qt.has_value() && Qt->defined();
  const Rounder rnd = make_rounder(S, gidx, rows, Zt, errors ? Qt->data_ptr<float>() : nullptr, Ot, Rt, mode, qmin, qmax);
  const int64_t r = X.size(1);
  const float* Xp = X.data_ptr<float>();
  float* Bp = B.data_ptr<float>();
  const float* Mp = M.data_ptr<float>();
  const int64_t ms0 = M.stride(0), ms1 = M.stride(1);
  std::vector<float> w(r), q(r);
  for (int64_t k = k2 - 1; k >= k1; --k) {
    const int64_t j = j0 + k;
    const float* xj = Xp + j * r;
    for (int64_t i = 0; i < r; ++i) w[i] = xj[i];
    for (int64_t t = k + 1; t < k2; ++t) {  // ω −= B[t] · M[j, j0 + t]
      const float m = Mp[j * ms0 + (j0 + t) * ms1];
      const float* bt = Bp + t * r;
      for (int64_t i = 0; i < r; ++i) w[i] -= bt[i] * m;
    }
    float* bk = Bp + k * r;
    if (errors) {
      rnd(j, w.data(), q.data());
      for (int64_t i = 0; i < r; ++i) bk[i] = w[i] - q[i];
    } else {
      rnd(j, w.data(), bk);
    }
  }
}

// ---- the damped Hessian in a processing order: one pass instead of torch's fp32 copy and two
// fancy-indexing gathers, a noticeable share of a GPTQ run at large c.

// (H + λI)[perm][:, perm] in `dtype` (fp32/fp64) in one pass over the fp64 Hessian: row perm[i] is read
// whole and gathered in cache
at::Tensor permuted_damped(const at::Tensor& H_, const at::Tensor& perm_, double lam, at::ScalarType dtype) {
  TORCH_CHECK(H_.device().is_cpu() && H_.dim() == 2 && H_.size(0) == H_.size(1) && at::isFloatingType(H_.scalar_type()),
              "permuted_damped: H must be a square floating-point CPU matrix, got ", H_.scalar_type(), " ", H_.sizes());
  TORCH_CHECK(perm_.device().is_cpu() && perm_.dim() == 1 && at::isIntegralType(perm_.scalar_type(), false),
              "permuted_damped: perm must be a 1-D integer CPU tensor, got ", perm_.scalar_type(), " ", perm_.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "permuted_damped: dtype must be fp32 or fp64, got ", dtype);
  const at::Tensor H = H_.to(at::kDouble).contiguous(), perm = perm_.to(at::kLong).contiguous();
  const int64_t c = H.size(0);
  TORCH_CHECK(perm.numel() == c, "permuted_damped: perm of length ", c);
  const int64_t* pp = perm.data_ptr<int64_t>();   // O(c) against the O(c²) gather it guards
  for (int64_t i = 0; i < c; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < c, "permuted_damped: perm[", i, "] = ", pp[i], " is not in [0, ", c, ")");
  at::Tensor out = at::empty({c, c}, H.options().dtype(dtype));
  const double* h = H.data_ptr<double>();
  const int64_t* p = perm.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(dtype, "permuted_damped", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, c, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const double* row = h + p[i] * c;
        scalar_t* oi = o + i * c;
        for (int64_t j = 0; j < c; ++j) oi[j] = static_cast<scalar_t>(row[p[j]]);
        oi[i] = static_cast<scalar_t>(row[p[i]] + lam);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("back_substitution_subblock(Tensor X, Tensor(a!) B, Tensor M, Tensor S, Tensor gidx, Tensor rows, "
        "Tensor(b!) Zt, Tensor(c!)? Qt, Tensor(d!)? Ot, Tensor(e!)? Rt, int j0, int k1, int k2, int mode, float qmin, "
        "float qmax) -> ()");
  m.def("permuted_damped(Tensor H, Tensor perm, float lam, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) {
  m.impl("back_substitution_subblock", &back_substitution_subblock);
  m.impl("permuted_damped", &permuted_damped);
}
