// Ragged paged attention for XLA:CPU, called through XLA's FFI: the contract of
// pallas_kernels/ragged_paged_attention.py (its jnp reference is the test oracle).
//
// Why a kernel of our own on CPU: XLA:CPU runs attention over scattered 16-token pages as many small
// gathers and matmuls, each a kernel with a fixed cost, so a decode step's attention cost far more than
// its K/V reads. Here each (query token, kv head) walks its own sequence's pages once, the G query heads
// of the kv head sharing every K/V row it reads, with an online softmax in float32.
//
// Operands: q [N, H, D]; k_pages, v_pages [L, KV, P, page, D] (q's dtype: f32, bf16 or f16); layer,
// num_seqs: int32 scalars; page_table [S, W], seq_lens [S], query_start [S + 1]: int32.
// Result: [N, H, D] in q's dtype; tokens of no sequence, and tokens that see no key, are 0.
// Every index read from an operand is clamped, so a bad table cannot read outside the pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

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

// Runs body(i) for i in [0, n) on the caller and the XLA:CPU intra-op pool. Work is taken from a shared
// counter, and the caller waits only for items a running thread has taken, so it never waits on a task
// the pool has not started (no deadlock when the pool is busy or absent).
struct Progress {
  std::atomic<int64_t> next{0};
  int64_t done = 0;
  std::mutex mu;
  std::condition_variable cv;
};

