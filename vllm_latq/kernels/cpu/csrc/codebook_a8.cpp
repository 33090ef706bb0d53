// A codebook layer (method e8) on the CPU with its activations rounded to int8: the opt-in twin of
// codebook.cpp's tiles (kernel cpu-e8-a8, kernels/cpu/codebook.py). x is rounded to int8 with a scale a
// block of 64 columns (max |x| / 127, halves to even; a group smaller than 64 or not dividing by it: a
// scale a group) and every product is an integer: a weight decoded to the byte q = d·w + c (d = 4, c = 15
// at 2 and 3 bits; 16 and 75 at 4), vpdpbusd multiplying it with x's byte and summing four a lane, a
// block's sums less c·Σx scaled by the group's 16-row scales times x's in fp32.
// The result is the reference's on the rounded x up to fp32 summation order.
//
// Layout (prepare, tile_codes_a8): half tiles of 32 rows, a pair of blocks (16 columns) a plane of 64
// bytes, [N/32, K/16, B, 64]: byte 8k + 2s + i is block 2p + i of row (s < 2 ? 0 : 16) + rowof(2k + s % 2).
// The decode is the tiles' (the pattern's four 256-entry lookups of k, the signs by one GF(2) affine map
// a lane pair), then one vpmultishiftqb a lane pair and 16 rows moves each lane's index out of its nibble
// into the byte vpdpbusd sums with three neighbours of its row — two lanes of each of the pair's blocks —
// so no transpose: 16 rows × 4 bytes a register against one broadcast dword of x. At 3 bits the ball's
// value code (3 bits, four more lookups) is moved into the same byte's high nibble and one 128-entry
// vpermi2b gives q; at 4 bits the two E8P stages' q add.
//
//   latq_cpu::codebook_linear_a8(x [..., K], tensors = (codes uint8 [N/32, K/16, B, 64], scales, table[,
//       signs]), ints = (bits, group_size, in_features, 32), bias?, out_features)   codebook_linear's
//       schema; the group a multiple of 16 columns, or the whole row
//   latq_cpu::codebook_a8_runs()   whether this path runs here (AVX-512 VBMI + VNNI + GFNI)

#include "codebook.h"

