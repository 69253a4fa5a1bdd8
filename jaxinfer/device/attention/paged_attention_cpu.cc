// Ragged paged attention for XLA:CPU, called through XLA's FFI: the contract of
// pallas_kernels/ragged_paged_attention.py (its jnp reference is the test oracle).
//
// Why a kernel of our own on CPU: XLA:CPU runs attention over scattered 16-token pages as many small
// gathers and matmuls, each a kernel with a fixed cost, so a decode step's attention cost far more than
// its K/V reads. Here each block of a sequence's query tokens walks that sequence's pages once per kv head,
// its tokens' G query heads sharing every K/V tile it reads, with an online softmax in float32; scores,
// exponentials and the weighted sum of V run a vector register's lanes at a time, with as many sums held in
// registers as the target has (on AVX2 as on AVX-512), the weighted sum up to four rows at once so that each
// V row is read once for all of them.
//
// Operands: q [N, H, D]; k_pages, v_pages [L, KV, P, page, D] (q's dtype: f32, bf16 or f16); layer,
// num_seqs: int32 scalars; page_table [S, W], seq_lens [S], query_start [S + 1]: int32.
// Result: [N, H, D] in q's dtype; tokens of no sequence, and tokens that see no key, are 0.
// Every index read from an operand is clamped, so a bad table cannot read outside the pool.
//
// RopeWriteAttend is the whole of a layer's attention in one call, the contract of
// pallas_kernels/rope_cache.py's reference followed by the one above: q and k unrotated, k and v [N, KV, D],
// each token's flat cache slot [N] (int32) and the cos and sin of its rotary angles [N, D / 2] (f32, as
// the reference computes them) besides; it rotates q and k, writes k and v into the pools (results 2 and
// 3, aliased to the pool operands, so updated in place; a slot outside the pool writes nothing) and
// attends. One call instead of a dozen small XLA operations per layer, each of which costs more to launch
// than its work on a decode step.
//
// PagedAttentionPartial (and its Quantized twin) is the contract of paged_attention_partial in the same
// Python module, which sequence parallel runs on every rank: each token over part of its sequence's keys
// (table entry j holds the sequence's page j * page_stride + page_offset; token t sees positions below
// kv_limit[t]), with float32 results [N, H, D] and the log-sum-exp [N, H] (-inf where no key is visible),
// so the ranks' partials merge exactly.
//
// BlockAttentionPartial is the contract of pallas_kernels/block_attention.py: queries over a block of keys
// of the same step that are not in pages yet (what a rank of ring attention does with each block passing
// by), q [N, H, D], k and v [KV, M, D], positions and sequence ids of both; float32 out and lse as above.
//
// Quantized pages (RaggedPagedAttentionQuantized, RopeWriteAttendQuantized): the pools hold int8 or
// float8_e4m3fn, with bf16 scales [L, KV, P, page, 1] (one per token and kv head) as two more operands
// (and, for the write, two more results aliased to them). The write quantizes each rotated k and each v
// as pallas_kernels/kv_quant.py does (amax * (1 / QMAX) rounded to bf16 first, then x * (1 / scale)
// rounded to nearest even and clipped), so its pages equal the jnp reference's bit for bit; attention
// dequantizes a tile of keys at a time into float32 (q * scale, then rounded to q's dtype as the
// reference's dequantize is), and from there runs the unquantized code. fp8 decodes by bit manipulation (fp8_value).

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct BF16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(BF16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, _Float16* out) { *out = static_cast<_Float16>(x); }
inline void from_float(float x, BF16* out) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out->bits = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  out->bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float8_e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities, S.1111.111 is NaN).
struct FP8 { uint8_t bits; };

// Its float32 value from bit fields alone, so that loops over a tile vectorize (a table lookup would be a
// gather per element): a normal code's exponent rebiased from 7 to 127 and its 3 mantissa bits moved to the
// top of float32's 23, a subnormal one m * 2^-9; S.1111.111 gives NaN.
inline float fp8_value(uint32_t c) {
  const uint32_t magnitude = c & 0x7fu;
  const float subnormal = static_cast<float>(magnitude) * 0x1p-9f;
  const uint32_t normal = (magnitude << 20) + (120u << 23);
  uint32_t bits;
  std::memcpy(&bits, &subnormal, sizeof bits);
  bits = magnitude < 8 ? bits : normal;
  bits = magnitude == 0x7fu ? 0x7fc00000u : bits;
  bits |= (c & 0x80u) << 24;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline float to_float(int8_t x) { return x; }
inline float to_float(FP8 x) { return fp8_value(x.bits); }

// x rounded to T and back (what the reference's cast to the model's dtype does to a dequantized value).
template <typename T>
inline float round_to(float x) {
  T t;
  from_float(x, &t);
  return to_float(t);
}
template <>
inline float round_to<float>(float x) { return x; }
template <>
inline float round_to<BF16>(float x) {   // to nearest even without from_float's NaN branch, so loops vectorize
  uint32_t u;                              // (a quiet NaN, all a dequantized value can be, stays one)
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The stored element of y = x * (1 / scale) (kv_quant.py): int8 rounds to nearest even, then clips to +-127;
// e4m3fn clips to +-448, then rounds to nearest even (subnormals below 2^-6, steps of 2^-9).
inline void quantized(float y, int8_t* out) {
  if (y != y) y = 0.f;
  *out = static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.f, 127.f));
}
inline void quantized(float y, FP8* out) {
  if (y != y) {
    out->bits = 0x7f;
    return;
  }
  y = std::clamp(y, -448.f, 448.f);
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  const float a = std::fabs(y);
  if (a < 0x1p-6f) {                       // subnormal (2^-6 itself rounds up into the first normal code, 0x08)
    out->bits = sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
    return;
  }
  uint32_t u;
  std::memcpy(&u, &a, sizeof u);
  u += 0x7ffffu + ((u >> 20) & 1u);        // round the 23-bit mantissa to 3 bits, to nearest even
  out->bits = sign | static_cast<uint8_t>((u >> 20) - (120u << 3));   // exponent bias 127 -> 7
}

template <typename S> constexpr float kQMax = 127.f;
template <> constexpr float kQMax<FP8> = 448.f;

