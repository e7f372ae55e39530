// Attention over a paged KV cache, read in place: each sequence's query tokens (one when it
// decodes, a prompt chunk after a cached prefix) over the context its block table points to,
// causally, within an optional sliding window. Built by distserve/model_executor/cpu_kernel.py
// with the host's compiler and called through ctypes.
//
// One task per decoding sequence, and per tile of up to 16 consecutive query tokens of a prompt,
// spread over the OpenMP threads torch uses (the process has one OpenMP runtime, torch's, so
// torch.set_num_threads applies here too). A task walks its blocks once, so K and V are read from
// memory once per task, where they sit, and stay in cache for the query heads that share a KV head
// (and a tile's tokens). Per block: the scores, an online softmax (a running maximum and sum; the
// accumulator is rescaled when the maximum grows), then the weighted values; each phase over all
// heads before the next (measured 10-15% faster than all three head by head). Every value stays
// finite (running maxima start at the lowest float, not -inf; masked scores weigh zero by a
// select, and keys past a task's last position are never read), so the kernel may be built with
// -ffast-math, which vectorises exp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // query tokens of a prompt tile: one per SIMD lane (16 floats: one AVX-512 register)

struct Shape {
  int64_t heads, kv_heads, dim, block_size, max_blocks, window;
};

// Per-thread working memory, sized once per call.
struct Scratch {
  std::vector<float> scores, acc, maxes, sums, queries;
  explicit Scratch(const Shape& s)
      : scores(s.heads * s.block_size * kLanes),
        acc(s.heads * kLanes * s.dim),
        maxes(s.heads * kLanes),
        sums(s.heads * kLanes),
        queries(s.heads * s.dim * kLanes) {}
};

