// What the exact codebook kernel (codebook.cpp) and its int8-activation twin (codebook_a8.cpp) share:
// the layer's view, its scales by bands of 16 rows, and the AVX-512 tiles' decode tables and lookups.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LATQ_CB_X86 1
#else
#define LATQ_CB_X86 0
#endif
// AVX-512 only where the build targets it (an x86-64-v3 build holds no AVX-512 code), as hadamard.cpp's
#if LATQ_CB_X86 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LATQ_CB_AVX512 1
#else
#define LATQ_CB_AVX512 0
#endif
// the tiles' byte decode (VBMI lookups, GFNI bit shuffles), where the build targets them; with BF16 the exact
// 64-row tiles' path (every CPU with VBMI + BF16 has GFNI), with VNNI the int8-activation one (codebook_a8.cpp)
#if LATQ_CB_AVX512 && defined(__AVX512VBMI__) && defined(__GFNI__)
#define LATQ_CB_BYTES 1
#else
#define LATQ_CB_BYTES 0
#endif
#if LATQ_CB_BYTES && defined(__AVX512BF16__)
#define LATQ_CB_TILES 1
#else
#define LATQ_CB_TILES 0
#endif
#if LATQ_CB_BYTES && defined(__AVX512VNNI__)
#define LATQ_CB_A8 1
#else
#define LATQ_CB_A8 0
#endif

const at::Tensor& latq_hadamard_scratch(const at::Tensor& x, const at::Tensor& signs);   // hadamard.cpp
bool latq_isa_runs(int isa);                                                              // hadamard.cpp

namespace latq_cb {

// the table (kernels/cpu/codebook.py, decode_table): fp32 rows of 8, byte offsets of each part
constexpr int64_t kRows = 1024;
constexpr int64_t kBallOff = 256 * 32;   // the ball's points / 2
constexpr int64_t kSignOff = 512 * 32;   // per sign byte: its mask row, then its shift row
constexpr int kBand = 16;                // rows sharing a coded scale grid (scale_codes.ROWS)
constexpr int kMaxRows = 8;              // rows of x one pass over the weights serves
constexpr int kTile = 64;                // rows a tile of the tiled layout

struct Layer {
  const uint8_t* codes;     // [N, nb, B], or tiled (T = 64): [N/64, nb, B, 64], a block's bytes as 64-row planes
  const at::Half* scales;   // [N, G], or null:
  const int32_t* coded;     // [ceil(N/16), G, 3]
  const char* table;        // [1024, 8] fp32, 32-byte aligned
  int64_t N, K, nb, B, G, bpg;   // bpg: blocks a group
  int64_t T;                      // rows a tile: 1 (row layout) or 64

