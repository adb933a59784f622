// engine.hpp — the Optimizer's internal state, shared by optimizer.cpp (registration, planning,
// step) and state.cpp (export / import). Not installed.
#pragma once

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "dion3/backend.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/orthogonalize.hpp"
#include "core/one_thread.hpp"

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
  ParamLayout layout;  // RowShard: rows is this rank's shard, layout.global_rows the matrix's
  // Its state's bound for the non-finite check (StepCheck::state_bound): the momentum's
  // (Megabatch::bounds) when the whole parameter is one member of a megabatch;
  // an element-wise parameter's (Impl::elementwise_bounds); null otherwise (the check reads the
  // state).
  float* state_bound = nullptr;
  // No gradient this step (Optimizer::clear_grad): the step reads and writes zeros in its place
  // (Impl::zeros), so the plan stays and the parameter and its state are left as they are.
  bool absent = false;

  const TensorView* find_state(const std::string& key) const;
};

// One matrix of a megabatch: matrix `matrix` of parameter `param`, or the row block of it that
// starts at its local row `first_row` (GroupConfig::split_sizes / num_heads); the megabatch's
// `rows` rows from there. Stepped by columns, first_row is the block's first stored column.
struct Member {
  int param = 0;
  int64_t matrix = 0;
  int64_t first_row = 0;
};

// A slice of a megabatch orthogonalized in one call, sized so that its workspace fits the
// optimizer's workspace limit.
struct Chunk {
  int64_t first = 0, count = 0;  // members [first, first + count)
  std::unique_ptr<MatrixSet> set;
  Orthogonalizer* orth = nullptr;
  std::size_t update_offset = 0, orth_offset = 0;  // in the arena: the update rows U, the orth workspace
  std::size_t update_bytes = 0;                    // the room the plan left U there (0: U is never gathered)
  // The orthogonalizer's run as one recorded unit (Backend::record), made after its first eager
  // run and replayed until the plan changes; recorded_out is what the run returns (arena memory).
  std::unique_ptr<Recording> recording;
  MatrixView recorded_out;
  bool ran = false;  // the first, eager run happened
  bool eager_only = false;  // the backend does not record, or recording this run failed
};

