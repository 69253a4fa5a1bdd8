// Weight-only quantized matmul for XLA:CPU, called through XLA's FFI: the contract of
// jaxinfer/device/quant_matmul_cpu.py (its jnp reference is the test oracle).
//
// Why a kernel of our own: a decode step reads every weight once, so its matmuls run at memory speed, and
// XLA:CPU runs `convert(values) * scale` then a dot by writing a float32 copy of the weight first (four times
// the int8 weight's bytes, then read again). Here the 1-byte weights are read once per call, in their own
// [K, N] row-major layout, and turned into floats in registers: int8 by one byte shuffle into the top byte of
// each 32-bit lane and an int -> float conversion; fp8 e4m3fn by rewriting its bits as float16, which F16C
// converts, subnormals included. Built for a CPU with AVX-512 F and BW (-march=native), the same conversions
// run in sixteen lanes, a tile's weights (64 columns) in four vectors: in cache, one Zen 5 core converts 27 G
// int8 weights a second so, against 18 in eight lanes.
//
// Loop order: for each segment of K (8 rows, within one scale block) the weight is walked 64 columns (one
// cache line a row) at a time: 8 rows read side by side, sequentially, which the hardware prefetcher
// follows, each line asked for kAheadBytes before it is read (past a row's end: the next segment's). The
// rows of x keep their sums in registers for the whole segment, each converted weight used for up to 6 rows
// of x, and fold them into float32 sums with the block's scale once per segment and column, not per weight.
// From 16 rows of x on, a segment's weights (128 rows) are converted once, a tile at a time, into a float
// panel that all rows share (32 KiB: it stays in L1), the classic 6 x 16 register tile on FMA. Calls of
// kThreadWork multiply-adds or more go to threads (XLA's intra-op pool), which split K for up to 4 rows of x
// (split_k), each streaming its own contiguous part of the weight; more rows go in equal chunks of up to 96
// rows (row_chunks), times parts of the columns, a multiple of the threads' count in all. x is read as it lies
// (row-major; bfloat16 and float16 converted first): transposing a prefill's x took as long as its matmul.
//
// Operands: x [M, K] (f32, bf16 or f16), values [K, N] (int8, f8e4m3fn, or bf16 or f16: XLA:CPU's 16-bit dots
// have no vector path, ~1 GB/s where this loop reads several), scale [ceil(K / block), N] f32.
// Result: [M, N] in x's dtype; sums in float32. The grouped form (a mixture's experts) takes values [X, K, N],
// scale [X, ceil(K / block), N] and sizes [X] int32, x's rows grouped by expert.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
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

// Where the weights of a segment come from: int8 or fp8 bytes, bfloat16 or float16 as stored, or floats
// already converted.
enum class Kind { kInt8, kFp8, kBf16, kF16, kF32 };

constexpr int64_t kTile = 64;           // columns per tile: one cache line of 1-byte weights (two of 16-bit ones)
constexpr float kFp8Unit = 0x1p8f;      // fp8 weights are converted to 2^-8 times their value (fp8_halves)
constexpr float kInt8Unit = 0x1p-24f;   // int8 weights to 2^24 times theirs (int8_top)

// Tuning, measured on 2-core AMD EPYCs (Zen 3, and Zen 5 for the segments and prefetch) for M = 1 .. 64, K and
// N of 768 .. 6144.
constexpr int64_t kSegmentFew = 8;        // K rows per segment with few rows of x, read side by side (16 rows
                                          // read a 4096-wide weight at half the speed on Zen 5)
constexpr int64_t kSegmentMany = 128;     // ... with many (a tile's float panel, 128 x 64 x 4 bytes)
constexpr int64_t kPanelRows = 16;        // rows of x from which a segment's weights are converted only once
constexpr int64_t kThreadWork = 1 << 23;  // multiply-adds below which the caller runs alone: XLA's pool thread
                                          // may start 100-300 us late, and one core multiplies 2^23 int8
                                          // weights in about 300 us (Zen 5)
constexpr int64_t kThreadWorkFp8 = 1 << 18;  // ... for fp8, whose conversion bounds one core at half that speed
constexpr int64_t kRowChunk = 96;         // rows of x per work item
constexpr int64_t kAccFloats = 1 << 15;   // accumulator floats per group of columns (128 KiB: L2)
constexpr int64_t kItems = 4;             // work items per thread, at most (a thread the pool starts late
                                          // finds the others' work taken by the rest, not waiting for it)
constexpr int64_t kSplitRows = 4;         // rows of x up to which the threads split K (else the columns) ...
constexpr int64_t kSplitSums = 2 << 20;   // ... where the parts' float32 sums take this many bytes at most: a
                                          // bfloat16 LM head's (32000 wide) at 4 rows in 8 parts, 4 MiB written
                                          // and read again, made a batch-4 decode step slower than the columns
