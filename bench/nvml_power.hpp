// bench/nvml_power.hpp — the GPU's energy counter, enforced power limit, SM clock and temperature
// through NVML, for the benches that ask whether a step is held by the power limit rather than by
// FLOPs or bytes. The driver's library is opened at run time (dlopen), so the benches build without
// NVML and, where it is missing, run and say so instead of printing these numbers.
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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
    clock_ = reinterpret_cast<int (*)(Device, int, unsigned*)>(sym("nvmlDeviceGetClockInfo"));
    temp_ = reinterpret_cast<int (*)(Device, int, unsigned*)>(sym("nvmlDeviceGetTemperature"));
    reasons_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(sym("nvmlDeviceGetCurrentClocksEventReasons"));
    if (!reasons_)
      reasons_ = reinterpret_cast<int (*)(Device, unsigned long long*)>(sym("nvmlDeviceGetCurrentClocksThrottleReasons"));
    if (!init || !by_bus || !energy_ || !limit_ || !clock_) {
      why_not_ = "libnvidia-ml.so.1 lacks a function this bench uses";
      return;
    }
    // NVML numbers devices its own way; the PCI bus id names the one CUDA calls cuda_device.
    char bus[32] = {};
    if (int rc = init(); rc != 0) {
      why_not_ = "nvmlInit_v2 returned " + std::to_string(rc);
      return;
    }
    shutdown_ = reinterpret_cast<int (*)()>(sym("nvmlShutdown"));
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_device) != cudaSuccess || by_bus(bus, &dev_) != 0) {
      why_not_ = std::string("no NVML device for PCI bus id ") + bus;
      return;
    }
    unsigned long long e = 0;
    if (energy_(dev_, &e) != 0) {
      why_not_ = "the energy counter is not supported on this device";
      return;
    }
    ok_ = true;  // limit_w() reads only through an open meter
    if (limit_w() <= 0) {
      ok_ = false;
      why_not_ = "no enforced power limit reported";
      return;
    }
  }
  PowerMeter(const PowerMeter&) = delete;
  PowerMeter& operator=(const PowerMeter&) = delete;
  ~PowerMeter() {
    if (shutdown_) shutdown_();
    if (lib_) dlclose(lib_);
  }

  bool ok() const { return ok_; }
  const std::string& why_not() const { return why_not_; }
  // Energy since the driver loaded, in joules (the counter is in millijoules); exits on a failed read,
  // which would otherwise pass for a huge or negative energy.
  double energy_j() const {
    unsigned long long e = 0;
    if (!ok_ || energy_(dev_, &e) != 0) {
      std::fprintf(stderr, "NVML: reading the energy counter failed\n");
      std::exit(1);
    }
    return static_cast<double>(e) * 1e-3;
  }
  // The counter moves in steps tens of milliseconds apart: a window is timed from the moment of one
  // step to the moment of another, not from whenever it was read. `between_reads` runs between two
  // reads (the caller keeps its work going there); a counter that does not move for 5 s ends the
  // program rather than pass a stale value for an edge.
  struct Edge {
    double joules;
    std::chrono::steady_clock::time_point at;
  };
  template <class F>
  Edge energy_edge(F&& between_reads) const {
    const double e0 = energy_j();
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (;;) {
      const double e = energy_j();
      const auto now = std::chrono::steady_clock::now();
      if (e != e0) return {e, now};
      if (now > give_up) {
        std::fprintf(stderr, "NVML: the energy counter did not move for 5 s\n");
        std::exit(1);
      }
      between_reads();
    }
  }
  unsigned temperature_c() const {
    unsigned c = 0;
    return ok_ && temp_ && temp_(dev_, kTemperatureGpu, &c) == 0 ? c : 0;
  }
  double limit_w() const {
    unsigned mw = 0;
    return ok_ && limit_(dev_, &mw) == 0 ? mw * 1e-3 : 0.0;
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
  static constexpr int kClockSm = 1;         // NVML_CLOCK_SM
  static constexpr int kTemperatureGpu = 0;  // NVML_TEMPERATURE_GPU
  void* lib_ = nullptr;
  Device dev_ = nullptr;
  bool ok_ = false;
  std::string why_not_;
  int (*energy_)(Device, unsigned long long*) = nullptr;
  int (*limit_)(Device, unsigned*) = nullptr;
  int (*clock_)(Device, int, unsigned*) = nullptr;
  int (*temp_)(Device, int, unsigned*) = nullptr;
  int (*reasons_)(Device, unsigned long long*) = nullptr;
  int (*shutdown_)() = nullptr;
};

