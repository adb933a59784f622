// dion3/optimizer.hpp — the engine: parameter registration, megabatch planning, the step.
//
// Parameters are registered once (weight, gradient and, optionally, externally owned state
// tensors) into groups with a GroupConfig. Matrix parameters are planned into megabatches by
// (group, matrix shape, dtype, layout); each megabatch runs as one batched pipeline:
// accumulate -> score -> select -> gather (+ error feedback) -> orthogonalize -> normalize ->
// update. Element-wise groups (AdamW, Lion) run as multi-tensor passes over their parameters.
//
// Guarantees: every argument is validated before anything is written; a step that meets a
// non-finite gradient (or whose state would overflow) either raises (default) or is skipped,
// step() reading the verdict once at its end (one host synchronisation; step_async() does not
// wait), and in both cases leaves weights and state untouched. The same inputs give the same
// bits on the same backend. An Optimizer is used from one thread at a time (a step or
// registration from a second thread while one runs throws); distinct ones are independent. Its
// API passes standard-library types by value: build against it with the compiler, standard
// library and ABI settings of the library's own build (the C API, dion3.h, is the interface that
// holds across them).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dion3/export.h"
#include "dion3/backend.hpp"
#include "dion3/comm.hpp"
#include "dion3/config.hpp"
#include "dion3/error.hpp"  // what every call throws
#include "dion3/view.hpp"

