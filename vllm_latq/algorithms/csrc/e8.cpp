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
//   latq_cpu::e8p_metric_descent(p, x [N, 8], D [8, 8], roots [240, 8], patterns, rounds, tries) -> [N, 8]
//     e8.py::metric_descent with E8P's membership: per row up to `rounds` moves to the best of the
//     `tries` roots of least gain 2(p − x)ᵀDr + rᵀDr that is negative and stays in E8P.
// The table is the format's (e8p_patterns(), passed in): a pattern is looked up by its digits
// (2|aᵢ| − 1)/2 ∈ {0, 1, 2} in base 3 (a coordinate beyond 2.5 is in no pattern).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int D8 = 8, NPAT = 256, NKEY = 6561;  // 3^8

// pattern lookup: key (base-3 digits of |h|) → pattern index, −1 where none
struct Table {
  std::vector<int16_t> at = std::vector<int16_t>(NKEY, -1);
  float a[D8][NPAT];       // patterns transposed: coordinate i of every pattern (fp32 path)
  double ad[D8][NPAT];     // the same in fp64
  float a2[NPAT];          // |a|²
  double a2d[NPAT];
  uint8_t par[NPAT];       // Σ ((2aᵢ − 1)/2 mod 2) mod 2: Σσa is odd iff par xor (number of σᵢ < 0) is odd

  explicit Table(const at::Tensor& patterns) {
    TORCH_CHECK(patterns.dim() == 2 && patterns.size(0) == NPAT && patterns.size(1) == D8,
                "e8: the table of E8P patterns is [256, 8]");
    const at::Tensor P = patterns.to(at::kDouble).contiguous();
    const double* p = P.data_ptr<double>();
    for (int k = 0; k < NPAT; ++k) {
      int key = 0, u = 0;
      double n2 = 0;
      for (int i = D8 - 1; i >= 0; --i) {
        const double v = p[k * D8 + i];
        const int d = static_cast<int>(std::lround(2 * v - 1)) / 2;   // 0.5, 1.5, 2.5 → 0, 1, 2
        TORCH_CHECK(d >= 0 && d <= 2 && 2 * v - 1 == 2 * d, "e8: a pattern coordinate outside {½, 3/2, 5/2}");
        key = key * 3 + d;
        u += d & 1;
        a[i][k] = static_cast<float>(v);
        ad[i][k] = v;
        n2 += v * v;
      }
      at[key] = static_cast<int16_t>(k);
      a2[k] = static_cast<float>(n2);
      a2d[k] = n2;
      par[k] = static_cast<uint8_t>(u & 1);
    }
  }

  // the pattern of a half-odd vector h (|hᵢ| ∈ ½ + ℤ), −1 if not in the table
  template <typename T>
  int find(const T* h) const {
    int key = 0;
    for (int i = D8 - 1; i >= 0; --i) {
      const T v = std::abs(h[i]);
      if (v > T(2.5)) return -1;
      key = key * 3 + static_cast<int>(v);   // 0.5 → 0, 1.5 → 1, 2.5 → 2
    }
    return at[key];
  }
  template <typename T> const T* col(int i) const;
  template <typename T> const T* norm2() const;
};
template <> const float* Table::col<float>(int i) const { return a[i]; }
template <> const double* Table::col<double>(int i) const { return ad[i]; }
template <> const float* Table::norm2<float>() const { return a2; }
template <> const double* Table::norm2<double>() const { return a2d; }

// std::nearbyint under the default rounding mode: half to even, as torch.round
template <typename T>
inline void nearest_d8(const T* y, T* f) {
  T s = 0;
  for (int i = 0; i < D8; ++i) {
    f[i] = std::nearbyint(y[i]);
    s += f[i];
  }
  if (std::fmod(s, T(2)) != 0) {   // the coordinate farthest from its integer rounds the other way
    int at = 0;
    T best = -1;
    for (int i = 0; i < D8; ++i) {
      const T d = std::abs(y[i] - f[i]);
      if (d > best) best = d, at = i;
    }
    f[at] += (y[at] - f[at] >= 0) ? T(1) : T(-1);
  }
}

template <typename T>
inline T dist2(const T* x, const T* p) {
  T s = 0;
  for (int i = 0; i < D8; ++i) s += (x[i] - p[i]) * (x[i] - p[i]);
  return s;
}

