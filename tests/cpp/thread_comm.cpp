// tests/cpp/thread_comm.cpp — thread ranks' communicators (see thread_comm.hpp).
#include "thread_comm.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "dion3/error.hpp"

#ifdef DION3_THREAD_COMM_CUDA
#include <cuda_runtime.h>
#endif

namespace t3 {
namespace {

using dion3::Device;
using dion3::fail;
using dion3::Status;

class Done final : public dion3::CommRequest {
 public:
  void wait() override {}
};

#ifdef DION3_THREAD_COMM_CUDA
void check_cuda(cudaError_t e, const std::string& label) {
  if (e != cudaSuccess) fail(label + ": " + cudaGetErrorString(e), Status::Internal);
}
#endif

// What the ranks share: the buffers each hands to the collective under way, and a barrier.
struct Hub {
  Hub(int ranks, Device dev, double timeout_seconds)
      : P(ranks), device(dev), timeout(timeout_seconds), send(ranks), recv(ranks), ints(ranks) {
    if (device == Device::CUDA) {
#ifdef DION3_THREAD_COMM_CUDA
      ready.resize(ranks);
      done.resize(ranks);
      for (int r = 0; r < ranks; ++r) {
        check_cuda(cudaEventCreateWithFlags(&ready[r], cudaEventDisableTiming), "thread communicator");
        check_cuda(cudaEventCreateWithFlags(&done[r], cudaEventDisableTiming), "thread communicator");
      }
#else
      fail("thread communicators on CUDA need the CUDA suite's build", Status::Unsupported);
#endif
    }
  }
  ~Hub() {
#ifdef DION3_THREAD_COMM_CUDA
    for (auto e : ready) cudaEventDestroy(e);
    for (auto e : done) cudaEventDestroy(e);
#endif
  }

  // Raises here and, at their next rendezvous, on every other rank (which would otherwise wait
  // for this one until the timeout).
  [[noreturn]] void abort(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(mu);
      broken = true;
    }
    cv.notify_all();
    fail(message, Status::Internal);
  }

  // Returns once every rank has arrived; raises on every rank once one waited past the timeout
  // or aborted.
  void barrier(const std::string& label) {
    std::unique_lock<std::mutex> lock(mu);
    if (broken) fail(label + ": another rank of this thread group failed or timed out", Status::Internal);
    const uint64_t gen = generation;
    if (++arrived == P) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const bool woken = cv.wait_for(lock, std::chrono::duration<double>(timeout),
                                   [&] { return generation != gen || broken; });
    if (generation != gen) return;
    broken = true;
    cv.notify_all();
    fail(label + (woken ? ": another rank of this thread group failed"
                        : ": not every thread rank started it within " + std::to_string(timeout) + " s"),
         Status::Internal);
  }