namespace dion3 {

// How a parameter is laid out across the ranks of a communicator (algorithm.md §3).
enum class Layout : int {
  Local = 0,       // one device owns it whole; no communication
  Replicated = 1,  // every rank holds the same whole tensor (DDP): ranks split the orthogonalization
  RowShard = 2,    // rank r holds rows [r*c, min((r+1)*c, m)) of an m-row matrix, c = ceil(m/P)
                   // (FSDP2's Shard(0)); the weight view is that shard, possibly empty
  ColShard = 3,    // rank r holds columns [r*c, min((r+1)*c, n)) of every row, c = ceil(n/P)
                   // (Shard(1), e.g. tensor parallel's row-wise split); selection and NorMuon
                   // see whole rows, as on one device
  Block = 4,       // rows cut over `comm` as RowShard and columns over `col_comm` as ColShard
                   // (FSDP2 over tensor parallel's row-wise split): the row-sharded rule over
                   // `comm`, with whole rows
};
DION3_API const char* layout_name(Layout l);

struct ParamLayout {
  Layout kind = Layout::Local;
  std::shared_ptr<Communicator> comm = nullptr;  // every layout but Local: the ranks it spans (Block: its rows')
  // (an optimizer's parameters span at most kAgreementRegions communicator objects: share one per group)
  // RowShard, Block: m, the rows of the whole matrix. Replicated element-wise parameters: its rows
  // (> 0) where every rank holds the whole tensor, whose shape then joins the ranks' agreement; 0
  // for a shard each rank steps as it is.
  int64_t global_rows = 0;
  int64_t global_cols = 0;  // ColShard, Block: n, the columns of the whole matrix
  // RowShard with rows cut otherwise than in ceil(m/P) chunks in rank order (FSDP2 over tensor
  // parallel's column-wise split cuts twice, rank-major over another mesh dimension): this rank's
  // first row, and the largest shard's rows (the same on every rank). -1 / 0: the standard cut.
  // Local selection only.
  int64_t row_offset = -1;
  int64_t row_chunk = 0;
  std::shared_ptr<Communicator> col_comm = nullptr;  // Block: the ranks the columns are cut over
};

struct ParamSpec {
  std::string name;
  TensorView weight;
  TensorView grad;  // may be re-bound before each step with set_grad()
  // Externally owned state (e.g. PyTorch tensors); missing ones are allocated by the engine
  // and zero-filled. Matrix algorithms: "momentum" (weight's shape); Dion3 and NorMuon also
  // "variance" (fp32, one entry per output feature: per matrix row, per column in a transposed
  // group). AdamW: "exp_avg", "exp_avg_sq"; Lion: "exp_avg".
  // (Both defaulted: {name, weight, grad} is a whole ParamSpec, also under -Wextra.)
  std::vector<std::pair<std::string, TensorView>> state = {};
  // Element-wise algorithms step the local tensor as it is, whatever the layout; a replicated one
  // (DDP) given Layout::Replicated and the communicator joins the ranks' agreement on settings.
  ParamLayout layout = {};
};

// A host copy of one state tensor.
struct HostTensor {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> data;
};

struct ParamState {
  std::string name;
  int64_t step = 0;  // updates applied to this parameter (AdamW bias correction)
  std::vector<std::pair<std::string, HostTensor>> tensors;
};

struct OptimizerState {
  int64_t steps = 0;
  int64_t skipped = 0;
  std::vector<ParamState> params;
};

// Named ranges around a step's phases and megabatches, for profilers. The CUDA backend always
// marks them as NVTX ranges (Nsight Systems); a front end may add its own, e.g. the PyTorch
// package's torch.profiler ranges. begin/end nest; names live until the matching end().
class StepTracer {
 public:
  virtual ~StepTracer() = default;
  virtual void begin(const char* name) = 0;
  virtual void end() = 0;
};

struct OptimizerOptions {
  NonFinitePolicy on_nonfinite = NonFinitePolicy::Raise;
  // Workspace budget (bytes). Megabatches are orthogonalized in chunks of as many matrices as
  // fit (at least one); all chunks share one arena, so this bounds the optimizer's memory
  // beyond its state whatever the model size. 0 (the default) = automatic: the larger of
  // 1 GiB and a quarter of the matrix parameters' momentum bytes — small models keep a 1 GiB
  // bound, large ones get batches big enough to fill the device (a tight budget splits big
  // megabatches into several smaller, slower orthogonalizations).
  std::size_t workspace_limit = 0;
  // Same-shape matrices share one batched orthogonalization and, when distributed, one collective
  // round per direction (algorithm.md §3). false: every matrix is its own megabatch (one round each), for
  // benchmarks that measure what megabatching saves.
  bool megabatch = true;
  // Each orthogonalization (a chunk of a megabatch, dozens of kernels) is recorded once, after
  // its first eager run, and replayed as one unit (Backend::record: a CUDA graph), which takes
  // most of the host's launch work out of a step. Results are the same bit for bit; false runs
  // it op by op, for benchmarks and as a fallback.
  bool record_orthogonalizer = true;
  // Distributed: the parameters' names join the ranks' agreement on the plan, so that a rank that
  // registered same-shape matrices in another order is refused instead of pairing them wrongly.
  // Only where every rank names each parameter alike (the PyTorch front end does).
  bool agree_on_names = false;
};

// A state tensor the engine keeps for a parameter: its name, dtype and shape.
struct StateSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
// The state tensors of a parameter of `shape` and `weight_dtype` in a group configured as `group`
// (the one definition: the engine makes them, the front ends lay out their checkpoints by it).
// Matrices keep "momentum" and, with NorMuon normalization, "variance" (fp32, one entry per
// output feature, flat: per matrix row, per column in a transposed group); AdamW "exp_avg" and
// "exp_avg_sq"; Lion "exp_avg".
DION3_API std::vector<StateSpec> state_specs(const GroupConfig& group, DType weight_dtype,
                                             const std::vector<int64_t>& shape);

// The per-step communication of one megabatch of `count` m x n matrices over `ranks` ranks,
// decided from the shapes alone: the engine plans with it, and benchmarks project rank counts
// they cannot run. update_dtype: of the gathered rows sent forward; orth_dtype: of the results
// sent back.
struct ExchangePlan {
  int64_t block = 0;      // matrices each rank orthogonalizes (ceil(count / ranks))
  int64_t k = 0;          // rows selected per matrix (per shard for row-sharded local scope)
  int64_t piece = 0;      // row-sharded: rows each rank sends per matrix
  int64_t orth_rows = 0;  // rows of each matrix the orthogonalizer sees
  int64_t orth_cols = 0;  // and its columns (n: column-sharded blocks are packed side by side)
  int rounds = 0;         // collective rounds per step
  std::size_t bytes_sent = 0;  // bytes one rank sends per step ((P - 1) blocks per round)
  int64_t real_rows = 0;  // of orth_rows, how many can be non-zero (0: all; see Orthogonalizer)
};
// row_chunk: rows of the largest row shard where the cut is not the standard one (ParamLayout).
// col_ranks: Block's column communicator size.
DION3_API ExchangePlan exchange_plan(Layout layout, const GroupConfig& group, int64_t count, int64_t rows,
                                     int64_t cols, int ranks, DType update_dtype, DType orth_dtype,
                                     int64_t row_chunk = 0, int col_ranks = 1);

// What one megabatch is: for introspection, benchmarks and tests.
struct MegabatchInfo {
  int group = 0;
  Algorithm algorithm = Algorithm::Dion3;
  int64_t rows = 0, cols = 0;  // m x n of each matrix
  // Stepped by columns (Dion2 on tall matrices; Dion3 and NorMuon in a transposed group): rows x
  // cols is the transposed shape (n x m) and selected_rows counts columns.
  bool columns = false;
  DType dtype = DType::F32;
  int64_t count = 0;           // matrices in the batch
  int64_t selected_rows = 0;   // k
  OrthMethod method = OrthMethod::Standard;
  DType iteration_dtype = DType::F32;
  std::size_t workspace_bytes = 0;  // arena bytes its most demanding chunk uses, and its own buffers
  int64_t chunk = 0;                 // matrices per orthogonalization call
  // Distribution (algorithm.md §3): the layout, ranks, the matrices this rank orthogonalizes, the rows
  // each rank sends per matrix (row-sharded), and per step the collective rounds and the bytes
  // this rank sends in them (what a benchmark reports).
  Layout layout = Layout::Local;
  int ranks = 1;
  int64_t owned = 0;
  int64_t piece_rows = 0;
  int64_t orth_rows = 0;  // rows of each matrix the orthogonalizer sees
  int64_t orth_cols = 0;  // and its columns (n: column-sharded blocks are packed side by side)
  int rounds = 0;
  std::size_t bytes_sent = 0;
};

class DION3_API Optimizer {
 public:
  explicit Optimizer(std::unique_ptr<Backend> backend, OptimizerOptions options = {});
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  int add_group(const GroupConfig& config);
  int add_param(int group, const ParamSpec& spec);
  void set_grad(int param, const TensorView& grad);
  // The parameter has no gradient this step (torch.optim's rule for a .grad of None): steps leave
  // it and its state as they are, without planning anew, until set_grad binds one again. Its
  // matrices still take their place in the step's batched work, as zeros. Matrix algorithms only:
  // an element-wise parameter (AdamW, Lion) is refused, as its steps count per parameter.
  // Distributed, which parameters have a gradient joins the ranks' agreement on the plan.
  void clear_grad(int param);

