// engine.hpp — the Optimizer's internal state, shared by optimizer.cpp (registration, planning,
// step) and state.cpp (export / import). Not installed.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "dion3/backend.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/orthogonalize.hpp"

namespace dion3 {

// One registered parameter.
struct Param {
  std::string name;
  int group = 0;
  TensorView weight;
  TensorView grad;
  // Matrix view (matrix algorithms): `count` matrices of rows x cols.
  int64_t count = 0, rows = 0, cols = 0;
  std::vector<std::pair<std::string, TensorView>> state;  // in a fixed order per algorithm
  std::vector<DeviceBuffer> owned;                          // engine-allocated state memory
  // Steps applied to this parameter = optimizer's applied steps - step_offset (AdamW's t).
  int64_t step_offset = 0;

  const TensorView* find_state(const std::string& key) const;
};

// A slice of a megabatch orthogonalized in one call, sized so that its workspace fits the
// optimizer's workspace limit.
struct Chunk {
  int64_t first = 0, count = 0;  // members [first, first + count)
  std::unique_ptr<MatrixSet> set;
  Orthogonalizer* orth = nullptr;
  std::size_t update_offset = 0, orth_offset = 0;  // in the arena: the update rows U, the orth workspace
};

// Parameters of one group sharing (matrix shape, dtypes): one batched pipeline per step.
struct Megabatch {
  int group = 0;
  int64_t rows = 0, cols = 0, k = 0;
  DType weight_dtype = DType::F32, grad_dtype = DType::F32, momentum_dtype = DType::F32;
  std::vector<std::pair<int, int64_t>> members;  // (param index, matrix index in param)
  std::unique_ptr<MatrixSet> set;                // every member: accumulate and select
  std::vector<Chunk> chunks;                     // gather, orthogonalize, update
  std::vector<std::unique_ptr<Orthogonalizer>> orths;  // one per distinct chunk size
  DeviceBuffer scores;   // members x rows fp32
  DeviceBuffer indices;  // members x k int32
  // Row sums of squares (fp32) for the normalisation: members x rows of M from accumulate when
  // the gather normalises (gathers_normalized), else members x k of the gathered rows U.
  DeviceBuffer row_sumsq;
  bool gathers_normalized = false;  // Dion3 with k <= cols: Backend::gather_normalized
  std::size_t chunk_bytes = 0;  // arena bytes the largest chunk needs
};

struct Optimizer::Impl {
  std::unique_ptr<Backend> backend;
  OptimizerOptions options;
  std::vector<GroupConfig> groups;
  std::vector<GroupConfig> planned;  // group configs the current plan was built for
  std::vector<Param> params;
  std::vector<Megabatch> megabatches;
  bool plan_valid = false;
  DeviceBuffer flag;   // one int: a gradient was non-finite this step
  DeviceBuffer arena;  // workspace shared by all chunks (their work is ordered on one stream)
  DeviceBuffer counters;  // int64 [steps applied, steps dropped], on the device
  bool state_created = false;

  // Names the expected state tensors of a parameter (name, dtype, shape).
  struct StateSpec {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  std::vector<StateSpec> state_specs(const Param& p) const;
  std::string describe(int param) const;  // "parameter 3 'mlp.up.weight'"
  void build_plan();
  std::array<int64_t, 2> read_counters() const;
  void validate_for_step();
  void enqueue_step();
};

}  // namespace dion3