constexpr int64_t kAheadBytes = 2048;     // how far along its row a line is prefetched before it is read (a
                                          // quarter or an eighth of that reads a 4096-wide weight slower)
constexpr int64_t kPanelAheadTiles = 2;   // ... when a panel's 128 rows are read a tile at a time (prefetched
                                          // further, they leave L1 before they are read)

// Sixteen fp8 e4m3fn bytes as float16 bit patterns of 2^-8 times their values: sign extension puts the sign
// in bits 15..7 and exponent:mantissa in 6..0; shifted left by 7 those land in float16's exponent:mantissa
// bits 13..7 (float16's bias 15 is e4m3's 7 plus 8, and its subnormals line up with e4m3's), the sign in
// bits 15 and 14, and bit 14 is cleared. The code for NaN (0x7f, 0xff) comes out as 480 / 256: tiles
// holding one take the exact path (find_nans).
inline __m256i fp8_halves(__m128i bytes) {
  const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
  return _mm256_and_si256(w, _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
}

// A byte shuffle that puts bytes first .. first + 7 of a 16-byte row (in both halves of a register) into the top
// byte of eight 32-bit lanes, zeros below: each int8 as 2^24 times itself, converted to float exactly (the
// kernel folds 2^-24 into the scale). One 16-byte load and two shuffles per 16 weights.
inline __m256i int8_top(int first) {
  alignas(32) int8_t control[32];
  for (int i = 0; i < 32; ++i) control[i] = i % 4 == 3 ? static_cast<int8_t>(first + i / 4) : -1;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(control));
}

// Weights v and v + 1 of one k (8 each) as floats: one 16-byte load for both.
template <Kind W>
inline void load_pair(const void* p, int v, __m256& lo, __m256& hi) {
  if constexpr (W == Kind::kInt8) {
    const __m256i b = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + 8 * v)));
    lo = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(b, int8_top(0)));
    hi = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(b, int8_top(8)));
  } else if constexpr (W == Kind::kFp8) {
    const __m256i h = fp8_halves(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + 8 * v)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  } else if constexpr (W == Kind::kBf16) {  // a bfloat16 is the top half of its float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + 8 * v));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
  } else if constexpr (W == Kind::kF16) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + 8 * v;
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
  } else {
    const float* f = static_cast<const float*>(p) + 8 * v;
    lo = _mm256_loadu_ps(f);
    hi = _mm256_loadu_ps(f + 8);
  }
}

template <Kind W>
constexpr int64_t kElementBytes = W == Kind::kF32 ? 4 : W == Kind::kBf16 || W == Kind::kF16 ? 2 : 1;

// The lines of a tile's row read kAheadBytes later (`ahead` bytes on; a prefetch never faults, even past the
// end): one for 1-byte weights, two for 16-bit ones; float panels are in cache already.
template <Kind W>
inline void prefetch_ahead(const char* row, int64_t ahead) {
  if constexpr (W != Kind::kF32) _mm_prefetch(row + ahead, _MM_HINT_T0);
  if constexpr (kElementBytes<W> == 2) _mm_prefetch(row + ahead + 64, _MM_HINT_T0);
}

// acc[r, 0 : 8V] += scale[0 : 8V] * sum over k < kn of x[r, k] * w[k, 0 : 8V], for R rows: the R x V partial
// sums stay in registers for the whole segment (w advances ldw elements per k; x's rows are ldx apart).
template <Kind W, int R, int V>
void segment_tile(const void* w, int64_t ldw, const float* x, int64_t ldx, int64_t kn, const float* scale,
                  float* acc, int64_t lda, int64_t ahead) {
  __m256 p[R][V];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) p[r][v] = _mm256_setzero_ps();
  const char* wb = static_cast<const char*>(w);
  const int64_t step = ldw * kElementBytes<W>;
  for (int64_t k = 0; k < kn; ++k, wb += step) {
    prefetch_ahead<W>(wb, ahead);
    if constexpr (V <= 4) {  // a few columns for many rows: the weights converted first, then one row at a time
      __m256 w[V];
      #pragma GCC unroll 16
      for (int v = 0; v < V; v += 2) load_pair<W>(wb, v, w[v], w[v + 1]);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
        #pragma GCC unroll 16
        for (int v = 0; v < V; ++v) p[r][v] = _mm256_fmadd_ps(b, w[v], p[r][v]);
      }
    } else {                 // many columns for a row or two: each pair of weight vectors used as converted
      __m256 b[R];
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) b[r] = _mm256_broadcast_ss(x + r * ldx + k);
      #pragma GCC unroll 16
      for (int v = 0; v < V; v += 2) {
        __m256 lo, hi;
        load_pair<W>(wb, v, lo, hi);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          p[r][v] = _mm256_fmadd_ps(b[r], lo, p[r][v]);
          p[r][v + 1] = _mm256_fmadd_ps(b[r], hi, p[r][v + 1]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const __m256 s = _mm256_loadu_ps(scale + 8 * v);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * lda + 8 * v;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(p[r][v], s, _mm256_loadu_ps(a)));
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)   // (the byte shuffle is BW's)
#define JAXINFER_LANES16 1
// The byte shuffle's control for sixteen int8s (a 16-byte row broadcast to the four 128-bit lanes): byte
// 4j + i of the row into the top byte of lane j's i-th 32-bit element, zeros below (int8_top's 2^24 units).
inline __m512i int8_top16() {
  alignas(64) int8_t control[64];
  for (int i = 0; i < 64; ++i) control[i] = i % 4 == 3 ? static_cast<int8_t>(i / 4) : -1;
  return _mm512_load_si512(control);
}

