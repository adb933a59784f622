// tests/cpp/thread_comm.hpp — ranks as threads of one process, for tests: a dion3::Communicator
// per rank whose collectives exchange through the process's memory. Host buffers are copied
// by the calling threads; device buffers (builds of the CUDA suite, DION3_THREAD_COMM_CUDA) by
// copies enqueued on each rank's stream, ordered after every rank's earlier work and before
// its later work with events, so several ranks on one GPU run the multi-rank code paths that
// otherwise need one GPU each. Every collective is a rendezvous of all ranks (a rank that does
// not arrive within the timeout makes the others raise); not capturable in CUDA graphs.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dion3/comm.hpp"

namespace t3 {

// Communicators of `ranks` thread ranks (element r is rank r's), buffers on `device`.
std::vector<std::shared_ptr<dion3::Communicator>> thread_communicators(int ranks, dion3::Device device,
                                                                       double timeout_seconds = 60.0);

// Runs f(rank) on `ranks` threads and joins them; an exception escaping a rank is reported as a
// test failure naming `what` and the rank.
void on_threads(int ranks, const std::string& what, const std::function<void(int)>& f);

}  // namespace t3
