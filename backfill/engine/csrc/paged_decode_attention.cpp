// Decode attention read straight from the paged KV pool, for CPU (backfill/engine/paged_attention.py).
//
// One query token per sequence. Each (sequence, KV head) is one task: it walks the sequence's
// block table, reads each block's keys and values once where they lie in the pool (no gathered
// copy), and keeps a running softmax over them (the online-softmax of FlashAttention), for all the
// query heads that share the KV head. Tasks run on PyTorch's own intra-op thread pool.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// One row of head_dim elements to fp32. bf16 is the top half of an fp32, so its conversion is a
// 16-bit shift written on the raw bits, which the compiler vectorizes (c10's converting operator
// it does not, and then nothing downstream vectorizes either).
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void row_to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
void attend(const T* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens, T* out,
            int64_t batch, int64_t width, int64_t n_q, int64_t n_kv, int64_t head_dim, int64_t block_size) {
  const int64_t group = n_q / n_kv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t token_stride = n_kv * head_dim;  // between two tokens of one block, for one head
  at::parallel_for(0, batch * n_kv, 1, [&](int64_t begin, int64_t end) {
    // Per task: the group's queries, running outputs, the current block's scores [token][group],
    // and one key or value row in fp32: each row is converted once and used by every query of
    // the group that shares its KV head.
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores(block_size * group), row(head_dim);
    std::vector<float> running_max(group), denominator(group), block_max(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / n_kv, head = task % n_kv;
      const int64_t context = lens[seq];
      for (int64_t g = 0; g < group; ++g) {
        row_to_float(q + (seq * n_q + head * group + g) * head_dim, &query[g * head_dim], head_dim);
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] *= scale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(running_max.begin(), running_max.end(), -INFINITY);
      std::fill(denominator.begin(), denominator.end(), 0.0f);
      for (int64_t j = 0; j * block_size < context; ++j) {
        const int64_t block = tables[seq * width + j];
        const int64_t tokens = std::min(block_size, context - j * block_size);
        const T* keys = k_pool + (block * block_size * n_kv + head) * head_dim;
        const T* values = v_pool + (block * block_size * n_kv + head) * head_dim;
        std::copy(running_max.begin(), running_max.end(), block_max.begin());
        for (int64_t t = 0; t < tokens; ++t) {
          row_to_float(keys + t * token_stride, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = &query[g * head_dim];
            float s = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
            scores[t * group + g] = s;
            block_max[g] = std::max(block_max[g], s);
          }
        }
        // Rescale what was accumulated under the old maximum (exp(-inf) = 0 on the first block).
        for (int64_t g = 0; g < group; ++g) {
          const float rescale = std::exp(running_max[g] - block_max[g]);
          denominator[g] *= rescale;
          float* ag = &acc[g * head_dim];
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= rescale;
          running_max[g] = block_max[g];
        }
        for (int64_t t = 0; t < tokens; ++t) {
          row_to_float(values + t * token_stride, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = std::exp(scores[t * group + g] - block_max[g]);
            denominator[g] += p;
            float* ag = &acc[g * head_dim];
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(seq * n_q + head * group + g) * head_dim + d] =
              static_cast<T>(acc[g * head_dim + d] / denominator[g]);
    }
  });
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
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  const int64_t batch = q.size(0), n_q = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_pool.size(1), n_kv = k_pool.size(2), width = block_tables.size(1);
  TORCH_CHECK(k_pool.size(3) == head_dim && n_q % n_kv == 0, "head sizes do not match");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch, "one table and length per sequence");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i)
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "context length outside its block table");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(), v_pool.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                     batch, width, n_q, n_kv, head_dim, block_size);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)");
}