  // Groups may be edited between steps (lr schedules); edits are validated at the next step.
  GroupConfig& group(int index);
  // Replaces a group's settings after validating them, and refuses a structural change (algorithm,
  // flatten, transposed, momentum_dtype) once the group has parameters; nothing changes when it throws.
  void set_group(int index, const GroupConfig& config);
  const GroupConfig& group(int index) const;
  int num_groups() const;
  int num_params() const;
  const std::string& param_name(int param) const;

  // One optimizer step over every parameter, then one host synchronisation for the verdict.
  // Returns false when the step was dropped because a gradient was not finite and
  // on_nonfinite == Skip. Throws dion3::Error(NonFinite) under Raise, with nothing modified
  // (steps_skipped() included: it counts dropped steps, not raised ones). Distributed, it also
  // reads the ranks' agreement once its first collective is done, and throws
  // dion3::Error(InvalidArgument) on every rank, with nothing modified, when the ranks planned
  // different steps or hold different hyper-parameters, or when a rank refused the step (an
  // invalid setting there: that rank raises its own error, the others "another rank refused")
  // (comm.hpp).
  bool step();
  // Ranges of every later step also go to `tracer` (null: none beyond the backend's own).
  void set_tracer(std::shared_ptr<StepTracer> tracer);
  // For a rank of a distributed optimizer whose parameters have no gradient this step while the
  // others call step(): runs the step's collectives (reading no gradient, so none need be bound,
  // at the first step too; writing nothing), so that every rank refuses the step together instead
  // of pairing later collectives wrongly. Throws dion3::Error (InvalidArgument) here and in the others' step() when some rank
  // stepped; returns false, with nothing done, when every rank refused. Nothing is modified on
  // any rank, counters included, and every rank keeps its plan (unless the ranks' plans differed:
  // then the next step plans anew, and is compared again).
  bool refuse_step();
  // For a rank of a distributed optimizer that cannot take this step because a setting or input
  // is invalid there alone (step() and step_async() do this themselves for what they validate;
  // a front end calls it for what it checks first): runs the step's collectives as a refusal,
  // writing nothing, so that the other ranks' step() raises dion3::Error (InvalidArgument:
  // "another rank refused this step") instead of waiting for this rank (a step_async() there
  // drops the step on the device, counted nowhere). Never throws: the caller raises its own
  // error next. Does nothing without a plan (before the first step, or after anything that makes
  // the optimizer plan anew), under capture, or when the last step_async() is to be reported as
  // one the ranks disagreed on (the others' next call throws for that, before any collective).
  void refuse_invalid();
  // The same step, only enqueued on the backend's stream: no host synchronisation, so it can
  // be captured in a CUDA graph and replayed. A non-finite gradient drops the step on the
  // device whatever the policy (steps_skipped() counts it); nothing is raised for it.
  // Distributed, the first step after the plan was made (and every step on the CPU) reads the
  // ranks' agreement on the host and throws as step() does when their plans differ; such a step
  // cannot be captured. Otherwise ranks whose plans (later steps) or hyper-parameters (any step)
  // differ drop the step on the device, counted nowhere, and the next step(), step_async() or
  // refuse_step() of every rank throws for it before anything else (a rank that planned anew
  // throws at once). So every rank must make the same kind of call at a step
  // (step() there throws at once). A step another rank refused (refuse_step, refuse_invalid) is
  // dropped the same way without a later error: the refusing rank raised. A replayed capture
  // reports nothing.
  void step_async();
  // Throws now what the next step would throw first for the last step_async() (above): for a
  // front end about to drop this optimizer for a new one, which would not know of it.
  void check_last_agreement();
  // Hyper-parameters (lr, weight decay, momentum, betas, epsilon, per group) are read by the
  // step's operations from device memory that every step not being captured refreshes first. A
  // step captured in a CUDA graph reads them when replayed: call this before each replay (outside
  // the graph) so that it follows the groups' current values, e.g. an lr schedule. Throws when a
  // group changed a setting the plan depends on (fraction, split_sizes, num_heads, nesterov,
  // cautious_wd, selection_scope, the orthogonalizer): a replay cannot follow that, the step must
  // be captured again.
  void refresh_hyperparameters();
  // Changes whenever the step's plan (megabatches, buffers) is rebuilt: a captured step is stale.
  uint64_t plan_generation() const;
  // Whether the next step plans anew (none yet, or parameters, groups, a setting the plan depends
  // on or a bound gradient's dtype changed since): such a step cannot be captured in a CUDA graph.
  bool needs_new_plan() const;
  // Counters kept on the device (reading them synchronises): steps applied, steps dropped.
  int64_t steps_taken() const;
  int64_t steps_skipped() const;
  // The two counters as they stood after the last step() or step_async() that was not being
  // captured: each starts their copy to the host, and this answers from it once it has arrived
  // (never waiting; false until then, or when no such step was taken).
  bool posted_counters(int64_t out[2]) const;

