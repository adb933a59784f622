// engine.hpp — the Optimizer's internal state, shared by optimizer.cpp (registration, planning,
// step) and state.cpp (export / import). Not installed.
#pragma once

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
  int64_t step = 0;

  const TensorView* find_state(const std::string& key) const;
};

// Parameters of one group sharing (matrix shape, dtypes): one batched pipeline per step.
struct Megabatch {
  int group = 0;
  int64_t rows = 0, cols = 0, k = 0;
  DType weight_dtype = DType::F32, grad_dtype = DType::F32, momentum_dtype = DType::F32;
  std::vector<std::pair<int, int64_t>> members;  // (param index, matrix index in param)
  std::unique_ptr<MatrixSet> set;
  std::unique_ptr<Orthogonalizer> orth;
  DeviceBuffer scores;   // count x rows fp32
  DeviceBuffer indices;  // count x k int32
  DeviceBuffer update;   // count x k x cols fp32: gathered rows, then their orthogonalized update
};

struct Optimizer::Impl {
  std::unique_ptr<Backend> backend;
  OptimizerOptions options;
  std::vector<GroupConfig> groups;
  std::vector<GroupConfig> planned;  // group configs the current plan was built for
  std::vector<Param> params;
  std::vector<Megabatch> megabatches;
  bool plan_valid = false;
  DeviceBuffer flag;  // one int: a gradient was non-finite this step
  int64_t steps = 0, skipped = 0;
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
};

}  // namespace dion3