// The meter a bench's --energy-s needs; without one the program ends (status 1) saying why.
inline std::unique_ptr<PowerMeter> open_power_meter(const char* program) {
  auto pm = std::make_unique<PowerMeter>(0);
  if (!pm->ok()) {
    std::fprintf(stderr, "%s: --energy-s needs NVML: %s\n", program, pm->why_not().c_str());
    std::exit(1);
  }
  return pm;
}

// Samples the SM clock and the clock-limit reasons every 10 ms on a thread of its own (so the
// sampling never holds up the work being measured) until stopped.
class ClockSampler {
 public:
  explicit ClockSampler(const PowerMeter& pm) : pm_(pm), thread_([this] { run(); }) {}
  ClockSampler(const ClockSampler&) = delete;
  ClockSampler& operator=(const ClockSampler&) = delete;
  ~ClockSampler() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  struct Summary {
    double mean_mhz = 0;
    unsigned min_mhz = 0, max_mhz = 0;
    double power_capped = 0;      // share of samples with the software power cap (0x4) holding the clock
    unsigned long long reasons = 0;  // every reason seen (NVML's mask, OR of the samples)
    int samples = 0;
  };
  Summary summary() {
    stop();
    Summary s;
    s.samples = static_cast<int>(mhz_.size());
    if (mhz_.empty()) return s;
    double sum = 0;
    int capped = 0;
    for (std::size_t i = 0; i < mhz_.size(); ++i) {
      sum += mhz_[i];
      capped += (reasons_[i] & 0x4) != 0;
      s.reasons |= reasons_[i];
    }
    s.mean_mhz = sum / mhz_.size();
    s.min_mhz = *std::min_element(mhz_.begin(), mhz_.end());
    s.max_mhz = *std::max_element(mhz_.begin(), mhz_.end());
    s.power_capped = static_cast<double>(capped) / mhz_.size();
    return s;
  }

 private:
  void run() {
    while (!stop_) {
      mhz_.push_back(pm_.sm_mhz());
      reasons_.push_back(pm_.clock_reasons());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  const PowerMeter& pm_;
  std::atomic<bool> stop_{false};
  std::vector<unsigned> mhz_;
  std::vector<unsigned long long> reasons_;
  std::thread thread_;
};

// The energy of `one()` run back to back, per call. `one` must return only once the GPU has done
// its work (a synchronising call), so that host time is GPU time. After warm_s of calls, the
// window runs from the call in which the counter moved to the end of the first such call at least
// `seconds` later: both edges fall while the work runs, each off by at most one call.
struct EnergyWindow {
  int calls = 0;
  double joules = 0, ms = 0;  // a call
  ClockSampler::Summary clocks;
};
template <class F>
EnergyWindow energy_window(const PowerMeter& pm, double seconds, double warm_s, F&& one) {
  auto elapsed = [](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  };
  for (const auto w = std::chrono::steady_clock::now(); elapsed(w) < warm_s;) one();
  EnergyWindow e;
  const auto e0 = pm.energy_edge(one);
  ClockSampler clocks(pm);
  do {  // at least one call, so that a window never divides by zero
    one();
    ++e.calls;
  } while (elapsed(e0.at) < seconds);
  const auto e1 = pm.energy_edge([&] {
    one();
    ++e.calls;
  });
  e.clocks = clocks.summary();
  e.joules = (e1.joules - e0.joules) / e.calls;
  e.ms = std::chrono::duration<double, std::milli>(e1.at - e0.at).count() / e.calls;
  return e;
}

}  // namespace bench
