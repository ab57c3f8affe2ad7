// x @ W.T for a few rows on x86 CPUs, bf16 or fp32 weights (backfill/engine/small_batch_matmul.py).
//
// A decode step of one to eight sequences reads every weight once and does little arithmetic, so
// it should run at the speed of a streaming read. On the 2-core Zen 5, inductor's dot products
// reach the streaming speed at one sequence but become compute-bound at four (their horizontal
// sums cost almost as much as the products), and F.linear reads bf16 weights at 22-26 GB/s.
// Here the weight is packed once, at load, so that one 64-byte load holds two consecutive input
// features of sixteen output features ([N/16][K/2][16][2], the pair layout
// VDPBF16PS multiplies), and a pair of a row's inputs is broadcast against it: each output lane
// accumulates its own dot product, no horizontal sums are needed, and every weight byte is read
// once for all rows. fp32 weights take the same layout with one input feature per step and plain
// fused multiply-adds. C column blocks are walked together so that one broadcast feeds C products
// (and C streams keep the memory busy); M * C accumulators stay in registers.
//
// The instruction set is the compiler's (-march=native, or -mno-avx512f where PyTorch is held to
// AVX2): with AVX-512 BF16 a column block is one zmm register; with AVX2 and FMA it is two ymm
// halves, bf16 weights are widened to fp32 in registers (a shift or a mask per pair: they still
// cross the memory bus at two bytes), and, with half the registers, a pass serves four rows.
//
// On a CPU with AMX tiles (Intel Xeon from Sapphire Rapids), packed_matmul_tiles multiplies the same
// packed weight on them: sixteen pair-steps of a column block are one 1 KB tile of the pair layout
// TDPBF16PS takes, so the weight is read once, straight from the packing, for up to 64 rows of x at a
// time. From a handful of rows up, the vector kernel is bound by its multiply-adds; the tiles do 16
// rows' products in one instruction and keep reading at the speed memory gives, where oneDNN's
// kernels (built for large products) stream a decode step's weights at about half of it.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "balanced_for.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

namespace {

constexpr int64_t kLanes = 16;     // fp32 outputs per column block
constexpr int64_t kMaxRows = 8;    // rows one pass over the weight serves
// Column blocks per pass for more than eight rows: their weight tile (3 x 16 outputs x K inputs,
// 55 KB at K = 576) stays in L1/L2 while every eight-row chunk of x passes over it.
constexpr int kTiledColumns = 3;

// bf16: one step is a pair of input features, multiplied and summed in one VDPBF16PS.
struct Bf16Pairs {
  using Weight = c10::BFloat16;
  using Step = int32_t;  // a pair of bf16 inputs, broadcast as one 32-bit lane
  static constexpr int64_t kFeaturesPerStep = 2;
  static inline __m512i load(const Weight* w) { return _mm512_loadu_si512(w); }
  static inline __m512 multiply_add(__m512 acc, __m512i w, Step x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(x));
  }
};

// fp32: one step is one input feature, one fused multiply-add.
struct Fp32Single {
  using Weight = float;
  using Step = float;
  static constexpr int64_t kFeaturesPerStep = 1;
  static inline __m512 load(const Weight* w) { return _mm512_loadu_ps(w); }
  static inline __m512 multiply_add(__m512 acc, __m512 w, Step x) { return _mm512_fmadd_ps(w, _mm512_set1_ps(x), acc); }
};

// Outputs [n_block * 16, (n_block + C) * 16) for M rows of x: one pass over those C blocks.
template <typename K, int M, int C>
inline void column_blocks(const typename K::Weight* weight, const typename K::Step* x_steps, float* out,
                          int64_t n_block, int64_t steps, int64_t out_features,
                          const typename K::Weight* next = nullptr) {
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t step_elems = K::kFeaturesPerStep * kLanes;
  const int64_t block_elems = steps * step_elems;
  const typename K::Weight* w = weight + n_block * block_elems;
  for (int64_t p = 0; p < steps; ++p) {
    if (next != nullptr)
      for (int c = 0; c < C; ++c) __builtin_prefetch(next + c * block_elems + p * step_elems);
    decltype(K::load(w)) wv[C];
    for (int c = 0; c < C; ++c) wv[c] = K::load(w + c * block_elems + p * step_elems);
    for (int m = 0; m < M; ++m) {
      const typename K::Step xv = x_steps[m * steps + p];
      for (int c = 0; c < C; ++c) acc[m][c] = K::multiply_add(acc[m][c], wv[c], xv);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t col = ((out_block < 0 ? n_block : out_block) + c) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, out_features - col);
    const __mmask16 mask = valid == kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(out + m * out_features + col, mask, acc[m][c]);
  }
}