  const int P;
  const Device device;
  const double timeout;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool broken = false;
  std::vector<const void*> send;
  std::vector<void*> recv;
  std::vector<std::vector<int32_t>> ints;
#ifdef DION3_THREAD_COMM_CUDA
  std::vector<cudaEvent_t> ready, done;
#endif
};

class ThreadCommunicator final : public dion3::Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_->P; }
  Device device() const override { return hub_->device; }
  std::string describe() const override { return "threads of one process, " + std::to_string(hub_->P) + " ranks"; }

  std::unique_ptr<dion3::CommRequest> all_gather(const void* send, void* recv, std::size_t bytes, void* stream,
                                                 const std::string& label) override {
    exchange(send, recv, bytes, stream, label, false);
    return std::make_unique<Done>();
  }
  std::unique_ptr<dion3::CommRequest> all_to_all(const void* send, void* recv, std::size_t bytes, void* stream,
                                                 const std::string& label) override {
    exchange(send, recv, bytes, stream, label, true);
    return std::make_unique<Done>();
  }
  std::unique_ptr<dion3::CommRequest> all_reduce_max(int32_t* data, std::size_t count, void* stream,
                                                     const std::string& label) override {
    Hub& h = *hub_;
    std::vector<int32_t>& mine = h.ints[rank_];
    mine.resize(count);
    copy_sync(mine.data(), data, count * sizeof(int32_t), stream, label);
    h.barrier(label);
    std::vector<int32_t> out(mine);
    for (int q = 0; q < h.P; ++q)
      for (std::size_t i = 0; i < count; ++i) out[i] = std::max(out[i], h.ints[q][i]);
    h.barrier(label);  // every rank has read every rank's values
    copy_sync(data, out.data(), count * sizeof(int32_t), stream, label);
    return std::make_unique<Done>();
  }

 private:
  // Block q of recv gets rank q's send (all-gather), or block `rank` of rank q's send (all-to-all).
  void exchange(const void* send, void* recv, std::size_t bytes, void* stream, const std::string& label,
                bool to_each) {
    Hub& h = *hub_;
    // The contract of comm.hpp: an all-gather's send is this rank's block of recv or lies apart
    // from recv; an all-to-all's always lies apart.
    const auto s0 = reinterpret_cast<uintptr_t>(send), r0 = reinterpret_cast<uintptr_t>(recv);
    const std::size_t recv_bytes = static_cast<std::size_t>(h.P) * bytes, send_bytes = to_each ? recv_bytes : bytes;
    const bool apart = s0 + send_bytes <= r0 || r0 + recv_bytes <= s0;
    if (bytes > 0 && !apart && (to_each || s0 != r0 + rank_ * bytes))
      h.abort(label + ": send overlaps recv other than as this rank's block (rank " + std::to_string(rank_) +
              ", send at byte " + std::to_string(static_cast<long long>(s0 - r0)) + " of recv, blocks of " +
              std::to_string(bytes) + ")");
    h.send[rank_] = send;
    h.recv[rank_] = recv;
#ifdef DION3_THREAD_COMM_CUDA
    auto s = static_cast<cudaStream_t>(stream);
    if (h.device == Device::CUDA) cuda_ok(cudaEventRecord(h.ready[rank_], s), label);
#else
    (void)stream;
#endif
    h.barrier(label);  // every rank's buffers are known (and, on CUDA, its earlier work recorded)
    for (int q = 0; q < h.P; ++q) {
      const char* src = static_cast<const char*>(h.send[q]) + (to_each ? rank_ * bytes : 0);
      char* dst = static_cast<char*>(recv) + q * bytes;
      if (h.device == Device::CPU) {
        if (src != dst && bytes) std::memcpy(dst, src, bytes);
        continue;
      }
#ifdef DION3_THREAD_COMM_CUDA
      cuda_ok(cudaStreamWaitEvent(s, h.ready[q], 0), label);
      if (src != dst && bytes) cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), label);
#endif
    }
#ifdef DION3_THREAD_COMM_CUDA
    if (h.device == Device::CUDA) cuda_ok(cudaEventRecord(h.done[rank_], s), label);
#endif
    h.barrier(label);  // every rank has read (or enqueued its reads of) every send buffer
#ifdef DION3_THREAD_COMM_CUDA
    if (h.device == Device::CUDA)
      for (int q = 0; q < h.P; ++q)
        if (q != rank_) cuda_ok(cudaStreamWaitEvent(s, h.done[q], 0), label);  // before this rank reuses send
#endif
  }

  // A copy finished before it returns, ordered after the work on `stream` (CUDA).
  void copy_sync(void* dst, const void* src, std::size_t bytes, void* stream, const std::string& label) {
    if (hub_->device == Device::CPU) {
      if (bytes) std::memcpy(dst, src, bytes);
      return;
    }
#ifdef DION3_THREAD_COMM_CUDA
    auto s = static_cast<cudaStream_t>(stream);
    cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), label);
    cuda_ok(cudaStreamSynchronize(s), label);
#else
    (void)stream;
    (void)label;
#endif
  }

#ifdef DION3_THREAD_COMM_CUDA
  // A CUDA failure inside a collective aborts every rank at once (they would otherwise wait for
  // this one until the timeout).
  void cuda_ok(cudaError_t e, const std::string& label) {
    if (e != cudaSuccess) hub_->abort(label + ": " + cudaGetErrorString(e));
  }
#endif

  std::shared_ptr<Hub> hub_;
  int rank_;
};

}  // namespace

std::vector<std::shared_ptr<dion3::Communicator>> thread_communicators(int ranks, Device device, double timeout_seconds) {
  auto hub = std::make_shared<Hub>(ranks, device, timeout_seconds);
  std::vector<std::shared_ptr<dion3::Communicator>> out;
  for (int r = 0; r < ranks; ++r) out.push_back(std::make_shared<ThreadCommunicator>(hub, r));
  return out;
}

void on_threads(int ranks, const std::string& what, const std::function<void(int)>& f) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&f, &what, r, ranks] {
      try {
        f(r);
      } catch (const std::exception& e) {
        ADD_FAILURE() << what << ", rank " << r << " of " << ranks << ": " << e.what();
      }
    });
  for (auto& t : threads) t.join();
}

}  // namespace t3