// One vector of d values (T) -> d stored elements (S) and its bf16 scale: amax * (1 / QMAX) rounded to bf16
// first, 1 for an all-zero vector. Products with float32 reciprocals, as the jnp reference (kv_quant.py).
template <typename T, typename S>
void quantize(const T* x, int64_t d, S* out, BF16* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  from_float(amax * (1.f / kQMax<S>), scale);
  float s = to_float(*scale);
  if (!(s > 0.f)) {
    s = 1.f;
    from_float(s, scale);
  }
  const float inverse = 1.f / s;
  for (int64_t i = 0; i < d; ++i) quantized(to_float(x[i]) * inverse, out + i);
}

// keys x d stored elements and one scale per key -> float32 values as the model's dtype T holds them.
template <typename T, typename S>
void dequantize(const S* x, const BF16* scales, int64_t keys, int64_t d, float* out) {
  for (int64_t c = 0; c < keys; ++c) {
    const float s = to_float(scales[c]);
    for (int64_t i = 0; i < d; ++i) out[c * d + i] = round_to<T>(to_float(x[c * d + i]) * s);
  }
}

// The scales beside quantized pages (null for pages of the model's dtype).
struct Scales {
  BF16* k = nullptr;
  BF16* v = nullptr;
};

using jaxinfer::parallel_for;   // parallel_for.h

struct Shape {
  int64_t n, heads, d, layers, kv_heads, pages, page, slots, width;
};

// Rotary embedding (Hugging Face "rotate half") as the reference rounds it: x1 * c - x2 * s and
// x2 * c + x1 * s in float32, cast once to T; cos and sin [N, D / 2] per token. Null: q arrives rotated.
struct Rope {
  const float* cos = nullptr;
  const float* sin = nullptr;
};

template <typename T>
void rotate(const T* x, int64_t d, const float* cos, const float* sin, T* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    from_float(x1 * cos[i] - x2 * sin[i], out + i);
    from_float(x2 * cos[i] + x1 * sin[i], out + i + half);
  }
}

// Each token t's k (rotated) and v into flat slot slots[t] = page * P + offset of `layer`; slots outside the
// pool (padding) write nothing. Pages of another type than T (S: int8, FP8) get each vector quantized, its
// scale written beside it.
template <typename T, typename S>
void write_kv(const Shape& s, const T* k, const T* v, const int32_t* slots, int32_t layer, const Rope& rope,
              S* k_pages, S* v_pages, const Scales& scales) {
  const int64_t d = s.d, half = d / 2;
  std::vector<T> rotated(d);
  for (int64_t t = 0; t < s.n; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= s.pages * s.page) continue;
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t row = ((layer * s.kv_heads + g) * s.pages + slot / s.page) * s.page + slot % s.page;
      const T* kx = k + (t * s.kv_heads + g) * d;
      const T* vx = v + (t * s.kv_heads + g) * d;
      if constexpr (std::is_same_v<S, T>) {
        rotate(kx, d, rope.cos + t * half, rope.sin + t * half, k_pages + row * d);
        std::copy(vx, vx + d, v_pages + row * d);
      } else {
        rotate(kx, d, rope.cos + t * half, rope.sin + t * half, rotated.data());
        quantize(rotated.data(), d, k_pages + row * d, scales.k + row);
        quantize(vx, d, v_pages + row * d, scales.v + row);
      }
    }
  }
}

// Query rows (a token's G heads, for tokens of one sequence) that share each K/V tile read: a prompt chunk
// reads its context once per block of rows, not once per token.
constexpr int64_t kBlockRows = 64;

struct Item {
  int32_t seq, first, tokens, kv_head;
};

// Keys are taken kTile at a time (a row of float32 scores per query row), whatever the page
// size: a page of 16 is one tile, of 64 four, of 8 a tile with 8 keys.
constexpr int64_t kTile = 16;

// A tile's sixteen lanes (GCC/Clang vector extensions), for its masks of visible keys.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr f32x16 kLanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// The arithmetic's vectors: one of the target's registers (sixteen lanes with AVX-512, else eight). GCC keeps
// a vector wider than the target's in memory, so sums in sixteen lanes on AVX2 would be loaded and stored at
// every multiply-add; these stay in registers, as many as the target has (kRegisters).
#ifdef __AVX512F__
constexpr int64_t kWidth = 16;
constexpr int kRegisters = 32;
#else
constexpr int64_t kWidth = 8;
constexpr int kRegisters = 16;
#endif
typedef float fvec __attribute__((vector_size(kWidth * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(kWidth * sizeof(int32_t))));
inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

// A register's lanes swapped in halves, quarters and pairs (its eighths too with sixteen lanes): the steps of
// a tree over them.
template <int Step>
inline fvec swapped(fvec x) {
#ifdef __AVX512F__
  if constexpr (Step == 8) return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  if constexpr (Step == 4) return __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  if constexpr (Step == 2) return __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  if constexpr (Step == 4) return __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
  if constexpr (Step == 2) return __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
  return __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
}

// The sum and the largest of a register's lanes, by trees of swaps rather than chains of lanes.
inline float sumv(fvec x) {
  if constexpr (kWidth == 16) x += swapped<8>(x);
  x += swapped<4>(x);
  x += swapped<2>(x);
  x += swapped<1>(x);
  return x[0];
}
inline float maxv(fvec x) {
  if constexpr (kWidth == 16) x = x > swapped<8>(x) ? x : swapped<8>(x);
  x = x > swapped<4>(x) ? x : swapped<4>(x);
  x = x > swapped<2>(x) ? x : swapped<2>(x);
  x = x > swapped<1>(x) ? x : swapped<1>(x);
  return x[0];
}

// exp of a register's lanes for x <= 88 in plain arithmetic, so it vectorizes (std::exp does not): Cephes'
// expf, 2^n * e^r with |r| <= ln 2 / 2 (n rounded by the 1.5 * 2^23 trick) and a degree-6 polynomial,
// within 2 ulp; below -87 it gives ~0.
inline fvec expv(fvec x) {
  const fvec lo = fvec{} - 87.0f, hi = fvec{} + 88.0f, magic = fvec{} + 12582912.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const fvec n = (x * 1.44269504088896341f + magic) - magic;
  const fvec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  fvec p = fvec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof scale);   // 2^n from its exponent bits
  return p * scale;
}