  // Views of a parameter's state tensors (in device memory). After writing state through them
  // (or into externally owned state) between steps, call state_changed().
  std::vector<std::pair<std::string, TensorView>> state_views(int param) const;
  // The state was written outside step() and import_state(): the next step's non-finite check
  // reads all of it again (between steps the check may otherwise skip reading momentum that a
  // bound kept from the optimizer's own last write shows cannot overflow), and the next eager
  // step refuses a NaN, an Inf or a negative second moment written there, as import_state does.
  // Called while a step is being captured, it holds for every replay of that graph and for the
  // next step or refresh_hyperparameters() outside the capture.
  // state_changed(param): only that parameter's state was written (its second moments are read);
  // state_changed(params): those parameters' (one forget of the bounds for all of them).
  void state_changed();
  void state_changed(int param);
  void state_changed(std::span<const int> params);
  OptimizerState export_state() const;
  // Checks every tensor's name, dtype and shape, its values (no NaN or Inf, no negative second
  // moment: variance, exp_avg_sq) and the step counters (not negative, none above 2^62, so that
  // later steps cannot overflow them) before copying any of them. This rank's alone: no collective, so distributed
  // ranks agree on the outcome themselves (checkpoints.md).
  void import_state(const OptimizerState& state);

  std::vector<MegabatchInfo> plan();
  Backend& backend();
  const OptimizerOptions& options() const;

 private:
  struct DION3_LOCAL Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dion3
