// nccl.cpp — the NCCL Communicator (CUDA buffers), for native trainers on GPUs. Collectives run
// on the communicator's own stream: it waits for an event recorded on the caller's stream, and
// wait() makes the caller's stream wait for an event recorded after the collective — stream
// ordering both ways, no host synchronisation. All-to-all is a group of send/recv pairs.
// Errors NCCL reports asynchronously (a peer that failed) are checked at every start and wait;
// settle() turns a collective that never finishes into an error (and aborts the communicator).
// Built when CMake finds NCCL (DION3_HAVE_NCCL); otherwise the factory says so.
#include "core/format.hpp"
#include "dion3/comm.hpp"
#include "dion3/error.hpp"

#ifdef DION3_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <thread>
#include <vector>

namespace dion3 {
namespace {

void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) fail(what + ": CUDA error " + cudaGetErrorString(e), Status::Internal);
}
void check_nccl(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess && r != ncclInProgress) fail(what + ": NCCL error " + ncclGetErrorString(r), Status::Internal);
}

class NcclCommunicator;

class NcclRequest final : public CommRequest {
 public:
  NcclRequest(cudaEvent_t done, cudaStream_t caller, ncclComm_t comm, std::string label)
      : done_(done), caller_(caller), comm_(comm), label_(std::move(label)) {}
  void wait() override {
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &async), label_);
    check_nccl(async, label_);
    check_cuda(cudaStreamWaitEvent(caller_, done_, 0), label_);
  }

 private:
  cudaEvent_t done_;  // owned by the communicator (a ring of events)
  cudaStream_t caller_;
  ncclComm_t comm_;
  std::string label_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, double timeout) : comm_(comm), device_(device), timeout_(timeout) {
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
    int current = 0;
    check_cuda(cudaGetDevice(&current), "cudaGetDevice");
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (auto& e : events_) check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaSetDevice(current), "cudaSetDevice");
  }
  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);
    for (auto e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::CUDA; }
  std::string describe() const override { return "NCCL, " + std::to_string(size_) + " ranks"; }

  // Polls the collectives' completion events; past the timeout the communicator is aborted (its
  // kernels then end, so no later synchronisation hangs) and the oldest unfinished one is named.
  void settle() override {
    using Clock = std::chrono::steady_clock;
    for (const Pending& p : pending_) {
      for (;;) {
        const cudaError_t e = cudaEventQuery(p.done);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) check_cuda(e, p.label);
        ncclResult_t async = ncclSuccess;
        check_nccl(ncclCommGetAsyncError(comm_, &async), p.label);
        check_nccl(async, p.label);
        if (timeout_ > 0 && std::chrono::duration<double>(Clock::now() - p.start).count() > timeout_) {
          ncclCommAbort(comm_);  // which frees the ncclComm_t: never touch it again
          aborted_ = p.label;
          pending_.clear();
          fail(p.label + ": timed out after " + format_number(timeout_) +
                   " s (another rank did not join this collective); the NCCL communicator was aborted",
               Status::Internal);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    pending_.clear();
  }

  std::unique_ptr<CommRequest> all_gather(const void* send, void* recv, std::size_t bytes, void* stream,
                                          const std::string& label) override {
    return run(stream, label, [&] { check_nccl(ncclAllGather(send, recv, bytes, ncclChar, comm_, stream_), label); });
  }
  std::unique_ptr<CommRequest> all_to_all(const void* send, void* recv, std::size_t bytes, void* stream,
                                          const std::string& label) override {
    return run(stream, label, [&] {
      check_nccl(ncclGroupStart(), label);
      for (int r = 0; r < size_; ++r) {
        check_nccl(ncclSend(static_cast<const char*>(send) + r * bytes, bytes, ncclChar, r, comm_, stream_), label);
        check_nccl(ncclRecv(static_cast<char*>(recv) + r * bytes, bytes, ncclChar, r, comm_, stream_), label);
      }
      check_nccl(ncclGroupEnd(), label);
    });
  }
  std::unique_ptr<CommRequest> all_reduce_max(int32_t* data, std::size_t count, void* stream,
                                              const std::string& label) override {
    return run(stream, label,
               [&] { check_nccl(ncclAllReduce(data, data, count, ncclInt32, ncclMax, comm_, stream_), label); });
  }

 private:
  template <class F>
  std::unique_ptr<CommRequest> run(void* stream, const std::string& label, F&& launch) {
    if (!aborted_.empty())
      fail(label + ": the NCCL communicator was aborted when '" + aborted_ + "' timed out; create a new "
               "ncclComm_t and communicator (and optimizer) to go on",
           Status::Internal);
    auto caller = static_cast<cudaStream_t>(stream);
    ncclResult_t async = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(comm_, &async), label);
    check_nccl(async, label);
    // Events are reused round-robin; a ring longer than the collectives one step keeps in flight.
    cudaEvent_t ready = events_[next_++ % kEvents], done = events_[next_++ % kEvents];
    check_cuda(cudaEventRecord(ready, caller), label);
    check_cuda(cudaStreamWaitEvent(stream_, ready, 0), label);
    launch();
    check_cuda(cudaEventRecord(done, stream_), label);
    // Steps that never settle (step_async, graph capture) keep only the collectives whose events
    // the ring has not handed out again.
    if (pending_.size() >= kEvents / 2) pending_.erase(pending_.begin());
    pending_.push_back({done, label, std::chrono::steady_clock::now()});
    return std::make_unique<NcclRequest>(done, caller, comm_, label);
  }

  struct Pending {
    cudaEvent_t done;
    std::string label;
    std::chrono::steady_clock::time_point start;
  };
  std::vector<Pending> pending_;  // started since the last settle()
  std::string aborted_;           // the collective whose timeout aborted comm_; empty while usable

  static constexpr int kEvents = 256;
  ncclComm_t comm_;
  int device_, rank_ = 0, size_ = 1;
  double timeout_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t events_[kEvents] = {};
  unsigned next_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(void* nccl_comm, int device, double timeout_seconds) {
  if (!nccl_comm) fail("make_nccl_communicator: null ncclComm_t");
  return std::make_shared<NcclCommunicator>(static_cast<ncclComm_t>(nccl_comm), device, timeout_seconds);
}

}  // namespace dion3

#else  // no NCCL in this build

namespace dion3 {

std::shared_ptr<Communicator> make_nccl_communicator(void*, int, double) {
  fail("this build of dion3 has no NCCL communicator; build with -DDION3_CUDA=ON where NCCL is installed",
       Status::Unsupported);
}

}  // namespace dion3

#endif