// The tile's keys as float32 rows [keys, d]: the cache itself where it is float32, else converted.
inline const float* as_floats(const float* x, int64_t, float*) { return x; }
template <typename T>
const float* as_floats(const T* x, int64_t n, float* buffer) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = to_float(x[i]);
  return buffer;
}

// scores [rows, kTile] = q [rows, d] . k [keys, d]^T (columns past `keys` are left unset). Eight rows and
// more (a prefill block): k transposed once into kt [d, kTile], then four rows at a time, each a row of kTile
// sums in registers fed by one broadcast per d. Fewer (a decode token's head group), no transpose: per row,
// four keys at a time, each key's products summed a register's width of d at a time into a register of its
// own, then across its lanes (a tile's last group repeats its last key for the columns past `keys`).
template <typename T>
void tile_scores(const float* q, int64_t rows, int64_t d, const T* k, int64_t keys, float* kt, float* scores) {
  if (rows < 8 && d % kWidth == 0) {
    const float* kf = as_floats(k, keys * d, kt);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      for (int64_t c = 0; c < keys; c += 4) {
        const float* k0 = kf + c * d;
        const float* k1 = kf + std::min(c + 1, keys - 1) * d;
        const float* k2 = kf + std::min(c + 2, keys - 1) * d;
        const float* k3 = kf + std::min(c + 3, keys - 1) * d;
        fvec s0{}, s1{}, s2{}, s3{};
        for (int64_t x = 0; x < d; x += kWidth) {
          const fvec qx = loadv(qr + x);
          s0 += qx * loadv(k0 + x);
          s1 += qx * loadv(k1 + x);
          s2 += qx * loadv(k2 + x);
          s3 += qx * loadv(k3 + x);
        }
        float* out = scores + r * kTile + c;
        out[0] = sumv(s0);
        out[1] = sumv(s1);
        out[2] = sumv(s2);
        out[3] = sumv(s3);
      }
    }
    return;
  }
  if (rows < 4) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < keys; ++c) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t x = 0; x < d; ++x) dot += q[r * d + x] * to_float(k[c * d + x]);
        scores[r * kTile + c] = dot;
      }
    return;
  }
  for (int64_t c = 0; c < kTile; ++c)
    for (int64_t x = 0; x < d; ++x) kt[x * kTile + c] = c < keys ? to_float(k[c * d + x]) : 0.f;
  constexpr int64_t V = kTile / kWidth;   // registers per row of kTile sums
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {   // four rows' sums held in registers across the whole dot product
    const float *q0 = q + r * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
    fvec s0[V] = {}, s1[V] = {}, s2[V] = {}, s3[V] = {};
    for (int64_t x = 0; x < d; ++x) {
#pragma GCC unroll 2
      for (int64_t h = 0; h < V; ++h) {
        const fvec kx = loadv(kt + x * kTile + h * kWidth);
        s0[h] += q0[x] * kx;
        s1[h] += q1[x] * kx;
        s2[h] += q2[x] * kx;
        s3[h] += q3[x] * kx;
      }
    }
#pragma GCC unroll 2
    for (int64_t h = 0; h < V; ++h) {
      storev(scores + r * kTile + h * kWidth, s0[h]);
      storev(scores + (r + 1) * kTile + h * kWidth, s1[h]);
      storev(scores + (r + 2) * kTile + h * kWidth, s2[h]);
      storev(scores + (r + 3) * kTile + h * kWidth, s3[h]);
    }
  }
  for (; r < rows; ++r) {
    fvec s0[V] = {};
    for (int64_t x = 0; x < d; ++x)
#pragma GCC unroll 2
      for (int64_t h = 0; h < V; ++h) s0[h] += q[r * d + x] * loadv(kt + x * kTile + h * kWidth);
#pragma GCC unroll 2
    for (int64_t h = 0; h < V; ++h) storev(scores + r * kTile + h * kWidth, s0[h]);
  }
}

// acc [R, d] = acc * correction + p [R, kTile] . v [keys, d] for R (1-4) rows at once, C (1-4) registers of
// columns: each V row read once for all R rows, the R x C sums held in registers across the tile.
template <int R, int C>
void accumulate_block(float* acc, int64_t d, const float* correction, const float* p, const float* v, int64_t keys) {
  fvec a[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) a[r][c] = loadv(acc + r * d + kWidth * c) * correction[r];
  for (int64_t j = 0; j < keys; ++j) {
    fvec vj[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) vj[c] = loadv(v + j * d + kWidth * c);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float pr = p[r * kTile + j];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) a[r][c] += pr * vj[c];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) storev(acc + r * d + kWidth * c, a[r][c]);
}

// f(std::integral_constant<int, n>{}) for n in 1..4: a run-time count of rows or registers as a template argument.
template <typename F>
void up_to_four(int64_t n, F&& f) {
  switch (n) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// acc [rows, d] = acc * correction + p [rows, kTile] . v [keys, d], p 0 past each row's own keys: blocks of up
// to four rows by up to four registers of columns (R x C sums and C of V within the target's registers). A
// head_dim that is not a multiple of the register's lanes takes plain loops.
void accumulate(float* acc, int64_t rows, int64_t d, const float* correction, const float* p, const float* v,
                int64_t keys) {
  if (d % kWidth != 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t x = 0; x < d; ++x) {
        float part = acc[r * d + x] * correction[r];
        for (int64_t j = 0; j < keys; ++j) part += p[r * kTile + j] * v[j * d + x];
        acc[r * d + x] = part;
      }
    return;
  }
  for (int64_t r = 0; r < rows; r += 4)
    up_to_four(std::min<int64_t>(4, rows - r), [&](auto n) {
      constexpr int rows_here = decltype(n)::value;
      constexpr int most = std::min(4, (kRegisters - 2) / (rows_here + 1));
      for (int64_t x = 0; x < d; x += kWidth * most)
        up_to_four(std::min<int64_t>(most, (d - x) / kWidth), [&](auto c) {
          if constexpr (decltype(c)::value <= most)
            accumulate_block<decltype(n)::value, decltype(c)::value>(acc + r * d + x, d, correction + r,
                                                                    p + r * kTile, v + x, keys);
        });
    });
}