// Weights v * 16 .. v * 16 + 15 of one k as floats in the kernel's units (those of load_pair).
template <Kind W>
inline __m512 load16(const void* p, int v) {
  if constexpr (W == Kind::kInt8) {
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const int8_t*>(p) + 16 * v)));
    return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(b, int8_top16()));
  } else if constexpr (W == Kind::kFp8) {
    return _mm512_cvtph_ps(fp8_halves(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + 16 * v))));
  } else if constexpr (W == Kind::kBf16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + 16 * v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (W == Kind::kF16) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + 16 * v)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(p) + 16 * v);
  }
}

// segment_tile in sixteen lanes, a whole tile (four vectors) for each of R rows: the weights of a k converted
// once, then used by every row (R x 4 sums, 4 weights, 1 of x: 29 of the 32 registers at R = 6).
template <Kind W, int R>
void segment_tile16(const void* w, int64_t ldw, const float* x, int64_t ldx, int64_t kn, const float* scale,
                    float* acc, int64_t lda, int64_t ahead) {
  constexpr int V = kTile / 16;
  __m512 p[R][V];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) p[r][v] = _mm512_setzero_ps();
  const char* wb = static_cast<const char*>(w);
  const int64_t step = ldw * kElementBytes<W>;
  for (int64_t k = 0; k < kn; ++k, wb += step) {
    prefetch_ahead<W>(wb, ahead);
    __m512 wv[V];
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) wv[v] = load16<W>(wb, v);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) p[r][v] = _mm512_fmadd_ps(b, wv[v], p[r][v]);
    }
  }
  #pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const __m512 s = _mm512_loadu_ps(scale + 16 * v);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * lda + 16 * v;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(p[r][v], s, _mm512_loadu_ps(a)));
    }
  }
}
#endif

// Rows of x per register tile, at most: 6 rows x 2 vectors of sums, 2 of weights, 1 of x (in sixteen lanes: 6 x 4
// sums, 4 weights, 1 of x).
constexpr int kMaxRows = 6;

// Vectors of 8 columns per register tile of R rows: 8 or more independent sums where R allows (an FMA's
// latency times the two FMA pipes), 12 at most.
constexpr int columns_for(int rows) { return rows <= 1 ? 8 : rows <= 2 ? 4 : 2; }

// segment_tile for R = rows (1 <= rows <= kMaxRows), 8 * columns_for(R) columns at a time over the tile's 64
// (`width` of them real, the rest zero padding).
template <Kind W, int R = 1>
void segment_tile_rows(int64_t rows, const void* w, int64_t ldw, const float* x, int64_t ldx, int64_t kn,
                       const float* scale, float* acc, int64_t lda, int64_t width, int64_t ahead) {
  if constexpr (R < kMaxRows) {
    if (rows != R) return segment_tile_rows<W, R + 1>(rows, w, ldw, x, ldx, kn, scale, acc, lda, width, ahead);
  }
#ifdef JAXINFER_LANES16
  (void)width;   // the whole tile in one pass (past `width`: zero weights, scales and sums)
  segment_tile16<W, R>(w, ldw, x, ldx, kn, scale, acc, lda, ahead);
#else
  constexpr int V = columns_for(R);
  for (int64_t c = 0; c < width; c += 8 * V)
    segment_tile<W, R, V>(static_cast<const char*>(w) + c * kElementBytes<W>, ldw, x, ldx, kn, scale + c, acc + c,
                          lda, ahead);
#endif
}

// One tile's segment for all `rows` rows of x, in register tiles of up to 6 rows, as equal in size as can be.
template <Kind W>
void segment_rows(const void* w, int64_t ldw, const float* x, int64_t ldx, int64_t kn, const float* scale,
                  float* acc, int64_t lda, int64_t rows, int64_t width, int64_t ahead = 0) {
  const int64_t groups = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t g = 0, r = 0; g < groups; ++g) {
    const int64_t n = (rows - r) / (groups - g);
    segment_tile_rows<W>(n, w, ldw, x + r * ldx, ldx, kn, scale, acc + r * lda, lda, width, ahead);
    r += n;
  }
}

