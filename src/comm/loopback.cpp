// loopback.cpp — the single-rank Communicator: every collective is a copy, done before the call
// returns on the CPU and enqueued on the caller's stream on CUDA.
#include <cstring>

#include "dion3/comm.hpp"
#include "dion3/error.hpp"

#ifdef DION3_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace dion3 {
namespace {

class Done final : public CommRequest {
 public:
  void wait() override {}
};

class LoopbackCommunicator final : public Communicator {
 public:
  explicit LoopbackCommunicator(Device device) : device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return device_; }
  std::string describe() const override { return "loopback, 1 rank"; }

  std::unique_ptr<CommRequest> all_gather(const void* send, void* recv, std::size_t bytes, void* stream,
                                          const std::string& label) override {
    copy(recv, send, bytes, stream, label);
    return std::make_unique<Done>();
  }
  std::unique_ptr<CommRequest> all_to_all(const void* send, void* recv, std::size_t bytes, void* stream,
                                          const std::string& label) override {
    copy(recv, send, bytes, stream, label);
    return std::make_unique<Done>();
  }
  std::unique_ptr<CommRequest> all_reduce_max(int32_t*, std::size_t, void*, const std::string&) override {
    return std::make_unique<Done>();
  }

 private:
  void copy(void* dst, const void* src, std::size_t bytes, void* stream, const std::string& label) {
    if (dst == src || bytes == 0) return;
    if (device_ == Device::CPU) {
      std::memmove(dst, src, bytes);
      return;
    }
#ifdef DION3_HAVE_CUDA
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) fail(label + ": " + cudaGetErrorString(e), Status::Internal);
#else
    (void)stream;
    fail(label + ": a CUDA loopback communicator in a build without CUDA", Status::Unsupported);
#endif
  }
  Device device_;
};

}  // namespace

std::shared_ptr<Communicator> make_loopback_communicator(Device device) {
  return std::make_shared<LoopbackCommunicator>(device);
}

}  // namespace dion3