// One row's scores of a tile [kTile] -> its weights (0 in the lanes `visible` masks off), with the online
// softmax's running max m and sum l, and the correction to apply to what the row gathered before (0 on its
// first tile with a visible key).
inline void softmax_update(float* p, i32x16 visible, float& m, float& l, float& correction) {
  constexpr int64_t V = kTile / kWidth;
  ivec mask[V];
  std::memcpy(mask, &visible, sizeof mask);
  fvec x[V];
  float top = m;
#pragma GCC unroll 2
  for (int64_t h = 0; h < V; ++h) {
    x[h] = mask[h] ? loadv(p + h * kWidth) : fvec{} - std::numeric_limits<float>::infinity();
    top = std::max(top, maxv(x[h]));
  }
  fvec total{};
#pragma GCC unroll 2
  for (int64_t h = 0; h < V; ++h) {
    const fvec w = mask[h] ? expv(x[h] - top) : fvec{};
    storev(p + h * kWidth, w);
    total += w;
  }
  correction = top == m ? 1.f : std::exp(m - top);
  l = l * correction + sumv(total);
  m = top;
}

// Whether any lane of a mask is set.
inline bool any_lane(i32x16 mask) {
  for (int c = 0; c < 16; ++c)
    if (mask[c] != 0) return true;
  return false;
}

// A row that sees no key of the tile: no weight, nothing rescaled.
inline void skip_tile(float* p, float& correction) {
  std::fill(p, p + kTile, 0.f);
  correction = 1.f;
}

// Each token's number of visible keys, counted along its sequence's table (entry j's keys are keys j * page
// to j * page + page - 1): the real tokens' causal counts, their position + 1, as far as the table reaches.
std::vector<int32_t> causal_visible(const Shape& s, const int32_t* seq_lens, const int32_t* query_start,
                                    int32_t num_seqs) {
  std::vector<int32_t> visible(s.n, 0);
  for (int32_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = std::clamp<int64_t>(query_start[seq], 0, s.n);
    const int64_t end = std::clamp<int64_t>(query_start[seq + 1], begin, s.n);
    for (int64_t t = begin; t < end; ++t)
      visible[t] = static_cast<int32_t>(std::clamp<int64_t>(seq_lens[seq] - (end - t) + 1, 0, s.width * s.page));
  }
  return visible;
}

// The same for a part of each sequence's pages: table entry j holds the sequence's page j * stride + offset
// (a rank of sp holds every sp-th page), and token t sees the keys at positions below kv_limit[t]. Positions
// grow along the table, so a token's visible keys are a prefix of it: the entries wholly below the limit, and
// part of the next.
std::vector<int32_t> limit_visible(const Shape& s, const int32_t* kv_limit, const int32_t* query_start,
                                   int32_t num_seqs, int64_t stride, int64_t offset) {
  std::vector<int32_t> visible(s.n, 0);
  const int64_t page = s.page;
  for (int32_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = std::clamp<int64_t>(query_start[seq], 0, s.n);
    const int64_t end = std::clamp<int64_t>(query_start[seq + 1], begin, s.n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t limit = kv_limit[t], pages = (limit + page - 1) / page;   // sequence pages touched
      const int64_t entries = std::clamp<int64_t>((pages - offset + stride - 1) / stride, 0, s.width);
      if (entries == 0) continue;
      const int64_t last_first = ((entries - 1) * stride + offset) * page;   // first position of the last entry
      visible[t] = static_cast<int32_t>((entries - 1) * page + std::clamp<int64_t>(limit - last_first, 0, page));
    }
  }
  return visible;
}

// Attention of every real token over the first visible[t] keys along its sequence's table (q rotated first
// where rope.cos is set); pages of another type than T (S: int8, FP8) are dequantized a tile at a time with
// their scales. out [N, H, D] in O (T, or float32 for partials); lse [N, H] float32 where given (-inf for a
// row that sees no key, whose output is 0).
template <typename T, typename S, typename O>
void attend(const Shape& s, const T* q, const S* k_pages, const S* v_pages, const Scales& scales, int32_t layer,
            const int32_t* table, const std::vector<int32_t>& visible, const int32_t* query_start, int32_t num_seqs,
            float scale, O* out, float* lse, ffi::ThreadPool& pool, const Rope& rope = {}) {
  const int64_t group = s.heads / s.kv_heads, d = s.d, page = s.page;
  std::fill(out, out + s.n * s.heads * d, O{});
  if (lse != nullptr) std::fill(lse, lse + s.n * s.heads, -std::numeric_limits<float>::infinity());
  layer = std::clamp<int32_t>(layer, 0, static_cast<int32_t>(s.layers) - 1);

  // The work: (sequence, block of its tokens, kv head).
  std::vector<Item> items;
  const int64_t block_tokens = std::max<int64_t>(1, kBlockRows / group);
  int64_t work = 0;
  for (int32_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = std::clamp<int64_t>(query_start[seq], 0, s.n);
    const int64_t end = std::clamp<int64_t>(query_start[seq + 1], begin, s.n);
    for (int64_t t = begin; t < end; ++t) work += visible[t];
    for (int64_t t = begin; t < end; t += block_tokens)
      for (int64_t g = 0; g < s.kv_heads; ++g)
        items.push_back({seq, static_cast<int32_t>(t), static_cast<int32_t>(std::min(block_tokens, end - t)),
                         static_cast<int32_t>(g)});
  }

  const int64_t layer_stride = s.kv_heads * s.pages * page * d;
  auto run = [&](int64_t i) {
    const Item& it = items[i];
    const int64_t rows = it.tokens * group;   // row r: token it.first + r / group, head g * group + r % group
    int64_t most = 0;
    for (int64_t t = 0; t < it.tokens; ++t) most = std::max<int64_t>(most, visible[it.first + t]);
    if (most == 0) return;
    const int32_t* entries = table + static_cast<int64_t>(it.seq) * s.width;
    const int64_t head_start = layer * layer_stride + it.kv_head * s.pages * page * d;
    const S* k_head = k_pages + head_start;
    const S* v_head = v_pages + head_start;

    std::vector<float> qf(rows * d), acc(rows * d, 0.f), kf(kTile * d), vf(kTile * d), sc(rows * kTile);
    std::vector<float> kq(std::is_same_v<S, T> ? 0 : kTile * d);   // a tile of dequantized keys
    std::vector<float> m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.f), correction(rows);
    std::vector<int64_t> row_visible(rows);
    std::vector<T> rotated(rope.cos != nullptr ? d : 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = it.first + r / group, h = it.kv_head * group + r % group;
      row_visible[r] = visible[t];
      const T* row = q + (t * s.heads + h) * d;
      if (rope.cos != nullptr) {
        rotate(row, d, rope.cos + t * (d / 2), rope.sin + t * (d / 2), rotated.data());
        row = rotated.data();
      }
      for (int64_t x = 0; x < d; ++x) qf[r * d + x] = to_float(row[x]) * scale;
    }

    for (int64_t start = 0, keys; start < most; start += keys) {   // up to kTile keys at a time, within one page
      const int64_t j = start / page, offset = start % page;
      keys = std::min({kTile, page - offset, most - start});
      const int64_t pid = std::clamp<int64_t>(entries[j], 0, s.pages - 1);
      const S* k = k_head + (pid * page + offset) * d;
      const S* v = v_head + (pid * page + offset) * d;
      const float* vt;
      if constexpr (std::is_same_v<S, T>) {
        tile_scores(qf.data(), rows, d, k, keys, kf.data(), sc.data());
        vt = as_floats(v, keys * d, vf.data());
      } else {
        const int64_t first = (head_start / d) + pid * page + offset;   // the tile's first scale
        dequantize<T>(k, scales.k + first, keys, d, kq.data());
        tile_scores(qf.data(), rows, d, static_cast<const float*>(kq.data()), keys, kf.data(), sc.data());
        dequantize<T>(v, scales.v + first, keys, d, vf.data());
        vt = vf.data();
      }
      for (int64_t r = 0; r < rows; ++r) {   // scores -> this tile's weights, and the rescale of what came before
        const int64_t seen = std::min(keys, row_visible[r] - start);   // this row's keys in the tile
        if (seen <= 0)
          skip_tile(&sc[r * kTile], correction[r]);
        else
          softmax_update(&sc[r * kTile], kLanes < static_cast<float>(seen), m[r], l[r], correction[r]);
      }
      accumulate(acc.data(), rows, d, correction.data(), sc.data(), vt, keys);
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (l[r] == 0.f) continue;
      const int64_t t = it.first + r / group, h = it.kv_head * group + r % group;
      O* o = out + (t * s.heads + h) * d;
      const float inv = 1.f / l[r];
      for (int64_t x = 0; x < d; ++x) from_float(acc[r * d + x] * inv, o + x);
      if (lse != nullptr) lse[t * s.heads + h] = m[r] + std::log(l[r]);
    }
  };
  // Threads pay off only past a few hundred thousand multiply-adds (a decode step of short sequences runs
  // faster on the caller alone).
  const int64_t flops = work * s.heads * d * 4;
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t helpers = flops < (1 << 20) ? 0 : std::min<int64_t>(pool.num_threads(), count - 1);
  parallel_for(pool, count, helpers, run);
}

