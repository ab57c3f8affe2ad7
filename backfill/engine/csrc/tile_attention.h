// Attention of many query rows over full KV blocks on AMX tiles (Intel Xeon since Sapphire Rapids),
// shared by the decode and prompt kernels (paged_decode_attention.cpp, paged_prompt_attention.cpp).
//
// Where many query rows see the same blocks (sequences mapping one cached prompt, or a prompt
// chunk's tokens over the context before it), the blocks' scores are a matrix product: a tile
// multiply does 16 x 16 x 32 bf16 products in the time a vector path does a few hundred. Scores
// accumulate in fp32 from the exact products of bf16 queries and keys, with the rows in the lanes,
// so the running softmax (FlashAttention's) is all vertical: no sums across lanes. The
// probabilities go into the value products rounded to bf16, as FlashAttention's bf16 path feeds
// them to its second product, and the softmax's sums add the rounded values, so the weights a row
// applies sum to its normaliser exactly. Linux hands out
// tile state only on request (arch_prctl), once per process. The exponentials are 2^x on the
// vectors (a degree-5 polynomial and a scale), as accurate as fp32's own exp to a few ulps.
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

// Eight tiles of 16 rows x 64 bytes: 0 and 1 the left sides (keys, or values transposed), 2 and 3 the
// right sides (queries, or probabilities), 4 to 7 the sums of a 2 x 2 block of products.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// 2^x for x <= 0: 2^round(x) times a degree-5 polynomial of the rest (relative error 2.4e-7).
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, whole);
  __m512 p = _mm512_set1_ps(0.00132782f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00967556f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550708f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022119f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314694f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001f));
  return _mm512_scalef_ps(p, whole);
}

// The pool's layout and the rows' results. Row r's query is query_row(r) (head_dim bf16); its
// running max, sum and weighted values go to max[r], sum[r] and acc[r * head_dim ...] (fp32).
struct TileRows {
  int64_t count;
  float* max;
  float* sum;
  float* acc;
};

// Keys per softmax pass: 256, so a pass's scores and probabilities stay near the core.
constexpr int64_t kPassBlocks = 16;