// An fp8 byte's value times 2^-8, NaN for 0x7f and 0xff (the exact path, for segments holding a NaN).
float fp8_scalar(uint8_t b) {
  if ((b & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  const int e = (b >> 3) & 15, m = b & 7;
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80 ? -mag : mag) / kFp8Unit;
}

using jaxinfer::parallel_for;   // parallel_for.h

// The multiply-adds from which a call is split over threads.
int64_t thread_work(Kind kind) { return kind == Kind::kFp8 ? kThreadWorkFp8 : kThreadWork; }

// Whether threads split K (each streaming a contiguous part of the weight, their sums added up after) for m
// rows of x and n columns in `parts` parts, rather than the columns.
bool split_k(int64_t m, int64_t n, int64_t parts) {
  return m <= kSplitRows && parts > 1 && parts * m * n * static_cast<int64_t>(sizeof(float)) <= kSplitSums;
}

// m rows of x as `count` chunks of kRowChunk rows at most, `rows` each but the last.
struct RowChunks {
  int64_t count, rows;
};
RowChunks row_chunks(int64_t m) {
  const int64_t count = (m + kRowChunk - 1) / kRowChunk;
  return {count, (m + count - 1) / count};
}

struct Problem {
  int64_t m, k, n, block;
  Kind kind;              // the values' type: kInt8, kFp8, kBf16 or kF16
  const float* x;         // [m, k]: x in float32
  const uint8_t* values;  // [k, n] elements of `bytes` bytes
  const float* scale;     // [ceil(k / block), n]
  int64_t bytes;          // bytes per element of values
  bool fp8() const { return kind == Kind::kFp8; }
};

// The values' Kind for an FFI element type (kF32: not one the kernel takes).
Kind kind_of(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::S8: return Kind::kInt8;
    case ffi::DataType::F8E4M3FN: return Kind::kFp8;
    case ffi::DataType::BF16: return Kind::kBf16;
    case ffi::DataType::F16: return Kind::kF16;
    default: return Kind::kF32;
  }
}

// One value of `kind` at p as a float in the kernel's units.
float value_scalar(const uint8_t* p, Kind kind) {
  uint16_t h;
  switch (kind) {
    case Kind::kInt8: return static_cast<int8_t>(*p) / kInt8Unit;
    case Kind::kFp8: return fp8_scalar(*p);
    case Kind::kBf16: std::memcpy(&h, p, 2); return to_float(BF16{h});
    case Kind::kF16: {
      _Float16 f;
      std::memcpy(&f, p, 2);
      return static_cast<float>(f);
    }
    default: return 0.f;
  }
}

// The factor from a weight in the kernel's units to its value (see fp8_halves and int8_top).
float unit_of(Kind kind) { return kind == Kind::kFp8 ? kFp8Unit : kind == Kind::kInt8 ? kInt8Unit : 1.f; }

// segment_rows<kind>(args...) for the kind of the values.
template <typename... A>
void segment_rows_of(Kind kind, A... args) {
  switch (kind) {
    case Kind::kInt8: return segment_rows<Kind::kInt8>(args...);
    case Kind::kFp8: return segment_rows<Kind::kFp8>(args...);
    case Kind::kBf16: return segment_rows<Kind::kBf16>(args...);
    case Kind::kF16: return segment_rows<Kind::kF16>(args...);
    default: return segment_rows<Kind::kF32>(args...);
  }
}

// An fp8 segment's tiles holding a NaN code (0x7f or 0xff): kn rows of `width` bytes from w (ld apart), read
// row by row (which also brings the segment into cache in the order memory lies). A NaN code is the one byte
// that `| 0x80` turns into 0xff: the maximum of those over the segment finds whether there is any (two
// operations per 32 bytes); which tiles hold them is worked out only then.
void find_nans(const uint8_t* w, int64_t ld, int64_t kn, int64_t width, std::vector<char>& nan) {
  const int64_t tiles = (width + kTile - 1) / kTile, whole = width / 32 * 32;
  nan.assign(tiles, 0);
  const __m256i high = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i most = _mm256_setzero_si256();
  bool any = false;
  for (int64_t k = 0; k < kn; ++k) {
    const uint8_t* row = w + k * ld;
    for (int64_t j = 0; j < whole; j += 32) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j));
      most = _mm256_max_epu8(most, _mm256_or_si256(bytes, high));
    }
    for (int64_t j = whole; j < width; ++j) any |= (row[j] & 0x7f) == 0x7f;
  }
  const __m256i hit = _mm256_cmpeq_epi8(most, _mm256_set1_epi8(-1));
  if (!any && _mm256_testz_si256(hit, hit)) return;
  for (int64_t k = 0; k < kn; ++k)
    for (int64_t j = 0; j < width; ++j) nan[j / kTile] |= (w[k * ld + j] & 0x7f) == 0x7f;
}