// Attention of queries over a block of keys of the same step (BlockAttentionPartial; a ring block under
// sequence parallel): q [N, H, D], k and v [KV, M, D] (T), query t sees key j where q_seq[t] >= 0,
// k_seq[j] == q_seq[t] and k_pos[j] <= q_pos[t]. The work is attend's, (block of query tokens, kv head),
// with a lane mask per token and tile instead of a count of keys, and tiles no token of the block sees
// skipped. float32 out [N, H, D] and lse [N, H]: 0 and -inf for a row that sees no key.
template <typename T>
void block_attend(int64_t n, int64_t heads, int64_t d, int64_t kv_heads, int64_t m, const T* q, const T* k,
                  const T* v, const int32_t* q_pos, const int32_t* q_seq, const int32_t* k_pos,
                  const int32_t* k_seq, float scale, float* out, float* lse, ffi::ThreadPool& pool) {
  const int64_t group = heads / kv_heads;
  std::fill(out, out + n * heads * d, 0.f);
  std::fill(lse, lse + n * heads, -std::numeric_limits<float>::infinity());
  const int64_t tiles = (m + kTile - 1) / kTile;
  std::vector<int32_t> seq(tiles * kTile, -2), pos(tiles * kTile, 0);   // padded keys: of no sequence
  std::copy(k_seq, k_seq + m, seq.begin());
  std::copy(k_pos, k_pos + m, pos.begin());
  const int64_t block_tokens = std::max<int64_t>(1, kBlockRows / group);
  const int64_t blocks = (n + block_tokens - 1) / block_tokens;

  auto run = [&](int64_t i) {
    const int64_t first = i / kv_heads * block_tokens, g = i % kv_heads;
    const int64_t tokens = std::min(block_tokens, n - first), rows = tokens * group;
    if (std::all_of(q_seq + first, q_seq + first + tokens, [](int32_t s) { return s < 0; })) return;
    std::vector<float> qf(rows * d), acc(rows * d, 0.f), kt(kTile * d), vf(kTile * d), sc(rows * kTile);
    std::vector<float> mx(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.f), correction(rows);
    std::vector<i32x16> mask(tokens);   // per token: the tile's keys it sees
    std::vector<char> sees(tokens);      // per token: whether it sees any
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = q + ((first + r / group) * heads + g * group + r % group) * d;
      for (int64_t x = 0; x < d; ++x) qf[r * d + x] = to_float(row[x]) * scale;
    }
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t start = tile * kTile, keys = std::min(kTile, m - start);
      i32x16 key_seq, key_pos;
      std::memcpy(&key_seq, seq.data() + start, sizeof key_seq);
      std::memcpy(&key_pos, pos.data() + start, sizeof key_pos);
      for (int64_t t = 0; t < tokens; ++t) {
        const int32_t s = q_seq[first + t];
        mask[t] = (key_seq == s) & (key_pos <= q_pos[first + t]) & (s >= 0 ? -1 : 0);
        sees[t] = any_lane(mask[t]);
      }
      if (std::none_of(sees.begin(), sees.end(), [](char x) { return x; })) continue;
      const T* kh = k + (g * m + start) * d;
      tile_scores(qf.data(), rows, d, kh, keys, kt.data(), sc.data());
      const float* vt = as_floats(v + (g * m + start) * d, keys * d, vf.data());
      for (int64_t r = 0; r < rows; ++r) {
        if (sees[r / group])
          softmax_update(&sc[r * kTile], mask[r / group], mx[r], l[r], correction[r]);
        else
          skip_tile(&sc[r * kTile], correction[r]);
      }
      accumulate(acc.data(), rows, d, correction.data(), sc.data(), vt, keys);
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (l[r] == 0.f) continue;
      const int64_t h = (first + r / group) * heads + g * group + r % group;
      const float inv = 1.f / l[r];
      for (int64_t x = 0; x < d; ++x) out[h * d + x] = acc[r * d + x] * inv;
      lse[h] = mx[r] + std::log(l[r]);
    }
  };
  const int64_t flops = n * m * heads * d * 4;
  const int64_t count = blocks * kv_heads;
  const int64_t helpers = flops < (1 << 20) ? 0 : std::min<int64_t>(pool.num_threads(), count - 1);
  parallel_for(pool, count, helpers, run);
}

