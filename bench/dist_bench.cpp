// bench/dist_bench.cpp — dion3-dist-bench: the distributed layouts of algorithm.md §3, timed and counted.
//
// Run under mpirun (CPU backend, MPI communicator) it registers a model's matrices on every rank
// in each layout — replicated (DDP), row-sharded with local and with global selection — once
// megabatched and once with one collective per matrix, steps them, and prints per layout the
// median step time (the slowest rank's), the collective rounds and the bytes each rank sends per
// step, and the megabatched/per-matrix ratio measured in the same run. With --device cuda it runs
// on one GPU per rank over NCCL (world size 1 without mpirun) and adds the single-device path as
// the baseline the distributed path is measured against. --project prints, without running, the
// rounds and bytes per rank for larger models and rank counts, from the same arithmetic the
// engine plans with (dion3::exchange_plan).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "dion3/backend.hpp"
#include "dion3/comm.hpp"
#include "dion3/config.hpp"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "model_shapes.hpp"

#ifdef DION3_HAVE_MPI
#include <mpi.h>
#endif
#ifdef DION3_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;
using dion3::bench::MatrixShape;

const char* kUsage = R"(dion3-dist-bench — step time, collective rounds and bytes per rank of dion3's distributed layouts

Usage: mpirun -np P dion3-dist-bench [options]        (without mpirun: one rank)
       dion3-dist-bench --project [--ranks LIST] [--models LIST]

  --model NAME       gpt-small (default), gpt-1b, llama-7b
  --layers N         first N layers of the model (default 2; 0: all)
  --fraction F       Dion3 fraction (default 1/4)
  --iters N          timed steps per configuration, median reported (default 5)
  --device cpu|cuda  cpu: MPI communicator; cuda: NCCL, one GPU per rank (default cpu)
  --dtype f32|bf16   weights, gradients and momentum (default f32 on cpu, bf16 on cuda)
  --layouts LIST     from local,ddp,rows,rows-global (default: all; local only on cuda)
  --repeat N         run the layout list N times in a row (clock drift shows as spread)
  --project          print the per-rank rounds and bytes for --models at --ranks (no run)
  --ranks LIST       rank counts of --project (default 8,32,256)
  --models LIST      models of --project (default gpt-1b,llama-7b)
)";

