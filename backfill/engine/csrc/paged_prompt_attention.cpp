// Causal attention of prompt chunks, read straight from the paged KV pool, for CPU
// (backfill/engine/paged_attention.py).
//
// A step's prompt chunks (whole prompts or the later chunks of long ones) attend to their own
// tokens and everything before them. SDPA takes one chunk at a time from a gathered copy of its
// keys and values, and for a 128-token prompt spends most of its time on fixed costs: about 0.4 ms
// a layer for 19 MFLOP of causal products. Here one call per layer takes every chunk of the step.
// Each (chunk, KV head)'s keys and values are first read from the pool where they lie and converted
// to fp32 once, the keys transposed so that a query's scores against consecutive keys are vectors
// of fused multiply-adds (no sums across lanes); chunks whose block tables start with the same
// blocks (questions after one cached system prompt) share one conversion of those. A task is then
// one (chunk, KV head, tile of 16 query tokens): it walks the keys the tile may see, 64 at a time,
// and keeps a running softmax (FlashAttention's) for the tile's queries of every query head sharing
// that KV head, weighing the values a few query rows at a time with the accumulators in registers.
// Tasks are dealt out longest and shortest in turn, so the threads of PyTorch's intra-op pool get
// equal shares of the causal triangle.
//
// The arithmetic is ATen's Vectorized<float> (AVX-512 / AVX2 / scalar, chosen at build time by the
// CPU_CAPABILITY macros the loader passes), as in paged_decode_attention.cpp. On an AMX machine, a
// bf16 chunk's keys before its first token (whole key tiles of them) go through tile_attention.h
// for all the chunk's query rows at once, and attend_tile carries on from that softmax state.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "tile_attention.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Keys per tile: four or eight vectors of scores per query row, so that the running softmax's
// per-row work (two sums across lanes, a rescale) is spread over 64 keys.
constexpr int64_t kKeyTile = 64;
constexpr int64_t kQueryTile = 16;  // query tokens per task
constexpr int64_t kScoreVecs = kKeyTile / kLanes;
static_assert(kKeyTile % kLanes == 0, "a key tile is whole vectors");
// Register blocks: AVX-512 has 32 vector registers, AVX2 16. Query rows are scored kScoreRows at a
// time against kBlockVecs vectors of keys (a whole tile on AVX-512), and values weighed a few rows at
// a time over kBlockVecs vectors of head dims, so that the accumulators and the operands they share
// stay in registers: 16 accumulators of 32 registers. On AVX2, 6 rows by 2 vectors: 12 accumulators,
// and 8 loads (2 vectors, 6 broadcasts) feed 12 fused multiply-adds; 2 rows by 4 vectors (8 loads
// for 8) ran slower, and whole-tile blocks spilled.
constexpr bool kWideRegisters = kLanes >= 16;
constexpr int64_t kBlockVecs = kWideRegisters ? kScoreVecs : std::min<int64_t>(2, kScoreVecs);
constexpr int kScoreRows = kWideRegisters ? std::max<int>(1, static_cast<int>(16 / kScoreVecs)) : 6;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Calls block(std::integral_constant<int, R>, r) for rows [r, r + R) of [0, rows): blocks of kRows,
// then the remainder (fewer than kRows) in one block of its own size.
template <int kRows, typename Block>
inline void in_row_blocks(int64_t rows, Block&& block, int64_t r = 0) {
  for (; r + kRows <= rows; r += kRows) block(std::integral_constant<int, kRows>(), r);
  if constexpr (kRows > 1)
    if (r < rows) in_row_blocks<kRows - 1>(rows, block, r);
}

// One row of head_dim elements as fp32.
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    int64_t d = 0;
    for (; d + kLanes <= n; d += kLanes) {
      Vec out;
      if constexpr (std::is_same_v<T, c10::BFloat16>) at::vec::load_fp32_from_bf16(src + d, out);
      else at::vec::load_fp32_from_fp16(src + d, out);
      out.store(dst + d);
    }
    for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

struct Shape {
  int64_t n_q, n_kv, group, head_dim, block_size, width;
  int64_t q_token_stride;  // elements between two tokens of q (q may be a view into q/k/v)
};

struct Span {
  int64_t token_start, num_tokens, start_pos;
};

