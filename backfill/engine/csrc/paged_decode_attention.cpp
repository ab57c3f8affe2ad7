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
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// out[u] = the sum of the lanes of v[u], for four vectors at once.
inline void sum_lanes4(const Vec* v, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  // Fold each to 8 lanes, then three horizontal adds leave each vector's sum split over the two
  // 128-bit halves: 13 instructions for the four sums, against about 8 for each one alone.
  __m256 half[4];
  for (int u = 0; u < 4; ++u) {
    const __m512 x = v[u];
    half[u] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  }
  const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1)));
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
    if (j + 1 < last) prefetch_block(s, k_pool, v_pool, table[j + 1], head, hd);
    // Scores of the block: each key row is converted once and dotted with every query of the group.
    int64_t t = 0;
    if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
      // Four tokens at a time: their rows stay in registers across the group, and their four dot
      // products are summed across lanes together (the sums cost as much as the products).
      constexpr int64_t kChunks = kHeadDim / kLanes;
      for (; t + 4 <= tokens; t += 4) {
        Vec rows4[4][kChunks];
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
    // Values weighted by the probabilities: the block's rows are converted to fp32 once, then each
    // chunk of each query head's output sums over the block's tokens in a register (accumulating
    // in memory token by token chained every update through a store and a load).
    float* rows = scratch.values.data();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t d = 0; d < hd; d += kLanes) {
        const int64_t n = std::min(kLanes, hd - d);
        load_float(values + t * token_stride + d, n).store(rows + t * hd + d, n);
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
  std::vector<float> weights(count);
  for (int64_t g = 0; g < s.group; ++g) {
    float top = kNegInf;
    for (int64_t i = 0; i < count; ++i) top = std::max(top, parts[i].max[g]);
    float sum = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      weights[i] = parts[i].max[g] == kNegInf ? 0.0f : std::exp(parts[i].max[g] - top);
      sum += weights[i] * parts[i].sum[g];
    }
    for (int64_t d = 0; d < hd; ++d) {
      float value = 0.0f;
      for (int64_t i = 0; i < count; ++i) value += weights[i] * parts[i].acc[g * hd + d];
      out[g * hd + d] = static_cast<T>(value / sum);
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

template <typename T, int64_t kHeadDim>
void attend(const Shape& s, const T* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens,
            T* out, int64_t batch) {
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
  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(s);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / splits, split = task % splits;
      const int64_t seq = pair / s.n_kv, head = pair % s.n_kv;
      const int64_t blocks = (lens[seq] + s.block_size - 1) / s.block_size;
      const Partial part = partial(pair, split);
      attend_blocks<T, kHeadDim>(s, q + seq * s.n_q * s.head_dim, k_pool, v_pool, tables + seq * s.width, lens[seq],
                    split * blocks / splits, (split + 1) * blocks / splits, head, scratch, part);
      if (splits == 1) merge_and_write(s, &part, 1, output_of(pair));  // the whole context: write it now
    }
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
                         torch::Tensor& out) {
  const auto run = [&](auto head_dim_constant) {
    attend<T, decltype(head_dim_constant)::value>(s, q.data_ptr<T>(), k_pool.data_ptr<T>(), v_pool.data_ptr<T>(),
                                                   tables.data_ptr<int64_t>(), lens, out.data_ptr<T>(), q.size(0));
  };
  if (s.head_dim == 64) run(std::integral_constant<int64_t, 64>());
  else if (s.head_dim == 128) run(std::integral_constant<int64_t, 128>());
  else run(std::integral_constant<int64_t, 0>());
}

}  // namespace

// q [B, n_q, hd]; k_pool, v_pool [num_blocks, block_size, n_kv, hd]; block_tables [B, width] int64;
// context_lens [B] int64, each in [1, width * block_size]. Returns [B, n_q, hd].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "inputs must be contiguous");
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
  const Shape shape{n_q, n_kv, n_q / n_kv, head_dim, block_size, width};
  auto out = torch::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: attend_any_head_dim<float>(shape, q, k_pool, v_pool, block_tables, lens, out); break;
    case at::kBFloat16: attend_any_head_dim<c10::BFloat16>(shape, q, k_pool, v_pool, block_tables, lens, out); break;
    default: attend_any_head_dim<c10::Half>(shape, q, k_pool, v_pool, block_tables, lens, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)");
}
