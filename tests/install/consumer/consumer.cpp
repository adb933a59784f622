// A C++ program using an installed dion3: one Dion3 step through dion3::Optimizer on the CPU
// backend, and a dion3::Error thrown inside the library caught here by type.
#include <dion3/error.hpp>
#include <dion3/optimizer.hpp>

#include <cstdio>
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
  std::printf("C++ consumer: stepped, caught dion3::Error\n");
  return 0;
}