// Scratch of one thread, for one task at a time.
struct Scratch {
  std::vector<float> query, acc, max, sum, scores;
  Scratch(const Shape& s, int64_t rows)
      : query(rows * s.head_dim), acc(rows * s.head_dim), max(rows), sum(rows), scores(rows * kKeyTile) {}
};

// One (span, KV head)'s rows' softmax state over the keys the tiles took: [rows][head_dim], [rows], [rows].
struct PrefixState {
  float* acc;
  float* max;
  float* sum;
};

// One (span, KV head)'s keys and values up to its last token, in fp32: the keys transposed within
// each key tile, [tiles][head_dim][kKeyTile] (zero past the context), the values [tokens][head_dim].
// Keys before own_begin are the span's prefix, converted once for every span of its PrefixGroup (or
// folded in on tiles); the rest are its own. Read by every query tile of the span.
struct Context {
  const float* prefix_keys_t;  // positions [0, own_begin)
  const float* prefix_values;
  const float* keys_t;  // positions [own_begin, the context rounded up to whole key tiles)
  const float* values;
  int64_t own_begin;

  const float* tile_keys(int64_t k0, int64_t hd) const {
    return k0 < own_begin ? prefix_keys_t + k0 * hd : keys_t + (k0 - own_begin) * hd;
  }
  const float* tile_values(int64_t k0, int64_t hd) const {
    return k0 < own_begin ? prefix_values + k0 * hd : values + (k0 - own_begin) * hd;
  }
};

// The pool's row of one token (absolute position) for one KV head.
template <typename T>
inline const T* pool_row(const Shape& s, const T* pool, const int64_t* table, int64_t pos, int64_t head) {
  const int64_t block = table[pos / s.block_size];
  return pool + ((block * s.block_size + pos % s.block_size) * s.n_kv + head) * s.head_dim;
}

