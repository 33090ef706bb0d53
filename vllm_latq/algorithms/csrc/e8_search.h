// E8P's, the ball's and the metric searches one row of 8 at a time, shared by e8.cpp (the searches
// as ops over rows) and e8_sweep.cpp (block Babai's whole sweep and the scale search's errors): both
// run the same arithmetic, so either gives the other's points. Definitions: e8.cpp's header.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace latq_e8 {


constexpr int D8 = 8, NPAT = 256, NKEY = 6561;  // 3^8

// pattern lookup: key (base-3 digits of |h|) → pattern index, −1 where none
struct Table {
  std::vector<int16_t> at = std::vector<int16_t>(NKEY, -1);
  float a[D8][NPAT];       // patterns transposed: coordinate i of every pattern (fp32 path)
  double ad[D8][NPAT];     // the same in fp64
  float a2[NPAT];          // |a|²
  double a2d[NPAT];
  // Σσa is odd iff Σᵢ ((2aᵢ − 1)/2 mod 2) + (the number of σᵢ < 0) is: 4 where odd, by that number's parity
  float f4[2][NPAT];
  double f4d[2][NPAT];
  // the table as permutation classes: a class whose every permutation is in the table (a "type", its
  // values sorted descending) is searched by sorting |y| (the rearrangement inequality); the
  // patterns of the other classes (`extra`) one by one
  std::vector<std::array<double, D8>> type;
  std::vector<double> type_a2;
  std::vector<int> type_u, extra, none;   // none: no pattern (the extra loop skipped, nothing copied)
  std::vector<std::array<double, D8>> extra_sorted;   // the extra classes' values sorted (their bound)
  std::vector<double> extra_a2;

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
      for (int neg = 0; neg < 2; ++neg) f4[neg][k] = f4d[neg][k] = ((u + neg) & 1) ? 4 : 0;
    }
    classes(p);
  }

  void classes(const double* p) {
    std::vector<int> cls(NPAT), members;
    std::vector<std::array<double, D8>> sorted(NPAT);
    for (int k = 0; k < NPAT; ++k) {
      std::copy_n(p + k * D8, D8, sorted[k].begin());
      std::sort(sorted[k].begin(), sorted[k].end(), std::greater<double>());
    }
    std::vector<bool> seen(NPAT, false);
    for (int k = 0; k < NPAT; ++k) {
      if (seen[k]) continue;
      members.clear();
      for (int j = k; j < NPAT; ++j)
        if (sorted[j] == sorted[k]) members.push_back(j), seen[j] = true;
      double perms = 40320;   // 8! / Π (multiplicity)!
      for (int i = 0, run = 1; i < D8; ++i, ++run) {
        if (i + 1 < D8 && sorted[k][i + 1] == sorted[k][i]) continue;
        for (int f = 2; f <= run; ++f) perms /= f;
        run = 0;
      }
      if (static_cast<double>(members.size()) == perms) {
        type.push_back(sorted[k]);
        type_a2.push_back(a2d[k]);
        type_u.push_back(f4d[0][k] != 0);
      } else {
        extra.insert(extra.end(), members.begin(), members.end());
        extra_sorted.push_back(sorted[k]);
        extra_a2.push_back(a2d[k]);
      }
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
  template <typename T> const T* flip4(int neg) const;
};
template <> inline const float* Table::col<float>(int i) const { return a[i]; }
template <> inline const double* Table::col<double>(int i) const { return ad[i]; }
template <> inline const float* Table::norm2<float>() const { return a2; }
template <> inline const double* Table::norm2<double>() const { return a2d; }
template <> inline const float* Table::flip4<float>(int neg) const { return f4[neg]; }
template <> inline const double* Table::flip4<double>(int neg) const { return f4d[neg]; }

// std::nearbyint under the default rounding mode: half to even, as torch.round
template <typename T>
inline void nearest_d8(const T* y, T* f) {
  T s = 0;
  for (int i = 0; i < D8; ++i) {
    f[i] = std::nearbyint(y[i]);
    s += f[i];
  }
  if (static_cast<int64_t>(s) & 1) {   // the coordinate farthest from its integer rounds the other way
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
  for (int i = 0; i < D8; ++i) half = half && (static_cast<int64_t>(std::abs(e[i]) * 2) & 1);
  for (int i = 0; i < D8; ++i) h[i] = half ? e[i] : e[i] + T(0.5);
  return tab.find(h);
}

// the best point σ⊙a over the 256 patterns for the target y (one shift) → its squared distance
// |y|² − 2⟨|y|, a⟩ + |a|² (+ 4·min |yᵢ|aᵢ where Σσa is odd with y's signs: that coordinate flips).
// A type's best permutation pairs its values sorted with |y| sorted, both descending, even where the
// parity needs the flip: the flip's cost is then |y|'s least times the type's least value, the least
// any permutation offers, and sorting the rest is what leaves the most for ⟨|y|, a⟩.
template <typename T>
T shift_search(const Table& tab, const T* y, T* out) {
  T ay[D8], sgn[D8], yy = 0;
  int neg = 0, ord[D8];
  for (int i = 0; i < D8; ++i) {
    ay[i] = std::abs(y[i]);
    sgn[i] = y[i] < 0 ? T(-1) : T(1);
    neg += y[i] < 0;
    yy += ay[i] * ay[i];
    ord[i] = i;
  }
  T ys[D8];   // |y| descending, equals in index order (a stable sort), by a branchless sorting network
  for (int r = 0; r < D8; ++r) ys[r] = ay[r];
  static constexpr int NET[19][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {0, 4}, {1, 5}, {2, 6}, {3, 7}, {0, 1}, {2, 3},
                                     {4, 5}, {6, 7}, {2, 4}, {3, 5}, {1, 4}, {3, 6}, {1, 2}, {3, 4}, {5, 6}};
  for (const auto& ab : NET) {
    const int a = ab[0], b = ab[1];
    const bool swap = ys[b] > ys[a] || (ys[b] == ys[a] && ord[b] < ord[a]);
    const T va = ys[a], vb = ys[b];
    const int oa = ord[a], ob = ord[b];
    ys[a] = swap ? vb : va, ys[b] = swap ? va : vb;
    ord[a] = swap ? ob : oa, ord[b] = swap ? oa : ob;
  }
  T bd = std::numeric_limits<T>::infinity();
  int best_type = -1, best_pat = -1;
  for (size_t t = 0; t < tab.type.size(); ++t) {
    const auto& a = tab.type[t];
    T s = 0;
    for (int r = 0; r < D8; ++r) s += ys[r] * T(a[r]);
    const T d = yy - 2 * s + T(tab.type_a2[t]) + (((tab.type_u[t] + neg) & 1) ? 4 * (ys[D8 - 1] * T(a[D8 - 1])) : T(0));
    if (d < bd) bd = d, best_type = static_cast<int>(t);
  }
  bool any = false;   // an extra pattern is no closer than its class sorted against |y|, parity aside
  for (size_t c = 0; c < tab.extra_sorted.size() && !any; ++c) {
    T s = 0;
    for (int r = 0; r < D8; ++r) s += ys[r] * T(tab.extra_sorted[c][r]);
    any = yy - 2 * s + T(tab.extra_a2[c]) < bd;
  }
  const T* a2 = tab.norm2<T>();
  const T* flip4 = tab.flip4<T>(neg & 1);
  for (const int k : any ? tab.extra : tab.none) {
    T s = 0, fc = std::numeric_limits<T>::infinity();
    for (int i = 0; i < D8; ++i) {
      const T m = ay[i] * tab.col<T>(i)[k];
      s += m;
      fc = fc < m ? fc : m;
    }
    const T d = yy - 2 * s + a2[k] + flip4[k] * fc;
    if (d < bd) bd = d, best_pat = k, best_type = -1;
  }
  T a[D8];
  if (best_type >= 0) {
    for (int r = 0; r < D8; ++r) a[ord[r]] = T(tab.type[best_type][r]);
  } else {
    for (int i = 0; i < D8; ++i) a[i] = tab.col<T>(i)[best_pat];
  }
  int neg_a = neg;   // Σσa's parity with y's signs: the pattern's digits' and the signs'
  for (int i = 0; i < D8; ++i) neg_a += static_cast<int>(a[i]) & 1;   // 1.5 → 1: an odd digit
  int flip = -1;
  if (neg_a & 1) {   // the cheapest coordinate (first of equals) takes the other sign
    T m = std::numeric_limits<T>::infinity();
    for (int i = 0; i < D8; ++i) {
      const T c = ay[i] * a[i];
      if (c < m) m = c, flip = i;
    }
  }
  for (int i = 0; i < D8; ++i) out[i] = (i == flip ? -sgn[i] : sgn[i]) * a[i];
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

// ---- a code's stages: stage i rounds (x − v)·gainᵢ to its book's nearest point, v += p/gainᵢ
// (e8.py::VectorCode.nearest without a metric; kinds: 0 E8P, 1 the ball)

template <typename T>
inline void code_point(const Table& tab, const T* x, at::IntArrayRef kinds, at::ArrayRef<double> gains, T* v) {
  T t[D8], p[D8];
  for (int i = 0; i < D8; ++i) v[i] = 0;
  for (size_t st = 0; st < kinds.size(); ++st) {
    const T g = static_cast<T>(gains[st]);
    for (int i = 0; i < D8; ++i) t[i] = (x[i] - v[i]) * g;
    if (kinds[st] == 0)
      nearest_e8p_row(tab, t, p);
    else
      ball_row(t, p);
    for (int i = 0; i < D8; ++i) v[i] += p[i] / g;
  }
}

// ---- a book's nearest point [n, 8] in a metric D: the greatest 2xᵀDb − bᵀDb (first of equals),
// e8.py::nearest_in; (D b) and bᵀDb computed once per D

template <typename T>
struct MetricBook {
  const T* b;
  int64_t n;
  std::vector<T> Db, bDb;   // (D bₖ) transposed: coordinate j of every point; bₖᵀDbₖ

  MetricBook(const T* book, int64_t n_, const T* D) : b(book), n(n_), Db(D8 * n_), bDb(n_) {
    for (int64_t k = 0; k < n; ++k) {
      T s = 0;
      for (int j = 0; j < D8; ++j) {
        T dj = 0;
        for (int i = 0; i < D8; ++i) dj += D[j * D8 + i] * b[k * D8 + i];
        Db[j * n + k] = dj;
        s += b[k * D8 + j] * dj;
      }
      bDb[k] = s;
    }
  }

  // g: scratch of n gains
  void nearest(const T* x, T* out, T* g) const {
    T x2[D8];
    for (int j = 0; j < D8; ++j) x2[j] = 2 * x[j];
    for (int64_t k = 0; k < n; ++k) {   // −bᵀDb + Σⱼ 2xⱼ·(Db)ⱼ, in that order, in registers
      T gk = -bDb[k];
      for (int j = 0; j < D8; ++j) gk += x2[j] * Db[j * n + k];
      g[k] = gk;
    }
    int64_t best = 0;
    for (int64_t k = 1; k < n; ++k)
      if (g[k] > g[best]) best = k;
    std::copy_n(b + best * D8, D8, out);
  }
};

// ---- the local search in a metric D over E8's roots with E8P's membership (e8.py::metric_descent):
// per row up to `rounds` moves to the best of the `tries` roots of least gain 2(p − x)ᵀDr + rᵀDr
// that is negative and stays in E8P

template <typename T>
struct RootDescent {
  const Table& tab;
  const T *R, *D;
  int64_t nr;
  std::vector<T> RD, RT;   // rᵀDr; the roots transposed (the gains vectorize over roots)

  RootDescent(const Table& tab_, const T* roots, int64_t nr_, const T* D_)
      : tab(tab_), R(roots), D(D_), nr(nr_), RD(nr_), RT(D8 * nr_) {
    for (int64_t k = 0; k < nr; ++k) {
      T s = 0;
      for (int i = 0; i < D8; ++i) {
        RT[i * nr + k] = R[k * D8 + i];
        for (int j = 0; j < D8; ++j) s += R[k * D8 + i] * D[i * D8 + j] * R[k * D8 + j];
      }
      RD[k] = s;
    }
  }

  // p moves in place toward xr; g: scratch of nr gains, val/idx: of `tries`
  void descend(T* p, const T* xr, int64_t rounds, int64_t tries, T* g, T* val, int64_t* idx) const {
    for (int64_t round = 0; round < rounds; ++round) {
      T eD[D8];   // 2(p − x)ᵀD
      for (int j = 0; j < D8; ++j) {
        T s = 0;
        for (int i = 0; i < D8; ++i) s += (p[i] - xr[i]) * D[i * D8 + j];
        eD[j] = 2 * s;
      }
      for (int64_t k = 0; k < nr; ++k) {   // rᵀDr + Σⱼ eDⱼ·rⱼ, in that order (each product exact: rⱼ ∈ {0, ±½, ±1})
        T gk = RD[k];
        for (int j = 0; j < D8; ++j) gk += eD[j] * RT[j * nr + k];
        g[k] = gk;
      }
      // the `tries` least gains, ascending (insertion; ties: the earlier root first), kept only where
      // negative: the moves look no further, and the least negatives are the least gains' negative prefix
      int64_t n = 0;
      for (int64_t k = 0; k < nr; ++k) {
        const T gk = g[k];
        if (!(gk < 0) || (n == tries && gk >= val[n - 1])) continue;
        int64_t at = n < tries ? n++ : n - 1;
        while (at > 0 && val[at - 1] > gk) val[at] = val[at - 1], idx[at] = idx[at - 1], --at;
        val[at] = gk, idx[at] = k;
      }
      int64_t move = -1;
      for (int64_t t = 0; t < n && move < 0; ++t) {
        T e[D8], h[D8];
        for (int i = 0; i < D8; ++i) e[i] = p[i] + R[idx[t] * D8 + i] - T(0.25);
        if (e8p_pattern(tab, e, h) >= 0) move = idx[t];
      }
      if (move < 0) break;   // no admitted neighbour is closer: later rounds see the same
      for (int i = 0; i < D8; ++i) p[i] += R[move * D8 + i];
    }
  }
};

}  // namespace latq_e8