template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t helpers, const Body& body) {
  if (helpers <= 0 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto progress = std::make_shared<Progress>();
  auto work = [progress, n, &body] {
    int64_t mine = 0;
    for (int64_t i; (i = progress->next.fetch_add(1)) < n; ++mine) body(i);
    if (mine > 0) {
      std::lock_guard<std::mutex> lock(progress->mu);
      progress->done += mine;
      if (progress->done == n) progress->cv.notify_all();
    }
  };
  // A helper that starts after the work is gone touches only `progress`, which it co-owns.
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(progress->mu);
  progress->cv.wait(lock, [&] { return progress->done == n; });
}

struct Shape {
  int64_t n, heads, d, layers, kv_heads, pages, page, slots, width;
};

template <typename T>
void attend(const Shape& s, const T* q, const T* k_pages, const T* v_pages, int32_t layer, const int32_t* table,
            const int32_t* seq_lens, const int32_t* query_start, int32_t num_seqs, float scale, T* out,
            ffi::ThreadPool& pool) {
  const int64_t group = s.heads / s.kv_heads, d = s.d, page = s.page;
  std::fill(out, out + s.n * s.heads * d, T{});
  layer = std::clamp<int32_t>(layer, 0, static_cast<int32_t>(s.layers) - 1);
  num_seqs = std::clamp<int32_t>(num_seqs, 0, static_cast<int32_t>(s.slots));

  // Each real token's sequence and number of visible keys (its position + 1).
  std::vector<int32_t> token_seq(s.n, -1), visible(s.n, 0);
  int64_t work = 0;
  for (int32_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = std::clamp<int64_t>(query_start[seq], 0, s.n);
    const int64_t end = std::clamp<int64_t>(query_start[seq + 1], begin, s.n);
    for (int64_t t = begin; t < end; ++t) {   // keys up to the token's position, as far as the table reaches
      token_seq[t] = seq;
      visible[t] = static_cast<int32_t>(std::clamp<int64_t>(seq_lens[seq] - (end - t) + 1, 0, s.width * page));
      work += visible[t];
    }
  }

  const int64_t items = s.n * s.kv_heads;
  const int64_t layer_stride = s.kv_heads * s.pages * page * d;
  auto item = [&](int64_t i) {
    const int64_t t = i / s.kv_heads, g = i % s.kv_heads;
    const int32_t seq = token_seq[t];
    const int64_t keys = visible[t];
    if (seq < 0 || keys == 0) return;
    const int32_t* row = table + static_cast<int64_t>(seq) * s.width;
    const T* k_head = k_pages + layer * layer_stride + g * s.pages * page * d;
    const T* v_head = v_pages + layer * layer_stride + g * s.pages * page * d;

    std::vector<float> qf(group * d), acc(group * d, 0.f), score(group * page);
    std::vector<float> m(group, -std::numeric_limits<float>::infinity()), l(group, 0.f);
    for (int64_t h = 0; h < group; ++h)
      for (int64_t x = 0; x < d; ++x) qf[h * d + x] = to_float(q[(t * s.heads + g * group + h) * d + x]) * scale;

    for (int64_t j = 0; j * page < keys; ++j) {
      const int64_t pid = std::clamp<int64_t>(row[j], 0, s.pages - 1);
      const int64_t count = std::min(page, keys - j * page);
      const T* k = k_head + pid * page * d;
      const T* v = v_head + pid * page * d;
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = &qf[h * d];
        float* sh = &score[h * page];
        float top = m[h];
        for (int64_t c = 0; c < count; ++c) {
          const T* kc = k + c * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < d; ++x) dot += qh[x] * to_float(kc[x]);
          sh[c] = dot;
          top = std::max(top, dot);
        }
        const float correction = std::exp(m[h] - top);  // 0 on the first page (m = -inf)
        float* ah = &acc[h * d];
        float sum = 0.f;
        for (int64_t x = 0; x < d; ++x) ah[x] *= correction;
        for (int64_t c = 0; c < count; ++c) {
          const float p = std::exp(sh[c] - top);
          sum += p;
          const T* vc = v + c * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) ah[x] += p * to_float(vc[x]);
        }
        l[h] = l[h] * correction + sum;
        m[h] = top;
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      T* o = out + (t * s.heads + g * group + h) * d;
      const float inv = 1.f / l[h];
      for (int64_t x = 0; x < d; ++x) from_float(acc[h * d + x] * inv, o + x);
    }
  };
  // Threads pay off only past a few hundred thousand multiply-adds (a decode step of short sequences runs
  // faster on the caller alone).
  const int64_t flops = work * s.heads * d * 2;
  const int64_t helpers = flops < (1 << 19) ? 0 : std::min<int64_t>(pool.num_threads(), items - 1);
  parallel_for(pool, items, helpers, item);
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                    ffi::AnyBuffer v_pages, ffi::BufferR0<ffi::S32> layer,
                                    ffi::BufferR2<ffi::S32> page_table, ffi::BufferR1<ffi::S32> seq_lens,
                                    ffi::BufferR1<ffi::S32> query_start, ffi::BufferR0<ffi::S32> num_seqs,
                                    float sm_scale, ffi::Result<ffi::AnyBuffer> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 5) return ffi::Error::InvalidArgument("q must be rank 3 and the pages rank 5");
  const Shape s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], kd[3], td[0], td[1]};
  if (kd[4] != s.d || s.kv_heads <= 0 || s.heads % s.kv_heads != 0 || s.page <= 0 || s.pages <= 0 ||
      seq_lens.dimensions()[0] != s.slots || query_start.dimensions()[0] != s.slots + 1 ||
      !std::equal(kd.begin(), kd.end(), v_pages.dimensions().begin(), v_pages.dimensions().end()) || k_pages.element_type() != q.element_type() ||
      v_pages.element_type() != q.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("ragged paged attention: operand shapes or dtypes disagree");
  const int32_t lyr = *layer.typed_data(), seqs = *num_seqs.typed_data();
  const int32_t *tab = page_table.typed_data(), *lens = seq_lens.typed_data(), *qs = query_start.typed_data();
  switch (q.element_type()) {
    case ffi::DataType::F32:
      attend(s, q.typed_data<float>(), k_pages.typed_data<float>(), v_pages.typed_data<float>(), lyr, tab, lens, qs,
             seqs, sm_scale, out->typed_data<float>(), pool);
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      attend(s, static_cast<const BF16*>(q.untyped_data()), static_cast<const BF16*>(k_pages.untyped_data()),
             static_cast<const BF16*>(v_pages.untyped_data()), lyr, tab, lens, qs, seqs, sm_scale,
             static_cast<BF16*>(out->untyped_data()), pool);
      return ffi::Error::Success();
    case ffi::DataType::F16:
      attend(s, static_cast<const _Float16*>(q.untyped_data()), static_cast<const _Float16*>(k_pages.untyped_data()),
             static_cast<const _Float16*>(v_pages.untyped_data()), lyr, tab, lens, qs, seqs, sm_scale,
             static_cast<_Float16*>(out->untyped_data()), pool);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("ragged paged attention runs f32, bf16 and f16");
  }
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
