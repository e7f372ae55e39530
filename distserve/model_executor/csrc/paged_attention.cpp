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
//
// Queries and the output are float32 or bfloat16 (`Element`); queries come through their strides,
// and are scaled and widened to float32 once per task. The cache (`Cache`) holds the same type, or
// 8-bit codes (int8, or fp8 e4m3) with each row's float32 scale after its `dim` codes (a row: one
// token's K or V for one KV head; distserve/core/kv_cache_dtype.py): a key's score is its codes'
// dot product times its scale, a value's weight its softmax weight times its scale. Every product
// and sum is float32: a bfloat16 value widens exactly, by a 16-bit shift, which vectorises like a
// load; an int8 code by a sign extension and a conversion; an fp8 code by a 256-entry table.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // query tokens of a prompt tile: one per SIMD lane (16 floats: one AVX-512 register)

struct Shape {
  int64_t heads, kv_heads, dim, block_size, max_blocks, window;
  int64_t head_stride;                    // cache elements between a slot's KV heads: dim, or dim + 4 (8-bit)
  int64_t q_token_stride, q_head_stride;  // elements between a query row's tokens, and its heads
  float scale;                            // the queries' softmax scale
};

struct bf16 {
  uint16_t bits;
};

inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t bits = uint32_t{x.bits} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct fp8 {  // e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
  uint8_t bits;
};

std::array<float, 256> fp8_table() {
  std::array<float, 256> table{};
  for (int bits = 0; bits < 256; ++bits) {
    const int exponent = (bits >> 3) & 15, mantissa = bits & 7;
    float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                    : std::ldexp(1.f + mantissa / 8.f, exponent - 7);
    if (exponent == 15 && mantissa == 7) magnitude = std::numeric_limits<float>::quiet_NaN();
    table[bits] = bits & 128 ? -magnitude : magnitude;
  }
  return table;
}
const std::array<float, 256> kFp8 = fp8_table();

inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(fp8 x) { return kFp8[x.bits]; }

// Whether a cache element type is an 8-bit code, with a float32 scale after each row's codes.
template <typename Cache>
constexpr bool kScaled = std::is_same_v<Cache, int8_t> || std::is_same_v<Cache, fp8>;

// The scale of the row whose codes start at `row`: 1 for a cache of plain values.
template <typename Cache>
inline float row_scale(const Cache* row, int64_t dim) {
  if constexpr (kScaled<Cache>) {
    float scale;
    std::memcpy(&scale, row + dim, sizeof scale);
    return scale;
  } else {
    return 1.f;
  }
}

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, bf16* out) {  // round to nearest even (outputs are finite)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  out->bits = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Per-thread working memory, sized once per call.
struct Scratch {
  std::vector<float> scores, acc, maxes, sums, queries, rows;
  explicit Scratch(const Shape& s)
      : scores(s.heads * s.block_size * kLanes),
        acc(s.heads * kLanes * s.dim),
        maxes(s.heads * kLanes),
        sums(s.heads * kLanes),
        queries(s.heads * s.dim * kLanes),
        rows(s.block_size * s.dim) {}
};

// A decoding token's scores over a block's keys and its weighted values, the two loops of decode.
// Written with AVX-512 intrinsics where the compiler targets it, for head sizes that are a
// multiple of 32: each key's products summed lane-wise in two independent accumulators, and the
// horizontal sums of 16 keys at once by one transposing reduction (45 instructions for 16 keys,
// against about 8 a key summed one by one: 0.049 against 0.056 ms a layer for 4 sequences of 256
// tokens in cache, one thread, bfloat16; from memory, the reads bound it either way); a head's value
// accumulator held in registers across a block's keys. In bfloat16, with AVX-512 BF16, the products are of bfloat16 pairs in one
// instruction (vdpbf16ps, float32 sums) on the query as it came, scaled after. Elsewhere, plain
// loops the compiler vectorises.
template <int64_t DIM>
constexpr bool kVectorised =
#if defined(__AVX512F__)
    DIM > 0 && DIM % 32 == 0;
#else
    false;
#endif

// Whether scores come from the unscaled query, to be scaled after (vdpbf16ps takes bfloat16 only).
template <typename Element>
constexpr bool kScaledAfter =
#if defined(__AVX512BF16__)
    std::is_same_v<Element, bf16>;
#else
    false;
#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// An e4m3 code's exponent and mantissa bits moved to a float32's places make a float32 2^120
// times smaller (the exponent biases: 127 against 7), which a multiply puts right; subnormal
// codes become float32 subnormals, exact too (the process does not flush them: see cpu_kernel.py).
// Widened by a gather from the 256-entry table, once per query head, a decode step over fp8 took
// 12.3 ms where bfloat16 took 1.6 (8 sequences of 1,024 tokens, 32 heads over 8 KV heads of 128,
// 2 threads); this way, once per KV head, 2.2 ms.
inline __m512 load16(const fp8* p) {
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x7f)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)), 24);
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

