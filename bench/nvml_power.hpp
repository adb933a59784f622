// bench/nvml_power.hpp — the GPU's energy counter, enforced power limit, power and SM clock through
// NVML, for the benches that ask whether a step is held by the power limit rather than by FLOPs or
// bytes. The driver's library is opened at run time (dlopen), so the benches build without NVML
// and, where it is missing, run and say so instead of printing these numbers.
#pragma once

#include <dlfcn.h>

#include <cuda_runtime.h>

#include <string>

namespace bench {

class PowerMeter {
 public:
  explicit PowerMeter(int cuda_device = 0) {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) {
      why_not_ = "libnvidia-ml.so.1 not found";
      return;
    }
    auto sym = [&](const char* name) { return dlsym(lib_, name); };
    auto init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
    auto by_bus = reinterpret_cast<int (*)(const char*, Device*)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
    energy_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(sym("nvmlDeviceGetTotalEnergyConsumption"));
    limit_ = reinterpret_cast<int (*)(Device, unsigned*)>(sym("nvmlDeviceGetEnforcedPowerLimit"));
    power_ = reinterpret_cast<int (*)(Device, unsigned*)>(sym("nvmlDeviceGetPowerUsage"));
    clock_ = reinterpret_cast<int (*)(Device, int, unsigned*)>(sym("nvmlDeviceGetClockInfo"));
    reasons_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(sym("nvmlDeviceGetCurrentClocksEventReasons"));
    if (!reasons_)
      reasons_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(sym("nvmlDeviceGetCurrentClocksThrottleReasons"));
    if (!init || !by_bus || !energy_ || !limit_ || !power_ || !clock_) {
      why_not_ = "libnvidia-ml.so.1 lacks a function this bench uses";
      return;
    }
    // NVML numbers devices its own way; the PCI bus id names the one CUDA calls cuda_device.
    char bus[32] = {};
    if (int rc = init(); rc != 0) {
      why_not_ = "nvmlInit_v2 returned " + std::to_string(rc);
      return;
    }
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_device) != cudaSuccess || by_bus(bus, &dev_) != 0) {
      why_not_ = std::string("no NVML device for PCI bus id ") + bus;
      return;
    }
    unsigned long long e = 0;
    if (energy_(dev_, &e) != 0) {
      why_not_ = "the energy counter is not supported on this device";
      return;
    }
    ok_ = true;
  }
  PowerMeter(const PowerMeter&) = delete;
  PowerMeter& operator=(const PowerMeter&) = delete;
  ~PowerMeter() {
    if (lib_) dlclose(lib_);
  }

  bool ok() const { return ok_; }
  const std::string& why_not() const { return why_not_; }
  // Energy since the driver loaded, in joules (the counter is in millijoules).
  double energy_j() const {
    unsigned long long e = 0;
    return ok_ && energy_(dev_, &e) == 0 ? static_cast<double>(e) * 1e-3 : 0.0;
  }
  double limit_w() const {
    unsigned mw = 0;
    return ok_ && limit_(dev_, &mw) == 0 ? mw * 1e-3 : 0.0;
  }
  double power_w() const {
    unsigned mw = 0;
    return ok_ && power_(dev_, &mw) == 0 ? mw * 1e-3 : 0.0;
  }
  unsigned sm_mhz() const {
    unsigned mhz = 0;
    return ok_ && clock_(dev_, kClockSm, &mhz) == 0 ? mhz : 0;
  }
  // The reasons the clocks are held below their maximum now (NVML's bit mask; 0x4 is the software
  // power cap), 0 where the driver does not say.
  unsigned long long clock_reasons() const {
    unsigned long long r = 0;
    return ok_ && reasons_ && reasons_(dev_, &r) == 0 ? r : 0;
  }

 private:
  using Device = void*;
  static constexpr int kClockSm = 1;  // NVML_CLOCK_SM
  void* lib_ = nullptr;
  Device dev_ = nullptr;
  bool ok_ = false;
  std::string why_not_;
  int (*energy_)(Device, unsigned long long*) = nullptr;
  int (*limit_)(Device, unsigned*) = nullptr;
  int (*power_)(Device, unsigned*) = nullptr;
  int (*clock_)(Device, int, unsigned*) = nullptr;
  int (*reasons_)(Device, unsigned long long*) = nullptr;
};

}  // namespace bench
