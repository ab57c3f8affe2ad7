// x @ W.T for a few bf16 rows on AVX-512 BF16 CPUs (backfill/engine/small_batch_matmul.py).
//
// A decode step of one to eight sequences reads every weight once and does little arithmetic, so
// it should run at the speed of a streaming read. oneDNN's GEMMs read the weights at 22-26 GB/s
// for such batches on the 2-core Zen 5, and inductor's dot products reach the streaming speed at
// one sequence but become compute-bound at four (their horizontal sums cost almost as much as the
// products). Here the weight is packed once, at load, so that one 64-byte load holds two
// consecutive input features of sixteen output features ([N/16][K/2][16][2], the pair layout
// VDPBF16PS multiplies), and a pair of a row's inputs is broadcast against it: each output lane
// accumulates its own dot product, no horizontal sums are needed, and every weight byte is read
// once for all rows. C column blocks are walked together so that one broadcast feeds C products
// (and C streams keep the memory busy); M * C accumulators stay in registers.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;     // fp32 outputs per column block
constexpr int64_t kMaxRows = 8;    // rows one pass over the weight serves

// Outputs [n_block * 16, (n_block + C) * 16) for M rows of x: one pass over those C blocks.
template <int M, int C>
inline void column_blocks(const c10::BFloat16* weight, const int32_t* x_pairs, float* out, int64_t n_block,
                          int64_t pairs, int64_t x_stride_pairs, int64_t out_features) {
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t block_elems = pairs * 2 * kLanes;
  const c10::BFloat16* w = weight + n_block * block_elems;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + c * block_elems + p * 2 * kLanes);
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_set1_epi32(x_pairs[m * x_stride_pairs + p]);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)wv[c], (__m512bh)xv);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t col = (n_block + c) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, out_features - col);
    const __mmask16 mask = valid == kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(out + m * out_features + col, mask, acc[m][c]);
  }
}

// M rows against the whole weight, the column blocks split over PyTorch's intra-op threads.
template <int M>
void rows_against_weight(const c10::BFloat16* weight, const int32_t* x_pairs, float* out, int64_t out_features,
                         int64_t pairs, int64_t x_stride_pairs) {
  // As many column blocks per pass as leave the accumulators in registers (32 zmm in all).
  constexpr int C = M <= 2 ? 8 : (M <= 6 ? 4 : 3);
  const int64_t blocks = (out_features + kLanes - 1) / kLanes;
  const int64_t groups = (blocks + C - 1) / C;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * C;
      if (first + C <= blocks) {
        column_blocks<M, C>(weight, x_pairs, out, first, pairs, x_stride_pairs, out_features);
      } else {
        for (int64_t b = first; b < blocks; ++b)
          column_blocks<M, 1>(weight, x_pairs, out, b, pairs, x_stride_pairs, out_features);
      }
    }
  });
}

using RowsFn = void (*)(const c10::BFloat16*, const int32_t*, float*, int64_t, int64_t, int64_t);
constexpr RowsFn kRowsFns[kMaxRows] = {rows_against_weight<1>, rows_against_weight<2>, rows_against_weight<3>,
                                       rows_against_weight<4>, rows_against_weight<5>, rows_against_weight<6>,
                                       rows_against_weight<7>, rows_against_weight<8>};

// x [M, K] bf16 and a weight packed by pack_bf16_pairs (small_batch_matmul.py): [ceil(N/16), K/2 * 32].
// Returns x @ W.T in fp32, [M, N]. Rows beyond eight take further passes over the weight.
at::Tensor bf16_packed_matmul(const at::Tensor& packed_weight, const at::Tensor& x, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed_weight.device().is_cpu(), "bf16_packed_matmul runs on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed_weight.scalar_type() == at::kBFloat16,
              "bf16_packed_matmul takes bf16 tensors");
  TORCH_CHECK(x.dim() == 2 && packed_weight.dim() == 2, "bf16_packed_matmul takes 2-D x and a packed weight");
  const int64_t in_features = x.size(1);
  TORCH_CHECK(in_features % 2 == 0, "in_features must be even, got ", in_features);
  TORCH_CHECK(packed_weight.size(0) == (out_features + kLanes - 1) / kLanes &&
                  packed_weight.size(1) == in_features * kLanes,
              "packed weight of shape ", packed_weight.sizes(), " does not match ", out_features, " x ", in_features);
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = packed_weight.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  const int64_t pairs = in_features / 2;
  const auto* weight = wc.data_ptr<c10::BFloat16>();
  const auto* x_pairs = reinterpret_cast<const int32_t*>(xc.data_ptr<c10::BFloat16>());
  float* out_ptr = out.data_ptr<float>();
  for (int64_t row = 0; row < x.size(0); row += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, x.size(0) - row);
    kRowsFns[rows - 1](weight, x_pairs + row * pairs, out_ptr + row * out_features, out_features, pairs, pairs);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(backfill, m) {
  m.def("bf16_packed_matmul(Tensor packed_weight, Tensor x, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(backfill, CPU, m) {
  m.impl("bf16_packed_matmul", bf16_packed_matmul);
}