// x holds one Step per step of a row (a bf16 pair as one int32, or one float).
template <typename K>
constexpr int64_t kXPerStep = 1;

// As many column blocks per pass as leave the accumulators in registers (32 zmm in all).
template <int M>
constexpr int columns_per_pass() { return M <= 2 ? 8 : (M <= 6 ? 4 : 3); }

#elif defined(__AVX2__) && defined(__FMA__)

namespace {

constexpr int64_t kLanes = 16;  // fp32 outputs per column block (the packed layout's)

// AVX2 + FMA: 16 ymm registers. A column block is two 8-lane halves; x is widened to fp32 once per
// call, so each step broadcasts fp32 features, and a bf16 weight pair is split into its even and odd
// feature in registers.
constexpr int64_t kMaxRows = 6;         // rows one pass over the weight serves (12 accumulators at C = 1)
constexpr int kTiledColumns = 1;        // more rows: a 16-output tile (96 KB at K = 1536) held in L2

struct Fp32Single {
  using Weight = float;
  static constexpr int64_t kFeaturesPerStep = 1;
  // The step's weights of the block's low and high eight lanes (lo[f], hi[f] for feature f).
  static inline void load(const Weight* w, __m256* lo, __m256* hi) {
    lo[0] = _mm256_loadu_ps(w);
    hi[0] = _mm256_loadu_ps(w + 8);
  }
};

struct Bf16Pairs {
  using Weight = c10::BFloat16;
  static constexpr int64_t kFeaturesPerStep = 2;
  static inline void load(const Weight* w, __m256* lo, __m256* hi) {
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    // Eight 32-bit lanes each: a pair (even feature in the low half, odd in the high half).
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
    lo[0] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    lo[1] = _mm256_castsi256_ps(_mm256_and_si256(a, high));
    hi[0] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    hi[1] = _mm256_castsi256_ps(_mm256_and_si256(b, high));
  }
};

// Accumulators in flat arrays (row-major [M][C]) and every loop over them unrolled early: only then
// does GCC keep them in registers rather than write them back to the stack on every step.
// out_block: the output columns' block, where it is not n_block (a tile widened into a buffer of its own).
template <typename K, int M, int C>
inline void column_blocks(const typename K::Weight* weight, const float* x, float* out, int64_t n_block,
                          int64_t steps, int64_t out_features, const typename K::Weight* next = nullptr,
                          int64_t out_block = -1) {
  constexpr int F = K::kFeaturesPerStep;
  const int64_t in_features = steps * F;
  __m256 lo[M * C], hi[M * C];
  #pragma GCC unroll 16
  for (int i = 0; i < M * C; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  const int64_t step_elems = F * kLanes;
  const int64_t block_elems = steps * step_elems;
  const typename K::Weight* w = weight + n_block * block_elems;
  for (int64_t p = 0; p < steps; ++p) {
    if (next != nullptr)
      for (int c = 0; c < C; ++c) __builtin_prefetch(next + c * block_elems + p * step_elems);
    __m256 wlo[C * F], whi[C * F];
    #pragma GCC unroll 16
    for (int c = 0; c < C; ++c) K::load(w + c * block_elems + p * step_elems, wlo + c * F, whi + c * F);
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      #pragma GCC unroll 16
      for (int f = 0; f < F; ++f) {
        const __m256 xv = _mm256_broadcast_ss(x + m * in_features + p * F + f);
        #pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
          lo[m * C + c] = _mm256_fmadd_ps(wlo[c * F + f], xv, lo[m * C + c]);
          hi[m * C + c] = _mm256_fmadd_ps(whi[c * F + f], xv, hi[m * C + c]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const int64_t col = ((out_block < 0 ? n_block : out_block) + c) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, out_features - col);
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      float* dst = out + m * out_features + col;
      if (valid == kLanes) {
        _mm256_storeu_ps(dst, lo[m * C + c]);
        _mm256_storeu_ps(dst + 8, hi[m * C + c]);
      } else {  // the last block of an out_features that is no multiple of 16
        alignas(32) float tail[kLanes];
        _mm256_store_ps(tail, lo[m * C + c]);
        _mm256_store_ps(tail + 8, hi[m * C + c]);
        std::memcpy(dst, tail, valid * sizeof(float));
      }
    }
  }
}

// x holds a row's features as fp32: kFeaturesPerStep floats per step.
template <typename K>
constexpr int64_t kXPerStep = K::kFeaturesPerStep;

// Column blocks per pass at M rows: 2 * M * C accumulators of the 16 registers.
template <int M>
constexpr int columns_per_pass() { return M <= 1 ? 4 : (M <= 3 ? 2 : 1); }

// A bf16 column block ([steps][16][2]) widened to fp32 in Fp32Single's layout ([2 * steps][16]): for more
// rows than one pass serves, each chunk of rows would widen the same tile again, and from a few chunks
// the shifts and masks cost more than the multiply-adds leave room for. Widened once into a buffer
// that stays in L2, the chunks run at fp32's rate while the weight still crosses the bus at two bytes.
inline void widen_block(const c10::BFloat16* block, float* wide, int64_t steps, const c10::BFloat16* next) {
  constexpr int64_t kStepElems = 2 * kLanes;
  for (int64_t p = 0; p < steps; ++p) {
    if (next != nullptr) __builtin_prefetch(next + p * kStepElems);
    __m256 lo[2], hi[2];
    Bf16Pairs::load(block + p * kStepElems, lo, hi);
    float* even = wide + 2 * p * kLanes;
    _mm256_storeu_ps(even, lo[0]);
    _mm256_storeu_ps(even + 8, hi[0]);
    _mm256_storeu_ps(even + kLanes, lo[1]);
    _mm256_storeu_ps(even + kLanes + 8, hi[1]);
  }
}

#define BACKFILL_WIDEN_BF16_TILES 1
// Widened from this many chunks of rows up: for two, widening the tile (and reading the fp32 copy, over
// L1's size, from L2) costs more than the second widening it saves (8 rows: 0.8x the rate unwidened).
constexpr int64_t kWidenFromChunks = 3;

// x as fp32 (the kernel's input type on AVX2): bf16 rows are widened once per call.
inline const float* fp32_rows(const at::Tensor& x, at::Tensor& holder) {
  holder = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

#else
#error "the small-batch kernel needs AVX-512 BF16, or AVX2 and FMA"
#endif

// M rows against the whole weight, the column blocks split over PyTorch's intra-op threads.
template <typename K, typename X, int M>
void rows_against_weight(const typename K::Weight* weight, const X* x, float* out, int64_t out_features,
                         int64_t steps) {
  constexpr int C = columns_per_pass<M>();
  const int64_t blocks = (out_features + kLanes - 1) / kLanes;
  const int64_t groups = (blocks + C - 1) / C;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * C;
      if (first + C <= blocks) {
        column_blocks<K, M, C>(weight, x, out, first, steps, out_features);
      } else {
        for (int64_t b = first; b < blocks; ++b) column_blocks<K, M, 1>(weight, x, out, b, steps, out_features);
      }
    }
  });
}