// Parameters of one group sharing (matrix shape, dtypes, layout): one batched pipeline per step,
// run as three stages (Optimizer::Impl::prepare / orthogonalize / apply) so that one megabatch's
// collective is in flight while another computes.
//
// Distributed layouts (algorithm.md §3), with N members, P ranks and block = ceil(N / P): rank r
// orthogonalizes members [r*block, min((r+1)*block, N)), its own block; the others travel.
//  - Replicated: every rank accumulates and selects all N. It orthogonalizes its own block and
//    applies it at once, copies the results into its slot of `recv` (P*block x k x cols, member
//    order), and one in-place all-gather fills the other slots, which it applies last. Error
//    feedback of the others' rows happens without gathering them.
//  - RowShard: every rank selects `piece` rows of its shard of each member (kPadRow-padded in
//    piece_idx). The others' pieces go into `send` ([owner][member][piece][cols], i.e. member
//    order); one all-to-all gives `recv` ([source rank][member of my block][piece][cols]),
//    permuted into the orthogonalizer's input (member x P*piece x cols), where the rank gathers
//    its own pieces directly. Its own rows of the results are applied at once; the others are
//    permuted into `send` ([destination rank][member][piece][cols]) and one all-to-all returns
//    them to `recv` in member order. Over one rank nothing is exchanged. Global scope: the
//    selection spans the whole matrix, every piece goes through the exchange, and the owner
//    compacts the k selected rows (Backend::selection_slots).
//  - ColShard: every rank holds all rows of its columns. Partial row scores are all-gathered and
//    summed (every rank selects the same rows); the others' column pieces of the selected rows go
//    through `send` / `recv` ([rank][member][k][ceil(n/P)]) to the owner, which places them side
//    by side (its own gathered in place), orthogonalizes, applies its columns at once and copies
//    the whole result rows into its slot of an in-place all-gather in `send`: NorMuon and the
//    update of the others see whole rows, as on one device. A transposed group's matrix cut
//    along its stored rows takes this path stepped by columns: its stored rows are the columns.
//  - Block: rows cut over `comm` (as RowShard), columns over `col_comm`. Partial row scores are
//    summed over the column ranks; each rank's pieces of its block are all-gathered over them
//    (`colbuf`) into whole-width pieces (`send`), which then take the RowShard exchange over the
//    row ranks; results come back whole-width (`back` -> `recv`), so NorMuon sees whole rows and
//    each rank updates its columns. Every column rank of a row group orthogonalizes the same
//    matrices.
struct Megabatch {
  int group = 0;
  int64_t rows = 0, cols = 0, k = 0;  // rows: of the local matrices (a shard under RowShard)
  // Stepped by columns (Dion2 on a tall matrix that is not sharded, a transposed group's Dion3 and
  // NorMuon): rows / cols (and global_*) are the transposed shape, the row selection picks stored
  // columns (MatrixSet::columns).
  bool columns = false;
  DType weight_dtype = DType::F32, grad_dtype = DType::F32, momentum_dtype = DType::F32;
  std::vector<Member> members;
  std::unique_ptr<MatrixSet> set;                // every member: accumulate and select
  std::vector<Chunk> chunks;                     // gather, orthogonalize, update
  std::vector<std::unique_ptr<Orthogonalizer>> orths;  // one per distinct chunk size
  DeviceBuffer scores;   // members x rows fp32
  // Per member, an upper bound on every |M| element of the member, which lets the next step's
  // non-finite check skip reading M (StepCheck::state_bound). Row selection: the largest row
  // score of the last applied step plus one (the selected rows' error feedback only shrinks
  // them); Muon and NorMuon: the largest |M| any applied step stored, raised by accumulate. Zero
  // (unknown) after planning and whenever the state may have been written otherwise
  // (forget_state_bounds; under a capture also again outside it, bounds_forget_pending).
  DeviceBuffer bounds;
  DeviceBuffer indices;  // members x k int32
  // Row sums of squares (fp32) for the normalisation: members x rows of M from accumulate when
  // the gather normalises (gathers_normalized), then one per member, the selected rows' total
  // from select_rows (selected_sumsq); else, where the rank gathers U whole (gathers_whole_rows),
  // members x k of U's rows; else (the exchanges normalise after them) not allocated.
  DeviceBuffer row_sumsq;
  // Row-selecting algorithms, k <= cols, the rows whole on this rank (unsharded, or row- or
  // column-sharded over one rank): the gather writes the orthogonalizer's normalised input
  // (Backend::gather_normalized).
  bool gathers_normalized = false;
  std::size_t chunk_bytes = 0;  // arena bytes the most demanding chunk needs

  // Distribution (see above). Local: ranks 1, block N, no buffers.
  Layout layout = Layout::Local;
  Communicator* comm = nullptr;
  int ranks = 1, rank = 0;
  Communicator* col_comm = nullptr;  // Block: the column ranks
  int col_ranks = 1, col_rank = 0;
  int64_t global_rows = 0;    // m of the whole matrix
  int64_t global_cols = 0;    // n of the whole matrix (cols is the local count under ColShard)
  // The whole matrix's (out, in), whatever the orientation the step takes it in: adjust_lr's.
  // Stepped by columns, rows x cols is the stored shape transposed; a transposed group's
  // (GroupConfig::transposed) stored shape is (in, out).
  std::pair<int64_t, int64_t> logical_shape(bool transposed) const {
    return columns != transposed ? std::pair{global_cols, global_rows} : std::pair{global_rows, global_cols};
  }
  // RowShard cut otherwise than in ceil(m/P) chunks in rank order (ParamLayout::row_offset, or
  // row blocks that straddle shards): the largest shard's rows; 0 for the standard cut.
  int64_t row_chunk = 0;
  int64_t orth_cols = 0;      // columns per member the orthogonalizer sees (n: column blocks packed)
  int64_t piece = 0;          // RowShard: rows each rank contributes per member
  int64_t orth_rows = 0;      // rows per member the orthogonalizer sees (k, or ranks * piece)
  int64_t orth_real_rows = 0;  // of those, how many can be non-zero (0: all; ExchangePlan::real_rows)
  int64_t block = 0, owned_first = 0, owned_count = 0;
  bool global_scope = false;  // RowShard Dion3 with selection_scope = Global
  DType update_dtype = DType::F32;  // of the gathered rows U
  DType orth_dtype = DType::F32;    // of the orthogonalizer's result O
  DeviceBuffer send, recv;
  DeviceBuffer piece_idx;   // RowShard: N x piece local row indices
  DeviceBuffer score_send, score_recv, all_scores;  // global scope
  DeviceBuffer colbuf, back;  // Block: the column ranks' pieces; the results for other row ranks
  DeviceBuffer ones;   // ColShard: P ones, to sum the ranks' partial row scores with one GEMM
  DeviceBuffer slots;  // global scope: exchange-buffer rows of the selected rows (Backend::selection_slots)
  // The members other ranks orthogonalize, as (first member, set) ranges before and after the
  // rank's own block: their rows travel through the exchange; the own block's never do.
  std::vector<std::pair<int64_t, std::unique_ptr<MatrixSet>>> others;
  std::unique_ptr<CommRequest> inflight;
  uint64_t bound = 0;  // the Impl::binding its sets were made for (0: none yet)
  int hyper_slot = 0;  // its adjusted lr in Optimizer::Impl::hyper
  std::string label;  // "megabatch 2 (4096x11008 bf16, row-sharded over 8 ranks)"
  int rounds = 0;             // collective rounds per step
  std::size_t bytes_sent = 0;  // bytes this rank sends per step
};