// A tile's 64 weights of one k (W's, at b) as floats in the kernel's units, stored at f.
template <Kind W>
inline void tile_to_floats(const uint8_t* b, float* f) {
#ifdef JAXINFER_LANES16
  #pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) _mm512_storeu_ps(f + 16 * v, load16<W>(b, v));
#else
  #pragma GCC unroll 4
  for (int v = 0; v < 8; v += 2) {
    __m256 lo, hi;
    load_pair<W>(b, v, lo, hi);
    _mm256_storeu_ps(f + 8 * v, lo);
    _mm256_storeu_ps(f + 8 * v + 8, hi);
  }
#endif
}

// to_panel for weights of W.
template <Kind W>
void to_panel_as(const uint8_t* w, int64_t ld, int64_t kn, int64_t width, const char* nan, float* out) {
  constexpr int64_t bytes = kElementBytes<W>;
  for (int64_t k = 0; k < kn; ++k) {
    const uint8_t* row = w + k * ld * bytes;
    for (int64_t t = 0; t * kTile < width; ++t) {
      const uint8_t* b = row + t * kTile * bytes;
      float* f = out + (t * kn + k) * kTile;
      const int64_t cols = std::min(kTile, width - t * kTile);
      if (cols == kTile && !(W == Kind::kFp8 && nan[t])) {
        prefetch_ahead<W>(reinterpret_cast<const char*>(b), kPanelAheadTiles * kTile * bytes);
        tile_to_floats<W>(b, f);
        continue;
      }
      for (int64_t j = 0; j < kTile; ++j) f[j] = j >= cols ? 0.f : value_scalar(b + j * bytes, W);
    }
  }
}

// kn rows of `width` weights of `kind` from w (ld elements apart) as floats in the kernel's units, tile after
// tile ([tile][k][64], zero past `width`), read row by row. Tiles flagged in `nan` (fp8) convert exactly, NaN
// included.
void to_panel(const uint8_t* w, int64_t ld, int64_t kn, int64_t width, Kind kind, const char* nan, float* out) {
  switch (kind) {
    case Kind::kInt8: return to_panel_as<Kind::kInt8>(w, ld, kn, width, nan, out);
    case Kind::kFp8: return to_panel_as<Kind::kFp8>(w, ld, kn, width, nan, out);
    case Kind::kBf16: return to_panel_as<Kind::kBf16>(w, ld, kn, width, nan, out);
    default: return to_panel_as<Kind::kF16>(w, ld, kn, width, nan, out);
  }
}

// A thread's scratch memory, kept from call to call: allocated afresh, buffers of this size would be mapped
// and page-faulted in on every call. The constants above bound its size, but for `x` and `sums` (`scratch`).
struct Workspace {
  std::vector<float> acc;      // the rows' sums for a group of columns
  std::vector<float> scales;   // a block's scales for the group
  std::vector<float> floats;   // a tile's segment of weights as floats (the panel)
  std::vector<uint8_t> bytes;  // the last tile's weights, zero-padded to 64 columns
  std::vector<char> nan;       // an fp8 segment's tiles holding a NaN
  std::vector<float> x;        // x in float32, where it is not
  std::vector<float> sums;     // the float32 sums of each part of K
};
thread_local Workspace workspace;

// n floats of `kept` where that is 8 MiB or less, else of `once` (the caller's, freed after the call).
float* scratch(std::vector<float>& kept, std::vector<float>& once, size_t n) {
  std::vector<float>& v = n * sizeof(float) <= (8u << 20) ? kept : once;
  if (v.size() < n) v.resize(n);
  return v.data();
}

// A piece of the work: rows [r0, r1) of x times columns [c0, c1) of the weight over its rows [k0, k1).
struct Item {
  int64_t r0, r1, c0, c1, k0, k1;
};