// the nearest point of E8 = D8 ∪ (D8 + ½) to y
template <typename T>
inline void nearest_e8(const T* y, T* e) {
  T a[D8], b[D8], yh[D8];
  nearest_d8(y, a);
  for (int i = 0; i < D8; ++i) yh[i] = y[i] - T(0.5);
  nearest_d8(yh, b);
  for (int i = 0; i < D8; ++i) b[i] += T(0.5);
  const bool closer_b = dist2(y, b) < dist2(y, a);
  for (int i = 0; i < D8; ++i) e[i] = closer_b ? b[i] : a[i];
}

// a point of E8 + ¼ given as e = p − ¼ ∈ E8 → its pattern (−1 if none) and its half-odd part h
template <typename T>
inline int e8p_pattern(const Table& tab, const T* e, T* h) {
  bool half = true;
  for (int i = 0; i < D8; ++i) half = half && (std::fmod(std::abs(e[i]) * 2, T(2)) == 1);
  for (int i = 0; i < D8; ++i) h[i] = half ? e[i] : e[i] + T(0.5);
  return tab.find(h);
}

// the best point σ⊙a over the 256 patterns for the target y (one shift) → its squared distance
template <typename T>
T shift_search(const Table& tab, const T* y, T* out) {
  T ay[D8], sgn[D8];
  int neg = 0;
  for (int i = 0; i < D8; ++i) {
    ay[i] = std::abs(y[i]);
    sgn[i] = y[i] < 0 ? T(-1) : T(1);
    neg += y[i] < 0;
  }
  alignas(64) T d[NPAT], fc[NPAT];
  const T* a2 = tab.norm2<T>();
  T yy = 0;
  for (int i = 0; i < D8; ++i) yy += ay[i] * ay[i];
  for (int k = 0; k < NPAT; ++k) d[k] = 0, fc[k] = std::numeric_limits<T>::infinity();
  for (int i = 0; i < D8; ++i) {
    const T* ai = tab.col<T>(i);
    const T v = ay[i];
    for (int k = 0; k < NPAT; ++k) {
      const T m = v * ai[k];
      d[k] += m;
      fc[k] = fc[k] < m ? fc[k] : m;
    }
  }
  const uint8_t np = static_cast<uint8_t>(neg & 1);
  int best = 0;
  T bd = std::numeric_limits<T>::infinity();
  for (int k = 0; k < NPAT; ++k) {   // |y|² − 2⟨|y|, a⟩ + |a|², plus the flip where Σσa is odd
    const T dk = yy - 2 * d[k] + a2[k] + ((tab.par[k] ^ np) ? 4 * fc[k] : T(0));
    if (dk < bd) bd = dk, best = k;
  }
  int flip = -1;
  if (tab.par[best] ^ np) {   // the cheapest coordinate (first of equals) takes the other sign
    T m = std::numeric_limits<T>::infinity();
    for (int i = 0; i < D8; ++i) {
      const T c = ay[i] * tab.col<T>(i)[best];
      if (c < m) m = c, flip = i;
    }
  }
  for (int i = 0; i < D8; ++i) out[i] = (i == flip ? -sgn[i] : sgn[i]) * tab.col<T>(i)[best];
  return bd;
}

template <typename T>
inline void nearest_e8p_row(const Table& tab, const T* x, T* p) {
  T y[D8], e[D8], h[D8];
  for (int i = 0; i < D8; ++i) y[i] = x[i] - T(0.25);
  nearest_e8(y, e);
  if (e8p_pattern(tab, e, h) >= 0) {
    for (int i = 0; i < D8; ++i) p[i] = e[i] + T(0.25);
    return;
  }
  T yp[D8], ym[D8], pp[D8], pm[D8];   // outside the ball: the exhaustive search, both shifts
  for (int i = 0; i < D8; ++i) yp[i] = x[i] - T(0.25), ym[i] = x[i] + T(0.25);
  const T dp = shift_search(tab, yp, pp), dm = shift_search(tab, ym, pm);
  for (int i = 0; i < D8; ++i) p[i] = dp <= dm ? pp[i] + T(0.25) : pm[i] - T(0.25);
}

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

// ---- the 256-point ball in closed form: the best of its four kinds by the gain 2⟨x, p⟩ − |p|²
// (ties: the earlier kind), each kind's best point as e8.py::_nearest_ball_euclid builds it

