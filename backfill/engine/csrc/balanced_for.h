// A parallel loop over n items of about equal cost that keeps each thread on a contiguous range,
// as a static split does, and lets a thread that finishes early take items from the back of the
// ranges still running. On a shared 2-core host a static split of a decode step's matmuls and
// attention left each thread waiting for the other for 7-15% of its time (a vCPU's brief stalls and
// cache misses fall unevenly). Claiming items one at a time from one shared counter ran 11% slower:
// a thread's items are then not contiguous, and its next-tile prefetch no longer fetches its next tile.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace balanced {

// One thread's items [front, back): the owner takes from the front, others from the back; both
// bounds live in one word so that a claim is a single compare-and-swap.
struct alignas(64) Range {
  std::atomic<uint64_t> bounds{0};

  static uint64_t pack(uint64_t front, uint64_t back) { return front | (back << 32); }
  void set(int64_t front, int64_t back) { bounds.store(pack(front, back), std::memory_order_relaxed); }
  int64_t remaining() const {
    const uint64_t b = bounds.load(std::memory_order_relaxed);
    return static_cast<int64_t>(b >> 32) - static_cast<int64_t>(b & 0xffffffffu);
  }
  // The next item from the front, or -1 when none is left; *next_owned is the one after it, if it
  // is still this range's at the time of the claim (else -1).
  int64_t take_front(int64_t* next_owned) {
    uint64_t b = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = b & 0xffffffffu, back = b >> 32;
      if (front >= back) return -1;
      if (bounds.compare_exchange_weak(b, pack(front + 1, back), std::memory_order_relaxed)) {
        *next_owned = front + 1 < back ? static_cast<int64_t>(front + 1) : -1;
        return static_cast<int64_t>(front);
      }
    }
  }
  int64_t take_back() {
    uint64_t b = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = b & 0xffffffffu, back = b >> 32;
      if (front >= back) return -1;
      if (bounds.compare_exchange_weak(b, pack(front, back - 1), std::memory_order_relaxed))
        return static_cast<int64_t>(back - 1);
    }
  }
};

// Fewest items per thread for which taking them from each other's ranges pays: with fewer, each is a
// large share of the loop and a batch-1 decode step ran about 5% slower balanced.
constexpr int64_t kMinItemsPerThread = 8;

// body(item, next) for every item in [0, n) once, on PyTorch's intra-op threads. next is the item
// the same thread will most likely run after this one (-1 if none is known): a body may prefetch
// its data.
template <typename Body>
void parallel_for(int64_t n, const Body& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) body(i, i + 1 < n ? i + 1 : -1);
    return;
  }
  if (n < kMinItemsPerThread * threads) {  // too few to balance: the static split
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) body(i, i + 1 < end ? i + 1 : -1);
    });
    return;
  }
  std::unique_ptr<Range[]> ranges(new Range[threads]);
  for (int64_t t = 0; t < threads; ++t) ranges[t].set(t * n / threads, (t + 1) * n / threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t next = -1;
      for (int64_t i; (i = ranges[t].take_front(&next)) >= 0;) body(i, next);
      // Done: help the range with the most items left, from its back, until every range is empty.
      for (;;) {
        int64_t victim = -1, most = 0;
        for (int64_t v = 0; v < threads; ++v) {
          const int64_t left = ranges[v].remaining();
          if (left > most) most = left, victim = v;
        }
        if (victim < 0) break;
        const int64_t i = ranges[victim].take_back();
        if (i >= 0) body(i, -1);
      }
    }
  });
}

}  // namespace balanced