// q·k lane-wise: 16 partial sums whose total is the dot product. `q` the scaled float32 query
// head, `raw` the same head as it came.
template <int64_t DIM, typename Element, typename Cache>
inline __m512 key_partials(const float* q, const Element* raw, const Cache* k) {
#if defined(__AVX512BF16__)
  if constexpr (kScaledAfter<Element> && std::is_same_v<Element, Cache>) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < DIM; d += 32) {
      const __m512bh qd = (__m512bh)_mm512_loadu_si512(raw + d), kd = (__m512bh)_mm512_loadu_si512(k + d);
      sum = _mm512_dpbf16_ps(sum, qd, kd);
    }
    return sum;
  }
#endif
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  for (int64_t d = 0; d < DIM; d += 32) {
    even = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), even);
    odd = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), load16(k + d + 16), odd);
  }
  return _mm512_add_ps(even, odd);
}

// Lane t of the result: the sum of the 16 lanes of v[t]. Pairs of vectors are added interleaved,
// halving their count and doubling the sums each lane holds, until one is left.
inline __m512 sum_each(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: v[2i] and v[2i+1], two sums each
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: keys 4i..4i+3, one sum each
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);  // 128-bit lanes 0, 2 / 1, 3
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], kEven),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], kOdd));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], kEven),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, kEven), _mm512_shuffle_f32x4(low, high, kOdd));
}
#endif

// s[t] = q·k_t for the keys first..last of a block, k_t at kh + t * row (times its scale in an
// 8-bit cache).
template <int64_t DIM, typename Element, typename Cache>
inline void key_scores(const float* q, const Element* raw, const Cache* kh, int64_t row, int64_t first,
                       int64_t last, float scale, int64_t dim, float* s) {
#if defined(__AVX512F__)
  if constexpr (kVectorised<DIM>) {
    for (int64_t t0 = first; t0 <= last; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, last - t0 + 1);
      __m512 partials[16];
      for (int64_t i = 0; i < 16; ++i)
        partials[i] = i < n ? key_partials<DIM>(q, raw, kh + (t0 + i) * row) : _mm512_setzero_ps();
      __m512 sums = sum_each(partials);
      if constexpr (kScaledAfter<Element> && std::is_same_v<Element, Cache>)
        sums = _mm512_mul_ps(sums, _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(s + t0, static_cast<__mmask16>((1u << n) - 1), sums);
    }
  } else
#endif
  {
    for (int64_t t = first; t <= last; ++t) {
      const Cache* k = kh + t * row;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += q[d] * widen(k[d]);
      s[t] = dot;
    }
  }
  if constexpr (kScaled<Cache>)
    for (int64_t t = first; t <= last; ++t) s[t] *= row_scale(kh + t * row, dim);
}

