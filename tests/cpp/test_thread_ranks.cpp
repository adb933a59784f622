// tests/cpp/test_thread_ranks.cpp — the distributed layouts (algorithm.md §3) on the CPU backend with
// ranks as threads of this process (thread_comm.hpp): 2, 3 and 4 ranks, every case the MPI suite
// runs (layout_cases.hpp). The CUDA suite runs the same checks with the ranks on one GPU.
#include <gtest/gtest.h>

#include "layout_cases.hpp"

namespace {

class ThreadRanks : public ::testing::TestWithParam<int> {};

TEST_P(ThreadRanks, LayoutsEqualTheSingleProcessRule) { t3::check_layouts_on_threads(GetParam(), t3::host_backend()); }

INSTANTIATE_TEST_SUITE_P(Cpu, ThreadRanks, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace
