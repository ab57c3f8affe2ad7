// Decode attention read straight from the paged KV pool, for CPU (backfill/engine/paged_attention.py).
//
// One query token per sequence. A task is one (sequence, KV head, stretch of the context): it walks
// that stretch of the block table, reads each key and value row once where it lies in the pool (no
// gathered copy), and keeps a running softmax over it (the online softmax of FlashAttention) for
// all the query heads that share the KV head. When the batch has too few (sequence, head) pairs to
// keep every thread busy, each context is cut into stretches and their partial softmaxes merged
// afterwards (flash-decoding). Tasks run on PyTorch's own intra-op thread pool.
//
// The arithmetic is written on ATen's Vectorized<float> (AVX-512 / AVX2 / scalar, chosen at build
// time by the CPU_CAPABILITY macros the loader passes): rows are converted to fp32 a vector at a
// time, a block's scores are exponentiated together with ATen's fast vector exp, and the value rows
// are accumulated with fused multiply-adds. Written as plain loops, the scalar exp per score and
// per-element conversions made this kernel compute-bound at a few GB/s.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "balanced_for.h"
#include "tile_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Fewest shared leading blocks for which a group of sequences reads its prefix once (below).
constexpr int64_t kMinSharedBlocks = 2;
// Shared blocks go kSharedRowVecs vectors of query rows by kSharedTokens keys (or head dims) at a
// time in registers (shared_block_rows): on AVX-512's 32 registers 2 x 8 accumulators, on AVX2's 16
// 3 x 4, with the operands they share beside them (3 x 4 measured fastest on AVX2; a loop with its
// counts fixed at run time kept the accumulators in memory).
constexpr int64_t kSharedRowVecs = kLanes >= 16 ? 2 : 3;
constexpr int64_t kSharedTokens = kLanes >= 16 ? 8 : 4;

// v, held in a register: the empty asm hides its value from the compiler, which can then no longer
// fold the load into each fused multiply-add that reads it. Where a loop reads one operand vector
// from several of them, GCC folds it on AVX2 to spare a register, and the loop then issues a load
// per multiply-add (16 loads for 12 FMAs in shared_block_rows: load-bound, not FMA-bound).
inline Vec in_register(const Vec& v) {
#if defined(__GNUC__) && defined(CPU_CAPABILITY_AVX512)
  __m512 raw = v;
  asm("" : "+v"(raw));
  return raw;
#elif defined(__GNUC__) && defined(CPU_CAPABILITY_AVX2)
  __m256 raw = v;
  asm("" : "+x"(raw));
  return raw;
#else
  return v;
#endif
}

// n <= kLanes elements of a row, as fp32 lanes (the rest zero).
inline Vec load_float(const float* src, int64_t n) { return n == kLanes ? Vec::loadu(src) : Vec::loadu(src, n); }

template <typename Reduced>
inline Vec load_reduced(const Reduced* src, int64_t n) {
  if (n == kLanes) {
    Vec out;
    if constexpr (std::is_same_v<Reduced, c10::BFloat16>) at::vec::load_fp32_from_bf16(src, out);
    else at::vec::load_fp32_from_fp16(src, out);
    return out;
  }
  float tail[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tail[i] = static_cast<float>(src[i]);
  return Vec::loadu(tail);
}
inline Vec load_float(const c10::BFloat16* src, int64_t n) { return load_reduced(src, n); }
inline Vec load_float(const c10::Half* src, int64_t n) { return load_reduced(src, n); }

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// out[u] = the sum of the 8 lanes of h[u]: three horizontal adds leave each vector's sum split over
// the two 128-bit halves, and one add across them gives all four.
inline void sum_lanes4_of_8(const __m256* h, float* out) {
  const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
}
#endif

// out[u] = the sum of the lanes of v[u], for four vectors at once: 13 instructions for the four
// sums on AVX-512, against about 8 for each one alone.
inline void sum_lanes4(const Vec* v, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256 half[4];  // each folded to 8 lanes
  for (int u = 0; u < 4; ++u) {
    const __m512 x = v[u];
    half[u] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  }
  sum_lanes4_of_8(half, out);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 rows[4] = {v[0], v[1], v[2], v[3]};
  sum_lanes4_of_8(rows, out);
#else
  for (int u = 0; u < 4; ++u) out[u] = sum_lanes(v[u]);
#endif
}

// A running softmax over part of one (sequence, KV head)'s context, for its `group` query heads:
// the maximum score seen, the sum of exp(score - max), and sum of exp(score - max) * value.
struct Partial {
  float* max;  // [group]
  float* sum;  // [group]
  float* acc;  // [group * head_dim]
};

struct Shape {
  int64_t n_q, n_kv, group, head_dim, block_size, width;
  int64_t q_stride;  // elements from one sequence's queries to the next's (a slice of a q/k/v product)
};

// Scratch of one thread: the group's scaled queries in fp32, one block's scores [group][block] and
// its value rows in fp32 [block][head_dim].
struct Scratch {
  std::vector<float> query, scores, values;
  int64_t padded_block;
  explicit Scratch(const Shape& s)
      : query(s.group * s.head_dim), values(s.block_size * s.head_dim),
        padded_block((s.block_size + kLanes - 1) / kLanes * kLanes) {
    scores.resize(s.group * padded_block);
  }
};

// Ask for the next block's rows of one KV head while this block is computed. Blocks lie wherever
// the pool handed them out, so the hardware prefetcher cannot guess the next one: without this,
// each block began with a wait on memory and the kernel read the pool at 11-13 GB/s in a real
// decode step, against 45 GB/s for a streaming read.
template <typename T>
inline void prefetch_block(const Shape& s, const T* k_pool, const T* v_pool, int64_t block, int64_t head,
                           int64_t hd) {
  const int64_t token_stride = s.n_kv * hd, row_bytes = hd * static_cast<int64_t>(sizeof(T));
  const T* keys = k_pool + (block * s.block_size * s.n_kv + head) * hd;
  const T* values = v_pool + (block * s.block_size * s.n_kv + head) * hd;
  for (int64_t t = 0; t < s.block_size; ++t)
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(keys + t * token_stride) + byte);
      __builtin_prefetch(reinterpret_cast<const char*>(values + t * token_stride) + byte);
    }
}

template <typename T>
inline void prefetch_row(const T* row, int64_t hd) {
  for (int64_t byte = 0; byte < hd * static_cast<int64_t>(sizeof(T)); byte += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + byte);
}

// acc[g] += sum over the block's tokens of probs[g][t] * values[t], for kGroup query heads whose
// outputs stay in registers beside one value row, kBlock vectors of head dims at a time (the whole
// head where it fits, as head_dim 64 on AVX-512; else in blocks of at most 12-16 accumulators): each
// row's block is converted once and added to every head. The next block's value rows are asked for
// on the way.
template <typename T, int64_t kGroup, int64_t kChunks>
inline void add_values(const T* values, int64_t token_stride, int64_t tokens, const float* probs, int64_t padded,
                       const T* next_values, float* acc) {
  constexpr int64_t kMaxSums = kLanes >= 16 ? 16 : 12;
  constexpr int64_t kBlock = kGroup * kChunks <= kMaxSums ? kChunks
                             : (kChunks % 4 == 0 && kGroup * 4 <= kMaxSums) ? 4
                             : (kChunks % 2 == 0 && kGroup * 2 <= kMaxSums) ? 2 : 1;
  for (int64_t c0 = 0; c0 < kChunks; c0 += kBlock) {
    Vec sums[kGroup][kBlock];
    for (int64_t g = 0; g < kGroup; ++g)
      for (int64_t c = 0; c < kBlock; ++c) sums[g][c] = Vec::loadu(acc + (g * kChunks + c0 + c) * kLanes);
    for (int64_t t = 0; t < tokens; ++t) {
      if (c0 == 0 && next_values != nullptr) prefetch_row(next_values + t * token_stride, kChunks * kLanes);
      Vec row[kBlock];
      for (int64_t c = 0; c < kBlock; ++c) row[c] = load_float(values + t * token_stride + (c0 + c) * kLanes, kLanes);
      for (int64_t g = 0; g < kGroup; ++g) {
        const Vec p(probs[g * padded + t]);
        for (int64_t c = 0; c < kBlock; ++c) sums[g][c] = at::vec::fmadd(p, row[c], sums[g][c]);
      }
    }
    for (int64_t g = 0; g < kGroup; ++g)
      for (int64_t c = 0; c < kBlock; ++c) sums[g][c].store(acc + (g * kChunks + c0 + c) * kLanes);
  }
}

// Blocks [first, last) of one sequence's table, for one KV head, folded into `part`. kHeadDim > 0
// fixes the head size at compile time (the loops over it unroll and the queries stay in registers).
template <typename T, int64_t kHeadDim>
void attend_blocks(const Shape& s, const T* q, const T* k_pool, const T* v_pool, const int64_t* table,
                   int64_t context, int64_t first, int64_t last, int64_t head, Scratch& scratch, Partial part) {
  const int64_t hd = kHeadDim > 0 ? kHeadDim : s.head_dim, group = s.group, padded = scratch.padded_block;
  const int64_t token_stride = s.n_kv * hd;  // between two tokens of one block, for one head
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* query = scratch.query.data();
  float* scores = scratch.scores.data();
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q + (head * group + g) * hd;
    for (int64_t d = 0; d < hd; d += kLanes) {
      const int64_t n = std::min(kLanes, hd - d);
      (load_float(qg + d, n) * Vec(scale)).store(query + g * hd + d, n);
    }
    part.max[g] = kNegInf;
    part.sum[g] = 0.0f;
    std::fill(part.acc + g * hd, part.acc + (g + 1) * hd, 0.0f);
  }
  for (int64_t j = first; j < last; ++j) {
    const int64_t block = table[j];
    const int64_t tokens = std::min(s.block_size, context - j * s.block_size);
    const T* keys = k_pool + (block * s.block_size * s.n_kv + head) * hd;
    const T* values = v_pool + (block * s.block_size * s.n_kv + head) * hd;
    // The next block's rows are asked for a token at a time beside this block's work: issued all at
    // once, the prefetches filled the line fill buffers and stalled the loop behind them.
    const T* next_keys = j + 1 < last ? k_pool + (table[j + 1] * s.block_size * s.n_kv + head) * hd : nullptr;
    const T* next_values = j + 1 < last ? v_pool + (table[j + 1] * s.block_size * s.n_kv + head) * hd : nullptr;
    // Scores of the block: each key row is converted once and dotted with every query of the group.
    int64_t t = 0;
    if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
      // Four tokens at a time, their four dot products summed across lanes together (the sums cost
      // as much as the products); their rows stay in registers across the group where they fit.
      constexpr int64_t kChunks = kHeadDim / kLanes;
      if constexpr (kChunks > 4) {
        // Four rows of more than four vectors each do not fit in registers beside the dot products
        // (AVX2's 16, or head_dim 128 on AVX-512's 32): each query chunk is loaded once and dotted
        // with the four rows' chunks where they lie.
        for (; t + 4 <= tokens; t += 4) {
          if (next_keys != nullptr)
            for (int64_t u = 0; u < 4; ++u) prefetch_row(next_keys + (t + u) * token_stride, hd);
          for (int64_t g = 0; g < group; ++g) {
            Vec dots[4] = {Vec(0.0f), Vec(0.0f), Vec(0.0f), Vec(0.0f)};
            for (int64_t c = 0; c < kChunks; ++c) {
              const Vec qc = Vec::loadu(query + g * hd + c * kLanes);
              for (int64_t u = 0; u < 4; ++u)
                dots[u] = at::vec::fmadd(qc, load_float(keys + (t + u) * token_stride + c * kLanes, kLanes), dots[u]);
            }
            sum_lanes4(dots, scores + g * padded + t);
          }
        }
      }
      for (; t + 4 <= tokens; t += 4) {  // rows of at most four vectors (head_dim 64 on AVX-512)
        Vec rows4[4][kChunks];
        if (next_keys != nullptr)
          for (int64_t u = 0; u < 4; ++u) prefetch_row(next_keys + (t + u) * token_stride, hd);
        for (int64_t u = 0; u < 4; ++u)
          for (int64_t c = 0; c < kChunks; ++c) rows4[u][c] = load_float(keys + (t + u) * token_stride + c * kLanes, kLanes);
        for (int64_t g = 0; g < group; ++g) {
          Vec dots[4];
          for (int64_t u = 0; u < 4; ++u) {
            dots[u] = Vec(0.0f);
            for (int64_t c = 0; c < kChunks; ++c)
              dots[u] = at::vec::fmadd(Vec::loadu(query + g * hd + c * kLanes), rows4[u][c], dots[u]);
          }
          sum_lanes4(dots, scores + g * padded + t);
        }
      }
    }
    for (; t < tokens; ++t) {
      const T* key = keys + t * token_stride;
      if (next_keys != nullptr) prefetch_row(next_keys + t * token_stride, hd);
      for (int64_t g = 0; g < group; ++g) {
        Vec dot(0.0f);
        for (int64_t d = 0; d < hd; d += kLanes) {
          const int64_t n = std::min(kLanes, hd - d);
          dot = at::vec::fmadd(load_float(query + g * hd + d, n), load_float(key + d, n), dot);
        }
        scores[g * padded + t] = sum_lanes(dot);
      }
    }
    // Softmax of the block against the running one: positions past the context score -inf.
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * padded;
      std::fill(sg + tokens, sg + padded, kNegInf);
      Vec block_max(kNegInf);
      for (int64_t t = 0; t < padded; t += kLanes) block_max = at::vec::maximum(block_max, Vec::loadu(sg + t));
      const float new_max = std::max(part.max[g], at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, block_max));
      if (new_max > part.max[g]) {
        const float rescale = std::exp(part.max[g] - new_max);  // 0 on the first block (-inf)
        part.sum[g] *= rescale;
        for (int64_t d = 0; d < hd; d += kLanes) {
          const int64_t n = std::min(kLanes, hd - d);
          (load_float(part.acc + g * hd + d, n) * Vec(rescale)).store(part.acc + g * hd + d, n);
        }
        part.max[g] = new_max;
      }
      Vec total(0.0f);
      for (int64_t t = 0; t < padded; t += kLanes) {
        const Vec p = (Vec::loadu(sg + t) - Vec(new_max)).exp_u20();
        const Vec kept = Vec::blendv(Vec(0.0f), p, Vec::loadu(sg + t) > Vec(kNegInf));
        kept.store(sg + t);
        total = total + kept;
      }
      part.sum[g] += sum_lanes(total);
    }
    // Values weighted by the probabilities. With the head size and the group fixed at compile time
    // (up to 4 query heads per KV head), each row is converted once and added to all of them, the
    // sums in registers for the whole block (add_values).
    if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
      constexpr int64_t kChunks = kHeadDim / kLanes;
      const T* next = next_values;
      bool done = true;
      switch (group) {  // the group fixed at compile time, so that the sums get registers, not the stack
        case 1: add_values<T, 1, kChunks>(values, token_stride, tokens, scores, padded, next, part.acc); break;
        case 2: add_values<T, 2, kChunks>(values, token_stride, tokens, scores, padded, next, part.acc); break;
        case 3: add_values<T, 3, kChunks>(values, token_stride, tokens, scores, padded, next, part.acc); break;
        case 4: add_values<T, 4, kChunks>(values, token_stride, tokens, scores, padded, next, part.acc); break;
        default: done = false;
      }
      if (done) continue;
    }
    // Otherwise the block's rows are converted to fp32 once, then each chunk of each query head's
    // output sums over the block's tokens in a register (accumulating in memory token by token
    // chained every update through a store and a load).
    float* rows = scratch.values.data();
    for (int64_t t = 0; t < tokens; ++t) {
      if (next_values != nullptr) prefetch_row(next_values + t * token_stride, hd);
      for (int64_t d = 0; d < hd; d += kLanes) {
        const int64_t n = std::min(kLanes, hd - d);
        load_float(values + t * token_stride + d, n).store(rows + t * hd + d, n);
      }
    }
    for (int64_t d = 0; d < hd; d += kLanes) {
      const int64_t n = std::min(kLanes, hd - d);
      for (int64_t g = 0; g < group; ++g) {
        const float* probs = scores + g * padded;
        // Four partial sums: one chain of fused multiply-adds would wait out each one's latency.
        Vec sums[4] = {load_float(part.acc + g * hd + d, n), Vec(0.0f), Vec(0.0f), Vec(0.0f)};
        int64_t t = 0;
        for (; t + 4 <= tokens; t += 4)
          for (int64_t u = 0; u < 4; ++u)
            sums[u] = at::vec::fmadd(Vec(probs[t + u]), load_float(rows + (t + u) * hd + d, n), sums[u]);
        for (; t < tokens; ++t) sums[0] = at::vec::fmadd(Vec(probs[t]), load_float(rows + t * hd + d, n), sums[0]);
        ((sums[0] + sums[1]) + (sums[2] + sums[3])).store(part.acc + g * hd + d, n);
      }
    }
  }
}

// Merge `count` partials of one (sequence, KV head) and write its group's outputs.
template <typename T>
void merge_and_write(const Shape& s, const Partial* parts, int64_t count, T* out) {
  const int64_t hd = s.head_dim;
  float few[16];  // a heap buffer only for many parts: this runs once per (sequence, KV head)
  std::vector<float> many(count > 16 ? count : 0);
  float* weights = count > 16 ? many.data() : few;
  for (int64_t g = 0; g < s.group; ++g) {
    float top = kNegInf;
    for (int64_t i = 0; i < count; ++i) top = std::max(top, parts[i].max[g]);
    float sum = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      weights[i] = parts[i].max[g] == kNegInf ? 0.0f : std::exp(parts[i].max[g] - top);
      sum += weights[i] * parts[i].sum[g];
    }
    // The weighted sum of the parts' outputs a vector of dims at a time, scaled once by 1 / sum.
    const float inverse = 1.0f / sum;
    for (int64_t d = 0; d < hd; d += kLanes) {
      const int64_t n = std::min(kLanes, hd - d);
      Vec value(0.0f);
      for (int64_t i = 0; i < count; ++i) value = at::vec::fmadd(Vec(weights[i] * inverse), load_float(parts[i].acc + g * hd + d, n), value);
      float lanes[kLanes];
      value.store(lanes, n);
      for (int64_t j = 0; j < n; ++j) out[g * hd + d + j] = static_cast<T>(lanes[j]);
    }
  }
}

// How many stretches to cut each context into: enough tasks for every thread, at least a few
// blocks per stretch (merging costs a pass over the group's outputs).
int64_t choose_splits(int64_t pairs, int64_t max_blocks) {
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = (4 * threads + pairs - 1) / pairs;
  return std::max<int64_t>(1, std::min(wanted, max_blocks / 4));
}

// ---- Shared prefixes (cascade attention) -------------------------------------------------------
//
// With prefix caching, sequences that start with the same prompt map the same physical blocks
// (engine/prefix_cache.py). Walked per sequence, a batch of 64 lines sharing a 1,024-token system
// prompt reads those 64 blocks 64 times a layer, and at that context the step is mostly those reads.
// Instead, the sequences whose tables start with the same blocks form a group; one task per (group,
// KV head, stretch of the shared blocks) reads each shared block once and scores it against every
// query row of the group (members x query heads), and each sequence's own blocks after the prefix
// go through attend_blocks as before; the two partial softmaxes merge as split contexts do
// (flash-decoding). With the rows as the vector lanes, scores, the softmax and the value sums are
// all vertical: no sums across lanes, and a key or value element is broadcast to a whole row chunk.

struct PrefixGroup {
  std::vector<int64_t> members;  // sequence indices of the batch
  int64_t shared_blocks;         // leading table entries every member has, each a full block
};

// Groups of sequences whose block tables start with the same blocks. Only full blocks before each
// member's newest token count (that block is the member's own). Among the sequences with the same
// first block, the group keeps the members and prefix length that share the most block reads
// (members x blocks); a member that diverges early runs alone.
std::vector<PrefixGroup> find_prefix_groups(const Shape& s, const int64_t* tables, const int64_t* lens,
                                            int64_t batch, int64_t min_shared_blocks) {
  std::vector<PrefixGroup> groups;
  if (min_shared_blocks <= 0 || batch < 2) return groups;
  std::vector<int64_t> order;
  for (int64_t b = 0; b < batch; ++b)
    if ((lens[b] - 1) / s.block_size >= min_shared_blocks) order.push_back(b);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tables[a * s.width] < tables[b * s.width]; });
  for (size_t begin = 0; begin < order.size();) {
    size_t end = begin + 1;
    while (end < order.size() && tables[order[end] * s.width] == tables[order[begin] * s.width]) ++end;
    if (end - begin >= 2) {
      const int64_t leader = order[begin];
      const int64_t* lead = tables + leader * s.width;
      std::vector<std::pair<int64_t, int64_t>> matched;  // (blocks shared with the leader, sequence)
      for (size_t i = begin; i < end; ++i) {
        const int64_t b = order[i], limit = std::min((lens[b] - 1) / s.block_size, (lens[leader] - 1) / s.block_size);
        const int64_t* row = tables + b * s.width;
        int64_t n = 0;
        while (n < limit && row[n] == lead[n]) ++n;
        matched.emplace_back(n, b);
      }
      std::sort(matched.begin(), matched.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      int64_t best_count = 0, best_blocks = 0;
      for (size_t k = 1; k < matched.size(); ++k) {  // the k + 1 longest matches share matched[k].first
        const int64_t blocks = matched[k].first, count = static_cast<int64_t>(k) + 1;
        if (blocks >= min_shared_blocks && count * blocks > best_count * best_blocks) {
          best_count = count;
          best_blocks = blocks;
        }
      }
      if (best_count >= 2) {
        PrefixGroup group{{}, best_blocks};
        for (int64_t k = 0; k < best_count; ++k) group.members.push_back(matched[k].second);
        std::sort(group.members.begin(), group.members.end());
        groups.push_back(std::move(group));
      }
    }
    begin = end;
  }
  return groups;
}

// Scratch of one shared task: the rows' scaled queries transposed [head_dim][rows], their output
// sums transposed the same way, each row's running max and sum, and one block's keys and values in
// fp32 [block][head_dim] and its probabilities [block][lanes].
struct SharedScratch {
  std::vector<float> query_t, acc_t, max, sum, keys, values, probs;
  SharedScratch(const Shape& s, int64_t padded_rows)
      : query_t(s.head_dim * padded_rows), acc_t(s.head_dim * padded_rows), max(padded_rows), sum(padded_rows),
        keys(s.block_size * s.head_dim), values(s.block_size * s.head_dim),
        probs(kSharedRowVecs * s.block_size * kLanes) {}
};

// One full block of the shared prefix against kRowVecs vectors of query rows (rows r0 on), with the
// loop counts fixed at compile time so that every accumulator stays in a register: the scores take
// kSharedTokens tokens at a time (kRowVecs x kSharedTokens chains of fused multiply-adds, one
// broadcast key element feeding kRowVecs of them), the value sums as many head dims at a time.
template <int64_t kRowVecs, int64_t kHeadDim>
inline void shared_block_rows(int64_t r0, int64_t bs, int64_t padded_rows, bool first_block, const float* query_t,
                              const float* keys, const float* values, float* probs, float* row_max,
                              float* row_sum, float* acc_t) {
  constexpr int64_t hd = kHeadDim, U = kSharedTokens;
  for (int64_t t0 = 0; t0 < bs; t0 += U) {
    Vec dots[kRowVecs][U];
    for (int64_t r = 0; r < kRowVecs; ++r)
      for (int64_t u = 0; u < U; ++u) dots[r][u] = Vec(0.0f);
    for (int64_t d = 0; d < hd; ++d) {
      Vec qd[kRowVecs];
      for (int64_t r = 0; r < kRowVecs; ++r)
        qd[r] = in_register(Vec::loadu(query_t + d * padded_rows + r0 + r * kLanes));
      for (int64_t u = 0; u < U; ++u) {
        const Vec key(keys[(t0 + u) * hd + d]);
        for (int64_t r = 0; r < kRowVecs; ++r) dots[r][u] = at::vec::fmadd(qd[r], key, dots[r][u]);
      }
    }
    for (int64_t r = 0; r < kRowVecs; ++r)
      for (int64_t u = 0; u < U; ++u) dots[r][u].store(probs + (r * bs + t0 + u) * kLanes);
  }
  Vec rescale[kRowVecs];
  for (int64_t r = 0; r < kRowVecs; ++r) {
    // The block's softmax against the running one, per row (lane); the stretch's first block sets
    // the running max (no rescale of the zero sums).
    float* pr = probs + r * bs * kLanes;
    float* mx = row_max + r0 + r * kLanes;
    float* sm = row_sum + r0 + r * kLanes;
    Vec block_max = Vec::loadu(pr);
    for (int64_t t = 1; t < bs; ++t) block_max = at::vec::maximum(block_max, Vec::loadu(pr + t * kLanes));
    const Vec old_max = first_block ? block_max : Vec::loadu(mx);
    const Vec new_max = at::vec::maximum(old_max, block_max);
    rescale[r] = (old_max - new_max).exp_u20();
    Vec total(0.0f);
    for (int64_t t = 0; t < bs; ++t) {
      const Vec pt = (Vec::loadu(pr + t * kLanes) - new_max).exp_u20();
      pt.store(pr + t * kLanes);
      total = total + pt;
    }
    new_max.store(mx);
    const Vec old_sum = first_block ? Vec(0.0f) : Vec::loadu(sm);
    (old_sum * rescale[r] + total).store(sm);
  }
  // acc[d] = acc[d] * rescale + sum_t p[t] v[t][d], U head dims of kRowVecs row vectors at a time.
  for (int64_t d0 = 0; d0 < hd; d0 += U) {
    Vec acc[kRowVecs][U];
    for (int64_t r = 0; r < kRowVecs; ++r)
      for (int64_t u = 0; u < U; ++u)
        acc[r][u] = first_block ? Vec(0.0f) : Vec::loadu(acc_t + (d0 + u) * padded_rows + r0 + r * kLanes) * rescale[r];
    for (int64_t t = 0; t < bs; ++t) {
      Vec pt[kRowVecs];
      for (int64_t r = 0; r < kRowVecs; ++r) pt[r] = in_register(Vec::loadu(probs + (r * bs + t) * kLanes));
      for (int64_t u = 0; u < U; ++u) {
        const Vec value(values[t * hd + d0 + u]);
        for (int64_t r = 0; r < kRowVecs; ++r) acc[r][u] = at::vec::fmadd(pt[r], value, acc[r][u]);
      }
    }
    for (int64_t r = 0; r < kRowVecs; ++r)
      for (int64_t u = 0; u < U; ++u) acc[r][u].store(acc_t + (d0 + u) * padded_rows + r0 + r * kLanes);
  }
}