template <typename K, typename X, int M>
void chunk_against_tile(const typename K::Weight* weight, const X* x, float* out, int64_t first, int64_t last,
                        int64_t steps, int64_t out_features, const typename K::Weight* next) {
  if (last - first == kTiledColumns) {
    column_blocks<K, M, kTiledColumns>(weight, x, out, first, steps, out_features, next);
  } else {
    for (int64_t b = first; b < last; ++b) column_blocks<K, M, 1>(weight, x, out, b, steps, out_features);
  }
}

template <typename K, typename X, int... Ms>
constexpr auto chunk_fns(std::integer_sequence<int, Ms...>) {
  using ChunkFn = void (*)(const typename K::Weight*, const X*, float*, int64_t, int64_t, int64_t, int64_t,
                           const typename K::Weight*);
  return std::array<ChunkFn, sizeof...(Ms)>{chunk_against_tile<K, X, Ms + 1>...};
}

#if defined(BACKFILL_WIDEN_BF16_TILES)
// A chunk of M rows against a widened column block (see widen_block), written to the block's columns.
template <typename X, int M>
void chunk_against_wide(const float* wide, const X* x, float* out, int64_t block, int64_t steps,
                        int64_t out_features) {
  column_blocks<Fp32Single, M, 1>(wide, x, out, 0, steps, out_features, nullptr, block);
}

