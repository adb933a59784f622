// cpu_scratch.hpp — where the CPU ops' scratch memory comes from.
//
// A step that ran out of memory part way would leave the momentum or the weights half updated,
// so the step reserves its scratch before it writes anything: Pool::begin_step() sets aside
// blocks sized by what the ops took in earlier steps, and the ops' buffers (row buffers,
// converted operands, index tables: the Scratch vectors) are carved from them. A step like an
// earlier one therefore allocates nothing once it has begun. Beyond the reservation (the first
// step, a plan that needs more, a larger team) buffers come from the heap, and what was taken is
// remembered for the next step. end_step() gives the memory back, so the footprint between steps
// stays what it would be without the pool.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dion3::cpu {

class Pool {
 public:
  // Before the step writes anything; throws std::bad_alloc (nothing written yet, nothing kept)
  // when the reservation cannot be had. The calling thread's own slot (what an op takes outside
  // its parallel region: index tables, and the buffers of work too small to split) gets what it
  // took before; every slot of the team gets the most one op has taken on any of them, since
  // which thread takes which items changes from step to step.
  void begin_step() {
#ifdef _OPENMP
    const std::size_t threads = static_cast<std::size_t>(std::max(omp_get_max_threads(), 1));
#else
    const std::size_t threads = 1;
#endif
    for (const Slot& s : team_) team_most_ = std::max(team_most_, s.high);
    if (team_.size() != threads) team_ = std::vector<Slot>(threads);  // between steps every slot is empty
    try {
      reserve(caller_, caller_.high);
      for (Slot& s : team_) reserve(s, team_most_);
    } catch (...) {
      end_step();
      throw;
    }
  }

  // After the step, failed or not: the blocks go back to the heap.
  void end_step() noexcept {
    release(caller_);
    for (Slot& s : team_) release(s);
  }

  // Memory for the calling thread: its own slot outside a parallel region, its team slot (by
  // OpenMP thread number) inside one. Every piece a thread takes in one op is given back by that
  // thread, in the same region, before the op ends, and a slot whose pieces are all back starts
  // again at the front of its block.
  void* take(std::size_t bytes) {
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    Slot* s = slot();
    if (s && s->used + bytes <= s->size) {
      void* p = s->block.get() + s->used;
      s->used += bytes;
      s->taken += bytes;
      ++s->live;
      return p;
    }
    void* p = ::operator new(bytes, std::align_val_t{kAlign});
    if (s) {
      s->taken += bytes;
      ++s->live;
    }
    return p;
  }

  void give(void* p, std::size_t /*bytes*/) noexcept {
    Slot* s = slot();
    if (!s || !in_block(*s, p)) ::operator delete(p, std::align_val_t{kAlign});
    if (s && s->live > 0 && --s->live == 0) {  // the op is done with this slot: remember what it took
      s->high = std::max(s->high, s->taken);
      s->taken = s->used = 0;
    }
  }

 private:
  static constexpr std::size_t kAlign = 64;
  struct BlockFree {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{kAlign}); }
  };
  // A cache line each: the threads update their own slots' counts as they take and give.
  struct alignas(64) Slot {
    std::unique_ptr<std::byte, BlockFree> block;  // pages untouched until an op writes them
    std::size_t size = 0;   // of the block
    std::size_t used = 0;   // from its front
    std::size_t taken = 0;  // bytes taken since the slot was last empty, in the block or not
    std::size_t high = 0;   // the most an op took here
    std::size_t live = 0;   // pieces not yet given back
  };
  static void reserve(Slot& s, std::size_t bytes) {
    if (s.live != 0 || s.size >= bytes) return;
    s.block.reset();
    s.size = 0;
    s.block.reset(static_cast<std::byte*>(::operator new(bytes, std::align_val_t{kAlign})));
    s.size = bytes;
  }
  static void release(Slot& s) noexcept {
    if (s.live != 0) return;
    s.block.reset();
    s.size = s.used = 0;
  }
  static bool in_block(const Slot& s, const void* p) {
    const auto* b = static_cast<const std::byte*>(p);
    return s.block && b >= s.block.get() && b < s.block.get() + s.size;
  }
  Slot* slot() {
#ifdef _OPENMP
    if (!omp_in_parallel()) return &caller_;
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    // Team slots are made by begin_step only, never inside a parallel region; a thread beyond
    // them takes from the heap, uncounted.
    return t < team_.size() ? &team_[t] : nullptr;
#else
    return &caller_;
#endif
  }
  Slot caller_;
  std::vector<Slot> team_;
  std::size_t team_most_ = 0;  // the most one op took on a team slot, over every step so far
};

// A std::allocator that takes from a Pool (from the heap where it has none).
template <class T>
struct PoolAllocator {
  using value_type = T;
  Pool* pool = nullptr;
  PoolAllocator() = default;
  PoolAllocator(Pool& p) : pool(&p) {}  // NOLINT: implicit, so that Scratch<T>(n, pool) reads plainly
  template <class U>
  PoolAllocator(const PoolAllocator<U>& o) : pool(o.pool) {}
  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    if (!pool) return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
    return static_cast<T*>(pool->take(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (!pool) return ::operator delete(p, std::align_val_t{64});
    pool->give(p, n * sizeof(T));
  }
  template <class U>
  bool operator==(const PoolAllocator<U>& o) const {
    return pool == o.pool;
  }
};

template <class T>
using Scratch = std::vector<T, PoolAllocator<T>>;

}  // namespace dion3::cpu