namespace latq_cb {

constexpr int kHalfTile = 32;   // rows a half tile of the int8 layout

#if LATQ_CB_A8
#define LATQ_CB_A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni,gfni,avx2,fma,f16c")))

struct A8Tables {
  alignas(64) uint8_t bc[4][256];   // a ball's lanes 2j, 2j+1: their value codes at bits 4–6 and 0–2
  alignas(64) uint8_t q3[128];      // E8P index | ball code << 4 → 4w + 15
  alignas(64) uint8_t e15[64];      // E8P index (bits 4, 5 ignored) → 4w + 15
  alignas(64) uint8_t e60[64];      // 4 · that: a 4-bit code's first stage
  const void* from = nullptr;
};

// from the tiles' tables (themselves from decode_table), once a process
const A8Tables& a8_tables(const TileTables& tt) {
  static A8Tables at;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (at.from == tt.from) return at;
  bool present[16] = {};
  int code_of[16] = {};
  uint8_t value_of[8] = {};
  for (int j = 0; j < 4; ++j)   // the ball's values 2·ball + 4, coded by rank
    for (int p = 0; p < 256; ++p) present[tt.bp[j][p] & 15] = present[tt.bp[j][p] >> 4] = true;
  for (int v = 0, n = 0; v < 16; ++v)
    if (present[v]) {
      TORCH_CHECK(n < 8, "latq_cpu: the ball has more than 8 coordinate values");
      value_of[n] = static_cast<uint8_t>(v);
      code_of[v] = n++;
    }
  for (int j = 0; j < 4; ++j)
    for (int p = 0; p < 256; ++p)
      at.bc[j][p] = static_cast<uint8_t>(code_of[tt.bp[j][p] & 15] << 4 | code_of[tt.bp[j][p] >> 4]);
  for (int i = 0; i < 128; ++i) at.q3[i] = static_cast<uint8_t>(tt.e11[i & 15] + value_of[i >> 4]);
  for (int i = 0; i < 64; ++i) {
    at.e15[i] = tt.e15[i];
    at.e60[i] = static_cast<uint8_t>(4 * tt.e15[i]);
  }
  at.from = tt.from;
  return at;
}

// vpmultishiftqb controls (byte i of a qword ← its 8 bits from bit c_i on, wrapping): a qword of a pair
// plane holds rows of s = 0..3, blocks i = 0, 1; the output register ab (rows s = 2ab, 2ab + 1) gets a
// row's dword [even lane of block 0, odd, even of block 1, odd]. E8P indices sit in nibbles (even low),
// so a lane's is its byte's low nibble from bit 8·byte (+ 4 if odd); the ball's codes at bits 4–6 (even)
// and 0–2 (odd) of their byte, so from bit 8·byte (− 4 if odd) a lane's lands in the high nibble.
constexpr long long pack8(int a, int b, int c, int d, int e, int f, int g, int h) {
  return static_cast<long long>(static_cast<unsigned long long>(a) | static_cast<unsigned long long>(b) << 8 |
                                static_cast<unsigned long long>(c) << 16 | static_cast<unsigned long long>(d) << 24 |
                                static_cast<unsigned long long>(e) << 32 | static_cast<unsigned long long>(f) << 40 |
                                static_cast<unsigned long long>(g) << 48 | static_cast<unsigned long long>(h) << 56);
}
constexpr long long kPickIndex[2] = {pack8(0, 4, 8, 12, 16, 20, 24, 28), pack8(32, 36, 40, 44, 48, 52, 56, 60)};
constexpr long long kPickBall[2] = {pack8(0, 60, 8, 4, 16, 12, 24, 20), pack8(32, 28, 40, 36, 48, 44, 56, 52)};

// one E8P stage's index bytes of a pair plane (P, S) for lane pair j, both lanes' (even low nibble)
LATQ_CB_A8_TARGET inline __m512i e8p_index(const TileTables& tt, __m512i P, __mmask64 hi, __m512i S, int j) {
  return _mm512_xor_si512(lookup256(tt.kp[j], P, hi),
                          _mm512_gf2p8affine_epi64_epi8(S, _mm512_set1_epi64(sign_bits(j)), 0));
}

// a pair plane's q bytes: q[2j + ab] = lane pair j's of rows s = 2ab, 2ab + 1 (16 rows × 4 bytes)
template <int BITS>
LATQ_CB_A8_TARGET inline void pair_q(const TileTables& tt, const A8Tables& at, const uint8_t* p, __m512i q[8]) {
  const __m512i P = _mm512_loadu_si512(p), S = _mm512_loadu_si512(p + 64);
  // the ball, or the second stage's pattern (a 2-bit plane has neither: P again)
  const __m512i X = BITS == 2 ? P : _mm512_loadu_si512(p + 128);
  const __mmask64 hp = _mm512_movepi8_mask(P), hx = _mm512_movepi8_mask(X);
  const __m512i lo4 = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; ++j) {
    const __m512i I = e8p_index(tt, P, hp, S, j);
    __m512i J = I;
    if constexpr (BITS == 3) J = lookup256(at.bc[j], X, hx);
    if constexpr (BITS == 4) J = e8p_index(tt, X, hx, _mm512_loadu_si512(p + 192), j);
    for (int ab = 0; ab < 2; ++ab) {
      const __m512i e = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(kPickIndex[ab]), I);
      if constexpr (BITS == 2) {
        q[2 * j + ab] = _mm512_permutexvar_epi8(e, _mm512_load_si512(at.e15));
      } else if constexpr (BITS == 3) {
        const __m512i b = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(kPickBall[ab]), J);
        const __m512i idx = _mm512_ternarylogic_epi32(lo4, e, b, 0xCA);   // e's low nibble, b's high
        q[2 * j + ab] = _mm512_permutex2var_epi8(_mm512_load_si512(at.q3), idx, _mm512_load_si512(at.q3 + 64));
      } else {
        const __m512i e2 = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(kPickIndex[ab]), J);
        q[2 * j + ab] = _mm512_add_epi8(_mm512_permutexvar_epi8(e, _mm512_load_si512(at.e60)),
                                        _mm512_permutexvar_epi8(e2, _mm512_load_si512(at.e15)));
      }
    }
  }
}

// the columns of x one scale rounds (codebook.py, a8_block): 64, or the group where 64 does not divide it
inline int64_t x_block(const Layer& L) { return L.G == 1 || L.bpg % 8 == 0 ? 64 : L.bpg * 8; }