// One query token (a decoding sequence) at `position`. Per block, for every head: the scores of
// the block's tokens (a dot product each), then the online softmax, then the weighted values.
template <int64_t DIM>
void attend_token(const float* q, float* out, const float* k_cache, const float* v_cache, const int64_t* table,
                  int64_t position, const Shape& shape, Scratch& w) {
  const int64_t dim = DIM > 0 ? DIM : shape.dim, heads = shape.heads, block_size = shape.block_size;
  const int64_t group = heads / shape.kv_heads, row = shape.kv_heads * dim;
  const int64_t start = std::max<int64_t>(position - shape.window + 1, 0);
  float *scores = w.scores.data(), *acc = w.acc.data(), *maxes = w.maxes.data(), *sums = w.sums.data();
  std::fill(acc, acc + heads * dim, 0.f);
  std::fill(maxes, maxes + heads, std::numeric_limits<float>::lowest());
  std::fill(sums, sums + heads, 0.f);
  for (int64_t j = start / block_size; j <= position / block_size; ++j) {
    const int64_t base = j * block_size;  // position of the block's first token
    const int64_t first = std::max(start - base, int64_t{0});
    const int64_t last = std::min(position - base, block_size - 1);
    const float* k_block = k_cache + table[j] * block_size * row;
    const float* v_block = v_cache + table[j] * block_size * row;
    for (int64_t h = 0; h < heads; ++h) {  // scores
      const float* qh = q + h * dim;
      const float* kh = k_block + (h / group) * dim;
      float* s = scores + h * block_size;
      for (int64_t t = first; t <= last; ++t) {
        const float* k = kh + t * row;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qh[d] * k[d];
        s[t] = dot;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {  // softmax weights, the running maximum and sum
      float* s = scores + h * block_size;
      float block_max = maxes[h];
      for (int64_t t = first; t <= last; ++t) block_max = std::max(block_max, s[t]);
      if (block_max > maxes[h]) {  // rescale what is summed so far to the new maximum
        const float rescale = std::exp(maxes[h] - block_max);
        sums[h] *= rescale;
        float* a = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
        maxes[h] = block_max;
      }
      float block_sum = 0.f;
      for (int64_t t = first; t <= last; ++t) {
        s[t] = std::exp(s[t] - block_max);
        block_sum += s[t];
      }
      sums[h] += block_sum;
    }
    for (int64_t h = 0; h < heads; ++h) {  // weighted values
      const float* p = scores + h * block_size;
      const float* vh = v_block + (h / group) * dim;
      float* acc_h = acc + h * dim;
      float local[DIM > 0 ? DIM : 1];  // a local array, not the heap: it can live in registers
      float* a = DIM > 0 ? local : acc_h;
      if (DIM > 0) std::copy(acc_h, acc_h + dim, a);
      for (int64_t t = first; t <= last; ++t) {
        const float* v = vh + t * row;
        const float weight = p[t];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += weight * v[d];
      }
      if (DIM > 0) std::copy(a, a + dim, acc_h);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = 1.f / sums[h];
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = acc[h * dim + d] * inverse;
  }
}

// Up to kLanes consecutive query tokens of a prompt, the first at `first_position`, one per SIMD
// lane: a dot product per score would end in a horizontal sum, so the queries are transposed once
// (each head's [dim][lane]) and a key's scores for every lane come from one broadcast and
// multiply-add per dimension, four keys at a time (independent chains). The softmax is vectorised
// over lanes too; a lane's causal and window limits are a mask on its scores.
template <int64_t DIM>
void attend_tile(const float* q, float* out, const float* k_cache, const float* v_cache, const int64_t* table,
                 int64_t count, int64_t first_position, const Shape& shape, Scratch& w) {
  const int64_t dim = DIM > 0 ? DIM : shape.dim, heads = shape.heads, block_size = shape.block_size;
  const int64_t group = heads / shape.kv_heads, row = shape.kv_heads * dim;
  const int64_t last_position = first_position + count - 1;
  const int64_t start = std::max<int64_t>(first_position - shape.window + 1, 0);
  float *scores = w.scores.data(), *acc = w.acc.data(), *maxes = w.maxes.data(), *sums = w.sums.data();
  float* queries = w.queries.data();  // [heads][dim][lane]
  std::fill(w.queries.begin(), w.queries.end(), 0.f);
  for (int64_t m = 0; m < count; ++m)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d) queries[(h * dim + d) * kLanes + m] = q[(m * heads + h) * dim + d];
  int64_t newest[kLanes], oldest[kLanes];  // each lane's positions; a lane past `count` sees none
  for (int64_t m = 0; m < kLanes; ++m) {
    newest[m] = m < count ? first_position + m : -1;
    oldest[m] = m < count ? first_position + m - shape.window + 1 : 0;
  }
  std::fill(acc, acc + heads * kLanes * dim, 0.f);
  std::fill(maxes, maxes + heads * kLanes, std::numeric_limits<float>::lowest());
  std::fill(sums, sums + heads * kLanes, 0.f);
  for (int64_t j = start / block_size; j <= last_position / block_size; ++j) {
    const int64_t base = j * block_size;
    const int64_t first = std::max(start - base, int64_t{0});
    const int64_t last = std::min(last_position - base, block_size - 1);
    const float* k_block = k_cache + table[j] * block_size * row;
    const float* v_block = v_cache + table[j] * block_size * row;
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = queries + h * dim * kLanes;
      const float* kh = k_block + (h / group) * dim;
      float* s = scores + h * block_size * kLanes;  // [token][lane]
      int64_t t = first;
      for (; t + 3 <= last; t += 4) {  // scores of four keys at once
        float s0[kLanes] = {}, s1[kLanes] = {}, s2[kLanes] = {}, s3[kLanes] = {};
        const float *k0 = kh + t * row, *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
        for (int64_t d = 0; d < dim; ++d) {
          const float* qd = qh + d * kLanes;
#pragma omp simd
          for (int64_t m = 0; m < kLanes; ++m) {
            s0[m] += k0[d] * qd[m];
            s1[m] += k1[d] * qd[m];
            s2[m] += k2[d] * qd[m];
            s3[m] += k3[d] * qd[m];
          }
        }
        std::copy(s0, s0 + kLanes, s + t * kLanes);
        std::copy(s1, s1 + kLanes, s + (t + 1) * kLanes);
        std::copy(s2, s2 + kLanes, s + (t + 2) * kLanes);
        std::copy(s3, s3 + kLanes, s + (t + 3) * kLanes);
      }
      for (; t <= last; ++t) {
        float s0[kLanes] = {};
        const float* k0 = kh + t * row;
        for (int64_t d = 0; d < dim; ++d) {
          const float* qd = qh + d * kLanes;
#pragma omp simd
          for (int64_t m = 0; m < kLanes; ++m) s0[m] += k0[d] * qd[m];
        }
        std::copy(s0, s0 + kLanes, s + t * kLanes);
      }
      // Softmax over the block's keys, per lane: masked scores take no part, and weigh nothing.
      float* running_max = maxes + h * kLanes;
      float* running_sum = sums + h * kLanes;
      float block_max[kLanes], rescale[kLanes], block_sum[kLanes] = {};
      std::copy(running_max, running_max + kLanes, block_max);
      for (int64_t t = first; t <= last; ++t) {
        const int64_t position = base + t;
#pragma omp simd
        for (int64_t m = 0; m < kLanes; ++m) {
          const bool seen = position <= newest[m] && position >= oldest[m];
          block_max[m] = seen ? std::max(block_max[m], s[t * kLanes + m]) : block_max[m];
        }
      }
#pragma omp simd
      for (int64_t m = 0; m < kLanes; ++m) rescale[m] = std::exp(running_max[m] - block_max[m]);
      for (int64_t t = first; t <= last; ++t) {
        const int64_t position = base + t;
        float* st = s + t * kLanes;
#pragma omp simd
        for (int64_t m = 0; m < kLanes; ++m) {
          const bool seen = position <= newest[m] && position >= oldest[m];
          st[m] = seen ? std::exp(st[m] - block_max[m]) : 0.f;
          block_sum[m] += st[m];
        }
      }
#pragma omp simd
      for (int64_t m = 0; m < kLanes; ++m) {
        running_sum[m] = running_sum[m] * rescale[m] + block_sum[m];
        running_max[m] = block_max[m];
      }
      // Weighted values, lane by lane: the lane's accumulator in registers, a value row per key.
      const float* vh = v_block + (h / group) * dim;
      for (int64_t m = 0; m < count; ++m) {
        float* acc_m = acc + (h * kLanes + m) * dim;
        float local[DIM > 0 ? DIM : 1];
        float* a = DIM > 0 ? local : acc_m;
        const float r = rescale[m];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] = acc_m[d] * r;
        for (int64_t t = first; t <= last; ++t) {
          const float weight = s[t * kLanes + m];
          const float* v = vh + t * row;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += weight * v[d];
        }
        if (DIM > 0) std::copy(a, a + dim, acc_m);
      }
    }
  }
  for (int64_t m = 0; m < count; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      const float inverse = 1.f / sums[h * kLanes + m];
      const float* a = acc + (h * kLanes + m) * dim;
      for (int64_t d = 0; d < dim; ++d) out[(m * heads + h) * dim + d] = a[d] * inverse;
    }
}