// Blocks table[first, last) (each full, block_size 16) of KV head `head`, for rows.count query rows.
// head_dim % 32 == 0. Scores are scaled by 1 / sqrt(head_dim).
//
// Rows go in pairs of 16-row chunks, blocks in passes of 256 keys. Per pass: the values transposed
// once for all rows; per chunk pair, the scores of 2 chunks x 2 blocks on four tiles at a time, a
// softmax over the whole pass (the running max moves once per pass, not per block), and the value
// products as 2 x 2 tiles (two chunks x two groups of 16 dims, 32 keys a product). The next pair's
// scores run on the tiles while this pair's exponentials run on the vectors.
template <typename QueryRow>
void attend_full_blocks_on_tiles(int64_t n_kv, int64_t head_dim, const c10::BFloat16* k_pool,
                                 const c10::BFloat16* v_pool, const int64_t* table, int64_t first, int64_t last,
                                 int64_t head, QueryRow query_row, const TileRows& rows) {
  constexpr int64_t R = kTileRows, kPass = kPassBlocks;
  const int64_t hd = head_dim, bs = kTileRows;
  const int64_t chunks = (rows.count + 2 * R - 1) / (2 * R) * 2, chunk_pairs = chunks / 2;
  const int64_t token_bytes = n_kv * hd * 2, groups = hd / R;
  // In base-2 units: exp(s / sqrt(hd) - m) = 2^(s * log2(e) / sqrt(hd) - m * log2(e)).
  const __m512 scale2 = _mm512_set1_ps(1.4426950408889634f / std::sqrt(static_cast<float>(hd)));
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i half_ulp = _mm512_set1_epi32(0x8000);  // added to an fp32 word, rounds its bf16 half
  alignas(64) uint16_t deinterleave[32];
  for (int j = 0; j < 16; ++j) deinterleave[j] = 2 * j, deinterleave[16 + j] = 2 * j + 1;
  const __m512i deinterleave_idx = _mm512_load_si512(deinterleave);
  const __m512i token_words = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32(static_cast<int>(token_bytes / 4)));
  // Scratch kept per thread: fresh allocations on every call cost page faults.
  // queries [chunk][hd / 2][16 rows] (pairs of dims); output sums transposed [chunk][hd][16 rows];
  // values transposed [block pair][hd][32 tokens]; scores [buffer][chunk of the pair][block][16 tokens][16 rows];
  // probabilities [chunk of the pair][block pair][16 token pairs][16 rows], bf16 pairs.
  thread_local std::vector<uint32_t> query_pairs, probs;
  thread_local std::vector<float> acc, max, sum, scores;
  thread_local std::vector<uint16_t> values_t;
  query_pairs.assign(chunks * (hd / 2) * R, 0);
  for (int64_t r = 0; r < rows.count; ++r) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(query_row(r));
    for (int64_t p = 0; p < hd / 2; ++p) query_pairs[((r / R) * (hd / 2) + p) * R + r % R] = pairs[p];
  }
  acc.assign(chunks * hd * R, 0.0f), max.assign(chunks * R, 0.0f), sum.assign(chunks * R, 0.0f);
  values_t.resize(kPass / 2 * hd * 2 * R);
  scores.resize(2 * 2 * kPass * R * R);
  probs.resize(2 * kPass / 2 * R * R);
  auto scores_at = [&](int64_t buffer, int64_t u, int64_t b) { return scores.data() + ((buffer * 2 + u) * kPass + b) * R * R; };
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::max());
  configure_tiles();
  for (int64_t pass = first; pass < last; pass += kPass) {
    const int64_t nb = std::min(kPass, last - pass), block_pairs = (nb + 1) / 2;
    const bool first_pass = pass == first;
    // Values transposed: per pair of dims a gather of the 16 tokens' words, then the two dims apart.
    // A missing second block of the last pair is zero.
    for (int64_t b = 0; b < block_pairs * 2; ++b) {
      uint16_t* vt = values_t.data() + (b / 2) * hd * 2 * R + (b % 2) * R;
      if (b >= nb) {
        for (int64_t d = 0; d < hd; ++d) _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + d * 2 * R), _mm256_setzero_si256());
        continue;
      }
      const int* v_words = reinterpret_cast<const int*>(v_pool + (table[pass + b] * bs * n_kv + head) * hd);
      for (int64_t j = 0; j < hd / 2; ++j) {
        const __m512i apart = _mm512_permutexvar_epi16(deinterleave_idx, _mm512_i32gather_epi32(token_words, v_words + j, 4));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + 2 * j * 2 * R), _mm512_castsi512_si256(apart));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + (2 * j + 1) * 2 * R), _mm512_extracti64x4_epi64(apart, 1));
      }
    }
    // Scores transposed ([16 tokens][16 rows]) of chunk pair i against block pair p: the keys load
    // straight from the pool as the left sides.
    auto score_pair = [&](int64_t i, int64_t p, int64_t buffer) {
      const int64_t b0 = 2 * p, b1 = b0 + 1, c0 = 2 * i;
      const c10::BFloat16* k0 = k_pool + (table[pass + b0] * bs * n_kv + head) * hd;
      const c10::BFloat16* k1 = b1 < nb ? k_pool + (table[pass + b1] * bs * n_kv + head) * hd : k0;
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      for (int64_t d0 = 0; d0 < hd; d0 += 32) {
        _tile_loadd(0, k0 + d0, token_bytes);
        _tile_loadd(1, k1 + d0, token_bytes);
        _tile_loadd(2, query_pairs.data() + (c0 * (hd / 2) + d0 / 2) * R, 64);
        _tile_loadd(3, query_pairs.data() + ((c0 + 1) * (hd / 2) + d0 / 2) * R, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 1, 2);
        _tile_dpbf16ps(6, 0, 3);
        _tile_dpbf16ps(7, 1, 3);
      }
      _tile_stored(4, scores_at(buffer, 0, b0), 64);
      _tile_stored(5, scores_at(buffer, 0, b1), 64);
      _tile_stored(6, scores_at(buffer, 1, b0), 64);
      _tile_stored(7, scores_at(buffer, 1, b1), 64);
    };
    // The row maxima (lanes) of a chunk pair's scores over blocks [begin, end), folded into block_max.
    auto fold_max = [&](int64_t buffer, int64_t begin, int64_t end, __m512* block_max) {
      for (int64_t u = 0; u < 2; ++u)
        for (int64_t b = begin; b < std::min(end, nb); ++b) {
          const float* s = scores_at(buffer, u, b);
          for (int64_t t = 0; t < R; ++t) block_max[u] = _mm512_max_ps(block_max[u], _mm512_loadu_ps(s + t * R));
        }
    };
    __m512 block_max[2] = {lowest, lowest};
    for (int64_t p = 0; p < block_pairs; ++p) score_pair(0, p, 0);
    fold_max(0, 0, nb, block_max);
    for (int64_t i = 0; i < chunk_pairs; ++i) {
      const int64_t buffer = i % 2, c0 = 2 * i;
      __m512 new_max[2], rescale[2], total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t u = 0; u < 2; ++u) {
        float* max_c = max.data() + (c0 + u) * R;
        const __m512 m = _mm512_mul_ps(block_max[u], scale2);
        const __m512 old_max = first_pass ? m : _mm512_loadu_ps(max_c);
        new_max[u] = _mm512_max_ps(old_max, m);
        rescale[u] = exp2_nonpositive(_mm512_sub_ps(old_max, new_max[u]));
        _mm512_storeu_ps(max_c, new_max[u]);
      }
      // Probabilities, block pair by block pair, as a bf16 tile: token t in the low half of each
      // row's word, t + 1 in the high half.
      for (int64_t p = 0; p < block_pairs; ++p) {
        if (i + 1 < chunk_pairs) score_pair(i + 1, p, 1 - buffer);
        for (int64_t u = 0; u < 2; ++u)
          for (int64_t half = 0; half < 2; ++half) {
            const int64_t b = 2 * p + half;
            uint32_t* pair_rows = probs.data() + ((u * (kPass / 2) + p) * R + half * (R / 2)) * R;
            if (b >= nb) {
              for (int64_t t = 0; t < R / 2; ++t) _mm512_storeu_si512(pair_rows + t * R, _mm512_setzero_si512());
              continue;
            }
            const float* s = scores_at(buffer, u, b);
            for (int64_t t = 0; t < R; t += 2) {
              const __m512 p0 = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + t * R), scale2, new_max[u]));
              const __m512 p1 = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + (t + 1) * R), scale2, new_max[u]));
              // Rounded to bf16 (half an ulp added, the low half cleared); 0 <= p <= 1, so no overflow.
              const __m512i w0 = _mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(p0), half_ulp), high_half);
              const __m512i w1 = _mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(p1), half_ulp), high_half);
              total[u] = _mm512_add_ps(total[u], _mm512_add_ps(_mm512_castsi512_ps(w0), _mm512_castsi512_ps(w1)));
              _mm512_storeu_si512(pair_rows + t / 2 * R, _mm512_or_si512(w1, _mm512_srli_epi32(w0, 16)));
            }
          }
      }
      for (int64_t u = 0; u < 2; ++u) {
        float* sum_c = sum.data() + (c0 + u) * R;
        if (first_pass) {
          _mm512_storeu_ps(sum_c, total[u]);
          continue;
        }
        _mm512_storeu_ps(sum_c, _mm512_fmadd_ps(_mm512_loadu_ps(sum_c), rescale[u], total[u]));
        float* acc_c = acc.data() + (c0 + u) * hd * R;
        for (int64_t d = 0; d < hd; ++d) _mm512_storeu_ps(acc_c + d * R, _mm512_mul_ps(_mm512_loadu_ps(acc_c + d * R), rescale[u]));
      }
      // Output sums transposed ([16 dims][16 rows]): values^T x probabilities, with the next pair's
      // row maxima on the vectors meanwhile.
      block_max[0] = block_max[1] = lowest;
      const int64_t steps = groups / 2 * block_pairs;
      int64_t step = 0;
      for (int64_t g = 0; g < groups; g += 2) {
        float* o00 = acc.data() + (c0 * hd + g * R) * R;
        float* o01 = o00 + R * R;
        float* o10 = acc.data() + ((c0 + 1) * hd + g * R) * R;
        float* o11 = o10 + R * R;
        _tile_loadd(4, o00, 64); _tile_loadd(5, o01, 64); _tile_loadd(6, o10, 64); _tile_loadd(7, o11, 64);
        for (int64_t p = 0; p < block_pairs; ++p, ++step) {
          const uint16_t* vt = values_t.data() + (p * hd + g * R) * 2 * R;
          _tile_loadd(0, vt, 64);
          _tile_loadd(1, vt + R * 2 * R, 64);
          _tile_loadd(2, probs.data() + p * R * R, 64);
          _tile_loadd(3, probs.data() + (kPass / 2 + p) * R * R, 64);
          _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 1, 2); _tile_dpbf16ps(6, 0, 3); _tile_dpbf16ps(7, 1, 3);
          if (i + 1 < chunk_pairs) fold_max(1 - buffer, step * nb / steps, (step + 1) * nb / steps, block_max);
        }
        _tile_stored(4, o00, 64); _tile_stored(5, o01, 64); _tile_stored(6, o10, 64); _tile_stored(7, o11, 64);
      }
    }
  }
  _tile_release();
  const float ln2 = 0.6931471805599453f;
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t c = r / R, lane = r % R;
    rows.max[r] = max[r] * ln2;
    rows.sum[r] = sum[r];
    for (int64_t d = 0; d < hd; ++d) rows.acc[r * hd + d] = acc[(c * hd + d) * R + lane];
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