// Blocks [first, last) of a group's shared prefix, for one KV head, folded into each member's
// partial for that head (parts[m], m over the group's members). Every block here is full.
template <typename T, int64_t kHeadDim>
void attend_shared_blocks(const Shape& s, const T* q, const T* k_pool, const T* v_pool, const int64_t* table,
                          int64_t first, int64_t last, int64_t head, const std::vector<int64_t>& members,
                          const Partial* parts) {
  const int64_t hd = kHeadDim > 0 ? kHeadDim : s.head_dim, group = s.group, bs = s.block_size;
  const int64_t rows = static_cast<int64_t>(members.size()) * group;
  const int64_t padded_rows = (rows + kLanes - 1) / kLanes * kLanes;
  const int64_t token_stride = s.n_kv * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  SharedScratch scratch(s, padded_rows);
  float* query_t = scratch.query_t.data();
  float* acc_t = scratch.acc_t.data();
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + members[r / group] * s.q_stride + (head * group + r % group) * hd;
    for (int64_t d = 0; d < hd; ++d) query_t[d * padded_rows + r] = static_cast<float>(qr[d]) * scale;
  }
  float* keys = scratch.keys.data();
  float* values = scratch.values.data();
  float* probs = scratch.probs.data();
  for (int64_t j = first; j < last; ++j) {
    const int64_t block = table[j];
    const T* k_rows = k_pool + (block * bs * s.n_kv + head) * hd;
    const T* v_rows = v_pool + (block * bs * s.n_kv + head) * hd;
    if (j + 1 < last) prefetch_block(s, k_pool, v_pool, table[j + 1], head, hd);
    for (int64_t t = 0; t < bs; ++t)
      for (int64_t d = 0; d < hd; d += kLanes) {
        const int64_t n = std::min(kLanes, hd - d);
        load_float(k_rows + t * token_stride + d, n).store(keys + t * hd + d, n);
        load_float(v_rows + t * token_stride + d, n).store(values + t * hd + d, n);
      }
    int64_t fixed_rows = 0;  // rows done by shared_block_rows, where the head size and block size allow
    if constexpr (kHeadDim > 0 && kHeadDim % kSharedTokens == 0) {
      if (bs % kSharedTokens == 0) {
        const int64_t step = kSharedRowVecs * kLanes;
        for (; fixed_rows + step <= padded_rows; fixed_rows += step)
          shared_block_rows<kSharedRowVecs, kHeadDim>(fixed_rows, bs, padded_rows, j == first, query_t, keys, values,
                                                      probs, scratch.max.data(), scratch.sum.data(), acc_t);
        for (; fixed_rows < padded_rows; fixed_rows += kLanes)
          shared_block_rows<1, kHeadDim>(fixed_rows, bs, padded_rows, j == first, query_t, keys, values, probs,
                                         scratch.max.data(), scratch.sum.data(), acc_t);
      }
    }
    for (int64_t r0 = fixed_rows; r0 < padded_rows; r0 += kLanes) {
      // Scores of kLanes rows against the block's tokens, eight tokens at a time in registers.
      for (int64_t t0 = 0; t0 < bs; t0 += 8) {
        const int64_t tn = std::min<int64_t>(8, bs - t0);
        Vec dots[8];
        for (int64_t u = 0; u < 8; ++u) dots[u] = Vec(0.0f);
        for (int64_t d = 0; d < hd; ++d) {
          const Vec qd = Vec::loadu(query_t + d * padded_rows + r0);
          for (int64_t u = 0; u < tn; ++u) dots[u] = at::vec::fmadd(qd, Vec(keys[(t0 + u) * hd + d]), dots[u]);
        }
        for (int64_t u = 0; u < tn; ++u) dots[u].store(probs + (t0 + u) * kLanes);
      }
      // The block's softmax against the running one, per row (lane). The first block of the stretch
      // sets the running max (no rescale of the zero sums).
      Vec block_max = Vec::loadu(probs);
      for (int64_t t = 1; t < bs; ++t) block_max = at::vec::maximum(block_max, Vec::loadu(probs + t * kLanes));
      const Vec old_max = j == first ? block_max : Vec::loadu(scratch.max.data() + r0);
      const Vec new_max = at::vec::maximum(old_max, block_max);
      const Vec rescale = (old_max - new_max).exp_u20();
      Vec total(0.0f);
      for (int64_t t = 0; t < bs; ++t) {
        const Vec p = (Vec::loadu(probs + t * kLanes) - new_max).exp_u20();
        p.store(probs + t * kLanes);
        total = total + p;
      }
      new_max.store(scratch.max.data() + r0);
      const Vec old_sum = j == first ? Vec(0.0f) : Vec::loadu(scratch.sum.data() + r0);
      (old_sum * rescale + total).store(scratch.sum.data() + r0);
      // Output sums, eight head dims at a time in registers: acc[d] = acc[d] * rescale + sum_t p[t] v[t][d].
      for (int64_t d0 = 0; d0 < hd; d0 += 8) {
        const int64_t dn = std::min<int64_t>(8, hd - d0);
        Vec acc[8];
        for (int64_t u = 0; u < dn; ++u)
          acc[u] = j == first ? Vec(0.0f) : Vec::loadu(acc_t + (d0 + u) * padded_rows + r0) * rescale;
        for (int64_t t = 0; t < bs; ++t) {
          const Vec p = Vec::loadu(probs + t * kLanes);
          for (int64_t u = 0; u < dn; ++u) acc[u] = at::vec::fmadd(p, Vec(values[t * hd + d0 + u]), acc[u]);
        }
        for (int64_t u = 0; u < dn; ++u) acc[u].store(acc_t + (d0 + u) * padded_rows + r0);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Partial& part = parts[r / group];
    const int64_t g = r % group;
    part.max[g] = scratch.max[r];
    part.sum[g] = scratch.sum[r];
    for (int64_t d = 0; d < hd; ++d) part.acc[g * hd + d] = acc_t[d * padded_rows + r];
  }
}

// Decode attention of a batch in which some sequences share leading blocks: the groups' shared
// stretches and every sequence's own blocks as tasks of one pool (longest first, taken in turn by
// the threads, since their sizes differ by far), then one merge per (sequence, KV head).
template <typename T, int64_t kHeadDim>
void attend_with_prefixes(const Shape& s, const T* q, const T* k_pool, const T* v_pool, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t batch, const std::vector<PrefixGroup>& groups,
                          bool tiles) {
  const int64_t threads = at::get_num_threads();
  const int64_t stride = s.group * (s.head_dim + 2);
  std::vector<int64_t> own_first(batch, 0);  // each sequence's first block after its shared prefix
  for (const auto& group : groups)
    for (int64_t b : group.members) own_first[b] = group.shared_blocks;
  int64_t max_own = 0;
  for (int64_t b = 0; b < batch; ++b)
    max_own = std::max(max_own, (lens[b] + s.block_size - 1) / s.block_size - own_first[b]);
  const int64_t pairs = batch * s.n_kv;
  const int64_t splits = choose_splits(pairs, max_own);
  // Shared stretches: enough tasks for every thread, at least two blocks each.
  const int64_t group_heads = static_cast<int64_t>(groups.size()) * s.n_kv;
  // On tiles a stretch is whole softmax passes (tile_attention::kPassBlocks blocks) where it can
  // be: a short last pass costs a whole one's value transposition and half-empty block pairs.
  std::vector<int64_t> stretches(groups.size()), stretch_blocks(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t shared = groups[g].shared_blocks;
    int64_t n = std::max<int64_t>(1, std::min((4 * threads + group_heads - 1) / group_heads, shared / 2));
    int64_t length = (shared + n - 1) / n;
#if defined(BACKFILL_TILES)
    constexpr int64_t pass = tile_attention::kPassBlocks;
    if (tiles && std::is_same_v<T, c10::BFloat16> && shared >= 2 * pass) length = (length + pass - 1) / pass * pass;
#endif
    stretches[g] = (shared + length - 1) / length;
    stretch_blocks[g] = length;
  }
  // Partials: each pair's own splits, then each group member's shared stretches per head.
  std::vector<int64_t> shared_offset(groups.size());
  int64_t floats = pairs * splits * stride;
  for (size_t g = 0; g < groups.size(); ++g) {
    shared_offset[g] = floats;
    floats += static_cast<int64_t>(groups[g].members.size()) * s.n_kv * stretches[g] * stride;
  }
  std::vector<float> store(floats);
  auto partial_at = [&](int64_t offset) {
    float* base = store.data() + offset;
    return Partial{base + s.group * s.head_dim, base + s.group * s.head_dim + s.group, base};
  };
  auto own_partial = [&](int64_t pair, int64_t split) { return partial_at((pair * splits + split) * stride); };
  auto shared_partial = [&](size_t g, int64_t member, int64_t head, int64_t stretch) {
    return partial_at(shared_offset[g] + ((member * s.n_kv + head) * stretches[g] + stretch) * stride);
  };
  struct Task {
    int64_t cost, kind, a, b, c;  // kind 0: (pair, split); kind 1: (group, head, stretch)
  };
  std::vector<Task> tasks;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t seq = pair / s.n_kv;
    const int64_t blocks = (lens[seq] + s.block_size - 1) / s.block_size - own_first[seq];
    for (int64_t split = 0; split < splits; ++split) tasks.push_back({blocks / splits + 1, 0, pair, split, 0});
  }
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t head = 0; head < s.n_kv; ++head)
      for (int64_t stretch = 0; stretch < stretches[g]; ++stretch)
        tasks.push_back({static_cast<int64_t>(groups[g].members.size()) * stretch_blocks[g] + 1,
                         1, static_cast<int64_t>(g), head, stretch});
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch(s);
    std::vector<Partial> member_parts;
    std::vector<float> tile_max, tile_sum, tile_acc;
    for (int64_t i; (i = next.fetch_add(1)) < num_tasks;) {
      const Task& task = tasks[i];
      if (task.kind == 0) {
        const int64_t pair = task.a, split = task.b, seq = pair / s.n_kv, head = pair % s.n_kv;
        const int64_t begin = own_first[seq], blocks = (lens[seq] + s.block_size - 1) / s.block_size - begin;
        attend_blocks<T, kHeadDim>(s, q + seq * s.q_stride, k_pool, v_pool, tables + seq * s.width, lens[seq],
                                   begin + split * blocks / splits, begin + (split + 1) * blocks / splits, head,
                                   scratch, own_partial(pair, split));
      } else {
        const PrefixGroup& group = groups[task.a];
        const int64_t head = task.b, stretch = task.c, length = stretch_blocks[task.a];
        member_parts.clear();
        for (size_t m = 0; m < group.members.size(); ++m)
          member_parts.push_back(shared_partial(task.a, static_cast<int64_t>(m), head, stretch));
        const int64_t begin = stretch * length, end = std::min(group.shared_blocks, begin + length);
        const int64_t* table = tables + group.members[0] * s.width;
#if defined(BACKFILL_TILES)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (tiles) {
            const int64_t rows = static_cast<int64_t>(group.members.size()) * s.group;
            tile_max.resize(rows), tile_sum.resize(rows), tile_acc.resize(rows * s.head_dim);
            const auto query_row = [&](int64_t r) {
              return q + group.members[r / s.group] * s.q_stride + (head * s.group + r % s.group) * s.head_dim;
            };
            tile_attention::attend_full_blocks_on_tiles(s.n_kv, s.head_dim, k_pool, v_pool, table, begin, end, head, query_row,
                                        tile_attention::TileRows{rows, tile_max.data(), tile_sum.data(), tile_acc.data()});
            for (int64_t r = 0; r < rows; ++r) {
              const Partial& part = member_parts[r / s.group];
              const int64_t g = r % s.group;
              part.max[g] = tile_max[r];
              part.sum[g] = tile_sum[r];
              std::copy(tile_acc.data() + r * s.head_dim, tile_acc.data() + (r + 1) * s.head_dim,
                        part.acc + g * s.head_dim);
            }
            continue;
          }
        }