struct Optimizer::Impl {
  // One thread at a time (optimizer.hpp): each entry point that writes or steps holds a Use (a
  // step beneath a running one would read half-bound gradients).
  struct Use : ThreadOwner::Use {
    explicit Use(const Impl& s)
        : ThreadOwner::Use(s.user, Status::InvalidArgument,
                           "this optimizer is in use by another thread (a step or a registration runs "
                           "there): an optimizer is used from one thread at a time") {}
  };
  ThreadOwner user;
  std::unique_ptr<Backend> backend;
  OptimizerOptions options;
  std::vector<GroupConfig> groups;
  std::vector<GroupConfig> planned;  // group configs the current plan was built for
  std::vector<Param> params;
  std::vector<Megabatch> megabatches;
  bool plan_valid = false;
  // {verdict, took part} of this step (comm.hpp, kRankWithoutGradients); distributed, the first of
  // the agreement's regions (kAgreementWords ints per communicator).
  DeviceBuffer flag;
  // What the flag starts from, one set of flag_words ints per Start: {verdict, took part} and,
  // in each region, this rank's digest over its communicator (comm.hpp).
  enum Start : int { kStep, kNoGradients, kInvalidHere, kStarts };
  DeviceBuffer flag_starts;
  int flag_words = 2;
  // Per communicator (communicators()'s order): its plan's digest and megabatch count, and the
  // hyper_values() slots of its groups (all of each group's) and megabatches.
  struct Region {
    uint64_t plan = 0;
    uint32_t count = 0;
    std::vector<int> hyper_slots;
    std::vector<int> megabatches;  // whose members' absence (Param::absent) joins the plan digest
    // The matrix parameters over the communicator, whose absence joins it too: one cut into blocks
    // that each lie within a shard steps in local megabatches, outside `megabatches`.
    std::vector<int> matrix_params;
    std::vector<int> matrix_groups;  // their groups, whose lr rule joins the hyper-parameters' digest
  };
  std::vector<Region> regions;
  // Whether this plan's digests were seen to agree across the ranks (the first step of a plan
  // reads the agreement on the host; see agree_on_flag).
  bool plan_confirmed = false;
  // The settled agreement of the last distributed step that only enqueued, on its way to the
  // host: the next call reads it before anything else (check_posted_agreement).
  std::unique_ptr<HostCopy> agreement_posted;
  int agreement_posted_words = 0;
  bool agreement_pending = false;
  DeviceBuffer arena;  // workspace shared by all chunks (their work is ordered on one stream)
  // Two floats per AdamW parameter, one per Lion parameter (ElementwiseParam::state_bound):
  // raised by every applied step, zero (unknown) after planning and whenever the state may have
  // been written otherwise.
  DeviceBuffer elementwise_bounds;
  DeviceBuffer counters;  // int64 [steps applied, steps dropped], on the device
  std::unique_ptr<HostCopy> posted;  // counters on their way to the host after a step
  // The structural settings (algorithm, flatten, momentum_dtype) each group had when its first
  // parameter's state was sized; empty for groups without parameters. See structure_error().
  std::vector<std::optional<GroupConfig>> structure;
  // Memory a step writes (weights, state given by the caller), by start address: [start, end)
  // and what it is. These ranges never overlap each other or any gradient (see memory_clash()).
  std::map<std::uintptr_t, std::pair<std::uintptr_t, std::string>> written;
  // Every bound gradient's [start, end) by start, with its parameter (gradients may overlap each
  // other), one map per length class [2^c, 2^(c+1)) bytes: a written range [a, b) meets a
  // gradient of class c only among those starting in (a - 2^(c+1), b), so one long gradient does
  // not widen the search among short ones. With names, registration stays O(log n) a parameter.
  std::array<std::multimap<std::uintptr_t, std::pair<std::uintptr_t, int>>, 64> grad_ranges;
  std::unordered_map<std::string, int> param_index;  // by name
  void note_grad_range(int param);  // params[param].grad as bound now
  void forget_grad_range(int param);  // before it is rebound
  std::shared_ptr<StepTracer> tracer;  // see Optimizer::set_tracer
  // Hyper-parameters as the step's operations read them (see Hyper): kGroupHyper floats per
  // group, then each megabatch's adjusted lr, in device memory. upload_hyper() refreshes them
  // before every step that is not being captured, so a captured step replays with the values of
  // the last refresh (Optimizer::refresh_hyperparameters).
  // kGradScale: the gradient's coefficient in the momentum (1, or 1 - mu for ema_momentum).
  enum GroupHyper : int { kMu, kDecay, kMuonBeta2, kLr, kBeta1, kBeta2, kWeightDecay, kEpsilon, kGradScale, kGroupHyper };
  DeviceBuffer hyper;
  std::vector<float> hyper_uploaded;  // what `hyper` holds
  uint64_t plan_generation = 0;       // counts build_plan() calls
  // Counts changes of the memory a step touches (a gradient's view, a new plan, imported step
  // counters): the tables built from it (megabatch sets, the check and element-wise lists) are
  // kept from step to step and made again only when it moves.
  uint64_t binding = 1;
  uint64_t validated = 0;  // the binding validate_for_step last checked the parameters for
  // Where absent parameters' matrices point (Param::absent): zeros that every pass keeps zero (a
  // zero momentum and gradient give a zero update, which leaves a zero weight as it is), so any
  // number of them can share it. Sized for the largest matrix of the plan when first needed.
  DeviceBuffer zeros;
  int absent_now = 0;            // parameters absent now
  uint64_t absence = 0;          // counts changes of any parameter's Param::absent
  uint64_t absence_written = 0;  // the `absence` flag_starts were last written for
  // step_async does not wait for its verdict, so the steps it applies while parameters are absent
  // are counted on the device: one counter per absent set (absent_sets[i] counts in slot i),
  // folded into those parameters' step_offset by fold_absent_counts().
  static constexpr int kAbsentSlots = 16;
  DeviceBuffer absent_counts;  // int64 [kAbsentSlots][2]: finish_step's layout, slot [0] used
  struct AbsentSet {
    uint64_t absence;  // the `absence` it was taken at
    std::vector<int> params;
  };
  std::vector<AbsentSet> absent_sets;
  struct Elementwise {
    uint64_t bound = 0;
    std::vector<bool> nesterov;  // each group's, as the checks were made for
    std::vector<StepCheck> checks;
    std::vector<ElementwiseParam> adamw_ps, lion_ps;
    std::vector<AdamWParams> adamw_hs;
    std::vector<LionParams> lion_hs;
  } lists;
  bool capturing_now = false;  // the step being enqueued is captured by the caller
  // forget_state_bounds() was called under the caller's capture: its fills, captured, run again
  // when the next step or refresh_hyperparameters() is enqueued outside one.
  bool bounds_forget_pending = false;
  uint64_t captured_binding = 0;  // the binding of the last captured step (0: none): a replay reads that memory

