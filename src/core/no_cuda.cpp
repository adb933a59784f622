// no_cuda.cpp — the CUDA factory of a build without the CUDA backend (-DDION3_CUDA=OFF).
#include "dion3/backend.hpp"
#include "dion3/error.hpp"

namespace dion3 {

std::unique_ptr<Backend> make_cuda_backend(int, void*, Allocator*) {
  fail("this build of dion3 has no CUDA backend; rebuild it with CUDA (CMake: -DDION3_CUDA=ON; the PyTorch "
       "package: DION3_CUDA=1 pip install --no-build-isolation . on a machine with nvcc)", Status::Unsupported);
}

bool cuda_available() { return false; }

}  // namespace dion3