// acc[d] += p[t] * v_t[d] for the keys first..last of a block, v_t at vh + t * row (p[t] times
// its scale in an 8-bit cache).
template <int64_t DIM, typename Cache>
inline void add_weighted_values(float* acc, const float* p, const Cache* vh, int64_t row, int64_t first,
                                int64_t last, int64_t dim) {
#if defined(__AVX512F__)
  if constexpr (kVectorised<DIM>) {
    __m512 a[DIM / 16];
    for (int64_t c = 0; c < DIM / 16; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t t = first; t <= last; ++t) {
      const Cache* v = vh + t * row;
      const __m512 weight = _mm512_set1_ps(p[t] * row_scale(v, dim));
      for (int64_t c = 0; c < DIM / 16; ++c) a[c] = _mm512_fmadd_ps(weight, load16(v + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < DIM / 16; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#endif
  for (int64_t t = first; t <= last; ++t) {
    const Cache* v = vh + t * row;
    const float weight = p[t] * row_scale(v, dim);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += weight * widen(v[d]);
  }
}

// Part `part` of `parts` of a block's K or V (`elements` values) fetched into the L2 cache. A
// decoding token reads each row of a block a head at a time, a few cache lines a stride apart, and
// waits for memory on every head unless the block is already on its way: the block after next is
// fetched a head's share at a time, spread over the work on this one (and, when a task starts,
// the one after its first, whole). Decode over 32 sequences of 162 tokens, caches cold, one thread,
// bfloat16: 0.95 ms a layer against 1.31 ms fetching the next block at once, and 1.6 ms without.
template <typename Element>
inline void prefetch_part(const Element* block, int64_t elements, int64_t part, int64_t parts) {
  const char* bytes = reinterpret_cast<const char*>(block);
  const int64_t size = elements * int64_t{sizeof(Element)}, begin = size * part / parts, end = size * (part + 1) / parts;
  for (int64_t byte = begin; byte < end; byte += 64) __builtin_prefetch(bytes + byte, 0, 2);
}

// The rows first..last of a block's KV head in an 8-bit cache (row t at head + t * row), widened
// and times their scales, into out[t][dim]: a decoding token's query heads that share a KV head
// read these, so each code is widened once, not once per query head (without grouped heads the
// codes are read in place: the copy would only add a pass). On this project's 2-core
// Zen 4 a decode step's attention is bound by arithmetic, not memory, even in bfloat16: reading
// half the bytes, int8 took 1.05-1.35x bfloat16's time (8 sequences of 1,024 and 4,096 tokens, 32
// query heads over 8 KV heads of 128, 2 threads), and 0.55-0.7x that of a float32 cache.
template <typename Cache>
inline void scaled_rows(const Cache* head, int64_t row, int64_t first, int64_t last, int64_t dim, float* out) {
  for (int64_t t = first; t <= last; ++t) {
    const Cache* codes = head + t * row;
    const float scale = row_scale(codes, dim);
    float* o = out + t * dim;
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 scales = _mm512_set1_ps(scale);
    for (; d + 16 <= dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(load16(codes + d), scales));
#endif
    for (; d < dim; ++d) o[d] = widen(codes[d]) * scale;
  }
}

// Query token `m` of a task (its first at `q`), head by head, scaled, as float32 into `out` [heads][dim].
template <typename Element>
void load_query(const Element* q, int64_t m, const Shape& shape, float* out) {
  for (int64_t h = 0; h < shape.heads; ++h) {
    const Element* qh = q + m * shape.q_token_stride + h * shape.q_head_stride;
    for (int64_t d = 0; d < shape.dim; ++d) out[h * shape.dim + d] = widen(qh[d]) * shape.scale;
  }
}

// One query token (a decoding sequence) at `position`. Per block, for every head: the scores of
// the block's tokens (a dot product each), then the online softmax, then the weighted values.
template <int64_t DIM, typename Element, typename Cache>
void attend_token(const Element* query, Element* out, const Cache* k_cache, const Cache* v_cache,
                  const int64_t* table, int64_t position, const Shape& shape, Scratch& w) {
  const int64_t dim = DIM > 0 ? DIM : shape.dim, heads = shape.heads, block_size = shape.block_size;
  const int64_t group = heads / shape.kv_heads, stride = shape.head_stride, row = shape.kv_heads * stride;
  const int64_t start = std::max<int64_t>(position - shape.window + 1, 0);
  float *scores = w.scores.data(), *acc = w.acc.data(), *maxes = w.maxes.data(), *sums = w.sums.data();
  float* q = w.queries.data();  // [heads][dim]
  float* rows = w.rows.data();  // an 8-bit cache's rows of one KV head of a block, as float32 [block][dim]
  load_query(query, 0, shape, q);
  std::fill(acc, acc + heads * dim, 0.f);
  std::fill(maxes, maxes + heads, std::numeric_limits<float>::lowest());
  std::fill(sums, sums + heads, 0.f);
  for (int64_t j = start / block_size; j <= position / block_size; ++j) {
    const int64_t base = j * block_size;  // position of the block's first token
    const int64_t first = std::max(start - base, int64_t{0});
    const int64_t last = std::min(position - base, block_size - 1);
    const int64_t elements = block_size * row, last_block = position / block_size;
    const Cache* k_block = k_cache + table[j] * elements;
    const Cache* v_block = v_cache + table[j] * elements;
    if (j == start / block_size && j + 1 <= last_block) {
      prefetch_part(k_cache + table[j + 1] * elements, elements, 0, 1);
      prefetch_part(v_cache + table[j + 1] * elements, elements, 0, 1);
    }
    const bool fetch = j + 2 <= last_block;
    const Cache* k_later = fetch ? k_cache + table[j + 2] * elements : nullptr;
    const Cache* v_later = fetch ? v_cache + table[j + 2] * elements : nullptr;
    for (int64_t h = 0; h < heads; ++h) {  // scores
      const float* qh = q + h * dim;
      const Element* raw = query + h * shape.q_head_stride;
      const Cache* kh = k_block + (h / group) * stride;
      float* s = scores + h * block_size;
      if (kScaled<Cache> && group > 1) {  // the KV head's keys widened and scaled once, for its group
        if (h % group == 0) scaled_rows(kh, row, first, last, dim, rows);
        key_scores<DIM>(qh, raw, rows, dim, first, last, shape.scale, dim, s);
      } else {
        key_scores<DIM>(qh, raw, kh, row, first, last, shape.scale, dim, s);
      }
      if (fetch) prefetch_part(k_later, elements, h, heads);
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
      const Cache* vh = v_block + (h / group) * stride;
      if (kScaled<Cache> && group > 1) {
        if (h % group == 0) scaled_rows(vh, row, first, last, dim, rows);
        add_weighted_values<DIM>(acc + h * dim, scores + h * block_size, rows, dim, first, last, dim);
      } else {
        add_weighted_values<DIM>(acc + h * dim, scores + h * block_size, vh, row, first, last, dim);
      }
      if (fetch) prefetch_part(v_later, elements, h, heads);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = 1.f / sums[h];
    for (int64_t d = 0; d < dim; ++d) narrow(acc[h * dim + d] * inverse, out + h * dim + d);
  }
}

// A key's scores for every lane, times its scale (1 for plain values).
inline void store_scores(const float* lanes, float scale, float* out) {
#pragma omp simd
  for (int64_t m = 0; m < kLanes; ++m) out[m] = lanes[m] * scale;
}

// Up to kLanes consecutive query tokens of a prompt, the first at `first_position`, one per SIMD
// lane: a dot product per score would end in a horizontal sum, so the queries are transposed once
// (each head's [dim][lane]) and a key's scores for every lane come from one broadcast and
// multiply-add per dimension, four keys at a time (independent chains). The softmax is vectorised
// over lanes too; a lane's causal and window limits are a mask on its scores.
template <int64_t DIM, typename Element, typename Cache>
void attend_tile(const Element* q, Element* out, const Cache* k_cache, const Cache* v_cache,
                 const int64_t* table, int64_t count, int64_t first_position, const Shape& shape, Scratch& w) {
  const int64_t dim = DIM > 0 ? DIM : shape.dim, heads = shape.heads, block_size = shape.block_size;
  const int64_t group = heads / shape.kv_heads, stride = shape.head_stride, row = shape.kv_heads * stride;
  const int64_t last_position = first_position + count - 1;
  const int64_t start = std::max<int64_t>(first_position - shape.window + 1, 0);
  float *scores = w.scores.data(), *acc = w.acc.data(), *maxes = w.maxes.data(), *sums = w.sums.data();
  float* queries = w.queries.data();  // [heads][dim][lane]
  float* token = w.acc.data();        // one token's [heads][dim], before acc is cleared below
  std::fill(w.queries.begin(), w.queries.end(), 0.f);
  for (int64_t m = 0; m < count; ++m) {
    load_query(q, m, shape, token);
    for (int64_t hd = 0; hd < heads * dim; ++hd) queries[hd * kLanes + m] = token[hd];
  }
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
    const Cache* k_block = k_cache + table[j] * block_size * row;
    const Cache* v_block = v_cache + table[j] * block_size * row;
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = queries + h * dim * kLanes;
      const Cache* kh = k_block + (h / group) * stride;
      float* s = scores + h * block_size * kLanes;  // [token][lane]
      int64_t t = first;
      for (; t + 3 <= last; t += 4) {  // scores of four keys at once
        float s0[kLanes] = {}, s1[kLanes] = {}, s2[kLanes] = {}, s3[kLanes] = {};
        const Cache *k0 = kh + t * row, *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
        for (int64_t d = 0; d < dim; ++d) {
          const float* qd = qh + d * kLanes;
          const float x0 = widen(k0[d]), x1 = widen(k1[d]), x2 = widen(k2[d]), x3 = widen(k3[d]);
#pragma omp simd
          for (int64_t m = 0; m < kLanes; ++m) {
            s0[m] += x0 * qd[m];
            s1[m] += x1 * qd[m];
            s2[m] += x2 * qd[m];
            s3[m] += x3 * qd[m];
          }
        }
        store_scores(s0, row_scale(k0, dim), s + t * kLanes);
        store_scores(s1, row_scale(k1, dim), s + (t + 1) * kLanes);
        store_scores(s2, row_scale(k2, dim), s + (t + 2) * kLanes);
        store_scores(s3, row_scale(k3, dim), s + (t + 3) * kLanes);
      }
      for (; t <= last; ++t) {
        float s0[kLanes] = {};
        const Cache* k0 = kh + t * row;
        for (int64_t d = 0; d < dim; ++d) {
          const float* qd = qh + d * kLanes;
          const float x0 = widen(k0[d]);
#pragma omp simd
          for (int64_t m = 0; m < kLanes; ++m) s0[m] += x0 * qd[m];
        }
        store_scores(s0, row_scale(k0, dim), s + t * kLanes);
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
      const Cache* vh = v_block + (h / group) * stride;
      for (int64_t m = 0; m < count; ++m) {
        float* acc_m = acc + (h * kLanes + m) * dim;
        float local[DIM > 0 ? DIM : 1];
        float* a = DIM > 0 ? local : acc_m;
        const float r = rescale[m];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] = acc_m[d] * r;
        for (int64_t t = first; t <= last; ++t) {
          const Cache* v = vh + t * row;
          const float weight = s[t * kLanes + m] * row_scale(v, dim);
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += weight * widen(v[d]);
        }
        if (DIM > 0) std::copy(a, a + dim, acc_m);
      }
    }
  }
  for (int64_t m = 0; m < count; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      const float inverse = 1.f / sums[h * kLanes + m];
      const float* a = acc + (h * kLanes + m) * dim;
      for (int64_t d = 0; d < dim; ++d) narrow(a[d] * inverse, out + (m * heads + h) * dim + d);
    }
}

template <int64_t DIM, typename Element, typename Cache>
void paged_attention(const Element* q, const Cache* k_cache, const Cache* v_cache, const int64_t* block_tables,
                     const int64_t* query_starts, const int64_t* query_lens, const int64_t* context_lens,
                     Element* out, int64_t num_seqs, const Shape& shape) {
  const int64_t token_elements = shape.heads * shape.dim;
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
      const Element* query = q + row * shape.q_token_stride;
      if (query_lens[seq] == 1)
        attend_token<DIM>(query, out + row * token_elements, k_cache, v_cache, table, first_position, shape, scratch);
      else
        attend_tile<DIM>(query, out + row * token_elements, k_cache, v_cache, table, count, first_position, shape,
                         scratch);
    }
  }
}

template <typename Element, typename Cache>
int run(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
        const int64_t* query_starts, const int64_t* query_lens, const int64_t* context_lens, void* out,
        int64_t num_seqs, const Shape& shape) {
  if (shape.block_size < 1 || shape.kv_heads < 1 || shape.heads % shape.kv_heads != 0 || shape.window < 1) return 1;
  const auto* qe = static_cast<const Element*>(q);
  const auto *k = static_cast<const Cache*>(k_cache), *v = static_cast<const Cache*>(v_cache);
  auto* o = static_cast<Element*>(out);
  switch (shape.dim) {
    case 64:
      paged_attention<64>(qe, k, v, block_tables, query_starts, query_lens, context_lens, o, num_seqs, shape);
      break;
    case 128:
      paged_attention<128>(qe, k, v, block_tables, query_starts, query_lens, context_lens, o, num_seqs, shape);
      break;
    default:
      paged_attention<0>(qe, k, v, block_tables, query_starts, query_lens, context_lens, o, num_seqs, shape);
  }
  return 0;
}

}  // namespace