  // A profiler range for the lifetime of the object (Backend::range_push and the tracer).
  class Range {
   public:
    Range(const Impl& s, const char* name) : s_(s) {
      s_.backend->range_push(name);
      if (s_.tracer) s_.tracer->begin(name);
    }
    ~Range() {
      if (s_.tracer) s_.tracer->end();
      s_.backend->range_pop();
    }
    Range(const Range&) = delete;
    Range& operator=(const Range&) = delete;

   private:
    const Impl& s_;
  };

  // Names the expected state tensors of a parameter (name, dtype, shape).
  std::vector<StateSpec> state_specs(const Param& p) const;
  // How parameter i's matrices are cut into row blocks (GroupConfig::row_blocks) as this rank
  // holds them. A block of a row-sharded matrix that lies within one rank's shard is that rank's
  // alone (Local: orthogonalized where it lies, nothing exchanged; the other ranks do not see it);
  // one that straddles shards is row-sharded with a cut of its own (row_chunk). Throws naming the
  // parameter when the group's blocks do not fit its rows or layout.
  struct RowBlock {
    int64_t first_row = 0;     // this rank's first row of the block, in its local matrix (stepped by
                               // columns: the block's first column, every field counting columns)
    int64_t rows = 0;          // this rank's rows of it (0: a straddling block it holds none of)
    int64_t global_rows = 0;   // the block's height
    int64_t global_first = 0;  // the block's first row in the whole matrix
    Layout layout = Layout::Local;
    int64_t row_chunk = 0;     // RowShard: see Megabatch::row_chunk
  };
  std::vector<RowBlock> row_blocks(int i) const;
  std::string describe(int param) const;  // "parameter 3 'mlp.up.weight'"
  // The one place that decides whether group g's structure may change: never once its
  // parameters' state is sized by it. Empty when the group may go on as configured.
  std::string structure_error(int g) const;
  void check_group(int g) const;  // groups[g]'s settings and structure, as a step checks them (fails)
  std::string structure_error(int g, const GroupConfig& candidate) const;  // were groups[g] = candidate
  // What already registered memory [t.data, + t.bytes()) overlaps, if anything it must not: a
  // written range (weights, state) for any role, and for a written role also every gradient.
  std::string memory_clash(const TensorView& t, bool written_role) const;
  void build_plan();
  // Whether the next step would plan anew: no plan, a group's planned setting changed, or (with
  // grad_dtypes) a gradient given in another dtype (megabatches are keyed by it).
  bool plan_stale(bool grad_dtypes = true) const;
  Hyper group_hyper(int g, GroupHyper which) const;
  Hyper megabatch_lr(const Megabatch& mb) const;
  std::vector<float> hyper_values() const;
  void upload_hyper(bool capturing);  // capturing: the backend's stream is being captured
  void plan_distribution(Megabatch& mb, int index);
  // flag, flag_starts and regions for the plan: one region per communicator.
  void plan_agreement();
  // flag_starts with the regions' digests over `hyper` (the values the step reads).
  void write_starts(const std::vector<float>& hyper);
  void bind(Megabatch& mb);  // its sets' tables, when the binding moved (or under capture)
  void set_absent(Param& p, bool absent);  // Param::absent, and what follows it
  // A matrix of mb's rows (the whole stored matrix for a set stepped by columns) in `zeros`.
  MatrixView zero_matrix(int64_t rows, int64_t cols, DType dtype);
  // Absent members' state bounds are unknown after a step of a row-selecting megabatch
  // (select_rows bounded the zeros instead); Muon's and NorMuon's, only ever raised, still hold.
  void forget_absent_bounds();
  // An applied step leaves absent parameters' step counts (ParamState::step) as they were.
  void skip_absent_counts();
  // Before step_async enqueues a step: a slot of absent_counts for the absent set of now (may
  // read the device, to free the slots). -1 when no parameter is absent.
  int absent_slot();
  // The device's counts of absent_sets into step_offset, and the slots zeroed (reads the device).
  void fold_absent_counts();
  void build_lists();        // `lists`, when the binding moved
  // A template, not a std::function: wrapping the caller's lambda could allocate mid-step.
  template <class Run>
  MatrixView run_orthogonalizer(Chunk& c, Run&& run);
  std::array<int64_t, 2> read_counters() const;
  void post_counters();  // starts the copy posted_counters() answers from
  // grads_bound false (refuse_step): parameters without a bound gradient pass, since a refusal
  // reads none, and the parameters count as unchecked for the next step.
  void validate_for_step(bool grads_bound = true);
  void check_adjusted_lrs() const;  // each megabatch's lr after adjust_lr is finite in float32
  StepCheck step_check(const Param& p) const;  // what check_step evaluates for p's step
  void forget_state_bounds();  // the state may have been written outside a step: bounds unknown
  // state_changed(): the second moments (NorMuon's variance, AdamW's exp_avg_sq) of the
  // parameters written are read back and checked at the next eager step, which no kernel's check
  // covers (check_written_state). all_written: every parameter's.
  std::vector<int> written_params;
  bool all_written = false;
  void check_written_state();
  // Its read-back, kept between calls: a device buffer the written second moments are gathered
  // into (up to kReadBackBatchBytes at a time) and the pinned host copy of it, of its size.
  static constexpr std::size_t kReadBackBatchBytes = std::size_t{16} << 20;
  DeviceBuffer written_gathered;
  std::unique_ptr<HostCopy> written_readback;
  // count_dropped: whether a step dropped for a non-finite gradient counts in steps_skipped (not
  // when step() raises it).
  // start: kStep, or a refusal (refuse_step, refuse_invalid): the step's collectives, with
  // nothing checked or written.
  // blocking: the caller waits for the verdict (step, refuse_step, refuse_invalid), so the
  // agreement is read on the host right away (see agree_on_flag).
  void enqueue_step(bool count_dropped, Start start, bool blocking);
  // validate_for_step; when it throws in a distributed step with a plan the other ranks may
  // hold, this rank first joins their step's collectives as a refusal (kRankRefused), so that
  // they raise too instead of waiting for it.
  void validate_or_refuse(bool grads_bound = true);
  void refuse_invalid();  // see Optimizer::refuse_invalid
  // The error every rank raises for a step some rank refused or the ranks disagreed on (the
  // verdict's bits), from the settled agreement `words` (host); empty for none of those.
  std::string disagreement_error(const int* words) const;
  // The step's stages (see Megabatch).
  void agree_on_flag(int* flag, bool blocking);
  // Raises when the ranks' plans or hyper-parameters differed at the last step that only
  // enqueued (dropped on the device, and nothing told them until now): on every rank alike where
  // every rank enqueued that step. posted_disagreement() is that error, or empty; both consume it.
  void check_posted_agreement();
  std::string posted_disagreement();
  std::vector<int> read_agreement() const;  // the settled agreement in `flag`, on the host
  void settle_collectives();
  // Every communicator of the parameters, once each, in the order every rank meets them (kept
  // as parameters are added: a scan of them at every add_param and step would cost O(n) each).
  const std::vector<Communicator*>& communicators() const { return comms_met; }
  std::vector<Communicator*> comms_met;
  void prepare(Megabatch& mb, int* flag);
  void orthogonalize(Megabatch& mb, int* flag);
  void apply(Megabatch& mb, int* flag);
  void prepare_block(Megabatch& mb, int* flag);
  void plan_piece_lists(Megabatch& mb, bool selects);
  void plan_score_sum(Megabatch& mb, int ranks);
  const float* summed_scores(Megabatch& mb, Communicator& comm);
  // The chunk's update rows U (orth_rows x orth_cols per member) where the plan put them in the
  // arena; fails (Status::Internal) rather than hand out a view that runs past it.
  MatrixView update_rows_in_arena(const Megabatch& mb, const Chunk& c);
  // Where select_rows leaves the selected rows' sums of squares of a megabatch that gathers
  // normalised (after its members' row sums in row_sumsq).
  static float* selected_sumsq(Megabatch& mb) {
    return mb.row_sumsq.as<float>() + static_cast<int64_t>(mb.members.size()) * mb.rows;
  }
  void select_pieces(Megabatch& mb, const float* scores, const float* row_sumsq, int* flag);
  void orthogonalize_block(Megabatch& mb, int* flag);
  UpdateParams update_params(const Megabatch& mb) const;
};

// state.cpp: what no optimizer run can have produced in a state tensor ("" when every value is
// fine), and which states are running means of squares.
std::string bad_state_value(const HostTensor& t, bool second_moment);
std::string bad_state_value(DType dtype, const unsigned char* data, std::size_t n, bool second_moment);
bool is_second_moment(const std::string& name);

}  // namespace dion3