// Scores of `rows` query rows against the key tile: scores[r][j] = q[r] . k[j]. R rows by kBlockVecs
// key vectors at a time, so that that many independent chains of fused multiply-adds are in flight.
template <int64_t kHeadDim, int R>
inline void score_rows(const float* query, const float* keys_t, int64_t key_stride, float* scores, int64_t hd) {
  const int64_t n = kHeadDim > 0 ? kHeadDim : hd;
  for (int64_t v0 = 0; v0 < kScoreVecs; v0 += kBlockVecs) {
    Vec acc[R][kBlockVecs];
    for (int r = 0; r < R; ++r)
      for (int64_t v = 0; v < kBlockVecs; ++v) acc[r][v] = Vec(0.0f);
    for (int64_t d = 0; d < n; ++d) {
      Vec k[kBlockVecs];
      for (int64_t v = 0; v < kBlockVecs; ++v) k[v] = Vec::loadu(keys_t + d * key_stride + (v0 + v) * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec q(query[r * n + d]);
        for (int64_t v = 0; v < kBlockVecs; ++v) acc[r][v] = at::vec::fmadd(q, k[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t v = 0; v < kBlockVecs; ++v) acc[r][v].store(scores + r * kKeyTile + (v0 + v) * kLanes);
  }
}

// acc[r] += sum over the tile's keys j of p[r][j] * value[j], for R rows with acc in registers, a
// block of kBlockVecs vectors of head dims at a time.
template <int64_t kHeadDim, int R>
inline void weigh_values(const float* probs, const float* values, float* acc, int64_t keys) {
  constexpr int64_t kChunks = kHeadDim / kLanes;
  constexpr int64_t C = std::min<int64_t>(kChunks, kBlockVecs);
  static_assert(kChunks % C == 0, "head dims in whole register blocks");
  for (int64_t c0 = 0; c0 < kChunks; c0 += C) {
    Vec sums[R][C];
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) sums[r][c] = Vec::loadu(acc + r * kHeadDim + (c0 + c) * kLanes);
    for (int64_t j = 0; j < keys; ++j) {
      Vec v[C];
      for (int64_t c = 0; c < C; ++c) v[c] = Vec::loadu(values + j * kHeadDim + (c0 + c) * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec p(probs[r * kKeyTile + j]);
        for (int64_t c = 0; c < C; ++c) sums[r][c] = at::vec::fmadd(p, v[c], sums[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) sums[r][c].store(acc + r * kHeadDim + (c0 + c) * kLanes);
  }
}

// The same for a head size not fixed at compile time, one row at a time.
inline void weigh_values_any(const float* probs, const float* values, float* acc, int64_t keys, int64_t hd) {
  for (int64_t j = 0; j < keys; ++j) {
    const float p = probs[j];
    for (int64_t d = 0; d < hd; ++d) acc[d] += p * values[j * hd + d];
  }
}

// A stretch of one KV head's keys and values to convert into fp32 buffers whose first position is
// `base` (whole key tiles): positions [begin, end) of a block table, zero from `context` on.
struct Conversion {
  const int64_t* table;
  int64_t head;
  float* keys_t;
  float* values;
  int64_t base, begin, end, context;
};

template <typename T>
void convert(const Shape& s, const Conversion& c, const T* k_pool, const T* v_pool) {
  const int64_t hd = s.head_dim;
  std::vector<float> key_row(hd);
  for (int64_t pos = c.begin; pos < c.end; ++pos) {
    const int64_t at = pos - c.base;
    float* tile = c.keys_t + at / kKeyTile * hd * kKeyTile + at % kKeyTile;
    float* value = c.values + at * hd;
    if (pos < c.context) {
      row_to_float(pool_row(s, k_pool, c.table, pos, c.head), key_row.data(), hd);
      for (int64_t d = 0; d < hd; ++d) tile[d * kKeyTile] = key_row[d];
      row_to_float(pool_row(s, v_pool, c.table, pos, c.head), value, hd);
    } else {
      for (int64_t d = 0; d < hd; ++d) tile[d * kKeyTile] = 0.0f;
      std::fill(value, value + hd, 0.0f);
    }
  }
}

// One task: query tokens [first, last) of a span (relative to it), every query head of KV head `head`.
// prefix: where keys [0, key_begin) were already folded in (on tiles), the running max, sum and
// weighted values of the span's rows for this head (row token * group + g); unused when key_begin is 0.
template <typename T, int64_t kHeadDim>
void attend_tile(const Shape& s, const Span& span, const Context& ctx, const T* q, T* out, int64_t head,
                 int64_t first, int64_t last, int64_t key_begin, const PrefixState& prefix, Scratch& scratch) {
  const int64_t hd = kHeadDim > 0 ? kHeadDim : s.head_dim, group = s.group;
  const int64_t rows = (last - first) * group;  // row r: token first + r / group, query head head * group + r % group
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* query = scratch.query.data();
  float* acc = scratch.acc.data();
  float* scores = scratch.scores.data();
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (span.token_start + first + r / group) * s.q_token_stride + (head * group + r % group) * hd;
    for (int64_t d = 0; d < hd; ++d) query[r * hd + d] = static_cast<float>(src[d]) * scale;
    if (key_begin > 0) {
      const int64_t row = first * group + r;
      std::copy(prefix.acc + row * hd, prefix.acc + (row + 1) * hd, acc + r * hd);
      scratch.max[r] = prefix.max[row];
      scratch.sum[r] = prefix.sum[row];
    } else {
      std::fill(acc + r * hd, acc + (r + 1) * hd, 0.0f);
      scratch.max[r] = kNegInf;
      scratch.sum[r] = 0.0f;
    }
  }
  const int64_t first_pos = span.start_pos + first;     // the tile's first query position
  const int64_t key_end = span.start_pos + last;        // keys [0, key_end) are visible to its last
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyTile) {
    const int64_t keys = std::min(kKeyTile, key_end - k0);
    const float* keys_t = ctx.tile_keys(k0, hd);
    const float* values = ctx.tile_values(k0, hd);
    in_row_blocks<kScoreRows>(rows, [&](auto block_rows, int64_t r) {
      score_rows<kHeadDim, decltype(block_rows)::value>(query + r * hd, keys_t, kKeyTile, scores + r * kKeyTile, hd);
    });
    // Causal mask and the running softmax, row by row.
    const bool masked = k0 + kKeyTile - 1 > first_pos;  // some key of the tile lies past some query
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores + r * kKeyTile;
      const int64_t pos = first_pos + r / group;
      const int64_t visible = masked ? std::min(keys, std::max<int64_t>(0, pos - k0 + 1)) : keys;
      for (int64_t j = visible; j < kKeyTile; ++j) sr[j] = kNegInf;
      Vec top(kNegInf);
      for (int64_t v = 0; v < kScoreVecs; ++v) top = at::vec::maximum(top, Vec::loadu(sr + v * kLanes));
      const float tile_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                                            top);
      if (tile_max == kNegInf) {  // no key of this tile is visible to this query
        std::fill(sr, sr + kKeyTile, 0.0f);
        continue;
      }
      const float new_max = std::max(scratch.max[r], tile_max);
      if (new_max > scratch.max[r]) {
        const float rescale = std::exp(scratch.max[r] - new_max);  // 0 on the first tile (-inf)
        scratch.sum[r] *= rescale;
        float* ar = acc + r * hd;
        int64_t d = 0;
        for (; d + kLanes <= hd; d += kLanes) (Vec::loadu(ar + d) * Vec(rescale)).store(ar + d);
        for (; d < hd; ++d) ar[d] *= rescale;
        scratch.max[r] = new_max;
      }
      Vec total(0.0f);
      for (int64_t v = 0; v < kScoreVecs; ++v) {
        const Vec x = Vec::loadu(sr + v * kLanes);
        const Vec p = Vec::blendv(Vec(0.0f), (x - Vec(new_max)).exp_u20(), x > Vec(kNegInf));
        p.store(sr + v * kLanes);
        total = total + p;
      }
      scratch.sum[r] += at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
    }
    if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
      // Rows weighed at once: their accumulators (rows x kBlockVecs) take 16 of AVX-512's 32 registers,
      // 12 of AVX2's 16.
      constexpr int kRows =
          kWideRegisters ? std::max<int>(1, std::min<int>(4, static_cast<int>(16 / (kHeadDim / kLanes)))) : 6;
      in_row_blocks<kRows>(rows, [&](auto block_rows, int64_t r) {
        weigh_values<kHeadDim, decltype(block_rows)::value>(scores + r * kKeyTile, values, acc + r * hd, keys);
      });
    } else {
      for (int64_t r = 0; r < rows; ++r) weigh_values_any(scores + r * kKeyTile, values, acc + r * hd, keys, hd);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((span.token_start + first + r / group) * s.n_q + head * group + r % group) * hd;
    const float inverse = 1.0f / scratch.sum[r];
    for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(acc[r * hd + d] * inverse);
  }
}

struct Task {
  int64_t span, head, first, last, cost;
};

// Query rows of one prefix task on tiles: enough for the packed values of a block to serve many.
constexpr int64_t kPrefixRows = 256;

// Spans that share their prefix: the same prefix_end and the same blocks up to it (prompts that start
// with one cached prefix), their rows numbered span after span.
struct PrefixGroup {
  std::vector<int64_t> spans;
  std::vector<int64_t> first_row;  // each span's first row in the group
  int64_t rows = 0;
};

std::vector<PrefixGroup> group_prefixes(const Shape& s, const std::vector<Span>& spans, const int64_t* tables,
                                        const std::vector<int64_t>& prefix_end) {
  std::vector<int64_t> order;
  for (int64_t i = 0; i < static_cast<int64_t>(spans.size()); ++i)
    if (prefix_end[i] > 0) order.push_back(i);
  const auto same_prefix = [&](int64_t a, int64_t b) {
    if (prefix_end[a] != prefix_end[b]) return false;
    const int64_t blocks = (prefix_end[a] + s.block_size - 1) / s.block_size;
    return std::equal(tables + a * s.width, tables + a * s.width + blocks, tables + b * s.width);
  };
  std::vector<PrefixGroup> groups;
  std::vector<bool> taken(spans.size(), false);
  for (size_t x = 0; x < order.size(); ++x) {
    if (taken[order[x]]) continue;
    PrefixGroup group;
    for (size_t y = x; y < order.size(); ++y) {
      const int64_t i = order[y];
      if (taken[i] || !same_prefix(order[x], i)) continue;
      taken[i] = true;
      group.spans.push_back(i);
      group.first_row.push_back(group.rows);
      group.rows += spans[i].num_tokens * s.group;
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

// Each span's keys before its last whole key tile ahead of its first token go through the tiles
// (bf16 on an AMX machine), for all the query rows of the spans that share those blocks at once;
// the rest, the causal part included, through attend_tile, which carries on from the tiles'
// softmax state. Writes the state of span i's rows for head h at states[i * n_kv + h].
template <typename T>
void attend_prefixes_on_tiles(const Shape& s, const std::vector<Span>& spans, const int64_t* tables, const T* q,
                              const T* k_pool, const T* v_pool, const std::vector<int64_t>& prefix_end,
                              std::vector<PrefixState>& states, std::vector<float>& state_store) {
#if defined(BACKFILL_TILES)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const std::vector<PrefixGroup> groups = group_prefixes(s, spans, tables, prefix_end);
    // Per (group, head) one contiguous state for the group's rows, each span's rows a stretch of it.
    std::vector<int64_t> group_offset(groups.size() + 1, 0);
    for (size_t g = 0; g < groups.size(); ++g)
      group_offset[g + 1] = group_offset[g] + s.n_kv * groups[g].rows * (s.head_dim + 2);
    state_store.resize(group_offset.back());
    std::vector<PrefixState> group_states(groups.size() * s.n_kv);
    for (size_t g = 0; g < groups.size(); ++g)
      for (int64_t head = 0; head < s.n_kv; ++head) {
        const int64_t rows = groups[g].rows;
        float* base = state_store.data() + group_offset[g] + head * rows * (s.head_dim + 2);
        const PrefixState state{base, base + rows * s.head_dim, base + rows * (s.head_dim + 1)};
        group_states[g * s.n_kv + head] = state;
        for (size_t m = 0; m < groups[g].spans.size(); ++m) {
          const int64_t r0 = groups[g].first_row[m];
          states[groups[g].spans[m] * s.n_kv + head] =
              PrefixState{state.acc + r0 * s.head_dim, state.max + r0, state.sum + r0};
        }
      }
    struct PrefixTask {
      int64_t group, head, first_row, rows;
    };
    std::vector<PrefixTask> tasks;
    for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
      for (int64_t head = 0; head < s.n_kv; ++head)
        for (int64_t r0 = 0; r0 < groups[g].rows; r0 += kPrefixRows)
          tasks.push_back({g, head, r0, std::min(kPrefixRows, groups[g].rows - r0)});
    std::atomic<int64_t> next{0};
    const int64_t count = static_cast<int64_t>(tasks.size());
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < count;) {
        const PrefixTask& task = tasks[i];
        const PrefixGroup& group = groups[task.group];
        const auto query_row = [&](int64_t r) {
          const int64_t row = task.first_row + r;
          // The span holding this row: the last whose first row is at or before it.
          const int64_t m = std::upper_bound(group.first_row.begin(), group.first_row.end(), row) -
                            group.first_row.begin() - 1;
          const int64_t local = row - group.first_row[m];
          return q + (spans[group.spans[m]].token_start + local / s.group) * s.q_token_stride +
                 (task.head * s.group + local % s.group) * s.head_dim;
        };
        const PrefixState& state = group_states[task.group * s.n_kv + task.head];
        const int64_t span = group.spans[0];
        tile_attention::attend_full_blocks_on_tiles(
            s.n_kv, s.head_dim, k_pool, v_pool, tables + span * s.width, 0, prefix_end[span] / s.block_size,
            task.head, query_row,
            tile_attention::TileRows{task.rows, state.max + task.first_row, state.sum + task.first_row,
                                     state.acc + task.first_row * s.head_dim});
      }
    });
    return;
  }
#endif
  (void)s, (void)spans, (void)tables, (void)q, (void)k_pool, (void)v_pool, (void)prefix_end, (void)states,
      (void)state_store;
}

