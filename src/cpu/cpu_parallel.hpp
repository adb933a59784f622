// cpu_parallel.hpp — how the CPU backend spreads its work over threads.
//
// Work runs on the OpenMP team of the calling thread: omp_get_max_threads() threads. In a
// PyTorch process that is PyTorch's own intra-op pool (both load the one libgomp), sized by
// torch.set_num_threads; natively, OMP_NUM_THREADS or omp_set_num_threads. BLAS is called from
// inside that team one thread per call (BlasSerial), so no second thread pool competes with it
// for the cores. Work is cut by the shapes alone, never by the thread count: every result is
// bit-identical whatever the number of threads. Built without OpenMP, everything runs on the
// calling thread and BLAS keeps its own threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

// OpenBLAS's thread controls, weak: null where the BLAS linked is another library.
extern "C" {
int openblas_get_parallel(void) __attribute__((weak));
int openblas_get_num_threads(void) __attribute__((weak));
void openblas_set_num_threads(int) __attribute__((weak));
}

namespace dion3::cpu {

// Work below kParallelWork (multiply-adds, or elements read and written) runs on the calling
// thread: a parallel region's start and join cost more than it saves, and where another process
// holds a core, a whole scheduler slice. A thread takes items in chunks of about kGrainWork, so
// that many tiny items (small matrices, one BLAS call each) are not handed out one by one.
constexpr int64_t kParallelWork = int64_t{1} << 18, kGrainWork = int64_t{1} << 16;

// Calls body(state, i) for every i in [0, n) over the calling thread's OpenMP team, state being
// made once per thread by init() (its scratch buffers). `work` is the size of all n items
// together (see kParallelWork). Inside another parallel region, with one thread or with little
// work, it runs on the calling thread. The first exception a body throws is rethrown once every
// thread is done.
template <class Init, class Body>
void parallel_for(int64_t n, int64_t work, Init&& init, Body&& body) {
#ifdef _OPENMP
  // The whole team even where there are fewer items (the spare threads take none): libgomp keeps
  // a team of the size last asked for, and one of a new size is an allocation it cannot fail
  // without ending the process.
  const int threads = work < kParallelWork || n < 2 ? 1 : omp_get_max_threads();
  if (threads > 1 && !omp_in_parallel()) {
    const int64_t per_item = std::max<int64_t>(work / n, 1);
    const int64_t chunk = std::clamp<int64_t>(kGrainWork / per_item, 1, std::max<int64_t>(n / (4 * threads), 1));
    std::exception_ptr error;
    std::mutex error_mutex;
#pragma omp parallel num_threads(threads)
    {
      std::optional<decltype(init())> state;
      try {
        state.emplace(init());
      } catch (...) {  // out of memory: the op fails
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      // Every thread of the team must meet the loop, a thread without state too (it skips its
      // items), or the others would wait for it at the loop's end for ever.
#pragma omp for schedule(dynamic, chunk)
      for (int64_t i = 0; i < n; ++i) {
        if (!state) continue;
        try {
          body(*state, i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#else
  (void)work;
#endif
  auto state = init();
  for (int64_t i = 0; i < n; ++i) body(state, i);
}

// No per-thread state.
struct NoState {};
inline NoState no_state() { return {}; }

// While one exists, OpenBLAS built on pthreads runs each call on its caller's thread alone: the
// parallelism is the OpenMP team's, and OpenBLAS's own pool would oversubscribe the cores (its
// threads spin after each call, as OpenMP's do). The setting is process-wide, so the last
// BlasSerial to go puts back what it found. OpenBLAS built on OpenMP needs nothing: inside a
// parallel region it runs single-threaded by itself, and outside one it uses the same team.
class BlasSerial {
 public:
  BlasSerial() {
#ifdef _OPENMP
    if (!pthreads_openblas()) return;
    std::lock_guard<std::mutex> lock(mutex());
    if (depth()++ == 0) {
      saved() = openblas_get_num_threads();
      if (saved() != 1) openblas_set_num_threads(1);
    }
#endif
  }
  ~BlasSerial() {
#ifdef _OPENMP
    if (!pthreads_openblas()) return;
    std::lock_guard<std::mutex> lock(mutex());
    if (--depth() == 0 && saved() != 1) openblas_set_num_threads(saved());
#endif
  }
  BlasSerial(const BlasSerial&) = delete;
  BlasSerial& operator=(const BlasSerial&) = delete;

 private:
  static bool pthreads_openblas() {
    static const bool yes = openblas_get_parallel && openblas_get_num_threads && openblas_set_num_threads &&
                            openblas_get_parallel() == 1;
    return yes;
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static int& depth() {
    static int d = 0;
    return d;
  }
  static int& saved() {
    static int s = 1;
    return s;
  }
};

// Rows (or columns) per tile of a product whose rows each cost `row_cost` multiply-adds: whole
// multiples of 128 (thinner tiles pack the other operand too often for too little work), about
// 8M multiply-adds each. A function of the shape alone, as the header says.
inline int64_t tile_rows(int64_t rows, int64_t row_cost) {
  constexpr int64_t kTileWork = int64_t{1} << 23, kUnit = 128;
  const int64_t want = kTileWork / std::max<int64_t>(row_cost, 1);
  return std::min(rows, std::max(kUnit, (want + kUnit - 1) / kUnit * kUnit));
}

// Element-wise work is handed out in pieces of about this many elements.
constexpr int64_t kPieceElems = int64_t{1} << 16;

// Rows per piece of row-wise work on rows of `cols` elements.
inline int64_t row_block(int64_t cols) { return std::max<int64_t>(1, kPieceElems / std::max<int64_t>(cols, 1)); }

// Pieces of `batch` matrices of rows x cols: blocks of whole rows, or, where one row alone is
// longer than a piece, column ranges of one row (their bounds multiples of `align`).
struct Piece {
  int64_t b, r0, r1, c0, c1;
};
// Calls emit(piece) for each.
template <class Emit>
void for_each_piece(int64_t batch, int64_t rows, int64_t cols, int64_t align, Emit&& emit) {
  if (cols > kPieceElems) {
    const int64_t width = std::max<int64_t>(1, kPieceElems / align) * align;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c0 = 0; c0 < cols; c0 += width) emit(Piece{b, r, r + 1, c0, std::min(cols, c0 + width)});
    return;
  }
  const int64_t block = row_block(cols);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r0 = 0; r0 < rows; r0 += block) emit(Piece{b, r0, std::min(rows, r0 + block), 0, cols});
}
inline std::vector<Piece> pieces(int64_t batch, int64_t rows, int64_t cols, int64_t align) {
  std::vector<Piece> out;
  for_each_piece(batch, rows, cols, align, [&](const Piece& q) { out.push_back(q); });
  return out;
}

}  // namespace dion3::cpu