template <int64_t DIM>
void paged_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* block_tables,
                     const int64_t* query_starts, const int64_t* query_lens, const int64_t* context_lens, float* out,
                     int64_t num_seqs, const Shape& shape) {
  const int64_t token_floats = shape.heads * shape.dim;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, its first query token in the tile)
  for (int64_t seq = 0; seq < num_seqs; ++seq)
    for (int64_t i = 0; i < query_lens[seq]; i += kLanes) tiles.emplace_back(seq, i);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel
  {
    Scratch scratch(shape);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < num_tiles; ++task) {
      const auto [seq, tile_first] = tiles[task];
      const int64_t count = std::min(kLanes, query_lens[seq] - tile_first);
      // A sequence's query tokens are the last query_lens of its context_lens positions.
      const int64_t first_position = context_lens[seq] - query_lens[seq] + tile_first;
      const int64_t row = query_starts[seq] + tile_first;
      const int64_t* table = block_tables + seq * shape.max_blocks;
      if (query_lens[seq] == 1)
        attend_token<DIM>(q + row * token_floats, out + row * token_floats, k_cache, v_cache, table,
                          first_position, shape, scratch);
      else
        attend_tile<DIM>(q + row * token_floats, out + row * token_floats, k_cache, v_cache, table, count,
                         first_position, shape, scratch);
    }
  }
}

}  // namespace

// q, out [tokens, heads, dim] (q already scaled); K/V caches [slots, kv_heads, dim]; block_tables
// [num_seqs, max_blocks]. Sequence s owns query tokens query_starts[s] .. + query_lens[s], the
// last of its context_lens[s] positions; each attends to the positions up to its own within the
// last `window`. Returns 0, or 1 for shapes the kernel does not take.
extern "C" int paged_attention_f32(const float* q, const float* k_cache, const float* v_cache,
                                   const int64_t* block_tables, const int64_t* query_starts,
                                   const int64_t* query_lens, const int64_t* context_lens, float* out,
                                   int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                   int64_t block_size, int64_t max_blocks, int64_t window) {
  if (block_size < 1 || kv_heads < 1 || heads % kv_heads != 0 || window < 1) return 1;
  const Shape shape{heads, kv_heads, dim, block_size, max_blocks, window};
  switch (dim) {
    case 64:
      paged_attention<64>(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out, num_seqs,
                          shape);
      break;
    case 128:
      paged_attention<128>(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out, num_seqs,
                           shape);
      break;
    default:
      paged_attention<0>(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out, num_seqs,
                         shape);
  }
  return 0;
}
