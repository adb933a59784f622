// bench/dion3_bench.cpp — dion3-bench: optimizer step time on model-shaped parameter sets.
//
// Registers every matrix of a model preset (or of --shapes) in one dion3::Optimizer per
// optimizer variant — Muon, NorMuon, Dion3 at several fractions, AdamW — feeds random
// gradients, and reports the median step time, the speed-up over Muon measured in the same
// run and the effective GFLOP/s of the orthogonalization work (algorithm.md §2 convention). A second
// table times orthogonalization alone (standard vs Gram Newton–Schulz) on the largest shape.
// Unit tests never time anything; this program is where speed is measured.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "dion3/backend.hpp"
#include "dion3/config.hpp"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/orthogonalize.hpp"
#include "model_shapes.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using dion3::bench::MatrixShape;

const char* kUsage = R"(dion3-bench — optimizer step time of Muon, NorMuon, Dion3 and AdamW on model shapes

Usage: dion3-bench [options]

Workload (default: --model gpt-small --layers 1, about 7M weights in 6 matrices):
  --model NAME        gpt-small  12 layers, d=768,  MLP 4d      (q,k,v,o d x d; up 4d x d; down d x 4d)
                      gpt-1b     16 layers, d=2048, MLP 4d
                      llama-7b   32 layers, d=4096, MLP 11008   (gate, up 11008 x d; down d x 11008)
  --layers N          use only the first N layers of the model (default: all layers when
                      --model is given, 1 layer for the no-argument default run)
  --shapes LIST       explicit matrices instead of a model, rows x cols (out x in), comma
                      separated; ROWSxCOLS:N repeats a shape N times, e.g. 1024x4096,4096x1024:4
Run:
  --device cpu|cuda   backend (default cpu; cuda needs a build with -DDION3_CUDA=ON)
  --dtype f32|bf16    dtype of weights, gradients and momentum (default f32)
  --fractions LIST    Dion3 fractions f, comma separated, fractions or decimals
                      (default 1,1/2,1/4,1/8)
  --optimizers LIST   which rows to run, from muon,normuon,dion3,adamw (default: all).
                      Speed-ups are relative to Muon, so keep muon in the list to get them.
  --orth METHOD       orthogonalizer of the step runs: auto|standard|gram (default auto)
  --warmup N          untimed steps per optimizer before timing (default 0: the median of
                      3 already discards the first step's one-time costs)
  --iters N           timed steps per optimizer; the median is reported (default 3)
  --schedule S        interleaved: all optimizers live at once and take turns step by step, so
                      a machine whose speed drifts (a shared CPU) biases none of them; needs
                      every optimizer's state in memory at once. sequential: one optimizer
                      at a time. Default: interleaved on cpu, sequential on cuda.
  --transposed        also time NorMuon and each Dion3 fraction on the same weights stored
                      (in, out) in a transposed group (stepped by columns): the rows whose
                      label ends with (in, out)
  --no-orth-table     skip the orthogonalization-only table
  --seed N            random seed of weights and gradients (default 1)
  --csv FILE          also write every table row to FILE (CSV with a header)
  -h, --help          this text

Output: the megabatch plan of a Dion3 optimizer over the workload (shape groups, selected rows
k, orthogonalization method, workspace), then

  optimizer  median ms  speed-up vs Muon (= Muon time / this time)  effective GFLOP/s

where effective FLOPs are those of standard Newton-Schulz on the matrices actually
orthogonalized, T*(4p^2q + 2p^3) for p x q with p <= q (algorithm.md §2): the full m x n
matrices for Muon/NorMuon, the k x n selected rows for Dion3. The same count is used whatever
method runs, so GFLOP/s compare like with like. Then, for the largest shape: standard vs Gram
Newton-Schulz alone (median ms, effective GFLOP/s, FLOPs really performed, speed-up, and the
max relative difference of their outputs).

Progress goes to stderr. CPU threads come from OpenMP (OMP_NUM_THREADS). On CUDA each
step ends with one host synchronisation (the non-finite check), so wall time is device time.
)";