template <typename T, int64_t kHeadDim>
void attend(const Shape& s, const std::vector<Span>& spans, const int64_t* tables, const T* q, const T* k_pool,
            const T* v_pool, T* out, bool tiles) {
  const int64_t span_count = static_cast<int64_t>(spans.size()), hd = s.head_dim;
  // Each span's prefix: its keys before the last whole key tile ahead of its first token, visible to
  // every one of its queries. Spans that share its blocks (prompts after one cached prefix) share it:
  // on tiles, all their rows at once; on vectors, converted once and read by all their tasks.
  std::vector<int64_t> prefix_end(span_count), key_begin(span_count, 0);  // attend_tile's keys start at key_begin
  for (int64_t i = 0; i < span_count; ++i) {
    prefix_end[i] = spans[i].start_pos / kKeyTile * kKeyTile;
    if (tiles) key_begin[i] = prefix_end[i];
  }
  std::vector<PrefixState> states(span_count * s.n_kv, PrefixState{nullptr, nullptr, nullptr});
  std::vector<float> state_store;
  if (tiles) attend_prefixes_on_tiles(s, spans, tables, q, k_pool, v_pool, prefix_end, states, state_store);
  const std::vector<PrefixGroup> groups =
      tiles ? std::vector<PrefixGroup>() : group_prefixes(s, spans, tables, prefix_end);
  // fp32 buffers: each group's prefix, then each span's own keys (all KV heads, keys then values).
  std::vector<int64_t> group_offset(groups.size() + 1, 0), span_offset(span_count + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g)
    group_offset[g + 1] = group_offset[g] + 2 * s.n_kv * hd * prefix_end[groups[g].spans[0]];
  span_offset[0] = group_offset.back();
  const auto padded_of = [&](int64_t i) {
    return (spans[i].start_pos + spans[i].num_tokens + kKeyTile - 1) / kKeyTile * kKeyTile;
  };
  for (int64_t i = 0; i < span_count; ++i)
    span_offset[i + 1] = span_offset[i] + 2 * s.n_kv * hd * (padded_of(i) - prefix_end[i]);
  // Not zeroed: the conversions write every float, the padding included.
  const at::Tensor converted_buffer = at::empty({span_offset[span_count]}, at::kFloat);
  float* converted = converted_buffer.data_ptr<float>();
  std::vector<const float*> prefix_of(span_count, nullptr);  // the span's group's prefix, KV head 0
  std::vector<Conversion> conversions;
  const auto add_conversions = [&](const int64_t* table, float* base, int64_t begin, int64_t end, int64_t context) {
    const int64_t tokens = end - begin;
    for (int64_t head = 0; head < s.n_kv; ++head) {
      float* keys_t = base + 2 * head * hd * tokens;
      // A few key tiles each, so that one long prefix is converted on every thread.
      for (int64_t p = begin; p < end; p += 4 * kKeyTile)
        conversions.push_back({table, head, keys_t, keys_t + hd * tokens, begin, p, std::min(end, p + 4 * kKeyTile),
                               context});
    }
  };
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t first = groups[g].spans[0];
    add_conversions(tables + first * s.width, converted + group_offset[g], 0, prefix_end[first], prefix_end[first]);
    for (int64_t i : groups[g].spans) prefix_of[i] = converted + group_offset[g];
  }
  for (int64_t i = 0; i < span_count; ++i)
    add_conversions(tables + i * s.width, converted + span_offset[i], prefix_end[i], padded_of(i),
                    spans[i].start_pos + spans[i].num_tokens);
  at::parallel_for(0, static_cast<int64_t>(conversions.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) convert(s, conversions[c], k_pool, v_pool);
  });
  const auto context_of = [&](int64_t span, int64_t head) {
    const int64_t own = padded_of(span) - prefix_end[span], prefix = prefix_end[span];
    const float* keys_t = converted + span_offset[span] + 2 * head * hd * own;
    const float* prefix_keys_t = prefix_of[span] ? prefix_of[span] + 2 * head * hd * prefix : nullptr;
    return Context{prefix_keys_t, prefix_keys_t ? prefix_keys_t + hd * prefix : nullptr, keys_t, keys_t + hd * own,
                   prefix};
  };
  std::vector<Task> tasks;
  for (int64_t i = 0; i < span_count; ++i)
    for (int64_t first = 0; first < spans[i].num_tokens; first += kQueryTile) {
      const int64_t last = std::min(spans[i].num_tokens, first + kQueryTile);
      for (int64_t head = 0; head < s.n_kv; ++head)
        tasks.push_back({i, head, first, last, (last - first) * (spans[i].start_pos + last - key_begin[i])});
    }
  // Longest and shortest in turn: parallel_for hands each thread a contiguous range of tasks.
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::vector<Task> dealt;
  dealt.reserve(tasks.size());
  for (size_t lo = 0, hi = tasks.size(); lo < hi;) {
    dealt.push_back(tasks[lo++]);
    if (lo < hi) dealt.push_back(tasks[--hi]);
  }
  at::parallel_for(0, static_cast<int64_t>(dealt.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(s, kQueryTile * s.group);
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = dealt[i];
      attend_tile<T, kHeadDim>(s, spans[task.span], context_of(task.span, task.head), q, out, task.head, task.first,
                               task.last, key_begin[task.span], states[task.span * s.n_kv + task.head], scratch);
    }
  });
}