// Runs f(T{}) with T the element type of a float32, bfloat16 or float16 buffer.
template <typename F>
ffi::Error by_dtype(ffi::DataType type, F&& f) {
  switch (type) {
    case ffi::DataType::F32:
      f(float{});
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      f(BF16{});
      return ffi::Error::Success();
    case ffi::DataType::F16:
      f(_Float16{});
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("ragged paged attention runs f32, bf16 and f16");
  }
}

// Runs f(T{}, S{}) with T the element type of q (f32, bf16 or f16) and S that of the pages: int8 or FP8 for
// quantized pages, else T (attention_shape has checked that the pair is one of these).
template <typename F>
ffi::Error by_dtypes(ffi::DataType q_type, ffi::DataType pool_type, F&& f) {
  return by_dtype(q_type, [&](auto tag) {
    switch (pool_type) {
      case ffi::DataType::S8:
        f(tag, int8_t{});
        break;
      case ffi::DataType::F8E4M3FN:
        f(tag, FP8{});
        break;
      default:
        f(tag, tag);
    }
  });
}

template <typename T>
T* data(ffi::AnyBuffer& b) { return static_cast<T*>(b.untyped_data()); }

template <typename T>
T* data(ffi::AnyBuffer* b) { return b == nullptr ? nullptr : data<T>(*b); }

// Whether quantized pages' scales are bf16 [L, KV, P, page, 1] beside pages of dimensions kd.
bool scales_fit(ffi::AnyBuffer& scales, ffi::Span<const int64_t> kd) {
  const auto sd = scales.dimensions();
  return scales.element_type() == ffi::DataType::BF16 && sd.size() == 5 && sd[4] == 1 &&
         std::equal(kd.begin(), kd.begin() + 4, sd.begin(), sd.begin() + 4);
}

// The attention operands' shape, or why they disagree. k_scales, v_scales: those of quantized pages (int8 or
// float8_e4m3fn), null for pages of q's dtype.
// The shape of q, the pools and the table, or why they disagree (`what` names the caller in the message);
// the checks every entry point shares.
ffi::ErrorOr<Shape> pool_shape(const char* what, ffi::AnyBuffer& q, ffi::AnyBuffer& k_pages, ffi::AnyBuffer& v_pages,
                               ffi::BufferR2<ffi::S32>& page_table, ffi::BufferR1<ffi::S32>& query_start,
                               ffi::AnyBuffer* k_scales, ffi::AnyBuffer* v_scales) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 5) return ffi::Error::InvalidArgument("q must be rank 3 and the pages rank 5");
  const Shape s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], kd[3], td[0], td[1]};
  const auto pool_type = k_pages.element_type();
  const bool pools_ok =
      k_scales == nullptr
          ? pool_type == q.element_type()
          : (pool_type == ffi::DataType::S8 || pool_type == ffi::DataType::F8E4M3FN) && scales_fit(*k_scales, kd) &&
                scales_fit(*v_scales, kd);
  if (!pools_ok || kd[4] != s.d || s.kv_heads <= 0 || s.heads % s.kv_heads != 0 || s.page <= 0 || s.pages <= 0 ||
      query_start.dimensions()[0] != s.slots + 1 ||
      !std::equal(kd.begin(), kd.end(), v_pages.dimensions().begin(), v_pages.dimensions().end()) ||
      v_pages.element_type() != pool_type)
    return ffi::Error::InvalidArgument(std::string(what) + ": operand shapes or dtypes disagree");
  return s;
}

ffi::ErrorOr<Shape> attention_shape(ffi::AnyBuffer& q, ffi::AnyBuffer& k_pages, ffi::AnyBuffer& v_pages,
                                    ffi::BufferR2<ffi::S32>& page_table, ffi::BufferR1<ffi::S32>& seq_lens,
                                    ffi::BufferR1<ffi::S32>& query_start, ffi::AnyBuffer& out,
                                    ffi::AnyBuffer* k_scales = nullptr, ffi::AnyBuffer* v_scales = nullptr) {
  const char* what = "ragged paged attention";
  const auto s = pool_shape(what, q, k_pages, v_pages, page_table, query_start, k_scales, v_scales);
  if (s.has_error()) return s;
  if (seq_lens.dimensions()[0] != s->slots || out.element_type() != q.element_type())
    return ffi::Error::InvalidArgument(std::string(what) + ": operand shapes or dtypes disagree");
  return s;
}

ffi::Error Attention(ffi::ThreadPool& pool, ffi::AnyBuffer& q, ffi::AnyBuffer& k_pages, ffi::AnyBuffer& v_pages,
                     ffi::AnyBuffer* k_scales, ffi::AnyBuffer* v_scales, ffi::BufferR0<ffi::S32>& layer,
                     ffi::BufferR2<ffi::S32>& page_table, ffi::BufferR1<ffi::S32>& seq_lens,
                     ffi::BufferR1<ffi::S32>& query_start, ffi::BufferR0<ffi::S32>& num_seqs, float sm_scale,
                     ffi::AnyBuffer& out) {
  const auto s = attention_shape(q, k_pages, v_pages, page_table, seq_lens, query_start, out, k_scales, v_scales);
  if (s.has_error()) return s.error();
  const Scales scales{data<BF16>(k_scales), data<BF16>(v_scales)};
  return by_dtypes(q.element_type(), k_pages.element_type(), [&](auto tag, auto pool_tag) {
    using T = decltype(tag);
    using S = decltype(pool_tag);
    const int32_t n = std::clamp<int32_t>(*num_seqs.typed_data(), 0, static_cast<int32_t>(s->slots));
    attend(*s, data<T>(q), data<S>(k_pages), data<S>(v_pages), scales, *layer.typed_data(), page_table.typed_data(),
           causal_visible(*s, seq_lens.typed_data(), query_start.typed_data(), n), query_start.typed_data(), n,
           sm_scale, data<T>(out), static_cast<float*>(nullptr), pool);
  });
}