struct Options {
  std::string model = "gpt-small";
  int layers = -1;  // -1: 1 layer for the default workload, all layers when --model is given
  bool model_given = false;
  std::string shapes;
  std::string device = "cpu";
  std::string dtype = "f32";
  std::vector<double> fractions = {1.0, 0.5, 0.25, 0.125};
  std::vector<std::string> optimizers = {"muon", "normuon", "dion3", "adamw"};
  std::string orth = "auto";
  int warmup = 0;
  int iters = 3;
  bool orth_table = true;
  bool transposed = false;
  unsigned seed = 1;
  std::string csv;
  std::string schedule;  // "interleaved" | "sequential"; empty = by device
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "dion3-bench: %s\n(see dion3-bench --help)\n", msg.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    std::size_t end = s.find(sep, start);
    std::string item = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!item.empty()) out.push_back(item);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

int parse_int(const std::string& s, const std::string& flag, int lo) {
  std::size_t used = 0;
  int v = 0;
  try {
    v = std::stoi(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || v < lo)
    usage_error(flag + " needs an integer >= " + std::to_string(lo) + ", got '" + s + "'");
  return v;
}

double parse_fraction(const std::string& s) {
  double v = -1;
  try {
    if (auto slash = s.find('/'); slash != std::string::npos)
      v = std::stod(s.substr(0, slash)) / std::stod(s.substr(slash + 1));
    else
      v = std::stod(s);
  } catch (const std::exception&) {
    v = -1;
  }
  if (!(v > 0.0 && v <= 1.0)) usage_error("--fractions: '" + s + "' is not a fraction in (0, 1]");
  return v;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (auto eq = a.find('='); eq != std::string::npos) return a.substr(eq + 1);
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    std::string key = a.substr(0, a.find('='));
    if (key == "-h" || key == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (key == "--model") {
      o.model = value();
      o.model_given = true;
    } else if (key == "--layers") {
      o.layers = parse_int(value(), key, 1);
    } else if (key == "--shapes") {
      o.shapes = value();
    } else if (key == "--device") {
      o.device = value();
      if (o.device != "cpu" && o.device != "cuda") usage_error("--device is cpu or cuda, got '" + o.device + "'");
    } else if (key == "--dtype") {
      o.dtype = value();
      if (o.dtype != "f32" && o.dtype != "bf16") usage_error("--dtype is f32 or bf16, got '" + o.dtype + "'");
    } else if (key == "--fractions") {
      o.fractions.clear();
      for (const auto& f : split(value(), ',')) o.fractions.push_back(parse_fraction(f));
      if (o.fractions.empty()) usage_error("--fractions needs at least one value");
    } else if (key == "--optimizers") {
      o.optimizers = split(value(), ',');
      for (const auto& n : o.optimizers)
        if (n != "muon" && n != "normuon" && n != "dion3" && n != "adamw")
          usage_error("--optimizers: unknown '" + n + "' (muon, normuon, dion3, adamw)");
    } else if (key == "--orth") {
      o.orth = value();
      if (o.orth != "auto" && o.orth != "standard" && o.orth != "gram")
        usage_error("--orth is auto, standard or gram, got '" + o.orth + "'");
    } else if (key == "--warmup") {
      o.warmup = parse_int(value(), key, 0);
    } else if (key == "--iters") {
      o.iters = parse_int(value(), key, 1);
    } else if (key == "--schedule") {
      o.schedule = value();
      if (o.schedule != "interleaved" && o.schedule != "sequential")
        usage_error("--schedule is interleaved or sequential, got '" + o.schedule + "'");
    } else if (key == "--no-orth-table") {
      o.orth_table = false;
    } else if (key == "--transposed") {
      o.transposed = true;
    } else if (key == "--seed") {
      o.seed = static_cast<unsigned>(parse_int(value(), key, 0));
    } else if (key == "--csv") {
      o.csv = value();
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (o.schedule.empty()) o.schedule = o.device == "cpu" ? "interleaved" : "sequential";
  if (!o.shapes.empty() && (o.model_given || o.layers > 0))
    usage_error("--shapes replaces a model's matrices: give --shapes, or --model and --layers, not both");
  if (!o.csv.empty() && !std::ofstream(o.csv, std::ios::app))  // before the run, not after it
    usage_error("--csv " + o.csv + ": cannot be written (" + std::strerror(errno) + ")");
  return o;
}

// ---- helpers ------------------------------------------------------------------------------

std::string fraction_label(double f) {
  double inv = 1.0 / f;
  if (f == 1.0) return "1";
  if (std::fabs(inv - std::round(inv)) < 1e-9) return "1/" + std::to_string(static_cast<long>(std::round(inv)));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", f);
  return buf;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", b, units[u]);
  return buf;
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::unique_ptr<dion3::Backend> make_backend(const Options& o) {
  if (o.device == "cuda") return dion3::make_cuda_backend(0);
  return dion3::make_cpu_backend();
}

// Progress on stderr: an updating line on a terminal, one line per finished task otherwise.
class Progress {
 public:
  Progress() : tty_(isatty(STDERR_FILENO) != 0) {}
  void update(const std::string& line) {
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s", line.c_str());
      std::fflush(stderr);
    }
  }
  void done(const std::string& line) {
    if (tty_)
      std::fprintf(stderr, "\r\033[K%s\n", line.c_str());
    else
      std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }

 private:
  bool tty_;
};

// Memory for weights and gradients, filled once and shared by every optimizer variant (their
// values do not matter for timing). Lives on its own backend so it outlives each optimizer.
struct Tensors {
  dion3::DType dtype;
  std::vector<dion3::DeviceBuffer> weights, grads;
};

void fill_random(dion3::Backend& be, void* dst, int64_t n, dion3::DType dtype, float scale,
                 std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, scale);
  if (dtype == dion3::DType::BF16) {
    std::vector<uint16_t> h(static_cast<std::size_t>(n));
    for (auto& x : h) x = to_bf16(dist(rng));
    be.copy_from_host(dst, h.data(), h.size() * 2);
  } else {
    std::vector<float> h(static_cast<std::size_t>(n));
    for (auto& x : h) x = dist(rng);
    be.copy_from_host(dst, h.data(), h.size() * 4);
  }
}

std::vector<float> read_floats(dion3::Backend& be, const void* src, int64_t n, dion3::DType dtype) {
  std::vector<float> out(static_cast<std::size_t>(n));
  if (dtype == dion3::DType::BF16) {
    std::vector<uint16_t> h(out.size());
    be.copy_to_host(h.data(), src, h.size() * 2);
    for (std::size_t i = 0; i < h.size(); ++i) out[i] = from_bf16(h[i]);
  } else {
    be.copy_to_host(out.data(), src, out.size() * 4);
  }
  return out;
}

// Blocks until the backend's queued work is done (read_flag synchronises).
struct Syncer {
  dion3::Backend& be;
  dion3::DeviceBuffer flag;
  explicit Syncer(dion3::Backend& b) : be(b), flag(b.allocator(), sizeof(int)) {
    be.fill_zero(flag.get(), sizeof(int));
  }
  void operator()() { be.read_flag(flag.as<int>()); }
};

// ---- the step table -------------------------------------------------------------------------

struct Variant {
  std::string label;
  dion3::Algorithm algorithm;
  double fraction = 1.0;
  bool transposed = false;  // the weights stored (in, out), in a transposed group
};

struct Row {
  std::string table, label;
  double fraction = 0;
  int64_t rows = 0, cols = 0;
  double median_ms = 0, min_ms = 0, speedup = 0;
  double eff_gflops = 0;     // effective GFLOP/s (algorithm.md §2 convention)
  double eff_gflop = 0;      // effective GFLOP per call
  double real_gflop = -1;    // GFLOP really performed per call (orth table only; -1 = unknown)
  std::string note;
};

dion3::OrthMethod orth_method(const Options& o) { return dion3::parse_orth_method(o.orth); }

void print_plan(const std::vector<dion3::MegabatchInfo>& plan, const std::string& title) {
  std::printf("Megabatch plan (%s):\n", title.c_str());
  std::printf("  %-5s %-8s %-12s %-6s %6s %8s %-9s %-6s %10s\n", "group", "algo", "shape", "dtype",
              "count", "k", "method", "iter", "workspace");
  for (const auto& m : plan) {
    std::string shape = std::to_string(m.rows) + "x" + std::to_string(m.cols);
    const char* method = m.method == dion3::OrthMethod::Gram       ? "gram"
                         : m.method == dion3::OrthMethod::Standard ? "standard"
                                                                   : "auto";
    bool matrix = dion3::is_matrix_algorithm(m.algorithm);
    std::printf("  %-5d %-8s %-12s %-6s %6lld %8s %-9s %-6s %10s\n", m.group,
                dion3::algorithm_name(m.algorithm), shape.c_str(), dion3::dtype_name(m.dtype),
                static_cast<long long>(m.count),
                matrix ? std::to_string(m.selected_rows).c_str() : "-", matrix ? method : "-",
                matrix ? dion3::dtype_name(m.iteration_dtype) : "-",
                human_bytes(static_cast<double>(m.workspace_bytes)).c_str());
  }
}

// Effective NS FLOPs of one step, from the plan (k x n selected matrices for Dion3).
double step_effective_flops(const std::vector<dion3::MegabatchInfo>& plan, int steps) {
  double flops = 0;
  for (const auto& m : plan) {
    if (!dion3::is_matrix_algorithm(m.algorithm)) continue;
    int64_t k = m.selected_rows > 0 ? m.selected_rows : m.rows;
    flops += dion3::effective_ns_flops(m.count, std::min(k, m.cols), std::max(k, m.cols), steps);
  }
  return flops;
}

// One optimizer variant with everything registered, ready to step. The Syncer's buffer comes
// from the optimizer's backend, so it is declared after (and destroyed before) the optimizer.
struct Runner {
  Variant variant;
  dion3::GroupConfig cfg;
  std::unique_ptr<dion3::Optimizer> opt;
  std::unique_ptr<Syncer> sync;
  std::vector<dion3::MegabatchInfo> plan;
  std::vector<double> times;
  ~Runner() { sync.reset(); }

  Runner(const Options& o, const Variant& v, const std::vector<MatrixShape>& shapes, Tensors& t)
      : variant(v) {
    opt = std::make_unique<dion3::Optimizer>(make_backend(o));
    cfg.algorithm = v.algorithm;
    cfg.fraction = v.fraction;
    cfg.transposed = v.transposed;
    cfg.orth.method = orth_method(o);
    int g = opt->add_group(cfg);
    const dion3::Device dev = o.device == "cuda" ? dion3::Device::CUDA : dion3::Device::CPU;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      dion3::ParamSpec spec;
      spec.name = shapes[i].name;
      std::vector<int64_t> shape = {shapes[i].rows, shapes[i].cols};
      if (v.transposed) std::swap(shape[0], shape[1]);
      spec.weight = dion3::TensorView{t.weights[i].get(), t.dtype, dev, 0, shape};
      spec.grad = dion3::TensorView{t.grads[i].get(), t.dtype, dev, 0, shape};
      opt->add_param(g, spec);
    }
    plan = opt->plan();
    sync = std::make_unique<Syncer>(opt->backend());
  }

  double step() {
    auto t0 = Clock::now();
    opt->step();
    (*sync)();
    return ms_since(t0);
  }

  Row row() const {
    Row r;
    r.table = "step";
    r.label = variant.label;
    r.fraction = dion3::is_matrix_algorithm(variant.algorithm) ? variant.fraction : 0.0;
    r.median_ms = median(times);
    r.min_ms = *std::min_element(times.begin(), times.end());
    const int T = static_cast<int>(cfg.orth.coefficients.size());
    double flops = step_effective_flops(plan, T);
    r.eff_gflops = flops > 0 ? flops / (r.median_ms * 1e-3) / 1e9 : 0.0;
    r.eff_gflop = flops / 1e9;
    return r;
  }
};

std::string step_label(const Options& o, int s) {
  return s < o.warmup ? "warmup " + std::to_string(s + 1) + "/" + std::to_string(o.warmup)
                      : "step " + std::to_string(s - o.warmup + 1) + "/" + std::to_string(o.iters);
}

// Interleaved: every optimizer lives at once and they take turns, step by step, so that a
// machine whose speed drifts (other jobs, thermal limits) biases no optimizer against another.
// Sequential: one optimizer at a time (only one optimizer's state in memory).
std::vector<Row> run_steps(const Options& o, const std::vector<Variant>& variants,
                           const std::vector<MatrixShape>& shapes, Tensors& t, Progress& progress,
                           std::vector<std::vector<dion3::MegabatchInfo>>& plans) {
  const int n = o.warmup + o.iters;
  const int total = static_cast<int>(variants.size());
  std::vector<Row> rows;
  plans.clear();
  if (o.schedule == "interleaved") {
    std::vector<std::unique_ptr<Runner>> runners;
    for (int i = 0; i < total; ++i) {
      progress.update("registering " + variants[i].label);
      runners.push_back(std::make_unique<Runner>(o, variants[i], shapes, t));
    }
    for (int s = 0; s < n; ++s) {
      for (int i = 0; i < total; ++i) {
        progress.update("[" + step_label(o, s) + "] " + std::to_string(i + 1) + "/" +
                        std::to_string(total) + " " + variants[i].label);
        double ms = runners[i]->step();
        if (s >= o.warmup) runners[i]->times.push_back(ms);
      }
      progress.done("[" + step_label(o, s) + "] all " + std::to_string(total) + " optimizers done");
    }
    for (auto& r : runners) {
      rows.push_back(r->row());
      plans.push_back(r->plan);
    }
    return rows;
  }
  for (int i = 0; i < total; ++i) {
    Runner r(o, variants[i], shapes, t);
    const std::string prefix = "[" + std::to_string(i + 1) + "/" + std::to_string(total) + "] " + variants[i].label;
    for (int s = 0; s < n; ++s) {
      progress.update(prefix + ": " + step_label(o, s));
      double ms = r.step();
      if (s >= o.warmup) r.times.push_back(ms);
    }
    char line[200];
    std::snprintf(line, sizeof line, "%s: median %.1f ms over %d steps", prefix.c_str(), median(r.times), o.iters);
    progress.done(line);
    rows.push_back(r.row());
    plans.push_back(r.plan);
  }
  return rows;
}

// ---- the orthogonalization table -------------------------------------------------------------

std::vector<Row> run_orth_table(const Options& o, const MatrixShape& s, dion3::DType dtype,
                                Progress& progress, std::string* auto_choice, double* max_rel_diff) {
  auto backend = make_backend(o);
  dion3::Backend& be = *backend;
  std::vector<Row> rows;
  const int64_t n = s.rows * s.cols;
  const int64_t p = std::min(s.rows, s.cols), q = std::max(s.rows, s.cols);
  std::vector<float> outputs[2];
  {
    dion3::DeviceBuffer in(be.allocator(), n * dion3::dtype_size(dtype));
    std::mt19937 rng(o.seed + 7);
    fill_random(be, in.get(), n, dtype, 1.0f, rng);
    Syncer sync(be);
    auto view = [&](void* ptr) { return dion3::MatrixView::contiguous(ptr, dtype, 1, s.rows, s.cols); };

    dion3::OrthConfig base;
    *auto_choice = dion3::choose_orth_method(be, base, p, q) == dion3::OrthMethod::Gram ? "gram" : "standard";
    const int T = static_cast<int>(base.coefficients.size());
    int restarts = 0;
    for (int r : base.restarts)
      if (r > 0 && r < T) ++restarts;

    // Both orthogonalizers are planned up front and run alternately (same reason as the
    // interleaved step schedule: drift in machine speed then favours neither).
    const dion3::OrthMethod methods[2] = {dion3::OrthMethod::Standard, dion3::OrthMethod::Gram};
    const char* labels[2] = {"standard NS", "Gram NS"};
    std::vector<std::unique_ptr<dion3::Orthogonalizer>> orths;
    std::vector<dion3::DeviceBuffer> outs;
    for (int mi = 0; mi < 2; ++mi) {
      dion3::OrthConfig cfg = base;
      cfg.method = methods[mi];
      orths.push_back(std::make_unique<dion3::Orthogonalizer>(be, cfg, 1, s.rows, s.cols));
      outs.emplace_back(be.allocator(), n * dion3::dtype_size(dtype));
    }
    std::vector<double> times[2];
    const int runs = o.warmup + o.iters;
    for (int it = 0; it < runs; ++it) {
      for (int mi = 0; mi < 2; ++mi) {
        progress.update(std::string("[orth] ") + labels[mi] + " " + std::to_string(s.rows) + "x" +
                        std::to_string(s.cols) + ": run " + std::to_string(it + 1) + "/" + std::to_string(runs));
        auto t0 = Clock::now();
        orths[mi]->run(view(in.get()), view(outs[mi].get()));
        sync();
        if (it >= o.warmup) times[mi].push_back(ms_since(t0));
      }
    }
    for (int mi = 0; mi < 2; ++mi) {
      outputs[mi] = read_floats(be, outs[mi].get(), n, dtype);
      Row r;
      r.table = "orth";
      r.label = labels[mi];
      r.rows = s.rows;
      r.cols = s.cols;
      r.median_ms = median(times[mi]);
      r.min_ms = *std::min_element(times[mi].begin(), times[mi].end());
      r.eff_gflops = dion3::effective_ns_flops(1, p, q, T) / (r.median_ms * 1e-3) / 1e9;
      double real = mi == 0 ? dion3::standard_ns_flops(1, p, q, T, be.symmetric_cost_factor())
                            : dion3::gram_ns_flops(1, p, q, T, restarts, be.symmetric_cost_factor());
      r.real_gflop = real / 1e9;
      r.eff_gflop = dion3::effective_ns_flops(1, p, q, T) / 1e9;
      r.note = std::string("iter ") + dion3::dtype_name(orths[mi]->iteration_dtype()) +
               (orths[mi]->transposed() ? ", transposed" : "");
      rows.push_back(r);
      char line[120];
      std::snprintf(line, sizeof line, "[orth] %s: median %.1f ms", labels[mi], r.median_ms);
      progress.done(line);
    }
    orths.clear();  // workspace goes back before `be` is destroyed
    outs.clear();
  }
  double maxabs = 0, maxdiff = 0;
  for (std::size_t i = 0; i < outputs[0].size(); ++i) {
    maxabs = std::max(maxabs, static_cast<double>(std::fabs(outputs[0][i])));
    maxdiff = std::max(maxdiff, static_cast<double>(std::fabs(outputs[0][i] - outputs[1][i])));
  }
  *max_rel_diff = maxabs > 0 ? maxdiff / maxabs : 0.0;
  for (auto& r : rows) r.speedup = rows[0].median_ms / r.median_ms;
  return rows;
}

std::string csv_field(const std::string& v) {
  if (v.find_first_of(",\"\n") == std::string::npos) return v;
  std::string out = "\"";
  for (char c : v) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

void write_csv(const std::string& path, const Options& o, const std::string& workload,
               const std::vector<Row>& rows) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write " + path);
  f << "table,name,fraction,rows,cols,median_ms,min_ms,speedup,effective_gflops,"
       "effective_gflop_per_call,performed_gflop_per_call,device,dtype,workload,note\n";
  for (const auto& r : rows) {
    f << r.table << ',' << csv_field(r.label) << ',';
    if (r.fraction > 0) f << r.fraction;
    f << ',';
    if (r.rows > 0) f << r.rows << ',' << r.cols;
    else f << ',';
    f << ',' << r.median_ms << ',' << r.min_ms << ',' << r.speedup << ',' << r.eff_gflops << ','
      << r.eff_gflop << ',';
    if (r.real_gflop >= 0) f << r.real_gflop;
    f << ',' << o.device << ',' << o.dtype << ',' << csv_field(workload) << ',' << csv_field(r.note) << '\n';
  }
}

int run(const Options& o) {
  // Workload.
  std::vector<MatrixShape> shapes;
  std::string workload;
  if (!o.shapes.empty()) {
    shapes = dion3::bench::parse_shapes(o.shapes);
    workload = "shapes " + o.shapes;
  } else {
    const auto& preset = dion3::bench::find_preset(o.model);
    int layers = o.layers > 0 ? std::min(o.layers, preset.layers) : o.model_given ? preset.layers : 1;
    shapes = dion3::bench::model_matrices(preset, layers);
    workload = preset.name + " (" + std::to_string(layers) + " of " + std::to_string(preset.layers) + " layers)";
  }
  const dion3::DType dtype = o.dtype == "bf16" ? dion3::DType::BF16 : dion3::DType::F32;

  auto data_backend = make_backend(o);
  const int64_t elems = dion3::bench::total_elements(shapes);
  std::printf("dion3-bench: %s, %zu matrices, %.2fM weights, device %s, dtype %s, warmup %d, iters %d, %s\n",
              workload.c_str(), shapes.size(), elems / 1e6, o.device.c_str(), o.dtype.c_str(), o.warmup,
              o.iters, o.schedule.c_str());
  if (const char* th = std::getenv("OMP_NUM_THREADS"); th && o.device == "cpu")
    std::printf("OMP_NUM_THREADS=%s\n", th);

  Tensors t;
  t.dtype = dtype;
  {
    std::mt19937 rng(o.seed);
    for (const auto& s : shapes) {
      const int64_t n = s.rows * s.cols;
      t.weights.emplace_back(data_backend->allocator(), n * dion3::dtype_size(dtype));
      t.grads.emplace_back(data_backend->allocator(), n * dion3::dtype_size(dtype));
      fill_random(*data_backend, t.weights.back().get(), n, dtype, 0.02f, rng);
      fill_random(*data_backend, t.grads.back().get(), n, dtype, 1e-3f, rng);
    }
  }

  // Variants, Muon first: it is the baseline of the speed-up column.
  auto wants = [&](const char* n) {
    return std::find(o.optimizers.begin(), o.optimizers.end(), n) != o.optimizers.end();
  };
  std::vector<Variant> variants;
  if (wants("muon")) variants.push_back({"Muon", dion3::Algorithm::Muon, 1.0});
  if (wants("normuon")) variants.push_back({"NorMuon", dion3::Algorithm::NorMuon, 1.0});
  if (wants("dion3"))
    for (double f : o.fractions)
      variants.push_back({"Dion3 f=" + fraction_label(f), dion3::Algorithm::Dion3, f});
  if (o.transposed) {
    const std::size_t plain = variants.size();
    for (std::size_t i = 0; i < plain; ++i)
      if (dion3::normalizes_rows(variants[i].algorithm))
        variants.push_back({variants[i].label + " (in, out)", variants[i].algorithm, variants[i].fraction, true});
  }
  if (wants("adamw")) variants.push_back({"AdamW", dion3::Algorithm::AdamW, 1.0});

  Progress progress;
  std::vector<Row> rows;
  std::vector<dion3::MegabatchInfo> plan;
  std::string plan_title;
  // The plan shown is the Dion3 run at the library's default fraction when present.
  const double default_f = dion3::GroupConfig{}.fraction;
  auto t_start = Clock::now();
  std::vector<std::vector<dion3::MegabatchInfo>> plans;
  rows = run_steps(o, variants, shapes, t, progress, plans);
  for (std::size_t i = 0; i < variants.size(); ++i) {
    const auto& v = variants[i];
    bool show = v.algorithm == dion3::Algorithm::Dion3 &&
                (plan_title.empty() || std::fabs(v.fraction - default_f) < 1e-12);
    if (show || (plan_title.empty() && i + 1 == variants.size())) {
      plan = plans[i];
      plan_title = v.label + ", orth " + o.orth;
    }
  }
  double muon_ms = 0;
  for (const auto& r : rows)
    if (r.label == "Muon") muon_ms = r.median_ms;
  for (auto& r : rows) r.speedup = muon_ms > 0 ? muon_ms / r.median_ms : 0.0;

  std::printf("\n");
  print_plan(plan, plan_title);
  std::printf("\nOptimizer step (%s, %s, %s):\n", workload.c_str(), o.device.c_str(), o.dtype.c_str());
  std::printf("  %-22s %12s %12s %14s %16s\n", "optimizer", "median ms", "min ms", "vs Muon", "eff. GFLOP/s");
  for (const auto& r : rows) {
    char speed[32] = "-", gf[32] = "-";
    if (r.speedup > 0) std::snprintf(speed, sizeof speed, "%.2fx", r.speedup);
    if (r.eff_gflops > 0) std::snprintf(gf, sizeof gf, "%.1f", r.eff_gflops);
    std::printf("  %-22s %12.2f %12.2f %14s %16s\n", r.label.c_str(), r.median_ms, r.min_ms, speed, gf);
  }

  if (o.orth_table) {
    const MatrixShape* largest = &shapes[0];
    for (const auto& s : shapes)
      if (s.rows * s.cols > largest->rows * largest->cols) largest = &s;
    std::string auto_choice;
    double rel = 0;
    auto orows = run_orth_table(o, *largest, dtype, progress, &auto_choice, &rel);
    std::printf("\nOrthogonalization alone, %lldx%lld (%s input; auto picks %s):\n",
                static_cast<long long>(largest->rows), static_cast<long long>(largest->cols),
                o.dtype.c_str(), auto_choice.c_str());
    std::printf("  %-12s %12s %12s %16s %14s %12s  %s\n", "method", "median ms", "min ms", "eff. GFLOP/s",
                "GFLOP done", "vs standard", "");
    for (const auto& r : orows)
      std::printf("  %-12s %12.2f %12.2f %16.1f %14.2f %11.2fx  %s\n", r.label.c_str(), r.median_ms,
                  r.min_ms, r.eff_gflops, r.real_gflop, r.speedup, r.note.c_str());
    std::printf("  max |gram - standard| / max |standard| = %.3g\n", rel);
    rows.insert(rows.end(), orows.begin(), orows.end());
  }
  std::printf("\ntotal %.1f s\n", ms_since(t_start) / 1e3);
  if (!o.csv.empty()) {
    write_csv(o.csv, o, workload, rows);
    std::printf("wrote %s\n", o.csv.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse_args(argc, argv);
  try {
    return run(o);
  } catch (const dion3::Error& e) {
    if (e.status() == dion3::Status::Unsupported && o.device == "cuda" &&
        std::string(e.what()).find("DION3_CUDA") == std::string::npos)
      std::fprintf(stderr,
                   "dion3-bench: %s\n(--device cuda needs a build configured with -DDION3_CUDA=ON)\n",
                   e.what());
    else
      std::fprintf(stderr, "dion3-bench: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dion3-bench: %s\n", e.what());
    return 1;
  }
}
