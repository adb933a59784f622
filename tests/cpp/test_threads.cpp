// tests/cpp/test_threads.cpp — the CPU backend's threads: it works on the calling thread's
// OpenMP team alone (OpenBLAS's own thread pool stays idle, and its setting is left as found),
// and its results do not depend on how many threads there are.
#include <gtest/gtest.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "dion3/optimizer.hpp"
#include "test_util.hpp"

// OpenBLAS's thread controls, null where another BLAS is linked.
extern "C" {
int openblas_get_num_threads(void) __attribute__((weak));
void openblas_set_num_threads(int) __attribute__((weak));
}

namespace {

using dion3::Algorithm;
using dion3::DType;
using dion3::GroupConfig;
using dion3::OrthMethod;
using t3::Harness;
using t3::Rng;

// CPU time (clock ticks) each thread of this process has used so far, by thread id.
std::map<long, long> thread_ticks() {
  std::map<long, long> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(e.path() / "stat");
    std::string line;
    if (!std::getline(f, line)) continue;  // the thread has just ended
    // After "pid (name) ": state is field 3; utime and stime are fields 14 and 15.
    std::istringstream in(line.substr(line.rfind(')') + 2));
    std::vector<std::string> fields;
    for (std::string s; in >> s;) fields.push_back(s);
    out[std::stol(e.path().filename().string())] = std::stol(fields.at(11)) + std::stol(fields.at(12));
  }
  return out;
}

// Sets OpenMP's and OpenBLAS's thread counts for one test and puts them back after it.
class Threads {
 public:
  Threads(int omp, int blas) {
#ifdef _OPENMP
    omp_before_ = omp_get_max_threads();
    omp_set_num_threads(omp);
#endif
    if (openblas_get_num_threads && openblas_set_num_threads) {
      blas_before_ = openblas_get_num_threads();
      openblas_set_num_threads(blas);
    }
  }
  ~Threads() {
#ifdef _OPENMP
    omp_set_num_threads(omp_before_);
#endif
    if (blas_before_ > 0) openblas_set_num_threads(blas_before_);
  }

 private:
  int omp_before_ = 1, blas_before_ = 0;
};

TEST(CpuThreads, OneOpenMPThreadRunsTheStepOnTheCallingThreadAlone) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: the CPU backend runs on the calling thread and BLAS's own";
#else
  if (!std::filesystem::exists("/proc/self/task")) GTEST_SKIP() << "needs /proc/self/task";
  // OpenBLAS's own pool at two threads: it must stay idle all the same.
  Threads threads(1, 2);
  const int blas_set = openblas_get_num_threads ? openblas_get_num_threads() : 0;
  Harness h;
  Rng rng(11);
  GroupConfig g;
  g.fraction = 1.0;  // whole 512 x 512 products: large enough for any BLAS to use its threads
  const int gi = h.opt.add_group(g);
  for (const char* name : {"w0", "w1", "w2", "w3"}) h.add(gi, name, DType::F32, {512, 512}, rng);
  h.randomize_grads(rng);
  ASSERT_TRUE(h.opt.step());  // first step: buffers allocated, libraries warmed up

  const long self = syscall(SYS_gettid);
  const auto before = thread_ticks();
  long mine = 0, others = 0;
  for (int s = 0; s < 20 && mine < 30; ++s) {  // until the calling thread has worked >= 0.3 s
    h.randomize_grads(rng);
    ASSERT_TRUE(h.opt.step());
    const auto now = thread_ticks();
    mine = now.at(self) - before.at(self);
    others = 0;
    for (const auto& [tid, ticks] : now)
      if (tid != self) others += ticks - (before.count(tid) ? before.at(tid) : 0);
  }
  EXPECT_GE(mine, 30) << "the steps took too little time to tell";
  EXPECT_LE(others, 2) << "other threads worked " << others << " ticks while the calling thread worked " << mine;
  if (openblas_get_num_threads) {
    EXPECT_EQ(openblas_get_num_threads(), blas_set) << "OpenBLAS's setting was not restored";
  }
#endif
}