template <typename X, int... Ms>
constexpr auto wide_chunk_fns(std::integer_sequence<int, Ms...>) {
  using WideFn = void (*)(const float*, const X*, float*, int64_t, int64_t, int64_t);
  return std::array<WideFn, sizeof...(Ms)>{chunk_against_wide<X, Ms + 1>...};
}
#endif

template <typename K, typename X, int... Ms>
constexpr auto rows_fns(std::integer_sequence<int, Ms...>) {
  using RowsFn = void (*)(const typename K::Weight*, const X*, float*, int64_t, int64_t);
  return std::array<RowsFn, sizeof...(Ms)>{rows_against_weight<K, X, Ms + 1>...};
}

// More than kMaxRows rows: each thread takes a range of column groups and runs every chunk of x
// against one group's weight tile before the next, so the weight is read from memory once
// (rows outside, weight inside would read it once per chunk: at 64 rows, eight times).
template <typename K, typename X>
void many_rows(const typename K::Weight* weight, const X* x, float* out, int64_t rows, int64_t out_features,
               int64_t steps) {
  static constexpr auto kChunkFns = chunk_fns<K, X>(std::make_integer_sequence<int, kMaxRows>{});
  const int64_t x_row = steps * kXPerStep<K>;
  const int64_t blocks = (out_features + kLanes - 1) / kLanes;
  const int64_t groups = (blocks + kTiledColumns - 1) / kTiledColumns;
  balanced::parallel_for(groups, [&](int64_t g, int64_t next_group) {
    const int64_t first = g * kTiledColumns, last = std::min(blocks, first + kTiledColumns);
    // The first pass reads the tile from memory; it also asks for the next tile a line per step, so
    // that the weight streams in beside the multiply-adds instead of between tiles.
    const typename K::Weight* next =
        next_group >= 0 ? weight + next_group * kTiledColumns * steps * K::kFeaturesPerStep * kLanes : nullptr;
#if defined(BACKFILL_WIDEN_BF16_TILES)
    if constexpr (std::is_same_v<K, Bf16Pairs>) {
      static_assert(kTiledColumns == 1, "a widened tile is one column block");
      if (rows > (kWidenFromChunks - 1) * kMaxRows) {
        static constexpr auto kWideFns = wide_chunk_fns<X>(std::make_integer_sequence<int, kMaxRows>{});
        thread_local std::vector<float> wide;
        wide.resize(2 * steps * kLanes);
        widen_block(weight + first * steps * 2 * kLanes, wide.data(), steps, next);
        for (int64_t row = 0; row < rows; row += kMaxRows) {
          const int64_t count = std::min<int64_t>(kMaxRows, rows - row);
          kWideFns[count - 1](wide.data(), x + row * x_row, out + row * out_features, first, 2 * steps,
                              out_features);
        }
        return;
      }
    }
#endif
    for (int64_t row = 0; row < rows; row += kMaxRows) {
      const int64_t count = std::min<int64_t>(kMaxRows, rows - row);
      kChunkFns[count - 1](weight, x + row * x_row, out + row * out_features, first, last, steps, out_features,
                           row == 0 ? next : nullptr);
    }
  });
}

