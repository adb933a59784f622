// tests/cpp/layout_cases.hpp — the distributed layouts' checks (algorithm.md §3), written once for
// every way the tests run ranks: MPI processes on the CPU backend (tests/mpi) and threads of one
// process on the CPU or on one GPU (thread_comm.hpp). A rank builds the same full matrices and
// gradients as every other rank from one seed, registers its own part (its shard, or the whole
// matrix when replicated) in the memory its backend steps, and checks that part, its momentum
// and its rows' NorMuon variance against the float64 transcription (reference.hpp) computed
// alongside; replicated runs must agree bit for bit over the ranks, and equal a single-process
// engine bit for bit where the backend's products do not depend on the batch.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dion3/backend.hpp"
#include "dion3/comm.hpp"
#include "dion3/optimizer.hpp"

namespace t3 {

// Rows (or columns) [first, first + count) of rank r's part of an m-long dimension cut in
// contiguous ceil(m/P) chunks.
struct Shard {
  int first, count;
};
Shard shard_of(int m, int ranks, int r);
// Rows `r` and columns `c` of a row-major matrix with n columns.
std::vector<double> part_of(const std::vector<double>& full, int n, Shard r, Shard c);
std::vector<double> rows_of(const std::vector<double>& full, int n, Shard s);

// Which backend steps a rank's parameters and where they live: the CPU backend and host memory,
// or the CUDA backend and one GPU's memory (set up by the CUDA suite). Parameters are fp32.
struct RankBackend {
  dion3::Device device = dion3::Device::CPU;
  int device_index = 0;
  std::function<std::unique_ptr<dion3::Backend>()> make_backend;
  // The orthogonalization's iteration dtype (nullopt: the backend's default). In fp32 the weights
  // and NorMuon's variance follow the float64 rule to fp32 rounding; a 16-bit iteration is checked
  // against it within that iteration's error.
  std::optional<dion3::DType> iteration = dion3::DType::F32;
  // Whether a matrix's result is independent of the batch it is orthogonalized in, so that a
  // replicated run (each rank a slice of the megabatch) equals one process bit for bit. Not on
  // CUDA, where cuBLAS picks its kernels by the batch's size; the ranks' replicas must agree
  // with each other bit for bit everywhere.
  bool batch_invariant = true;
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*)> release;
  std::function<void(void* dst, const void* host_src, std::size_t bytes)> upload;
  std::function<void(void* host_dst, const void* src, std::size_t bytes)> download;
};
RankBackend host_backend();

struct LayoutCase {
  std::string name;
  dion3::Layout layout;
  dion3::Algorithm algorithm = dion3::Algorithm::Dion3;
  dion3::SelectionScope scope = dion3::SelectionScope::Local;
  std::vector<std::pair<int, int>> shapes;  // one parameter per entry; equal shapes share a megabatch
  double fraction = 0.25;
  int steps = 3;
  bool megabatch = true;  // false: one collective round per matrix
  std::size_t workspace_limit = 0;  // OptimizerOptions::workspace_limit; 1: chunks of one matrix
  // Parameter i has no gradient at step s when absent_at(i, s) (Optimizer::clear_grad on every
  // rank): it and its state must stay as they are while the others step as the reference does.
  bool absent = false;
  // The group is transposed: each rank registers the (out, in) matrix of the reference stored as
  // (in, out), `layout` cutting the stored rows (RowShard: the rule's columns).
  bool transposed = false;
  // > 1: the group's num_heads, the rule stepping each block of m / heads rows (output features)
  // as a matrix of its own (transposed cases).
  int heads = 0;
};
bool absent_at(std::size_t param, int step);

// Replicated, row-sharded (local and global scope, per matrix) and column-sharded cases over
// shapes with several matrices per megabatch, uneven shards and shards that leave ranks empty.
const std::vector<LayoutCase>& layout_cases();

// Rank `rank` of comm's ranks steps case c and checks its part after every step (gtest
// expectations; safe from several threads).
void check_layout_case(const LayoutCase& c, const RankBackend& be, const std::shared_ptr<dion3::Communicator>& comm);

// Row and column blocks (FSDP2 over tensor parallel's row-wise split): rows cut over row_comm
// (rank d of dp), columns over col_comm (rank t of tp); the row-sharded rule over the row ranks,
// whole rows, for Dion3 and NorMuon.
void check_block_case(const RankBackend& be, const std::shared_ptr<dion3::Communicator>& row_comm,
                      const std::shared_ptr<dion3::Communicator>& col_comm);

// Steps the ranks disagree on, checked on rank comm->rank(): hyper-parameters that differ on the
// last rank (matrix and element-wise groups; every rank steps, or every rank only enqueues and the
// next call reports it) and a step invalid on rank 0 alone (it steps or refuses for want of
// gradients; the others step or enqueue). Every
// rank refuses, with the message its part calls for, nothing moves (weights, state, counters),
// and once alike again the ranks step together, their replicas equal bit for bit.
void check_agreement_case(const RankBackend& be, const std::shared_ptr<dion3::Communicator>& comm);
// The same on `ranks` thread ranks.
void check_agreement_on_threads(int ranks, const RankBackend& be);

// Every case of layout_cases(), then the block layout over the grids (ranks x 1, 1 x ranks, and
// 2 x 2 for four), on `ranks` thread ranks (thread_comm.hpp) whose parameters live in be.
void check_layouts_on_threads(int ranks, const RankBackend& be);

}  // namespace t3