// Weights and state bytes after three steps of several groups (products cut into several tiles,
// a transposed shape, fp32 and bf16 iterations, NorMuon, AdamW and Lion over long vectors).
std::vector<unsigned char> three_steps() {
  Harness h;
  Rng rng(23);
  GroupConfig standard;
  standard.fraction = 1.0;
  standard.orth.method = OrthMethod::Standard;
  GroupConfig gram = standard;
  gram.orth.method = OrthMethod::Gram;
  GroupConfig bf16 = standard;
  bf16.fraction = 0.5;
  bf16.orth.iteration_dtype = DType::BF16;
  GroupConfig normuon;
  normuon.algorithm = Algorithm::NorMuon;
  GroupConfig adamw;
  adamw.algorithm = Algorithm::AdamW;
  GroupConfig lion;
  lion.algorithm = Algorithm::Lion;
  const int gs = h.opt.add_group(standard), gg = h.opt.add_group(gram), gb = h.opt.add_group(bf16);
  const int gn = h.opt.add_group(normuon), ga = h.opt.add_group(adamw), gl = h.opt.add_group(lion);
  for (const char* i : {"0", "1"}) {
    h.add(gs, std::string("s") + i, DType::F32, {300, 700}, rng);
    h.add(gg, std::string("g") + i, DType::F32, {700, 300}, rng);
    h.add(gb, std::string("b") + i, DType::BF16, {400, 260}, rng);
    h.add(gn, std::string("n") + i, DType::F32, {260, 520}, rng);
  }
  h.add(ga, "a32", DType::F32, {70000}, rng);
  h.add(ga, "a16", DType::BF16, {70000}, rng);
  h.add(gl, "l32", DType::F32, {70000}, rng);
  for (int s = 0; s < 3; ++s) {
    h.randomize_grads(rng);
    EXPECT_TRUE(h.opt.step());
  }
  return t3::snapshot(h.opt, h.all());
}

TEST(CpuThreads, ResultsAreBitIdenticalWhateverTheThreadCount) {
  std::vector<unsigned char> one, four;
  {
    Threads threads(1, 1);
    one = three_steps();
  }
  {
    Threads threads(4, 4);
    four = three_steps();
  }
  ASSERT_EQ(one.size(), four.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < one.size(); ++i) differ += one[i] != four[i];
  EXPECT_EQ(differ, 0u) << "of " << one.size() << " bytes";
}

// Holds the step inside its first traced stage until released, telling the test it got there.
class Gate final : public dion3::StepTracer {
 public:
  void begin(const char*) override {
    if (done_) return;
    done_ = true;
    inside_.set_value();
    release_.get_future().wait();
  }
  void end() override {}
  std::promise<void> inside_, release_;

 private:
  bool done_ = false;
};

// An Optimizer is used from one thread at a time (optimizer.hpp): a second thread's step or
// gradient binding while a step runs fails, naming the cause, instead of racing it (which wrote
// NaN weights); the running step ends as if alone, and the optimizer serves the other thread after.
TEST(Threads, ASecondThreadsCallWhileAStepRunsIsRefused) {
  Rng rng(4);
  Harness h, alone;
  GroupConfig g;
  g.lr = 0.02;
  auto& p = h.add(h.opt.add_group(g), "w", DType::F32, {16, 12}, rng);
  Rng same(4);
  auto& q = alone.add(alone.opt.add_group(g), "w", DType::F32, {16, 12}, same);
  h.randomize_grads(rng);
  q.g.assign(p.g.values());
  ASSERT_TRUE(alone.opt.step());
  auto gate = std::make_shared<Gate>();
  h.opt.set_tracer(gate);
  std::future<void> inside = gate->inside_.get_future();
  std::thread stepping([&] { EXPECT_TRUE(h.opt.step()); });
  inside.wait();
  for (auto call : {std::function<void()>([&] { h.opt.step(); }),
                    std::function<void()>([&] { h.opt.set_grad(0, p.g.view()); })}) {
    try {
      call();
      ADD_FAILURE() << "a call from a second thread during a step was not refused";
    } catch (const dion3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("in use by another thread"), std::string::npos) << e.what();
    }
  }
  gate->release_.set_value();
  stepping.join();
  EXPECT_EQ(p.w.values(), q.w.values());
  EXPECT_TRUE(h.opt.step());  // this thread now
}

}  // namespace