template <typename T>
inline void ball_row(const T* x, T* p) {
  T ax[D8], sgn[D8];
  int neg = 0;
  for (int i = 0; i < D8; ++i) ax[i] = std::abs(x[i]), sgn[i] = x[i] < 0 ? T(-1) : T(1), neg += x[i] < 0;
  int i1 = 0;   // the two largest |xᵢ| (first of equals first)
  for (int i = 1; i < D8; ++i)
    if (ax[i] > ax[i1]) i1 = i;
  int i2 = i1 == 0 ? 1 : 0;
  for (int i = 0; i < D8; ++i)
    if (i != i1 && ax[i] > ax[i2]) i2 = i;
  int lo = 0, far = 0;
  T sum = 0;
  for (int i = 0; i < D8; ++i) {
    if (ax[i] < ax[lo]) lo = i;
    sum += ax[i];
  }
  auto axis = [&](int i) { return i == D8 - 1 ? x[i] : ax[i]; };   // −2e₇ is not in the ball
  for (int i = 1; i < D8; ++i)
    if (axis(i) > axis(far)) far = i;
  const bool odd = neg & 1;
  const T g[4] = {T(0), 2 * (ax[i1] + ax[i2]) - 2, sum - 2 * ax[lo] * T(odd) - 2, 4 * axis(far) - 4};
  int kind = 0;
  for (int k = 1; k < 4; ++k)
    if (g[k] > g[kind]) kind = k;
  for (int i = 0; i < D8; ++i) p[i] = 0;
  if (kind == 1) {
    p[i1] = sgn[i1], p[i2] = sgn[i2];
  } else if (kind == 2) {
    for (int i = 0; i < D8; ++i) p[i] = T(0.5) * sgn[i];
    if (odd) p[lo] = -p[lo];
  } else if (kind == 3) {
    p[far] = 2 * (far == D8 - 1 ? T(1) : sgn[far]);
  }
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
    const T* D = Dt.data_ptr<T>();
    const T* R = Rt.data_ptr<T>();
    std::vector<T> RD(nr);   // rᵀDr
    for (int64_t k = 0; k < nr; ++k) {
      T s = 0;
      for (int i = 0; i < D8; ++i)
        for (int j = 0; j < D8; ++j) s += R[k * D8 + i] * D[i * D8 + j] * R[k * D8 + j];
      RD[k] = s;
    }
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 256, [&](int64_t r0, int64_t r1) {
      std::vector<T> val(tries);
      std::vector<int64_t> idx(tries);
      for (int64_t r = r0; r < r1; ++r) {
        T* p = op + r * D8;
        const T* xr = xp + r * D8;
        for (int64_t round = 0; round < rounds; ++round) {
          T eD[D8];
          for (int j = 0; j < D8; ++j) {
            T s = 0;
            for (int i = 0; i < D8; ++i) s += (p[i] - xr[i]) * D[i * D8 + j];
            eD[j] = 2 * s;
          }
          int64_t n = 0;   // the `tries` least gains, ascending (insertion; ties: the earlier root first)
          for (int64_t k = 0; k < nr; ++k) {
            T g = RD[k];
            for (int j = 0; j < D8; ++j) g += eD[j] * R[k * D8 + j];
            if (n == tries && g >= val[n - 1]) continue;
            int64_t at = n < tries ? n++ : n - 1;
            while (at > 0 && val[at - 1] > g) val[at] = val[at - 1], idx[at] = idx[at - 1], --at;
            val[at] = g, idx[at] = k;
          }
          int64_t move = -1;
          for (int64_t t = 0; t < n && val[t] < 0 && move < 0; ++t) {
            T c[D8], e[D8], h[D8];
            for (int i = 0; i < D8; ++i) c[i] = p[i] + R[idx[t] * D8 + i], e[i] = c[i] - T(0.25);
            if (e8p_pattern(tab, e, h) >= 0) move = idx[t];
          }
          if (move < 0) break;   // no admitted neighbour is closer: later rounds see the same
          for (int i = 0; i < D8; ++i) p[i] += R[move * D8 + i];
        }
      }
    });
  });
  return out;
}

}  // namespace

#ifdef LATQ_E8_DEV
TORCH_LIBRARY(e8dev, m) {
#else
TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
#endif
  m.def("e8p_nearest(Tensor x, Tensor patterns) -> Tensor");
  m.def("ball256_nearest(Tensor x) -> Tensor");
  m.def("e8p_metric_descent(Tensor p, Tensor x, Tensor D, Tensor roots, Tensor patterns, int rounds, int tries) -> Tensor");
}

#ifdef LATQ_E8_DEV
TORCH_LIBRARY_IMPL(e8dev, CPU, m) {
#else
TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) {
#endif
  m.impl("e8p_nearest", &e8p_nearest);
  m.impl("ball256_nearest", &ball256_nearest);
  m.impl("e8p_metric_descent", &e8p_metric_descent);
}