// Attention over part of each sequence's keys (paged_attention_partial's contract): float32 out and lse.
ffi::Error Partial(ffi::ThreadPool& pool, ffi::AnyBuffer& q, ffi::AnyBuffer& k_pages, ffi::AnyBuffer& v_pages,
                   ffi::AnyBuffer* k_scales, ffi::AnyBuffer* v_scales, ffi::BufferR0<ffi::S32>& layer,
                   ffi::BufferR2<ffi::S32>& page_table, ffi::BufferR1<ffi::S32>& query_start,
                   ffi::BufferR0<ffi::S32>& num_seqs, ffi::BufferR1<ffi::S32>& kv_limit,
                   ffi::BufferR0<ffi::S32>& page_offset, int64_t page_stride, float sm_scale, ffi::AnyBuffer& out,
                   ffi::AnyBuffer& lse) {
  const char* what = "paged attention partial";
  const auto shape = pool_shape(what, q, k_pages, v_pages, page_table, query_start, k_scales, v_scales);
  if (shape.has_error()) return shape.error();
  const Shape& s = *shape;
  const auto qd = q.dimensions(), od = out.dimensions(), ld = lse.dimensions();
  if (kv_limit.dimensions()[0] != s.n || page_stride < 1 || out.element_type() != ffi::DataType::F32 ||
      lse.element_type() != ffi::DataType::F32 || !std::equal(qd.begin(), qd.end(), od.begin(), od.end()) ||
      ld.size() != 2 || ld[0] != s.n || ld[1] != s.heads)
    return ffi::Error::InvalidArgument(std::string(what) + ": operand shapes or dtypes disagree");
  const Scales scales{data<BF16>(k_scales), data<BF16>(v_scales)};
  const int32_t n = std::clamp<int32_t>(*num_seqs.typed_data(), 0, static_cast<int32_t>(s.slots));
  const auto visible = limit_visible(s, kv_limit.typed_data(), query_start.typed_data(), n, page_stride,
                                     std::max<int32_t>(*page_offset.typed_data(), 0));
  return by_dtypes(q.element_type(), k_pages.element_type(), [&](auto tag, auto pool_tag) {
    using T = decltype(tag);
    using S = decltype(pool_tag);
    attend(s, data<T>(q), data<S>(k_pages), data<S>(v_pages), scales, *layer.typed_data(), page_table.typed_data(),
           visible, query_start.typed_data(), n, sm_scale, data<float>(out), data<float>(lse), pool);
  });
}

ffi::Error PagedAttentionPartialImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                     ffi::AnyBuffer v_pages, ffi::BufferR0<ffi::S32> layer,
                                     ffi::BufferR2<ffi::S32> page_table, ffi::BufferR1<ffi::S32> query_start,
                                     ffi::BufferR0<ffi::S32> num_seqs, ffi::BufferR1<ffi::S32> kv_limit,
                                     ffi::BufferR0<ffi::S32> page_offset, int64_t page_stride, float sm_scale,
                                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse) {
  return Partial(pool, q, k_pages, v_pages, nullptr, nullptr, layer, page_table, query_start, num_seqs, kv_limit,
                 page_offset, page_stride, sm_scale, *out, *lse);
}

ffi::Error PagedAttentionPartialQuantizedImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scales,
    ffi::AnyBuffer v_scales, ffi::BufferR0<ffi::S32> layer, ffi::BufferR2<ffi::S32> page_table,
    ffi::BufferR1<ffi::S32> query_start, ffi::BufferR0<ffi::S32> num_seqs, ffi::BufferR1<ffi::S32> kv_limit,
    ffi::BufferR0<ffi::S32> page_offset, int64_t page_stride, float sm_scale, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> lse) {
  return Partial(pool, q, k_pages, v_pages, &k_scales, &v_scales, layer, page_table, query_start, num_seqs, kv_limit,
                 page_offset, page_stride, sm_scale, *out, *lse);
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                    ffi::AnyBuffer v_pages, ffi::BufferR0<ffi::S32> layer,
                                    ffi::BufferR2<ffi::S32> page_table, ffi::BufferR1<ffi::S32> seq_lens,
                                    ffi::BufferR1<ffi::S32> query_start, ffi::BufferR0<ffi::S32> num_seqs,
                                    float sm_scale, ffi::Result<ffi::AnyBuffer> out) {
  return Attention(pool, q, k_pages, v_pages, nullptr, nullptr, layer, page_table, seq_lens, query_start, num_seqs,
                   sm_scale, *out);
}

ffi::Error RaggedPagedAttentionQuantizedImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                             ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                                             ffi::BufferR0<ffi::S32> layer, ffi::BufferR2<ffi::S32> page_table,
                                             ffi::BufferR1<ffi::S32> seq_lens, ffi::BufferR1<ffi::S32> query_start,
                                             ffi::BufferR0<ffi::S32> num_seqs, float sm_scale,
                                             ffi::Result<ffi::AnyBuffer> out) {
  return Attention(pool, q, k_pages, v_pages, &k_scales, &v_scales, layer, page_table, seq_lens, query_start,
                   num_seqs, sm_scale, *out);
}

// The pools (and scales) and the results they must be aliased to.
struct Written {
  ffi::AnyBuffer *k_pages, *v_pages, *k_scales, *v_scales;
  ffi::AnyBuffer *k_out, *v_out, *k_scales_out, *v_scales_out;

  bool aliased() const {
    return k_out->untyped_data() == k_pages->untyped_data() && v_out->untyped_data() == v_pages->untyped_data() &&
           (k_scales == nullptr || (k_scales_out->untyped_data() == k_scales->untyped_data() &&
                                    v_scales_out->untyped_data() == v_scales->untyped_data()));
  }
};