// q [tokens, heads, dim] through its strides (unscaled) and out [tokens, heads, dim], contiguous:
// float32, or bfloat16 when `bfloat16` is non-zero. K/V caches [slots, kv_heads, dim] of the same
// type (`cache` 0), or [slots, kv_heads, dim + 4] of int8 (`cache` 1) or fp8 e4m3 (`cache` 2) codes,
// each row's float32 scale in its last 4 bytes; contiguous. block_tables [num_seqs, max_blocks].
// Sequence s owns query tokens query_starts[s] .. + query_lens[s], the last of its context_lens[s]
// positions; each attends to the positions up to its own within the last `window`. Returns 0, or 1
// for shapes or types the kernel does not take.
extern "C" int paged_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                               const int64_t* query_starts, const int64_t* query_lens, const int64_t* context_lens,
                               void* out, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                               int64_t block_size, int64_t max_blocks, int64_t window, int64_t q_token_stride,
                               int64_t q_head_stride, float scale, int bfloat16, int cache) {
  const int64_t head_stride = cache == 0 ? dim : dim + 4;
  const Shape shape{heads,       kv_heads,       dim,           block_size, max_blocks, window,
                    head_stride, q_token_stride, q_head_stride, scale};
  using Run = int (*)(const void*, const void*, const void*, const int64_t*, const int64_t*, const int64_t*,
                      const int64_t*, void*, int64_t, const Shape&);
  constexpr Run runs[2][3] = {{run<float, float>, run<float, int8_t>, run<float, fp8>},
                              {run<bf16, bf16>, run<bf16, int8_t>, run<bf16, fp8>}};
  if (cache < 0 || cache > 2) return 1;
  return runs[bfloat16 ? 1 : 0][cache](q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out,
                                        num_seqs, shape);
}