// An item's sums into out (n columns a row) in T, or, where `sums` is given, into sums in float32 (the same
// layout) for the caller to add up.
template <typename T>
void run_item(const Problem& p, const Item& item, T* out, float* sums) {
  const auto [r0, r1, c0, c1, k_begin, k_end] = item;
  const int64_t rows = r1 - r0;
  const bool panel = rows >= kPanelRows;
  const int64_t seg = panel ? kSegmentMany : kSegmentFew;
  const int64_t group = std::max<int64_t>(1, kAccFloats / (rows * kTile)) * kTile;
  const int64_t most = std::min(group, (c1 - c0 + kTile - 1) / kTile * kTile);
  Workspace& ws = workspace;
  if (ws.acc.size() < static_cast<size_t>(rows * most)) ws.acc.resize(rows * most);
  if (ws.scales.size() < static_cast<size_t>(most)) ws.scales.resize(most);
  std::vector<float>& acc = ws.acc;
  std::vector<float>& scales = ws.scales;
  std::vector<uint8_t>& bytes = ws.bytes;
  std::vector<float>& floats = ws.floats;
  std::vector<char>& nan = ws.nan;
  const float unit = unit_of(p.kind);
  const int64_t ahead_tiles = kAheadBytes / (kTile * p.bytes);
  const float* x = p.x + r0 * p.k;
  for (int64_t g0 = c0; g0 < c1; g0 += group) {
    const int64_t g1 = std::min(c1, g0 + group), width = g1 - g0, lda = (width + kTile - 1) / kTile * kTile;
    std::fill(acc.begin(), acc.begin() + rows * lda, 0.f);
    for (int64_t k0 = k_begin, k1, last = -1; k0 < k_end; k0 = k1) {
      const int64_t b = k0 / p.block;
      k1 = std::min({k_end, k0 + seg, (b + 1) * p.block});
      const int64_t kn = k1 - k0;
      if (b != last) {  // this block's scales (times the weights' unit), zero past the last column
        for (int64_t j = 0; j < lda; ++j) scales[j] = j < width ? p.scale[b * p.n + g0 + j] * unit : 0.f;
        last = b;
      }
      const uint8_t* src = p.values + (k0 * p.n + g0) * p.bytes;
      const float* xk = x + k0;
      if (p.fp8()) find_nans(src, p.n, kn, width, nan);
      if (panel) {  // each tile's weights converted once for all rows, into a panel that stays in L1
        floats.resize(kn * kTile);
        for (int64_t t = 0; t * kTile < width; ++t) {
          const int64_t cols = std::min(kTile, width - t * kTile);
          to_panel(src + t * kTile * p.bytes, p.n, kn, cols, p.kind, nan.data() + t, floats.data());
          segment_rows<Kind::kF32>(floats.data(), kTile, xk, p.k, kn, &scales[t * kTile], &acc[t * kTile], lda, rows,
                                   cols);
        }
        continue;
      }
      for (int64_t t = 0, tiles = lda / kTile; t < tiles; ++t) {  // each tile's weights converted as used
        const uint8_t* w = src + t * kTile * p.bytes;
        const int64_t cols = std::min(kTile, width - t * kTile);
        if (p.fp8() && nan[t]) {
          floats.resize(kn * kTile);
          to_panel(w, p.n, kn, cols, Kind::kFp8, nan.data() + t, floats.data());
          segment_rows<Kind::kF32>(floats.data(), kTile, xk, p.k, kn, &scales[t * kTile], &acc[t * kTile], lda, rows,
                                   cols);
          continue;
        }
        int64_t ldw = p.n;
        int64_t ahead = (t + ahead_tiles < tiles ? ahead_tiles * kTile : kn * p.n + (ahead_tiles - tiles) * kTile) *
                        p.bytes;
        if (cols < kTile) {  // the last tile: copied, zero-padded, so that every load stays inside the operand
          bytes.assign(kn * kTile * p.bytes, 0);
          for (int64_t k = 0; k < kn; ++k)
            std::memcpy(&bytes[k * kTile * p.bytes], w + k * ldw * p.bytes, cols * p.bytes);
          w = bytes.data();
          ldw = kTile;
          ahead = 0;
        }
        segment_rows_of(p.kind, static_cast<const void*>(w), ldw, xk, p.k, kn,
                        static_cast<const float*>(&scales[t * kTile]), &acc[t * kTile], lda, rows, cols, ahead);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = &acc[r * lda];
      if (sums) std::memcpy(sums + (r0 + r) * p.n + g0, a, width * sizeof(float));
      else for (int64_t c = 0; c < width; ++c) from_float(a[c], out + (r0 + r) * p.n + g0 + c);
    }
  }
}

// out[j] = the sum over parts of sums[part * size + j], in the parts' order whichever thread ran them:
// deterministic.
template <typename T>
void add_parts(const float* sums, int64_t parts, int64_t size, T* out) {
  for (int64_t j = 0; j < size; ++j) {
    float total = sums[j];
    for (int64_t i = 1; i < parts; ++i) total += sums[i * size + j];
    from_float(total, out + j);
  }
}

// Splits the work over the caller and XLA's intra-op threads, in a few parts per thread: a thread the pool
// starts late (it often is, by hundreds of microseconds) then delays the call by one small part at most. Few
// rows of x (memory-bound): K in equal parts, each a contiguous range of the weight streamed by one thread,
// their float32 sums added up at the end in a fixed order. More rows: the columns in equal parts (and chunks
// of rows).
template <typename T>
void quantized_matmul(const Problem& p, T* out, ffi::ThreadPool& pool) {
  static const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());  // reads sysfs
  const int64_t workers = p.m * p.k * p.n < thread_work(p.kind) ? 1 : std::min(pool.num_threads() + 1, cores);
  const int64_t k_parts = std::min(workers * kItems, p.k / kSegmentFew);
  if (workers > 1 && p.k >= 2 * kSegmentFew * workers && split_k(p.m, p.n, k_parts)) {
    const int64_t parts = k_parts, size = p.m * p.n;
    std::vector<float> once;
    float* sums = scratch(workspace.sums, once, parts * size);
    parallel_for(pool, parts, workers - 1, [&](int64_t i) {
      run_item<T>(p, Item{0, p.m, 0, p.n, i * p.k / parts, (i + 1) * p.k / parts}, nullptr, sums + i * size);
    });
    add_parts(sums, parts, size, out);
    return;
  }
  const int64_t tiles = (p.n + kTile - 1) / kTile;
  const RowChunks rc = row_chunks(p.m);
  const int64_t chunks = rc.count, chunk_rows = rc.rows;
  int64_t parts = 1;   // of the columns, so that there are about kItems items a worker, their count a multiple of
  if (workers > 1) {   // the workers' where the columns allow (3 chunks on 2 threads would leave one idle a third)
    const int64_t per_worker = std::clamp<int64_t>(tiles / (4 * workers), 1, kItems);
    parts = std::min(tiles, (workers * per_worker + chunks - 1) / chunks);
    while (parts < tiles && chunks * parts % workers != 0) ++parts;
  }
  parallel_for(pool, chunks * parts, std::min(workers, chunks * parts) - 1, [&](int64_t i) {
    const int64_t chunk = i / parts, part = i % parts;
    const int64_t r0 = chunk * chunk_rows, c0 = part * tiles / parts * kTile;
    const Item item{r0, std::min(p.m, r0 + chunk_rows), c0, std::min(p.n, (part + 1) * tiles / parts * kTile), 0, p.k};
    run_item<T>(p, item, out, nullptr);
  });
}

