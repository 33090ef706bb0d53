// The E8 solver's searches of algorithms/e8.py in C++ (loaded by vllm_latq/native.py): torch's
// path runs each block's E8P search as [N, 256] tensors (a topk, gathers, a second pass for the
// blocks the first could not settle), most of a layer's solve; here one block at a time in
// registers. Same definitions as e8.py, so the same points but at near-ties (sums in another order):
//
//   latq_cpu::e8p_nearest(x [N, 8], patterns [256, 8]) -> [N, 8]
//     E8P's nearest point: Conway–Sloane's nearest E8 point to x − ¼, plus ¼, where its pattern is
//     in the table; else the exact search of the 256 patterns for both shifts (each pattern's best
//     signs are x's, the cheapest coordinate flipped where the parity is wrong; ties: +¼, then the
//     earlier pattern).
//   latq_cpu::ball256_nearest(x [N, 8]) -> [N, 8]
//     The 256-point ball's nearest point in closed form (e8.py::_nearest_ball_euclid).
//   latq_cpu::e8_code_nearest(x [N, 8], patterns, kinds, gains) -> [N, 8]
//     A code's point, its stages in turn (e8.py::VectorCode.nearest without a metric).
//   latq_cpu::nearest_in_metric(x [N, 8], book [n, 8], D [8, 8]) -> [N, 8]
//     The book's nearest point in D (e8.py::nearest_in): the 3-bit ball stage's search in block Babai.
//   latq_cpu::e8p_metric_descent(p, x [N, 8], D [8, 8], roots [240, 8], patterns, rounds, tries) -> [N, 8]
//     e8.py::metric_descent with E8P's membership: per row up to `rounds` moves to the best of the
//     `tries` roots of least gain 2(p − x)ᵀDr + rᵀDr that is negative and stays in E8P.
// The rows' searches live in e8_search.h (shared with e8_sweep.cpp, block Babai's sweep).
// The table is the format's (e8p_patterns(), passed in): a pattern is looked up by its digits
// (2|aᵢ| − 1)/2 ∈ {0, 1, 2} in base 3 (a coordinate beyond 2.5 is in no pattern).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "e8_search.h"

namespace {

using namespace latq_e8;

at::Tensor rows8(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == D8, what, ": rows of 8");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, what, ": fp32 or fp64");
  return x.contiguous();
}

at::Tensor e8p_nearest(const at::Tensor& x_, const at::Tensor& patterns) {
  const at::Tensor x = rows8(x_, "e8p_nearest");
  const Table tab(patterns);
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "e8p_nearest", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 1024, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) nearest_e8p_row(tab, xp + r * D8, op + r * D8);
    });
  });
  return out;
}

at::Tensor ball256_nearest(const at::Tensor& x_) {
  const at::Tensor x = rows8(x_, "ball256_nearest");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ball256_nearest", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 4096, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) ball_row(xp + r * D8, op + r * D8);
    });
  });
  return out;
}

// ---- the ball's closed form (ball_row) and a code's stages at once (code_point): e8_search.h

at::Tensor e8_code_nearest(const at::Tensor& x_, const at::Tensor& patterns, at::IntArrayRef kinds,
                           at::ArrayRef<double> gains) {
  const at::Tensor x = rows8(x_, "e8_code_nearest");
  TORCH_CHECK(kinds.size() == gains.size() && !kinds.empty(), "e8_code_nearest: a kind and a gain a stage");
  const Table tab(patterns);
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "e8_code_nearest", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 1024, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        T v[D8];
        code_point(tab, xp + r * D8, kinds, gains, v);
        std::copy_n(v, D8, op + r * D8);
      }
    });
  });
  return out;
}

// ---- the nearest of a book's points [n, 8] in a metric D: the greatest 2xᵀDb − bᵀDb (first of equals),
// e8.py::nearest_in

at::Tensor nearest_in_metric(const at::Tensor& x_, const at::Tensor& book_, const at::Tensor& D_) {
  const at::Tensor x = rows8(x_, "nearest_in_metric");
  TORCH_CHECK(book_.dim() == 2 && book_.size(1) == D8 && D_.dim() == 2 && D_.size(0) == D8 && D_.size(1) == D8,
              "nearest_in_metric: book [n, 8], D [8, 8]");
  const int64_t n = book_.size(0);
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "nearest_in_metric", [&] {
    using T = scalar_t;
    const at::Tensor B = book_.to(x.scalar_type()).contiguous(), Dt = D_.to(x.scalar_type()).contiguous();
    const MetricBook<T> book(B.data_ptr<T>(), n, Dt.data_ptr<T>());
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 256, [&](int64_t r0, int64_t r1) {
      std::vector<T> g(n);
      for (int64_t r = r0; r < r1; ++r) book.nearest(xp + r * D8, op + r * D8, g.data());
    });
  });
  return out;
}

// ---- the local search in a metric D over E8's 240 roots, E8P's membership

at::Tensor e8p_metric_descent(const at::Tensor& p_, const at::Tensor& x_, const at::Tensor& D_,
                              const at::Tensor& roots_, const at::Tensor& patterns, int64_t rounds, int64_t tries) {
  const at::Tensor x = rows8(x_, "e8p_metric_descent");
  TORCH_CHECK(p_.sizes() == x.sizes(), "e8p_metric_descent: p and x alike");
  TORCH_CHECK(D_.dim() == 2 && D_.size(0) == D8 && D_.size(1) == D8, "e8p_metric_descent: D is [8, 8]");
  TORCH_CHECK(roots_.dim() == 2 && roots_.size(1) == D8, "e8p_metric_descent: roots [n, 8]");
  const int64_t nr = roots_.size(0);
  TORCH_CHECK(tries >= 1 && tries <= nr, "e8p_metric_descent: 1 ≤ tries ≤ roots");
  const Table tab(patterns);
  at::Tensor out = p_.to(x.scalar_type()).contiguous().clone();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "e8p_metric_descent", [&] {
    using T = scalar_t;
    const at::Tensor Dt = D_.to(x.scalar_type()).contiguous(), Rt = roots_.to(x.scalar_type()).contiguous();
    const RootDescent<T> descent(tab, Rt.data_ptr<T>(), nr, Dt.data_ptr<T>());
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 256, [&](int64_t r0, int64_t r1) {
      std::vector<T> val(tries), g(nr);
      std::vector<int64_t> idx(tries);
      for (int64_t r = r0; r < r1; ++r)
        descent.descend(op + r * D8, xp + r * D8, rounds, tries, g.data(), val.data(), idx.data());
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("e8p_nearest(Tensor x, Tensor patterns) -> Tensor");
  m.def("ball256_nearest(Tensor x) -> Tensor");
  m.def("e8_code_nearest(Tensor x, Tensor patterns, int[] kinds, float[] gains) -> Tensor");
  m.def("nearest_in_metric(Tensor x, Tensor book, Tensor D) -> Tensor");
  m.def("e8p_metric_descent(Tensor p, Tensor x, Tensor D, Tensor roots, Tensor patterns, int rounds, int tries) -> Tensor");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) {
  m.impl("e8p_nearest", &e8p_nearest);
  m.impl("ball256_nearest", &ball256_nearest);
  m.impl("e8_code_nearest", &e8_code_nearest);
  m.impl("nearest_in_metric", &nearest_in_metric);
  m.impl("e8p_metric_descent", &e8p_metric_descent);
}