#endif
        attend_shared_blocks<T, kHeadDim>(s, q, k_pool, v_pool, table, begin, end, head, group.members,
                                          member_parts.data());
      }
    }
  });
  // Where each sequence's shared partials lie: (group, member index), or none.
  std::vector<std::pair<int64_t, int64_t>> membership(batch, {-1, -1});
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t m = 0; m < groups[g].members.size(); ++m)
      membership[groups[g].members[m]] = {static_cast<int64_t>(g), static_cast<int64_t>(m)};
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    std::vector<Partial> parts;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / s.n_kv, head = pair % s.n_kv;
      parts.clear();
      for (int64_t i = 0; i < splits; ++i) parts.push_back(own_partial(pair, i));
      const auto [g, m] = membership[seq];
      if (g >= 0)
        for (int64_t i = 0; i < stretches[g]; ++i) parts.push_back(shared_partial(g, m, head, i));
      merge_and_write(s, parts.data(), static_cast<int64_t>(parts.size()),
                      out + (seq * s.n_q + head * s.group) * s.head_dim);
    }
  });
}

template <typename T, int64_t kHeadDim>
void attend(const Shape& s, const T* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens,
            T* out, int64_t batch, int64_t min_shared_blocks, bool tiles) {
  const std::vector<PrefixGroup> groups = find_prefix_groups(s, tables, lens, batch, min_shared_blocks);
  if (!groups.empty())
    return attend_with_prefixes<T, kHeadDim>(s, q, k_pool, v_pool, tables, lens, out, batch, groups, tiles);
  int64_t max_blocks = 0;
  for (int64_t b = 0; b < batch; ++b) max_blocks = std::max(max_blocks, (lens[b] + s.block_size - 1) / s.block_size);
  const int64_t pairs = batch * s.n_kv;
  const int64_t splits = choose_splits(pairs, max_blocks);
  const int64_t stride = s.group * (s.head_dim + 2);  // floats of one partial: acc, max, sum
  std::vector<float> store(pairs * splits * stride);
  auto partial = [&](int64_t pair, int64_t split) {
    float* base = store.data() + (pair * splits + split) * stride;
    return Partial{base + s.group * s.head_dim, base + s.group * s.head_dim + s.group, base};
  };
  const auto output_of = [&](int64_t pair) {
    return out + ((pair / s.n_kv) * s.n_q + (pair % s.n_kv) * s.group) * s.head_dim;
  };
  // One per thread that may run a task; called inside a parallel region the loop runs on this
  // thread alone, whose number can exceed the thread count reported there.
  std::vector<Scratch> scratches(std::max(at::get_num_threads(), at::get_thread_num() + 1), Scratch(s));
  balanced::parallel_for(pairs * splits, [&](int64_t task, int64_t) {
    const int64_t pair = task / splits, split = task % splits;
    const int64_t seq = pair / s.n_kv, head = pair % s.n_kv;
    const int64_t blocks = (lens[seq] + s.block_size - 1) / s.block_size;
    const Partial part = partial(pair, split);
    attend_blocks<T, kHeadDim>(s, q + seq * s.q_stride, k_pool, v_pool, tables + seq * s.width, lens[seq],
                               split * blocks / splits, (split + 1) * blocks / splits, head,
                               scratches[at::get_thread_num()], part);
    if (splits == 1) merge_and_write(s, &part, 1, output_of(pair));  // the whole context: write it now
  });
  if (splits == 1) return;
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    std::vector<Partial> parts(splits);
    for (int64_t pair = begin; pair < end; ++pair) {
      for (int64_t i = 0; i < splits; ++i) parts[i] = partial(pair, i);
      merge_and_write(s, parts.data(), splits, output_of(pair));
    }
  });
}