struct Options {
  std::string model = "gpt-small";
  int layers = 2;
  double fraction = 0.25;
  int iters = 5;
  std::string device = "cpu";
  std::string dtype;
  std::vector<std::string> layouts;
  int repeat = 1;
  bool project = false;
  std::vector<int> ranks = {8, 32, 256};
  std::vector<std::string> models = {"gpt-1b", "llama-7b"};
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "dion3-dist-bench: %s\n(see --help)\n", msg.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t a = 0;
  while (a <= s.size()) {
    std::size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

double parse_fraction(const std::string& s) {
  const auto slash = s.find('/');
  const double v = slash == std::string::npos ? std::atof(s.c_str())
                                              : std::atof(s.substr(0, slash).c_str()) / std::atof(s.substr(slash + 1).c_str());
  if (!(v > 0 && v <= 1)) usage_error("--fraction must lie in (0, 1], got '" + s + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--model") o.model = value();
    else if (a == "--layers") o.layers = std::max(0, std::atoi(value().c_str()));
    else if (a == "--fraction") o.fraction = parse_fraction(value());
    else if (a == "--iters") o.iters = std::max(1, std::atoi(value().c_str()));
    else if (a == "--device") o.device = value();
    else if (a == "--dtype") o.dtype = value();
    else if (a == "--layouts") o.layouts = split(value());
    else if (a == "--repeat") o.repeat = std::max(1, std::atoi(value().c_str()));
    else if (a == "--project") o.project = true;
    else if (a == "--ranks") {
      o.ranks.clear();
      for (const auto& r : split(value())) o.ranks.push_back(std::max(1, std::atoi(r.c_str())));
    } else if (a == "--models") o.models = split(value());
    else usage_error("unknown option '" + a + "'");
  }
  if (o.device != "cpu" && o.device != "cuda") usage_error("--device must be cpu or cuda");
  if (o.dtype.empty()) o.dtype = o.device == "cuda" ? "bf16" : "f32";
  if (o.dtype != "f32" && o.dtype != "bf16") usage_error("--dtype must be f32 or bf16");
  if (o.layouts.empty())
    o.layouts = o.device == "cuda" ? std::vector<std::string>{"local", "ddp", "rows", "rows-global"}
                                   : std::vector<std::string>{"ddp", "rows", "rows-global"};
  for (const auto& l : o.layouts)
    if (l != "local" && l != "ddp" && l != "rows" && l != "rows-global") usage_error("unknown layout '" + l + "'");
  return o;
}

std::string mib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", bytes / (1024.0 * 1024.0));
  return b;
}

// ---- --project: arithmetic only ----------------------------------------------------------------

void project(const Options& o) {
  std::printf("Per-rank collective rounds and bytes sent per optimizer step (Dion3 f = %g, bf16 momentum, "
              "iteration dtype bf16), from dion3::exchange_plan\n\n",
              o.fraction);
  std::printf("| model | ranks | layout | megabatches | rounds, megabatched | rounds, per matrix | MiB sent/rank, "
              "megabatched | MiB sent/rank, per matrix |\n|---|---|---|---|---|---|---|---|\n");
  for (const auto& name : o.models) {
    const auto shapes = dion3::bench::model_matrices(dion3::bench::find_preset(name), 0);
    std::map<std::pair<int64_t, int64_t>, int64_t> groups;
    for (const auto& s : shapes) ++groups[{s.rows, s.cols}];
    for (int P : o.ranks) {
      for (const char* layout : {"ddp", "rows", "rows-global"}) {
        dion3::GroupConfig g;
        g.fraction = o.fraction;
        g.selection_scope = std::string(layout) == "rows-global" ? dion3::SelectionScope::Global
                                                                 : dion3::SelectionScope::Local;
        const auto kind = std::string(layout) == "ddp" ? dion3::Layout::Replicated : dion3::Layout::RowShard;
        int rounds_mb = 0, rounds_pm = 0;
        double bytes_mb = 0, bytes_pm = 0;
        for (const auto& [shape, count] : groups) {
          const auto x = dion3::exchange_plan(kind, g, count, shape.first, shape.second, P, dion3::DType::BF16,
                                              dion3::DType::BF16);
          const auto one = dion3::exchange_plan(kind, g, 1, shape.first, shape.second, P, dion3::DType::BF16,
                                                dion3::DType::BF16);
          rounds_mb += x.rounds;
          bytes_mb += static_cast<double>(x.bytes_sent);
          rounds_pm += one.rounds * static_cast<int>(count);
          bytes_pm += static_cast<double>(one.bytes_sent) * static_cast<double>(count);
        }
        std::printf("| %s | %d | %s | %zu | %d | %d | %s | %s |\n", name.c_str(), P, layout, groups.size(), rounds_mb,
                    rounds_pm, mib(bytes_mb).c_str(), mib(bytes_pm).c_str());
      }
    }
  }
}

// ---- the measured run ---------------------------------------------------------------------------

struct World {
  int rank = 0, size = 1;
  std::shared_ptr<dion3::Communicator> comm;
  double max_over_ranks(double v) const {
#ifdef DION3_HAVE_MPI
    int init = 0;
    MPI_Initialized(&init);
    if (init) MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
#endif
    return v;
  }
  void barrier() const {
#ifdef DION3_HAVE_MPI
    int init = 0;
    MPI_Initialized(&init);
    if (init) MPI_Barrier(MPI_COMM_WORLD);
#endif
  }
};

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// Host values of one matrix (full), uniform in [-scale, scale], deterministic per seed (splitmix64:
// billions of values for the large models in seconds).
std::vector<float> values(int64_t rows, int64_t cols, uint64_t seed, float scale) {
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull;
  for (auto& e : v) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    e = scale * (static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
  return v;
}

struct Run {
  double ms = 0;
  int megabatches = 0, rounds = 0;
  double bytes = 0;
};

Run run_layout(const Options& o, const World& w, const std::vector<MatrixShape>& shapes, const std::string& layout,
               bool megabatch) {
  const bool cuda = o.device == "cuda";
  auto backend = cuda ? dion3::make_cuda_backend(0, nullptr, nullptr) : dion3::make_cpu_backend();
  dion3::Backend* be = backend.get();
  dion3::OptimizerOptions opts;
  opts.megabatch = megabatch;
  dion3::Optimizer opt(std::move(backend), opts);
  dion3::GroupConfig g;
  g.fraction = o.fraction;
  g.selection_scope = layout == "rows-global" ? dion3::SelectionScope::Global : dion3::SelectionScope::Local;
  const int gi = opt.add_group(g);
  const dion3::DType dt = o.dtype == "bf16" ? dion3::DType::BF16 : dion3::DType::F32;
  const std::size_t es = dion3::dtype_size(dt);
  std::vector<dion3::DeviceBuffer> memory;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const auto& s = shapes[i];
    int64_t first = 0, rows = s.rows;
    if (layout == "rows" || layout == "rows-global") {
      const int64_t c = (s.rows + w.size - 1) / w.size;
      first = std::min<int64_t>(s.rows, w.rank * c);
      rows = std::min<int64_t>(c, s.rows - first);
    }
    // Matrices of one shape share their values (a timing does not depend on them), so large
    // models are set up in seconds.
    static std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, uint64_t, int>, std::vector<unsigned char>> cache;
    auto upload = [&](uint64_t seed, float scale) {
      auto& bytes = cache[{s.rows, s.cols, first, rows, seed, static_cast<int>(dt)}];
      if (bytes.empty() && rows * s.cols > 0) {
        const auto full = values(s.rows, s.cols, seed, scale);
        bytes.resize(static_cast<std::size_t>(rows * s.cols) * es);
        for (int64_t e = 0; e < rows * s.cols; ++e) {
          const float v = full[static_cast<std::size_t>(first * s.cols + e)];
          if (dt == dion3::DType::F32) std::memcpy(&bytes[e * 4], &v, 4);
          else {
            const uint16_t b = to_bf16(v);
            std::memcpy(&bytes[e * 2], &b, 2);
          }
        }
      }
      memory.emplace_back(be->allocator(), std::max<std::size_t>(bytes.size(), 1));
      if (!bytes.empty()) be->copy_from_host(memory.back().get(), bytes.data(), bytes.size());
      return memory.back().get();
    };
    dion3::ParamSpec spec;
    spec.name = s.name;
    const auto dev = cuda ? dion3::Device::CUDA : dion3::Device::CPU;
    spec.weight = dion3::TensorView{upload(1, 0.02f), dt, dev, 0, {rows, s.cols}};
    spec.grad = dion3::TensorView{upload(2, 1.0f), dt, dev, 0, {rows, s.cols}};
    if (layout != "local") {
      spec.layout.kind = layout == "ddp" ? dion3::Layout::Replicated : dion3::Layout::RowShard;
      spec.layout.comm = w.comm;
      spec.layout.global_rows = s.rows;
    }
    opt.add_param(gi, spec);
  }
  Run r;
  for (const auto& mb : opt.plan()) {
    ++r.megabatches;
    r.rounds += mb.rounds;
    r.bytes += static_cast<double>(mb.bytes_sent);
  }
  opt.step();  // first step: plan, workspace
  std::vector<double> times;
  for (int it = 0; it < o.iters; ++it) {
    w.barrier();
    const auto t0 = Clock::now();
    opt.step();  // ends with the verdict's host synchronisation
    times.push_back(w.max_over_ranks(std::chrono::duration<double, std::milli>(Clock::now() - t0).count()));
  }
  std::sort(times.begin(), times.end());
  r.ms = times[times.size() / 2];
  return r;
}

int run(const Options& o, World& w) {
  const auto shapes = dion3::bench::model_matrices(dion3::bench::find_preset(o.model), o.layers);
  if (w.rank == 0) {
    std::printf("dion3-dist-bench: %s, %d layers (%zu matrices), Dion3 f = %g, %s %s, %d ranks (%s), median of %d "
                "steps (slowest rank)\n\n",
                o.model.c_str(), o.layers, shapes.size(), o.fraction, o.device.c_str(), o.dtype.c_str(), w.size,
                w.comm ? w.comm->describe().c_str() : "no communicator", o.iters);
    std::printf("| layout | collectives | megabatches | rounds/step | MiB sent/rank/step | step ms | "
                "megabatched vs per matrix |\n|---|---|---|---|---|---|---|\n");
  }
  double local_ms = 0;
  for (int rep = 0; rep < o.repeat; ++rep)
  for (const auto& layout : o.layouts) {
    Run per;
    for (bool megabatch : {false, true}) {
      if (layout == "local" && !megabatch) continue;
      const Run r = run_layout(o, w, shapes, layout, megabatch);
      if (layout == "local") local_ms = r.ms;
      if (w.rank == 0) {
        std::string ratio = "";
        if (megabatch && layout != "local") {
          char b[48];
          std::snprintf(b, sizeof b, "%.2fx faster", per.ms / r.ms);
          ratio = b;
        }
        if (layout != "local" && local_ms > 0) {
          char b[64];
          std::snprintf(b, sizeof b, "%s%+.1f%% vs single-device", ratio.empty() ? "" : "; ",
                        100.0 * (r.ms / local_ms - 1.0));
          ratio += b;
        }
        std::printf("| %s | %s | %d | %d | %s | %.2f | %s |\n", layout.c_str(),
                    layout == "local" ? "none" : megabatch ? "megabatched" : "one per matrix", r.megabatches,
                    r.rounds, mib(r.bytes).c_str(), r.ms, ratio.c_str());
        std::fflush(stdout);
      }
      if (!megabatch) per = r;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.project) {
    project(o);
    return 0;
  }
  World w;
  try {
#ifdef DION3_HAVE_MPI
    const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE");
    if (under_mpi) {
      MPI_Init(&argc, &argv);
      MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
      MPI_Comm_size(MPI_COMM_WORLD, &w.size);
    }
#endif
    if (o.device == "cpu") {
#ifdef DION3_HAVE_MPI
      if (w.size > 1 || std::getenv("OMPI_COMM_WORLD_SIZE")) w.comm = dion3::make_mpi_communicator();
#endif
      if (!w.comm) w.comm = dion3::make_loopback_communicator(dion3::Device::CPU);
    } else {
#ifdef DION3_HAVE_NCCL
      int ndev = 0;
      cudaGetDeviceCount(&ndev);
      if (ndev == 0) usage_error("--device cuda: no GPU");
      cudaSetDevice(w.rank % ndev);
      ncclUniqueId id;
      if (w.rank == 0) ncclGetUniqueId(&id);
#ifdef DION3_HAVE_MPI
      if (w.size > 1) MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
#endif
      ncclComm_t nc;
      if (ncclCommInitRank(&nc, w.size, id, w.rank) != ncclSuccess) usage_error("ncclCommInitRank failed");
      w.comm = dion3::make_nccl_communicator(nc, w.rank % ndev);
#else
      usage_error("--device cuda needs a build with CUDA and NCCL");
#endif
    }
    const int rc = run(o, w);
    w.comm.reset();
#ifdef DION3_HAVE_MPI
    int init = 0;
    MPI_Initialized(&init);
    if (init) MPI_Finalize();
#endif
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dion3-dist-bench (rank %d): %s\n", w.rank, e.what());
    return 1;
  }
}
