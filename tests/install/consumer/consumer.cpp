// A C++ program using an installed dion3: one Dion3 step through dion3::Optimizer on the CPU
// backend, one on the CUDA backend where the library has it and a GPU is visible (required when
// DION3_REQUIRE_CUDA=1), and a dion3::Error thrown inside the library caught here by type.
#include <dion3/error.hpp>
#include <dion3/optimizer.hpp>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main() {
  std::vector<float> w(16, 1.0f), g(16, 0.5f);
  g[3] = -2.0f;
  dion3::Optimizer opt(dion3::make_cpu_backend());
  int group = opt.add_group(dion3::GroupConfig{});
  dion3::ParamSpec spec;
  spec.name = "w";
  spec.weight = {w.data(), dion3::DType::F32, dion3::Device::CPU, 0, {4, 4}};
  spec.grad = {g.data(), dion3::DType::F32, dion3::Device::CPU, 0, {4, 4}};
  opt.add_param(group, spec);
  if (!opt.step() || opt.steps_taken() != 1 || w[0] == 1.0f) {
    std::fprintf(stderr, "C++ consumer: the step did not apply\n");
    return 1;
  }
  try {
    opt.set_grad(7, spec.grad);
    std::fprintf(stderr, "C++ consumer: set_grad(7) on one parameter did not throw\n");
    return 1;
  } catch (const dion3::Error& e) {
    if (e.status() != dion3::Status::InvalidArgument) return 1;
  }
  const char* require = std::getenv("DION3_REQUIRE_CUDA");
  if (dion3::cuda_available()) {
    // The weight and gradient in device memory from the backend's own allocator: the consumer
    // needs nothing from CUDA but what the installed library brings.
    dion3::Optimizer gpu(dion3::make_cuda_backend(0));
    dion3::Backend& be = gpu.backend();
    const std::size_t bytes = 16 * sizeof(float);
    void* dw = be.allocator().allocate(bytes);
    void* dg = be.allocator().allocate(bytes);
    std::vector<float> w0(16, 1.0f), out(16);
    be.copy_from_host(dw, w0.data(), bytes);
    be.copy_from_host(dg, g.data(), bytes);
    dion3::ParamSpec d = spec;
    d.weight = {dw, dion3::DType::F32, dion3::Device::CUDA, 0, {4, 4}};
    d.grad = {dg, dion3::DType::F32, dion3::Device::CUDA, 0, {4, 4}};
    gpu.add_param(gpu.add_group(dion3::GroupConfig{}), d);
    const bool applied = gpu.step();
    be.copy_to_host(out.data(), dw, bytes);
    be.allocator().deallocate(dw, bytes);
    be.allocator().deallocate(dg, bytes);
    if (!applied || out[0] == 1.0f) {
      std::fprintf(stderr, "C++ consumer: the CUDA step did not apply\n");
      return 1;
    }
    std::printf("C++ consumer: CUDA step applied\n");
  } else if (require && std::atoi(require)) {
    std::fprintf(stderr, "C++ consumer: DION3_REQUIRE_CUDA=1 but the installed library has no usable CUDA backend\n");
    return 1;
  }
  std::printf("C++ consumer: stepped, caught dion3::Error\n");
  return 0;
}