template <typename T>
void attend_any_head_dim(const Shape& s, const torch::Tensor& q, const torch::Tensor& k_pool,
                         const torch::Tensor& v_pool, const torch::Tensor& tables, const int64_t* lens,
                         torch::Tensor& out, int64_t min_shared_blocks, bool tiles) {
  const auto run = [&](auto head_dim_constant) {
    attend<T, decltype(head_dim_constant)::value>(s, q.data_ptr<T>(), k_pool.data_ptr<T>(), v_pool.data_ptr<T>(),
                                                   tables.data_ptr<int64_t>(), lens, out.data_ptr<T>(), q.size(0),
                                                   min_shared_blocks, tiles);
  };
  if (s.head_dim == 64) run(std::integral_constant<int64_t, 64>());
  else if (s.head_dim == 128) run(std::integral_constant<int64_t, 128>());
  else run(std::integral_constant<int64_t, 0>());
}

}  // namespace

// Rows [B, heads, hd] whose heads and elements are contiguous (each sequence's row may be a slice of
// a wider product).
bool rows_dense(const torch::Tensor& t) { return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2); }

// q [B, n_q, hd]; k_pool, v_pool [num_blocks, block_size, n_kv, hd]; block_tables [B, width] int64;
// context_lens [B] int64, each in [1, width * block_size]. Returns [B, n_q, hd]. Sequences whose
// tables start with the same min_shared_blocks or more full blocks read them once as a group
// (cascade attention, above); 0 walks every sequence's table alone. With k_new, v_new [B, n_kv, hd]
// and slots [B] int64, each sequence's new key and value are first written to its slot of the pools
// (block * block_size + offset): the step's KV write, without two more dispatches a layer.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     int64_t min_shared_blocks, bool tiles, const c10::optional<torch::Tensor>& k_new,
                                     const c10::optional<torch::Tensor>& v_new, const c10::optional<torch::Tensor>& slots) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(rows_dense(q) && k_pool.is_contiguous() && v_pool.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(),
              "inputs must be contiguous (q: within each sequence's row)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q, k_pool and v_pool must be CPU tensors of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "dtype must be float32, bfloat16 or float16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  const int64_t batch = q.size(0), n_q = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_pool.size(1), n_kv = k_pool.size(2), width = block_tables.size(1);
  TORCH_CHECK(k_pool.size(3) == head_dim && n_q % n_kv == 0, "head sizes do not match");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch, "one table and length per sequence");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i)
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "context length outside its block table");
  TORCH_CHECK(k_new.has_value() == v_new.has_value() && k_new.has_value() == slots.has_value(),
              "k_new, v_new and slots come together");
  if (k_new.has_value()) {
    const torch::Tensor& kn = *k_new;
    const torch::Tensor& vn = *v_new;
    const torch::Tensor& sl = *slots;
    TORCH_CHECK(rows_dense(kn) && rows_dense(vn) && kn.size(0) == batch && vn.size(0) == batch &&
                kn.size(1) == n_kv && vn.size(1) == n_kv && kn.size(2) == head_dim && vn.size(2) == head_dim,
                "k_new and v_new must be [B, n_kv, head_dim], contiguous within each row");
    TORCH_CHECK(kn.scalar_type() == q.scalar_type() && vn.scalar_type() == q.scalar_type(), "k_new, v_new: q's dtype");
    TORCH_CHECK(sl.scalar_type() == at::kLong && sl.is_contiguous() && sl.numel() == batch, "slots: [B] int64");
    const int64_t* slot = sl.data_ptr<int64_t>();
    const int64_t pool_slots = k_pool.size(0) * block_size, row_bytes = n_kv * head_dim * k_pool.element_size();
    for (int64_t i = 0; i < batch; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_slots, "slot outside the pool");
      std::memcpy(static_cast<char*>(k_pool.data_ptr()) + slot[i] * row_bytes,
                  static_cast<const char*>(kn.data_ptr()) + i * kn.stride(0) * kn.element_size(), row_bytes);
      std::memcpy(static_cast<char*>(v_pool.data_ptr()) + slot[i] * row_bytes,
                  static_cast<const char*>(vn.data_ptr()) + i * vn.stride(0) * vn.element_size(), row_bytes);
    }
  }
  const Shape shape{n_q, n_kv, n_q / n_kv, head_dim, block_size, width, q.stride(0)};
  const bool use_tiles = tiles && tile_attention::tiles_usable(block_size, head_dim);
  auto out = torch::empty({batch, n_q, head_dim}, q.options());
  switch (q.scalar_type()) {
    case at::kFloat: attend_any_head_dim<float>(shape, q, k_pool, v_pool, block_tables, lens, out, min_shared_blocks, use_tiles); break;
    case at::kBFloat16: attend_any_head_dim<c10::BFloat16>(shape, q, k_pool, v_pool, block_tables, lens, out, min_shared_blocks, use_tiles); break;
    default: attend_any_head_dim<c10::Half>(shape, q, k_pool, v_pool, block_tables, lens, out, min_shared_blocks, use_tiles);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("min_shared_blocks") = kMinSharedBlocks, py::arg("tiles") = true, py::arg("k_new") = py::none(),
        py::arg("v_new") = py::none(), py::arg("slots") = py::none());
  m.def("tiles_available", []() { return tile_attention::tiles_usable(16, 64); },
        "whether shared prefixes of bf16 pools with 16-token blocks run on AMX tiles here");
}
