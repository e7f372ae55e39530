// Decode attention over a paged KV cache, read in place: one query token per sequence over the
// context its block table points to. Built by distserve/model_executor/cpu_kernel.py with the
// host's compiler and called through ctypes.
//
// One task per sequence, spread over the OpenMP threads torch uses (the process has one OpenMP
// runtime, torch's, so torch.set_num_threads applies here too). A task walks its blocks once: per
// block, the scores of its tokens for every query head, then an online softmax (a running maximum
// and sum; the accumulator is rescaled when the maximum grows), then the weighted values. K and V
// are each read once from memory, where they sit; a block's rows stay in cache for the query
// heads that share a KV head. Each phase runs over all heads before the next: measured 10-15%
// faster than all three phases head by head. Every value stays finite (the running maximum starts
// at the lowest float, not -inf), so the kernel may be built with -ffast-math, which vectorises exp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxBlockSize = 256;

// DIM > 0: the head size as a constant, so that a head's accumulator lives in registers.
template <int64_t DIM>
void paged_decode(const float* q, const float* k_cache, const float* v_cache, const int64_t* block_tables,
                  const int64_t* positions, const int64_t* oldest, float* out, int64_t batch, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks) {
  const int64_t dim = DIM > 0 ? DIM : head_dim;
  const int64_t group = heads / kv_heads;  // query heads per KV head
  const int64_t row = kv_heads * dim;      // floats per cache slot
#pragma omp parallel
  {
    std::vector<float> scores(heads * kMaxBlockSize), acc(heads * dim), maxes(heads), sums(heads);
#pragma omp for schedule(dynamic)
    for (int64_t seq = 0; seq < batch; ++seq) {
      const float* q_seq = q + seq * heads * dim;
      const int64_t* table = block_tables + seq * max_blocks;
      const int64_t position = positions[seq], start = std::max<int64_t>(oldest[seq], 0);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(maxes.begin(), maxes.end(), std::numeric_limits<float>::lowest());
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t j = start / block_size; j <= position / block_size; ++j) {
        const int64_t base = j * block_size;  // position of the block's first token
        const int64_t first = std::max(start - base, int64_t{0});
        const int64_t last = std::min(position - base, block_size - 1);
        const float* k_block = k_cache + table[j] * block_size * row;
        const float* v_block = v_cache + table[j] * block_size * row;
        for (int64_t h = 0; h < heads; ++h) {  // scores
          const float* qh = q_seq + h * dim;
          const float* kh = k_block + (h / group) * dim;
          float* s = scores.data() + h * kMaxBlockSize;
          for (int64_t t = first; t <= last; ++t) {
            const float* k = kh + t * row;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qh[d] * k[d];
            s[t] = dot;
          }
        }
        for (int64_t h = 0; h < heads; ++h) {  // softmax weights, the running maximum and sum
          float* s = scores.data() + h * kMaxBlockSize;
          float block_max = maxes[h];
          for (int64_t t = first; t <= last; ++t) block_max = std::max(block_max, s[t]);
          if (block_max > maxes[h]) {  // rescale what is summed so far to the new maximum
            const float rescale = std::exp(maxes[h] - block_max);
            sums[h] *= rescale;
            float* a = acc.data() + h * dim;
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
          const float* p = scores.data() + h * kMaxBlockSize;
          const float* vh = v_block + (h / group) * dim;
          float* acc_h = acc.data() + h * dim;
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
      float* o = out + seq * heads * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float inverse = 1.f / sums[h];
        for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = acc[h * dim + d] * inverse;
      }
    }
  }
}

}  // namespace

// q [batch, heads, dim] (already scaled); K/V caches [slots, kv_heads, dim]; block_tables
// [batch, max_blocks]; each sequence sees its positions oldest..position. Returns 0, or 1 for
// shapes the kernel does not take.
extern "C" int paged_decode_f32(const float* q, const float* k_cache, const float* v_cache,
                                const int64_t* block_tables, const int64_t* positions, const int64_t* oldest,
                                float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                int64_t block_size, int64_t max_blocks) {
  if (block_size > kMaxBlockSize || block_size < 1 || kv_heads < 1 || heads % kv_heads != 0) return 1;
  switch (dim) {
    case 64:
      paged_decode<64>(q, k_cache, v_cache, block_tables, positions, oldest, out, batch, heads, kv_heads, dim,
                       block_size, max_blocks);
      break;
    case 128:
      paged_decode<128>(q, k_cache, v_cache, block_tables, positions, oldest, out, batch, heads, kv_heads, dim,
                        block_size, max_blocks);
      break;
    default:
      paged_decode<0>(q, k_cache, v_cache, block_tables, positions, oldest, out, batch, heads, kv_heads, dim,
                      block_size, max_blocks);
  }
  return 0;
}