// x rounded to int8, a scale a block of x_block columns, as the dots read it: per row m, pair p and lane
// pair j the dword [x(16p + 2j), x(16p + 2j + 1), x(16p + 8 + 2j), x(16p + 8 + 2j + 1)]; per row and block
// its scale and the Σ of its bytes. Rows of zeros pad M to a multiple of 8, so a pass of 6 or 8 rows may
// read past the last.
struct X8 {
  std::vector<int32_t> dw, sum;   // [M][K/16][4], [M][blocks]
  std::vector<float> scale;       // [M][blocks]: max |x| / 127 over the block
  int64_t blocks, pairs;          // blocks a row, pairs of blocks of codes (16 columns) a block
};

LATQ_CB_A8_TARGET X8 round_x(const at::Tensor& xf, const Layer& L) {
  const int64_t M = xf.size(0), np = L.K / 16, padded = (M + 7) / 8 * 8, bp = x_block(L) / 16;
  const int64_t nx = (np + bp - 1) / bp;
  X8 r{std::vector<int32_t>(padded * np * 4), std::vector<int32_t>(padded * nx), std::vector<float>(padded * nx), nx,
       bp};
  // a pair's 16 bytes in dword order: lane pair j's [2j, 2j + 1, 8 + 2j, 9 + 2j]
  const __m128i order = _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t xb = 0; xb < nx; ++xb) {
      const int64_t p0 = xb * bp, p1 = std::min(np, p0 + bp);
      const float* x = xf.data_ptr<float>() + m * L.K;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t p = p0; p < p1; ++p) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * p)));
      const float amax = _mm512_reduce_max_ps(mx);
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      r.scale[m * nx + xb] = amax / 127.f;
      for (int64_t p = p0; p < p1; ++p) {   // cvtps rounds in the current mode: to nearest even
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * p), inv));
        r.sum[m * nx + xb] += _mm512_reduce_add_epi32(q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r.dw.data() + (m * np + p) * 4),
                         _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(q), order));
      }
    }
  return r;
}

// rows [m0, m0 + MR) of x · half tile u's 32 rows, each block of x's sums (one group's, or part of one)
// scaled by the group's scales times x's (band: the half tile's two bands' [G][16]) → out [MR][2][16]
// fp32, band order, not yet divided by d
template <int BITS, int MR>
LATQ_CB_A8_TARGET void half_rows(const Layer& L, const TileTables& tt0, const A8Tables& at0, const X8& x, int64_t m0,
                                 int64_t u, const float* band, float* out) {
  constexpr int c = BITS == 4 ? 75 : 15;
  const int64_t np = L.K / 16, B = L.B, gpairs = L.G == 1 ? np : L.bpg / 2;
  const uint8_t* codes = L.codes + u * np * B * 64;
  __m512 y[MR][2];
  for (int i = 0; i < MR; ++i) y[i][0] = y[i][1] = _mm512_setzero_ps();
  for (int64_t xb = 0; xb < x.blocks; ++xb) {
    const int64_t p0 = xb * x.pairs, g = p0 / gpairs;
    __m512i acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_set1_epi32(-c * x.sum[(m0 + i) * x.blocks + xb]);
    for (int64_t p = p0; p < std::min(np, p0 + x.pairs); ++p) {
      const uint8_t* src = codes + p * B * 64;
      prefetch_codes(src, B);
      __m512i q[8];
      pair_q<BITS>(from_l1(tt0), from_l1(at0), src, q);
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < MR; ++i) {
          const __m512i xv = _mm512_set1_epi32(x.dw[((m0 + i) * np + p) * 4 + j]);
          acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], q[2 * j], xv);
          acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], q[2 * j + 1], xv);
        }
    }
    for (int ab = 0; ab < 2; ++ab) {
      const __m512 s = _mm512_loadu_ps(band + (ab * L.G + g) * kBand);
      for (int i = 0; i < MR; ++i)
        y[i][ab] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][ab]),
                                   _mm512_mul_ps(s, _mm512_set1_ps(x.scale[(m0 + i) * x.blocks + xb])), y[i][ab]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int ab = 0; ab < 2; ++ab) _mm512_storeu_ps(out + (i * 2 + ab) * kBand, y[i][ab]);
}