template <typename T>
void attend_any_head_dim(const Shape& s, const std::vector<Span>& spans, const torch::Tensor& tables,
                         const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                         torch::Tensor& out, bool tiles) {
  const auto run = [&](auto head_dim_constant) {
    attend<T, decltype(head_dim_constant)::value>(s, spans, tables.data_ptr<int64_t>(), q.data_ptr<T>(),
                                                   k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), out.data_ptr<T>(), tiles);
  };
  if (s.head_dim == 64) run(std::integral_constant<int64_t, 64>());
  else if (s.head_dim == 128) run(std::integral_constant<int64_t, 128>());
  else run(std::integral_constant<int64_t, 0>());
}

}  // namespace

// q [N, n_q, hd] (heads and head dims contiguous; tokens may be strided); k_pool, v_pool
// [num_blocks, block_size, n_kv, hd]; spans [S, 3] int64 rows (token_start, num_tokens, start_pos):
// tokens [token_start, token_start + num_tokens) of q are one sequence's positions
// [start_pos, start_pos + num_tokens), whose keys and values up to there are in the pool; tables
// [S, width] int64, each span's block table. Writes those tokens' rows of out [N, n_q, hd] (a
// contiguous tensor of q's dtype) and leaves the others. tiles: a bf16 span's keys before its
// chunk go through AMX tiles where this CPU has them (tile_attention.h).
void paged_prompt_attention(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                            const torch::Tensor& spans, const torch::Tensor& tables, torch::Tensor& out, bool tiles) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads and head dims must be contiguous");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && spans.is_contiguous() && tables.is_contiguous() &&
              out.is_contiguous(), "pools, spans, tables and out must be contiguous");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == k_pool.scalar_type() &&
              q.scalar_type() == v_pool.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, k_pool, v_pool and out must be CPU tensors of one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "dtype must be float32, bfloat16 or float16");
  TORCH_CHECK(spans.scalar_type() == at::kLong && tables.scalar_type() == at::kLong, "int64 spans and tables");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  const int64_t tokens = q.size(0), n_q = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_pool.size(1), n_kv = k_pool.size(2), width = tables.size(1);
  TORCH_CHECK(k_pool.size(3) == head_dim && n_q % n_kv == 0, "head sizes do not match");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && tables.dim() == 2 && tables.size(0) == spans.size(0),
              "spans [S, 3] and one block table per span");
  const int64_t* raw = spans.data_ptr<int64_t>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  std::vector<Span> list;
  for (int64_t i = 0; i < spans.size(0); ++i) {
    const Span span{raw[3 * i], raw[3 * i + 1], raw[3 * i + 2]};
    TORCH_CHECK(span.token_start >= 0 && span.num_tokens >= 1 && span.token_start + span.num_tokens <= tokens &&
                span.start_pos >= 0, "span ", i, " lies outside q");
    const int64_t context = span.start_pos + span.num_tokens;
    TORCH_CHECK(context <= width * block_size, "span ", i, "'s context is longer than its block table");
    for (int64_t b = 0; b < (context + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table_data[i * width + b] >= 0 && table_data[i * width + b] < k_pool.size(0),
                  "span ", i, "'s block table names a block outside the pool");
    list.push_back(span);
  }
  const Shape shape{n_q, n_kv, n_q / n_kv, head_dim, block_size, width, q.stride(0)};
  switch (q.scalar_type()) {
    case at::kFloat: attend_any_head_dim<float>(shape, list, tables, q, k_pool, v_pool, out, false); break;
    case at::kBFloat16:
      attend_any_head_dim<c10::BFloat16>(shape, list, tables, q, k_pool, v_pool, out,
                                         tiles && tile_attention::tiles_usable(block_size, head_dim));
      break;
    default: attend_any_head_dim<c10::Half>(shape, list, tables, q, k_pool, v_pool, out, false);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prompt_attention", &paged_prompt_attention,
        "causal attention of prompt chunks over a paged KV pool (CPU)", py::arg("q"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("spans"), py::arg("tables"), py::arg("out"), py::arg("tiles") = true);
}