  // block b of row n: its first code byte; byte i lies T bytes after byte i − 1
  const uint8_t* block(int64_t n, int64_t b) const { return codes + ((n / T) * nb + b) * B * T + n % T; }
};

// a CodebookState's arguments (kernels/cpu/codebook.py), checked against each other before any pointer is read
// — all but the codes' layout, each op's own — so a direct call raises rather than reads out of bounds
struct Args {
  at::Tensor codes, scales, table;
  std::optional<at::Tensor> signs;   // a rotated layer's
  int64_t bits, group, K, N, T, G;
  bool coded;
  bool rotated() const { return signs.has_value() && signs->defined(); }
  Layer layer() const;
};
Args check_args(const char* op, const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                at::IntArrayRef ints, const std::optional<at::Tensor>& bias, int64_t out_features);
// y [M, N] fp32 → + bias, x's dtype and leading shape
at::Tensor finish(at::Tensor y, const at::Tensor& x, const std::optional<at::Tensor>& bias);

inline int rowof(int i) { return i < 8 ? 2 * i : 2 * (i - 8) + 1; }   // a band's lane i holds row rowof(i)

// the scales of band t (rows 16t..16t+15) into s [G][16] fp32, even rows first (codebook.cpp)
void band_scales(const Layer& L, int64_t t, float* s, int isa);
extern std::atomic<int> g_isa;   // 2 AVX-512, 1 AVX2, 0 scalar
bool tiles_run();                // whether the 64-row tiles' path runs here

#if LATQ_CB_BYTES
struct TileTables {
  alignas(64) uint8_t kp[4][256];   // lanes 2j, 2j+1: k at bits 0–1 and 4–5; j = 3: the pattern's parity at bit 6
  alignas(64) uint8_t bp[4][256];   // lanes 2j, 2j+1: 2·ball + 4 (0..8) at bits 0–3 and 4–7
  alignas(64) uint8_t e15[64];      // index (bits 4, 5 ignored) → 4w + 15 of σ(½ + k) ± ¼
  alignas(64) uint8_t e11[64];      // the same − 4 (the ball's 2·ball + 4 brings it back)
  alignas(64) uint8_t e60[64];      // 4·e15: a 4-bit code's first stage, so the two stages' bytes add to 16w + 75
  alignas(64) uint16_t val[2][32];  // q → bf16((q − 15)/4); /16 for a 4-bit code's second stage
  alignas(64) uint16_t raw[2][32];  // an E8P stage's index (bits 0–3; 4 ignored) → the same, no q between
  // quarters 2h, 2h+1's vpermi2b: word 2i ← row 32h + rowof(i) of the even lane (low byte) and row 32h + 16 +
  // rowof(i) (high byte), 2i+1 the same of the odd lane
  alignas(64) uint8_t sel[2][64];
  // quarter r's vpermb for the fp32 dots: every byte of dword i ← row 16r + rowof(i)
  alignas(64) uint8_t spread[4][64];
  const void* from = nullptr;
};

// derived from the fp32 table (decode_table), the one definition of the codebooks, once a process
const TileTables& tile_tables(const float* T);

#define LATQ_CB_BYTES_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,gfni,avx2,fma,f16c")))
#define LATQ_CB_TILE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,gfni,avx2,fma,f16c")))

LATQ_CB_BYTES_TARGET inline __m512i lookup256(const uint8_t* t, __m512i idx, __mmask64 hi) {
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), idx, _mm512_load_si512(t + 64));
  const __m512i up = _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), idx, _mm512_load_si512(t + 192));
  return _mm512_mask_blend_epi8(hi, lo, up);
}

// GF(2) affine maps of a byte (gf2p8affineqb: output bit i = parity(row byte 7 − i & input)), one
// instruction for a bit shuffle. Lane pair j's: from a sign byte, lane 2j's sign to bit 2, lane 2j+1's
// to bit 6 (lane 7's: the parity of the seven signs), the shift bit to 3 and 7 — each lane's index
// bits once XOR'd onto kp[j] (k at 0–1 and 4–5, the pattern's parity at 6 for lane 7)
constexpr long long sign_bits(int j) {
  const unsigned long long odd = j == 3 ? 0x7Full : 1ull << (2 * j + 1);   // output bits 2, 3, 6, 7: bytes 5, 4, 1, 0
  return static_cast<long long>((1ull << (2 * j)) << 40 | 0x80ull << 32 | odd << 8 | 0x80ull);
}
constexpr long long kHighNibble = 0x1020408000000000ll;   // bits 4–7 to 0–3, the rest 0

// the tables are read from L1 in each block (as load operands) rather than held in registers:
// vpermt2b overwrites a table operand, and held tables cost a register copy a lookup
template <class Tables>
inline const Tables& from_l1(const Tables& tt0) {
  const Tables* t = &tt0;
  asm("" : "+r"(t));
  return *t;
}

// a block's code lines 2 KB ahead into L1: the codes stream once a call, from memory in a served
// model's pass over every layer (docs/KERNELS.md, "CPU kernel (cpu-e8)")
LATQ_CB_BYTES_TARGET inline void prefetch_codes(const uint8_t* p, int64_t lines) {
  for (int64_t l = 0; l < lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(p) + 2048 + 64 * l, _MM_HINT_T0);
}
#endif

}  // namespace latq_cb