// y [M, N] fp32 = round(x) · Wᵀ, a half tile a task, up to 8 rows of x a pass over it
template <int BITS>
LATQ_CB_A8_TARGET void gemm_a8(const Layer& L, const at::Tensor& xf, at::Tensor& y) {
  const TileTables& tt = tile_tables(reinterpret_cast<const float*>(L.table));
  const A8Tables& at = a8_tables(tt);
  const int64_t M = xf.size(0);
  const X8 x = round_x(xf, L);
  const float d = BITS == 4 ? 16.f : 4.f;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, L.N / kHalfTile, 1, [&](int64_t a, int64_t b) {
    std::vector<float> band(2 * L.G * kBand), out(8 * 2 * kBand);
    const __m512i natural = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    for (int64_t u = a; u < b; ++u) {
      for (int ab = 0; ab < 2; ++ab) band_scales(L, 2 * u + ab, band.data() + ab * L.G * kBand, 2);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mr = std::min<int64_t>(8, M - m0);
        switch (mr) {
          case 1: half_rows<BITS, 1>(L, tt, at, x, m0, u, band.data(), out.data()); break;
          case 2: half_rows<BITS, 2>(L, tt, at, x, m0, u, band.data(), out.data()); break;
          case 3: half_rows<BITS, 3>(L, tt, at, x, m0, u, band.data(), out.data()); break;
          case 4: half_rows<BITS, 4>(L, tt, at, x, m0, u, band.data(), out.data()); break;
          case 5: case 6: half_rows<BITS, 6>(L, tt, at, x, m0, u, band.data(), out.data()); break;
          default: half_rows<BITS, 8>(L, tt, at, x, m0, u, band.data(), out.data());
        }
        for (int64_t i = 0; i < mr; ++i)
          for (int ab = 0; ab < 2; ++ab) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(out.data() + (i * 2 + ab) * kBand), _mm512_set1_ps(1.f / d));
            _mm512_storeu_ps(yp + (m0 + i) * L.N + u * kHalfTile + ab * kBand, _mm512_permutexvar_ps(natural, v));
          }
      }
    }
  });
}
#endif

bool a8_runs() {
#if LATQ_CB_A8
  static const bool cpu = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("gfni");
  return cpu && g_isa.load() == 2;
#else
  return false;
#endif
}

}  // namespace latq_cb

namespace {
namespace cb = latq_cb;

at::Tensor codebook_linear_a8(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                              at::IntArrayRef ints, const std::optional<at::Tensor>& bias, int64_t out_features) {
  constexpr const char* op = "latq_cpu::codebook_linear_a8: ";
  const cb::Args a = cb::check_args(op, x, tensors, ints, bias, out_features);
  const int64_t bits = a.bits, K = a.K, N = a.N;
  TORCH_CHECK(a.T == cb::kHalfTile && N % cb::kHalfTile == 0, op, "tile rows ", a.T, " (32, dividing out_features ",
              N, ")");
  TORCH_CHECK(K % 16 == 0 && (a.group % 16 == 0 || a.G == 1), op, "in_features ", K, " and group size ", a.group,
              ": 16-column pairs of blocks (the group a multiple of 16, or the whole row)");
  TORCH_CHECK(a.codes.dim() == 4 && a.codes.size(0) * cb::kHalfTile == N && a.codes.size(1) * 16 == K &&
                  a.codes.size(2) == bits && a.codes.size(3) == 64,
              op, "codes must be uint8 [out/32, in/16, bits, 64] (tile_codes_a8), got ", a.codes.sizes());
  TORCH_CHECK(cb::a8_runs(), op, "needs AVX-512 VBMI, VNNI and GFNI, in the build and on this CPU");
  const at::Tensor& xr = a.rotated() ? latq_hadamard_scratch(x, *a.signs) : x;
  const int64_t M = x.numel() / K;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#if LATQ_CB_A8
  if (M > 0 && N > 0) {
    const cb::Layer L = a.layer();
    const at::Tensor xf = xr.reshape({M, K}).to(at::kFloat).contiguous();
    if (bits == 2) cb::gemm_a8<2>(L, xf, y);
    else if (bits == 3) cb::gemm_a8<3>(L, xf, y);
    else cb::gemm_a8<4>(L, xf, y);
  }
#endif
  return cb::finish(y, x, bias);
}

bool codebook_a8_runs() { return cb::a8_runs(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(latq_cpu, m) {
  m.def("codebook_linear_a8(Tensor x, Tensor?[] tensors, int[] ints, Tensor? bias, int out_features) -> Tensor");
  m.def("codebook_a8_runs() -> bool");
}

TORCH_LIBRARY_IMPL(latq_cpu, CPU, m) { m.impl("codebook_linear_a8", &codebook_linear_a8); }

TORCH_LIBRARY_IMPL(latq_cpu, CompositeExplicitAutograd, m) { m.impl("codebook_a8_runs", &codebook_a8_runs); }