template <typename T>
T* data(ffi::AnyBuffer& b) { return static_cast<T*>(b.untyped_data()); }

// x's n elements as float32: x itself where it is, else converted into `kept` or `once` (scratch).
template <typename T>
const float* as_float(const T* x, int64_t n, std::vector<float>& kept, std::vector<float>& once) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    float* out = scratch(kept, once, n);
    for (int64_t i = 0; i < n; ++i) out[i] = to_float(x[i]);
    return out;
  }
}

template <typename T>
void run(Problem p, ffi::AnyBuffer& x, ffi::AnyBuffer& out, ffi::ThreadPool& pool) {
  std::vector<float> once;
  p.x = as_float(data<T>(x), p.m * p.k, workspace.x, once);
  quantized_matmul(p, data<T>(out), pool);
}

// f(T{}) for x's element type T (float32, bfloat16 or float16): the kernels' entry points run as one template.
template <typename F>
ffi::Error for_x_type(ffi::DataType type, const std::string& kernel, F&& f) {
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
      return ffi::Error::InvalidArgument(kernel + ": x must be f32, bf16 or f16");
  }
}

// The experts of a mixture in one call: rows [start_g, start_g + sizes[g]) of x (grouped by expert, start_g the
// sizes before g) times expert g's weight, for each expert with rows; rows past the groups are 0. A step reads
// the experts its rows chose, as stored. The work of all the experts is one parallel_for (a call per expert
// would wake the pool per expert: at 8 experts of 2 rows each that halved decode's speed), each expert's in
// parts by its share of the multiply-adds: a few rows' K in parts (their float32 sums added up after, in
// order), more rows' columns (and chunks of rows).
template <typename T>
void run_grouped(Problem p, const int32_t* sizes, int64_t experts, ffi::AnyBuffer& x, ffi::AnyBuffer& out,
                 ffi::ThreadPool& pool) {
  struct Task {
    int64_t g;
    Item item;
    float* sums;   // a part of K's float32 sums, or null: written to out
  };
  struct Split {
    int64_t g, parts, first;   // its parts are tasks [first, first + parts)
  };
  const int64_t rows = p.m, blocks = (p.k + p.block - 1) / p.block, tiles = (p.n + kTile - 1) / kTile;
  std::vector<Problem> groups(experts, p);
  std::vector<int64_t> starts(experts, 0);
  int64_t start = 0, sums_size = 0;
  for (int64_t g = 0; g < experts; ++g) {
    starts[g] = start;
    groups[g].m = std::min<int64_t>(std::max<int32_t>(sizes[g], 0), rows - start);
    groups[g].values = p.values + g * p.k * p.n * p.bytes;
    groups[g].scale = p.scale + g * blocks * p.n;
    start += groups[g].m;
  }
  static const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t total = start * p.k * p.n;
  const int64_t workers = total < thread_work(p.kind) ? 1 : std::min(pool.num_threads() + 1, cores);
  std::vector<Task> tasks;
  std::vector<Split> splits;
  for (int64_t g = 0; g < experts; ++g) {
    const int64_t m = groups[g].m;
    if (m == 0) continue;
    const int64_t want = std::max<int64_t>(1, (workers * kItems * m + start - 1) / start);   // its share of the parts
    const int64_t k_parts = std::min(want, p.k / kSegmentFew);
    if (workers > 1 && split_k(m, p.n, k_parts)) {
      splits.push_back({g, k_parts, static_cast<int64_t>(tasks.size())});
      for (int64_t i = 0; i < k_parts; ++i)
        tasks.push_back({g, Item{0, m, 0, p.n, i * p.k / k_parts, (i + 1) * p.k / k_parts}, nullptr});
      sums_size += k_parts * m * p.n;
      continue;
    }
    const RowChunks rc = row_chunks(m);
    const int64_t chunks = rc.count, chunk_rows = rc.rows;
    const int64_t parts = workers == 1 ? 1 : std::clamp<int64_t>((want + chunks - 1) / chunks, 1, tiles);
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t i = 0; i < parts; ++i)
        tasks.push_back({g, Item{c * chunk_rows, std::min(m, (c + 1) * chunk_rows), i * tiles / parts * kTile,
                                 std::min(p.n, (i + 1) * tiles / parts * kTile), 0, p.k}, nullptr});
  }
  std::vector<float> once_x, once_sums;
  const float* xf = as_float(data<T>(x), start * p.k, workspace.x, once_x);
  float* sums = scratch(workspace.sums, once_sums, sums_size);
  for (int64_t g = 0; g < experts; ++g) groups[g].x = xf + starts[g] * p.k;  // each group's rows
  for (const Split& s : splits) {  // each split's parts' sums, side by side
    const int64_t size = groups[s.g].m * p.n;
    for (int64_t part = 0; part < s.parts; ++part) tasks[s.first + part].sums = sums + part * size;
    sums += s.parts * size;
  }
  T* o = data<T>(out);
  parallel_for(pool, tasks.size(), std::min<int64_t>(workers, tasks.size()) - 1, [&](int64_t i) {
    const Task& t = tasks[i];
    run_item<T>(groups[t.g], t.item, o + starts[t.g] * p.n, t.sums);
  });
  for (const Split& s : splits) add_parts(tasks[s.first].sums, s.parts, groups[s.g].m * p.n, o + starts[s.g] * p.n);
  std::memset(static_cast<void*>(o + start * p.n), 0, (rows - start) * p.n * sizeof(T));
}