template <typename K, typename X>
void all_rows(const typename K::Weight* weight, const X* x, float* out, int64_t rows, int64_t out_features,
              int64_t steps) {
  static constexpr auto kRowsFns = rows_fns<K, X>(std::make_integer_sequence<int, kMaxRows>{});
  if (rows == 0) return;
  if (rows > kMaxRows) {
    many_rows<K, X>(weight, x, out, rows, out_features, steps);
    return;
  }
  kRowsFns[rows - 1](weight, x, out, out_features, steps);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BACKFILL_TILES 1

// Linux hands out the AMX tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); without it the first tile instruction faults. Asked once per process.
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: tiles 0-3 accumulate (16 rows x 16 fp32 outputs), 4-5 hold x
// (16 rows x 32 bf16 inputs), 6-7 the weight (16 pair-steps x 16 outputs x 2).
inline void configure_tiles() {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

constexpr int64_t kTileSteps = 16;                         // pair-steps per weight tile
constexpr int64_t kTileElems = kTileSteps * 2 * kLanes;    // bf16 per weight tile (1 KB)
constexpr int64_t kTileInputs = 2 * kTileSteps;            // input features per tile
// Weight tiles ahead of the ones multiplied that are asked into cache: the tile loads wait on
// memory where the hardware prefetcher has not run ahead of four streams at once.
constexpr int64_t kPrefetchTiles = 4;

inline void prefetch_tile(const c10::BFloat16* tile) {
  const char* bytes = reinterpret_cast<const char*>(tile);
  for (int line = 0; line < 16; ++line) _mm_prefetch(bytes + line * 64, _MM_HINT_T0);
}

// Rows [row0, row0 + 16) of an accumulator tile stored at `tile`, those below `rows`, into out.
inline void write_tile(const float* tile, float* out, int64_t row0, int64_t rows, int64_t col, int64_t out_features) {
  const int64_t valid = std::min<int64_t>(kLanes, out_features - col);
  const __mmask16 mask = valid == kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
  for (int64_t r = 0; r < 16 && row0 + r < rows; ++r)
    _mm512_mask_storeu_ps(out + (row0 + r) * out_features + col, mask, _mm512_loadu_ps(tile + r * kLanes));
}

// Up to 16 rows: four column blocks a pass, one x tile against each block's weight tile.
void tiles_one_row_tile(const c10::BFloat16* weight, const c10::BFloat16* x, float* out, int64_t rows,
                        int64_t out_features, int64_t in_features, int64_t first, int64_t last) {
  alignas(64) float acc[4][16 * kLanes];
  const int64_t block_elems = in_features * kLanes, chunks = in_features / kTileInputs, x_stride = in_features * 2;
  int64_t b = first;
  for (; b + 4 <= last; b += 4) {
    const c10::BFloat16* w = weight + b * block_elems;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < chunks; ++k) {
      for (int c = 0; c < 4; ++c) prefetch_tile(w + c * block_elems + (k + kPrefetchTiles) * kTileElems);
      _tile_loadd(4, x + k * kTileInputs, x_stride);
      _tile_loadd(6, w + k * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, w + block_elems + k * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, w + 2 * block_elems + k * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, w + 3 * block_elems + k * kTileElems, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
    _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64); _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
    for (int c = 0; c < 4; ++c) write_tile(acc[c], out, 0, rows, (b + c) * kLanes, out_features);
  }
  for (; b < last; ++b) {
    const c10::BFloat16* w = weight + b * block_elems;
    _tile_zero(0);
    for (int64_t k = 0; k < chunks; ++k) {
      _tile_loadd(4, x + k * kTileInputs, x_stride);
      _tile_loadd(6, w + k * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, acc[0], 64);
    write_tile(acc[0], out, 0, rows, b * kLanes, out_features);
  }
}

// 17 to 32 rows: column blocks in pairs against two x tiles.
void tiles_two_row_tiles(const c10::BFloat16* weight, const c10::BFloat16* x, float* out, int64_t rows,
                         int64_t out_features, int64_t in_features, int64_t first, int64_t last) {
  alignas(64) float acc[4][16 * kLanes];
  const int64_t block_elems = in_features * kLanes, chunks = in_features / kTileInputs, x_stride = in_features * 2;
  const c10::BFloat16* x_low = x + 16 * in_features;
  for (int64_t b = first; b < last; b += 2) {
    const bool pair = b + 1 < last;
    const c10::BFloat16* w0 = weight + b * block_elems;
    const c10::BFloat16* w1 = pair ? w0 + block_elems : w0;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < chunks; ++k) {
      prefetch_tile(w0 + (k + kPrefetchTiles) * kTileElems);
      prefetch_tile(w1 + (k + kPrefetchTiles) * kTileElems);
      _tile_loadd(4, x + k * kTileInputs, x_stride);
      _tile_loadd(6, w0 + k * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, w1 + k * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, x_low + k * kTileInputs, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64); _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
    write_tile(acc[0], out, 0, rows, b * kLanes, out_features);
    write_tile(acc[2], out, 16, rows, b * kLanes, out_features);
    if (pair) {
      write_tile(acc[1], out, 0, rows, (b + 1) * kLanes, out_features);
      write_tile(acc[3], out, 16, rows, (b + 1) * kLanes, out_features);
    }
  }
}

// More rows: one column block at a time against up to four x tiles (64 rows) a pass; the block's
// weight stays in cache for the passes after the first.
void tiles_four_row_tiles(const c10::BFloat16* weight, const c10::BFloat16* x, float* out, int64_t rows,
                          int64_t padded_rows, int64_t out_features, int64_t in_features, int64_t first, int64_t last) {
  alignas(64) float acc[4][16 * kLanes];
  const int64_t block_elems = in_features * kLanes, chunks = in_features / kTileInputs, x_stride = in_features * 2;
  for (int64_t b = first; b < last; ++b) {
    const c10::BFloat16* w = weight + b * block_elems;
    for (int64_t r = 0; r < padded_rows; r += 64) {
      const c10::BFloat16* xr = x + r * in_features;
      const int64_t tiles = std::min<int64_t>(4, (padded_rows - r) / 16);
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t k = 0; k < chunks; ++k) {
        if (r == 0) prefetch_tile(w + (k + 2 * kPrefetchTiles) * kTileElems);
        _tile_loadd(6, w + k * kTileElems, 64);
        _tile_loadd(4, xr + k * kTileInputs, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (tiles > 1) { _tile_loadd(5, xr + 16 * in_features + k * kTileInputs, x_stride); _tile_dpbf16ps(1, 5, 6); }
        if (tiles > 2) { _tile_loadd(4, xr + 32 * in_features + k * kTileInputs, x_stride); _tile_dpbf16ps(2, 4, 6); }
        if (tiles > 3) { _tile_loadd(5, xr + 48 * in_features + k * kTileInputs, x_stride); _tile_dpbf16ps(3, 5, 6); }
      }
      _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64); _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
      for (int t = 0; t < tiles; ++t) write_tile(acc[t], out, r + 16 * t, rows, b * kLanes, out_features);
    }
  }
}
#endif  // AMX tiles

// x [M, K] and a weight packed by pack_for_small_batches (small_batch_matmul.py): [ceil(N/16), K * 16],
// both bf16, both fp32, or fp32 x with bf16 weights. Returns x @ W.T in fp32, [M, N].
at::Tensor packed_matmul(const at::Tensor& packed_weight, const at::Tensor& x, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed_weight.device().is_cpu(), "packed_matmul runs on CPU");
  const bool bf16 = packed_weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || packed_weight.scalar_type() == at::kFloat) &&
                  (x.scalar_type() == packed_weight.scalar_type() || x.scalar_type() == at::kFloat),
              "packed_matmul takes a bf16 or fp32 weight and x of its dtype or fp32, got x ", x.scalar_type(),
              " and weight ", packed_weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && packed_weight.dim() == 2, "packed_matmul takes 2-D x and a packed weight");
  const int64_t in_features = x.size(1);
  TORCH_CHECK(!bf16 || in_features % 2 == 0, "bf16 in_features must be even, got ", in_features);
  TORCH_CHECK(packed_weight.size(0) == (out_features + kLanes - 1) / kLanes &&
                  packed_weight.size(1) == in_features * kLanes,
              "packed weight of shape ", packed_weight.sizes(), " does not match ", out_features, " x ", in_features);
  const at::Tensor wc = packed_weight.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  // bf16 weights multiply bf16 pairs of x here: fp32 rows (a model whose activations are fp32) are rounded.
  const at::Tensor xc = bf16 ? x.to(at::kBFloat16).contiguous() : x.contiguous();
  if (bf16) {
    all_rows<Bf16Pairs>(wc.data_ptr<c10::BFloat16>(), reinterpret_cast<const int32_t*>(xc.data_ptr<c10::BFloat16>()),
                        out.data_ptr<float>(), x.size(0), out_features, in_features / 2);
  } else {
    all_rows<Fp32Single>(wc.data_ptr<float>(), xc.data_ptr<float>(), out.data_ptr<float>(), x.size(0), out_features,
                         in_features);
  }