ffi::Error RopeWrite(ffi::ThreadPool& pool, ffi::AnyBuffer& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v, const Written& w,
                     ffi::BufferR0<ffi::S32>& layer, ffi::BufferR1<ffi::S32>& slots, ffi::BufferR2<ffi::F32>& cos,
                     ffi::BufferR2<ffi::F32>& sin, ffi::BufferR2<ffi::S32>& page_table,
                     ffi::BufferR1<ffi::S32>& seq_lens, ffi::BufferR1<ffi::S32>& query_start,
                     ffi::BufferR0<ffi::S32>& num_seqs, float sm_scale, ffi::AnyBuffer& out) {
  const auto s = attention_shape(q, *w.k_pages, *w.v_pages, page_table, seq_lens, query_start, out, w.k_scales,
                                 w.v_scales);
  if (s.has_error()) return s.error();
  const auto kd = k.dimensions();
  if (kd.size() != 3 || kd[0] != s->n || kd[1] != s->kv_heads || kd[2] != s->d || s->d % 2 != 0 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end()) ||
      k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      slots.dimensions()[0] != s->n || cos.dimensions()[0] != s->n || cos.dimensions()[1] != s->d / 2 ||
      sin.dimensions()[0] != s->n || sin.dimensions()[1] != s->d / 2 ||
      w.k_out->size_bytes() != w.k_pages->size_bytes() || w.v_out->size_bytes() != w.v_pages->size_bytes())
    return ffi::Error::InvalidArgument("rope, write and attend: operand shapes or dtypes disagree");
  if (!w.aliased())
    return ffi::Error::InvalidArgument("rope, write and attend: the pools (and scales) must be aliased to the results");
  const Rope rope{cos.typed_data(), sin.typed_data()};
  const int32_t lyr = std::clamp<int32_t>(*layer.typed_data(), 0, static_cast<int32_t>(s->layers) - 1);
  const Scales scales{data<BF16>(w.k_scales_out), data<BF16>(w.v_scales_out)};
  return by_dtypes(q.element_type(), w.k_pages->element_type(), [&](auto tag, auto pool_tag) {
    using T = decltype(tag);
    using S = decltype(pool_tag);
    write_kv(*s, data<T>(k), data<T>(v), slots.typed_data(), lyr, rope, data<S>(*w.k_out), data<S>(*w.v_out), scales);
    const int32_t n = std::clamp<int32_t>(*num_seqs.typed_data(), 0, static_cast<int32_t>(s->slots));
    attend(*s, data<T>(q), data<S>(*w.k_out), data<S>(*w.v_out), scales, lyr, page_table.typed_data(),
           causal_visible(*s, seq_lens.typed_data(), query_start.typed_data(), n), query_start.typed_data(), n,
           sm_scale, data<T>(out), static_cast<float*>(nullptr), pool, rope);
  });
}

ffi::Error RopeWriteAttendImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::BufferR0<ffi::S32> layer,
                               ffi::BufferR1<ffi::S32> slots, ffi::BufferR2<ffi::F32> cos,
                               ffi::BufferR2<ffi::F32> sin, ffi::BufferR2<ffi::S32> page_table,
                               ffi::BufferR1<ffi::S32> seq_lens, ffi::BufferR1<ffi::S32> query_start,
                               ffi::BufferR0<ffi::S32> num_seqs, float sm_scale, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const Written w{&k_pages, &v_pages, nullptr, nullptr, &*k_out, &*v_out, nullptr, nullptr};
  return RopeWrite(pool, q, k, v, w, layer, slots, cos, sin, page_table, seq_lens, query_start, num_seqs, sm_scale,
                   *out);
}

ffi::Error RopeWriteAttendQuantizedImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_pages,
    ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales, ffi::BufferR0<ffi::S32> layer,
    ffi::BufferR1<ffi::S32> slots, ffi::BufferR2<ffi::F32> cos, ffi::BufferR2<ffi::F32> sin,
    ffi::BufferR2<ffi::S32> page_table, ffi::BufferR1<ffi::S32> seq_lens, ffi::BufferR1<ffi::S32> query_start,
    ffi::BufferR0<ffi::S32> num_seqs, float sm_scale, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> k_scales_out,
    ffi::Result<ffi::AnyBuffer> v_scales_out) {
  const Written w{&k_pages, &v_pages, &k_scales, &v_scales, &*k_out, &*v_out, &*k_scales_out, &*v_scales_out};
  return RopeWrite(pool, q, k, v, w, layer, slots, cos, sin, page_table, seq_lens, query_start, num_seqs, sm_scale,
                   *out);
}

// Queries over a block of keys of the same step (block_attention's contract in pallas_kernels): float32 out, lse.
ffi::Error BlockAttentionPartialImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                     ffi::BufferR1<ffi::S32> q_pos, ffi::BufferR1<ffi::S32> q_seq,
                                     ffi::BufferR1<ffi::S32> k_pos, ffi::BufferR1<ffi::S32> k_seq, float sm_scale,
                                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse) {
  const auto qd = q.dimensions(), kd = k.dimensions(), od = out->dimensions(), ld = lse->dimensions();
  if (qd.size() != 3 || kd.size() != 3 || kd[0] <= 0 || qd[1] % kd[0] != 0 || kd[2] != qd[2] ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end()) ||
      k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      q_pos.dimensions()[0] != qd[0] || q_seq.dimensions()[0] != qd[0] || k_pos.dimensions()[0] != kd[1] ||
      k_seq.dimensions()[0] != kd[1] || out->element_type() != ffi::DataType::F32 ||
      lse->element_type() != ffi::DataType::F32 || !std::equal(qd.begin(), qd.end(), od.begin(), od.end()) ||
      ld.size() != 2 || ld[0] != qd[0] || ld[1] != qd[1])
    return ffi::Error::InvalidArgument("block attention partial: operand shapes or dtypes disagree");
  return by_dtype(q.element_type(), [&](auto tag) {
    using T = decltype(tag);
    block_attend(qd[0], qd[1], qd[2], kd[0], kd[1], data<T>(q), data<T>(k), data<T>(v), q_pos.typed_data(),
                 q_seq.typed_data(), k_pos.typed_data(), k_seq.typed_data(), sm_scale, data<float>(*out),
                 data<float>(*lse), pool);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeWriteAttend, RopeWriteAttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttentionQuantized, RaggedPagedAttentionQuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeWriteAttendQuantized, RopeWriteAttendQuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::BufferR2<ffi::F32>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionPartial, PagedAttentionPartialImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("page_stride")
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionPartialQuantized, PagedAttentionPartialQuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR2<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("page_stride")
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockAttentionPartial, BlockAttentionPartialImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
