// Attention of many query rows over full KV blocks on AMX tiles (Intel Xeon since Sapphire Rapids),
// shared by the decode and prompt kernels (paged_decode_attention.cpp, paged_prompt_attention.cpp).
//
// Where many query rows see the same blocks (sequences mapping one cached prompt, or a prompt
// chunk's tokens over the context before it), the blocks' scores are a matrix product: a tile
// multiply does 16 x 16 x 32 bf16 products in the time a vector path does a few hundred. Scores
// accumulate in fp32 from the exact products of bf16 queries and keys, with the rows in the lanes,
// so the running softmax (FlashAttention's) is all vertical: no sums across lanes. The
// probabilities go into the value products as two bf16 tiles (the rounded value and what rounding
// left), so the sums keep about 16 bits of each probability rather than bf16's 8. Linux hands out
// tile state only on request (arch_prctl), once per process.
//
// Included at file scope after ATen's vec headers.

#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BACKFILL_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <limits>
#include <vector>
#endif

namespace tile_attention {

#if defined(BACKFILL_TILES)
constexpr int64_t kTileRows = 16;

inline bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 keys [16 tokens][32 dims], 1 queries (pairs of dims) [16][16 rows], 2 scores [16 tokens][16 rows],
// 3 values transposed [16 dims][16 tokens], 4 and 5 probabilities (high and low bf16; pairs of
// tokens) [8][16 rows], 6 output sums [16 dims][16 rows].
inline void configure_tiles() {
  TileConfig config;
  for (int t : {0, 1, 2, 6}) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  config.bytes_per_row[3] = 32, config.rows[3] = 16;
  for (int t : {4, 5}) config.bytes_per_row[t] = 64, config.rows[t] = 8;
  _tile_loadconfig(&config);
}

// The pool's layout and the rows' results. Row r's query is query_row(r) (head_dim bf16); its
// running max, sum and weighted values go to max[r], sum[r] and acc[r * head_dim ...] (fp32).
struct TileRows {
  int64_t count;
  float* max;
  float* sum;
  float* acc;
};

// Blocks table[first, last) (each full, block_size 16) of KV head `head`, for rows.count query rows.
// head_dim % 32 == 0. Scores are scaled by 1 / sqrt(head_dim).
template <typename QueryRow>
void attend_full_blocks_on_tiles(int64_t n_kv, int64_t head_dim, const c10::BFloat16* k_pool,
                                 const c10::BFloat16* v_pool, const int64_t* table, int64_t first, int64_t last,
                                 int64_t head, QueryRow query_row, const TileRows& rows) {
  const int64_t hd = head_dim, bs = kTileRows;
  const int64_t chunks = (rows.count + kTileRows - 1) / kTileRows, padded_rows = chunks * kTileRows;
  const int64_t token_bytes = n_kv * hd * 2;
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(static_cast<float>(hd)));
  // Queries as the right side of keys x queries: per chunk of 16 rows and pair of dims, the 16 rows'
  // two bf16 side by side [chunk][hd / 2][16 rows].
  std::vector<uint32_t> query_pairs(chunks * (hd / 2) * kTileRows, 0);
  for (int64_t r = 0; r < rows.count; ++r) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(query_row(r));
    for (int64_t p = 0; p < hd / 2; ++p) query_pairs[((r / kTileRows) * (hd / 2) + p) * kTileRows + r % kTileRows] = pairs[p];
  }
  // The output sums transposed, [chunk][hd][16 rows]; each row's running max and sum.
  std::vector<float> acc(chunks * hd * kTileRows, 0.0f), max(padded_rows), sum(padded_rows, 0.0f);
  std::vector<uint16_t> values_t(hd * kTileRows);  // the block's values transposed [hd][16 tokens]
  alignas(64) float scores[kTileRows * kTileRows];  // [16 tokens][16 rows]
  alignas(64) float sums[kTileRows * kTileRows];    // [16 dims][16 rows]
  alignas(64) uint32_t probs_high[kTileRows / 2 * kTileRows], probs_low[kTileRows / 2 * kTileRows];
  configure_tiles();
  for (int64_t j = first; j < last; ++j) {
    const int64_t block = table[j];
    const c10::BFloat16* k_rows = k_pool + (block * bs * n_kv + head) * hd;
    const uint16_t* v_rows = reinterpret_cast<const uint16_t*>(v_pool + (block * bs * n_kv + head) * hd);
    if (j + 1 < last) {  // the next block lies wherever the pool handed it out: ask for it early
      const char* next_k = reinterpret_cast<const char*>(k_pool + (table[j + 1] * bs * n_kv + head) * hd);
      const char* next_v = reinterpret_cast<const char*>(v_pool + (table[j + 1] * bs * n_kv + head) * hd);
      for (int64_t t = 0; t < bs; ++t)
        for (int64_t byte = 0; byte < hd * 2; byte += 64) {
          __builtin_prefetch(next_k + t * token_bytes + byte);
          __builtin_prefetch(next_v + t * token_bytes + byte);
        }
    }
    for (int64_t t = 0; t < bs; ++t)
      for (int64_t d = 0; d < hd; ++d) values_t[d * kTileRows + t] = v_rows[t * (token_bytes / 2) + d];
    for (int64_t c = 0; c < chunks; ++c) {
      // Scores transposed, [16 tokens][16 rows]: the keys load straight from the pool as the left side.
      _tile_zero(2);
      for (int64_t d0 = 0; d0 < hd; d0 += 32) {
        _tile_loadd(0, k_rows + d0, token_bytes);
        _tile_loadd(1, query_pairs.data() + (c * (hd / 2) + d0 / 2) * kTileRows, 64);
        _tile_dpbf16ps(2, 0, 1);
      }
      _tile_stored(2, scores, 64);
      __m512 row[kTileRows];
      __m512 block_max = _mm512_set1_ps(-std::numeric_limits<float>::max());
      for (int64_t t = 0; t < kTileRows; ++t) {
        row[t] = _mm512_mul_ps(_mm512_load_ps(scores + t * kTileRows), scale);
        block_max = _mm512_max_ps(block_max, row[t]);
      }
      float* max_c = max.data() + c * kTileRows;
      float* sum_c = sum.data() + c * kTileRows;
      // The first block sets the running max (nothing to rescale yet).
      const __m512 old_max = j == first ? block_max : _mm512_loadu_ps(max_c);
      const __m512 new_max = _mm512_max_ps(old_max, block_max);
      const __m512 rescale = at::vec::Vectorized<float>(_mm512_sub_ps(old_max, new_max)).exp_u20();
      _mm512_storeu_ps(max_c, new_max);
      __m512 total = _mm512_setzero_ps();
      for (int64_t t = 0; t < kTileRows; t += 2) {
        __m512i high[2], low[2];
        for (int u = 0; u < 2; ++u) {
          const __m512 p = at::vec::Vectorized<float>(_mm512_sub_ps(row[t + u], new_max)).exp_u20();
          total = _mm512_add_ps(total, p);
          high[u] = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
          const __m512 rest = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(high[u], 16)));
          low[u] = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest)));
        }
        // A pair of tokens per row of the right side: token t in the low half of each row's word.
        _mm512_store_si512(probs_high + t / 2 * kTileRows, _mm512_or_si512(high[0], _mm512_slli_epi32(high[1], 16)));
        _mm512_store_si512(probs_low + t / 2 * kTileRows, _mm512_or_si512(low[0], _mm512_slli_epi32(low[1], 16)));
      }
      _mm512_storeu_ps(sum_c, _mm512_fmadd_ps(j == first ? _mm512_setzero_ps() : _mm512_loadu_ps(sum_c), rescale, total));
      // Output sums transposed, 16 dims at a time: values^T [16 dims][16 tokens] x probabilities.
      _tile_loadd(4, probs_high, 64);
      _tile_loadd(5, probs_low, 64);
      for (int64_t d0 = 0; d0 < hd; d0 += kTileRows) {
        _tile_zero(6);
        _tile_loadd(3, values_t.data() + d0 * kTileRows, 32);
        _tile_dpbf16ps(6, 3, 4);
        _tile_dpbf16ps(6, 3, 5);
        _tile_stored(6, sums, 64);
        float* acc_c = acc.data() + (c * hd + d0) * kTileRows;
        for (int64_t d = 0; d < kTileRows; ++d)
          _mm512_storeu_ps(acc_c + d * kTileRows, _mm512_fmadd_ps(_mm512_loadu_ps(acc_c + d * kTileRows), rescale,
                                                                  _mm512_load_ps(sums + d * kTileRows)));
      }
    }
  }
  _tile_release();
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t c = r / kTileRows, lane = r % kTileRows;
    rows.max[r] = max[r];
    rows.sum[r] = sum[r];
    for (int64_t d = 0; d < hd; ++d) rows.acc[r * hd + d] = acc[(c * hd + d) * kTileRows + lane];
  }
}
#endif

// Whether full blocks of this shape run on tiles here: an AMX build, the OS's permission, 16-token
// blocks and heads of whole 32-dim tile rows.
inline bool tiles_usable(int64_t block_size, int64_t head_dim) {
#if defined(BACKFILL_TILES)
  return block_size == kTileRows && head_dim % 32 == 0 && tiles_permitted();
#else
  (void)block_size, (void)head_dim;
  return false;
#endif
}

}  // namespace tile_attention