ffi::Error GroupedQuantizedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> sizes, int64_t block,
                                      ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = x.dimensions(), wd = values.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || sizes.dimensions().size() != 1 || od.size() != 2 ||
      block < 1)
    return ffi::Error::InvalidArgument(
        "grouped quantized matmul: x, values, scale, sizes must be rank 2, 3, 3, 1 and block positive");
  const int64_t rows = xd[0], experts = wd[0], k = xd[1], n = wd[2];
  if (wd[1] != k || sd[0] != experts || sd[1] != (k + block - 1) / block || sd[2] != n ||
      sizes.dimensions()[0] != experts || od[0] != rows || od[1] != n || out->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("grouped quantized matmul: operand shapes disagree");
  const Kind kind = kind_of(values.element_type());
  if (kind == Kind::kF32)
    return ffi::Error::InvalidArgument("grouped quantized matmul: values must be int8, float8_e4m3fn, bf16 or f16");
  const Problem p{rows, k, n, block, kind, nullptr, static_cast<const uint8_t*>(values.untyped_data()),
                  scale.typed_data(), static_cast<int64_t>(ffi::ByteWidth(values.element_type()))};
  if (rows == 0 || n == 0) return ffi::Error::Success();
  return for_x_type(x.element_type(), "grouped quantized matmul", [&](auto zero) {
    run_grouped<decltype(zero)>(p, sizes.typed_data(), experts, x, *out, pool);
  });
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values,
                               ffi::Buffer<ffi::F32> scale, int64_t block, ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = x.dimensions(), wd = values.dimensions(), sd = scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2 || od.size() != 2 || block < 1)
    return ffi::Error::InvalidArgument("quantized matmul: x, values, scale must be rank 2 and block positive");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  if (wd[0] != k || sd[0] != (k + block - 1) / block || sd[1] != n || od[0] != m || od[1] != n ||
      out->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("quantized matmul: operand shapes disagree");
  const Kind kind = kind_of(values.element_type());
  if (kind == Kind::kF32)
    return ffi::Error::InvalidArgument("quantized matmul: values must be int8, float8_e4m3fn, bf16 or f16");
  const Problem p{m, k, n, block, kind, nullptr, static_cast<const uint8_t*>(values.untyped_data()),
                  scale.typed_data(), static_cast<int64_t>(ffi::ByteWidth(values.element_type()))};
  if (m == 0 || n == 0) return ffi::Error::Success();
  return for_x_type(x.element_type(), "quantized matmul", [&](auto zero) { run<decltype(zero)>(p, x, *out, pool); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedQuantizedMatmul, GroupedQuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::AnyBuffer>());