#else
  at::Tensor holder;
  const float* xf = fp32_rows(x, holder);
  if (bf16) {
    all_rows<Bf16Pairs>(wc.data_ptr<c10::BFloat16>(), xf, out.data_ptr<float>(), x.size(0), out_features,
                        in_features / 2);
  } else {
    all_rows<Fp32Single>(wc.data_ptr<float>(), xf, out.data_ptr<float>(), x.size(0), out_features, in_features);
  }
#endif
  return out;
}

// packed_matmul on AMX tiles: bf16 x [M, K] (K a multiple of 32) and a bf16 weight packed by
// pack_for_small_batches. Returns x @ W.T in fp32, [M, N].
at::Tensor packed_matmul_tiles(const at::Tensor& packed_weight, const at::Tensor& x, int64_t out_features) {
#if defined(BACKFILL_TILES)
  TORCH_CHECK(x.device().is_cpu() && packed_weight.device().is_cpu(), "packed_matmul_tiles runs on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed_weight.scalar_type() == at::kBFloat16,
              "packed_matmul_tiles takes a bf16 x and weight, got ", x.scalar_type(), " and ",
              packed_weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && packed_weight.dim() == 2, "packed_matmul_tiles takes 2-D x and a packed weight");
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(in_features % kTileInputs == 0, "packed_matmul_tiles needs in_features a multiple of ", kTileInputs,
              ", got ", in_features);
  TORCH_CHECK(packed_weight.size(0) == (out_features + kLanes - 1) / kLanes &&
                  packed_weight.size(1) == in_features * kLanes,
              "packed weight of shape ", packed_weight.sizes(), " does not match ", out_features, " x ", in_features);
  TORCH_CHECK(tiles_permitted(), "the kernel did not grant this process the AMX tile state (arch_prctl)");
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  if (rows == 0) return out;
  // x in whole 16-row tiles, the rows past `rows` zero.
  const int64_t padded_rows = (rows + 15) / 16 * 16;
  at::Tensor xp = x.contiguous();
  if (padded_rows != rows) {
    xp = at::zeros({padded_rows, in_features}, x.options());
    xp.narrow(0, 0, rows).copy_(x);
  }
  const at::Tensor wc = packed_weight.contiguous();
  const c10::BFloat16* w = wc.data_ptr<c10::BFloat16>();
  const c10::BFloat16* xb = xp.data_ptr<c10::BFloat16>();
  float* o = out.data_ptr<float>();
  const int64_t blocks = (out_features + kLanes - 1) / kLanes;
  const int64_t per_group = padded_rows <= 16 ? 4 : (padded_rows <= 32 ? 2 : 1);
  const int64_t groups = (blocks + per_group - 1) / per_group;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();  // the tile configuration is each thread's own
    const int64_t first = begin * per_group, last = std::min(blocks, end * per_group);
    if (padded_rows <= 16) {
      tiles_one_row_tile(w, xb, o, rows, out_features, in_features, first, last);
    } else if (padded_rows <= 32) {
      tiles_two_row_tiles(w, xb, o, rows, out_features, in_features, first, last);
    } else {
      tiles_four_row_tiles(w, xb, o, rows, padded_rows, out_features, in_features, first, last);
    }
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "packed_matmul_tiles: built for a CPU without AMX tiles");
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY(backfill, m) {
  m.def("packed_matmul(Tensor packed_weight, Tensor x, int out_features) -> Tensor");
  m.def("packed_matmul_tiles(Tensor packed_weight, Tensor x, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(backfill, CPU, m) {
  m.impl("packed_matmul", packed_matmul);
  m.impl("packed_matmul_tiles", packed_matmul_tiles);
}
