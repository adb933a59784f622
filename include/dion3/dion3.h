/* dion3/dion3.h — the C API of dion3 (usable from C99 and C++).
 *
 * A thin, exception-free layer over dion3::Optimizer for native trainers (llm.c style) and
 * foreign-function bindings:
 *   - an opaque optimizer handle (dion3_optimizer*),
 *   - a plain tensor-view struct (dion3_tensor: pointer, dtype, device, ndim, shape[8]),
 *   - integer status codes (dion3_status, equal to dion3::Status) and a thread-local
 *     last-error string (dion3_last_error()),
 *   - a self-describing binary format for optimizer state (export / import).
 *
 * Memory described by a dion3_tensor is owned by the caller and must stay valid (and, for
 * weights, not move) while the optimizer may touch it: dion3_step() updates weights in place and
 * only reads gradients, which the caller may change or rebind (dion3_set_grad) between steps.
 * Tensors are contiguous and row-major. A group without parameters fails every step while it is
 * empty.
 *
 * Typical use:
 *
 *   dion3_optimizer* opt = NULL;
 *   dion3_create(&opt, DION3_DEVICE_CPU, 0, NULL, DION3_NONFINITE_RAISE);
 *   dion3_group_config cfg;
 *   dion3_group_config_default(&cfg);          // Dion3, lr 0.01, fraction 0.25, ...
 *   cfg.fraction = 0.5;
 *   int g = -1, p = -1;
 *   dion3_add_group(opt, &cfg, &g);
 *   dion3_add_param(opt, g, "w", &weight, &grad, &p);
 *   ... fill grad ...;  dion3_step(opt, NULL);
 *   dion3_destroy(opt);
 *
 * Every function returns a dion3_status (except the few that cannot fail); on failure,
 * dion3_last_error() describes what went wrong, naming the parameter or field at fault.
 * Nothing is modified by a failing call, except that a failing create function (dion3_create*,
 * dion3_comm_create_*) sets its *out to NULL. An optimizer handle may be used from one thread at
 * a time (a step or registration called from a second thread while one runs fails with
 * DION3_INVALID_ARGUMENT); distinct handles are independent.
 */
#ifndef DION3_DION3_H
#define DION3_DION3_H

#include <stddef.h>
#include <stdint.h>

#include "dion3/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Raised whenever a public struct changes layout. A program compares it with what the library
 * it loads reports, dion3_api_version(), before its first call that passes a struct. */
#define DION3_C_API_VERSION 5
#define DION3_MAX_DIMS 8
#define DION3_MAX_ORTH_STEPS 16
#define DION3_MAX_ORTH_RESTARTS 16
#define DION3_MAX_SPLITS 64

/* ---- enums (values are part of the ABI; structs store them as int32_t) ----------------- */

typedef enum dion3_status {
  DION3_OK = 0,
  DION3_INVALID_ARGUMENT = 1, /* bad hyper-parameter, shape, dtype, index or state buffer */
  DION3_NON_FINITE = 2,       /* a gradient held NaN/Inf, or the state would overflow, and the
                                 policy is RAISE */
  DION3_UNSUPPORTED = 3,      /* valid request this build cannot serve (e.g. no CUDA) */
  DION3_INTERNAL = 4          /* backend failure (BLAS, CUDA, out of memory) */
} dion3_status;

typedef enum dion3_dtype {
  DION3_F32 = 0,
  DION3_F16 = 1,
  DION3_BF16 = 2,
  DION3_F64 = 3,
  DION3_I32 = 4,
  DION3_I64 = 5
} dion3_dtype;

typedef enum dion3_device { DION3_DEVICE_CPU = 0, DION3_DEVICE_CUDA = 1 } dion3_device;

typedef enum dion3_algorithm {
  DION3_ALGO_DION3 = 0,
  DION3_ALGO_NORMUON = 1,
  DION3_ALGO_MUON = 2,
  DION3_ALGO_ADAMW = 3,
  DION3_ALGO_LION = 4,
  DION3_ALGO_DION2 = 5 /* Dion3 without NorMuon; a tall unsharded matrix selects columns */
} dion3_algorithm;

typedef enum dion3_adjust_lr {
  DION3_ADJUST_LR_SPECTRAL_NORM = 0,
  DION3_ADJUST_LR_RMS_NORM = 1,
  DION3_ADJUST_LR_NONE = 2,
  DION3_ADJUST_LR_SPECTRAL_NORM_CLAMPED = 3 /* lr * sqrt(max(1, rows / cols)): the original Muon's */
} dion3_adjust_lr;

typedef enum dion3_orth_method {
  DION3_ORTH_AUTO = 0, /* per shape, the cheaper of the two by the backend's cost model; standard
                          where Gram would iterate in bfloat16 */
  DION3_ORTH_STANDARD = 1,
  DION3_ORTH_GRAM = 2
} dion3_orth_method;

typedef enum dion3_orth_coefficients {
  DION3_COEFF_POLAR_EXPRESS = 0, /* Polar Express, safety 1.05 (default) */
  DION3_COEFF_YOU = 1,           /* five tuned quintic steps, "You" (torch's classic Muon: CUSTOM) */
  DION3_COEFF_CUSTOM = 2,        /* orth_custom[0 .. orth_num_custom-1] */
  DION3_COEFF_REFERENCE = 3      /* the reference package's default Polar Express set */
} dion3_orth_coefficients;

typedef enum dion3_nonfinite_policy {
  DION3_NONFINITE_RAISE = 0, /* dion3_step returns DION3_NON_FINITE, nothing modified */
  DION3_NONFINITE_SKIP = 1   /* the step is dropped (*applied = 0), nothing modified */
} dion3_nonfinite_policy;

/* Row selection of row-sharded Dion3 (algorithm.md §3): each shard's own top rows, or the whole
 * matrix's exact top k (one more collective, more rows sent). */
typedef enum dion3_selection_scope { DION3_SCOPE_LOCAL = 0, DION3_SCOPE_GLOBAL = 1 } dion3_selection_scope;

/* How a parameter spans the ranks of a communicator (algorithm.md §3). */
typedef enum dion3_layout_kind {
  DION3_LAYOUT_LOCAL = 0,      /* one device owns it whole (default) */
  DION3_LAYOUT_REPLICATED = 1, /* every rank holds the same tensor (DDP) */
  DION3_LAYOUT_ROW_SHARD = 2, /* rank r holds rows [r*c, min((r+1)*c, m)), c = ceil(m/P) */
  DION3_LAYOUT_COL_SHARD = 3, /* rank r holds columns [r*c, min((r+1)*c, n)), c = ceil(n/P) */
  DION3_LAYOUT_BLOCK = 4      /* rows cut over comm as ROW_SHARD, columns over col_comm as COL_SHARD */
} dion3_layout_kind;

/* ---- plain structs --------------------------------------------------------------------- */

/* A contiguous, row-major tensor owned by the caller. */
typedef struct dion3_tensor {
  void* data;
  int32_t dtype;        /* dion3_dtype */
  int32_t device;       /* dion3_device */
  int32_t device_index; /* CUDA ordinal; 0 for CPU */
  int32_t ndim;         /* 0 .. DION3_MAX_DIMS */
  int64_t shape[DION3_MAX_DIMS];
} dion3_tensor;

/* Hyper-parameters of one parameter group (algorithm.md §1, §4). Always start from
 * dion3_group_config_default(): it fills dion3's defaults (the reference's names and values,
 * except where algorithm.md says otherwise). */
typedef struct dion3_group_config {
  int32_t algorithm; /* dion3_algorithm; default DION3_ALGO_DION3 */
  double lr;         /* 0.01 */
  double fraction;   /* 0.25: share of rows orthogonalized per step (Dion3) */
  double mu;         /* 0.95: momentum / error-feedback decay */
  double muon_beta2; /* 0.95: NorMuon second-moment EMA */
  double betas[2];   /* {0.9, 0.95}: AdamW / Lion */
  double weight_decay; /* 0.01, decoupled */
  double epsilon;      /* 1e-8 */
  int32_t adjust_lr;   /* dion3_adjust_lr; default spectral norm */
  int32_t flatten;     /* 0: >=3-D tensors are batches of matrices; 1: (dim0, rest) */
  int32_t nesterov;    /* Muon / NorMuon */
  int32_t cautious_wd; /* matrix algorithms; Dion3 / Dion2 do not decay unselected rows then */
  int32_t scale_lr_by_fraction; /* Dion3, Dion2: lr / sqrt(fraction); default 0 */
  int32_t momentum_dtype;       /* matrix algorithms: dion3_dtype, or -1 = the parameter's dtype
                                   (default); AdamW / Lion moments take the parameter's dtype */
  /* orthogonalization */
  int32_t orth_method;          /* dion3_orth_method; default AUTO */
  int32_t orth_coefficients;    /* dion3_orth_coefficients; default POLAR_EXPRESS */
  int32_t orth_num_custom;      /* used when orth_coefficients == CUSTOM */
  double orth_custom[DION3_MAX_ORTH_STEPS][3]; /* (a, b, c) per quintic step */
  int32_t orth_num_restarts;    /* default 1 */
  int32_t orth_restarts[DION3_MAX_ORTH_RESTARTS]; /* default {2} (Gram NS restart steps) */
  int32_t orth_iteration_dtype; /* dion3_dtype, or -1 = the backend's choice (default) */
  int32_t selection_scope;      /* dion3_selection_scope: row-sharded Dion3; default LOCAL */
  /* Row blocks orthogonalized as matrices of their own (fused QKV, attention heads); at most
   * one of the two, both 0 by default. With transposed = 1 (Dion3, NorMuon) the blocks are of
   * output features, the stored columns: */
  int32_t num_heads;            /* h blocks of equal height */
  int32_t num_split_sizes;      /* blocks of heights split_sizes[0 .. num_split_sizes) */
  /* Muon / NorMuon: 1 keeps the momentum as an average, M = mu*M + (1 - mu)*G (the Nesterov mix
   * mu*M + (1 - mu)*G), as torch.optim.Muon does; 0 (default): M = mu*M + G. */
  int32_t ema_momentum;
  int64_t split_sizes[DION3_MAX_SPLITS];
  /* The Newton-Schulz input is X / (||X||_F + orth_norm_eps) (default 1e-7, the reference's rule);
   * with orth_norm_floor = 1, X / max(||X||_F, orth_norm_eps) (torch.optim.Muon's). */
  double orth_norm_eps;
  int32_t orth_norm_floor;
  /* Matrix algorithms: 1 when the weights are stored (in, out), as x @ W reads them; their
   * columns are then the output features Dion3 selects and NorMuon normalises, and adjust_lr
   * takes the (out, in) shape. Dion3 and NorMuon take whole matrices (local, replicated) or ones
   * row-sharded in ceil(m/P) chunks (the input features cut). Element-wise algorithms ignore it.
   * Default 0. */
  int32_t transposed;
} dion3_group_config;

/* One megabatch of the plan (all same-shape matrices of a group orthogonalized together). */
typedef struct dion3_megabatch_info {
  int32_t group;
  int32_t algorithm;       /* dion3_algorithm */
  int64_t rows, cols;      /* m x n of each matrix */
  int32_t dtype;           /* dion3_dtype */
  int64_t count;           /* matrices in the batch */
  int64_t selected_rows;   /* k */
  int32_t method;          /* dion3_orth_method actually used (STANDARD or GRAM) */
  int32_t iteration_dtype; /* dion3_dtype */
  uint64_t workspace_bytes;
  int32_t columns; /* 1: stepped by columns (Dion2 on tall matrices, a transposed group's Dion3 and
                      NorMuon); rows x cols is then n x m */
} dion3_megabatch_info;

typedef struct dion3_optimizer dion3_optimizer; /* opaque */
typedef struct dion3_comm dion3_comm;           /* opaque: a communicator over some ranks */

/* A distributed parameter: its layout, the communicator of the ranks it spans, and the rows
 * (ROW_SHARD) or columns (COL_SHARD) of the whole matrix; the weight tensor is this rank's
 * shard, possibly empty. */
typedef struct dion3_layout {
  int32_t kind;        /* dion3_layout_kind */
  int64_t global_rows; /* ROW_SHARD, BLOCK: m; REPLICATED element-wise: its rows where every rank
                          holds it whole (its shape then joins the ranks' agreement), else 0 */
  dion3_comm* comm;    /* every kind but LOCAL (BLOCK: the rows' ranks); not owned, must outlive the
                          optimizer; one optimizer's parameters span at most 8 comm objects, so
                          parameters over one group share one */
  int64_t global_cols; /* COL_SHARD, BLOCK: n */
  dion3_comm* col_comm; /* BLOCK: the ranks the columns are cut over; NULL otherwise */
  /* ROW_SHARD with rows cut otherwise than in ceil(m/P) chunks in rank order (FSDP2 over tensor
   * parallel's column-wise split cuts twice): this rank's first row and the largest shard's rows,
   * the same on every rank. row_chunk 0 (zero-initialised) = the standard cut. Local selection
   * only. */
  int64_t row_offset;
  int64_t row_chunk;
} dion3_layout;

/* Optimizer-wide settings of dion3_create_with_options. Always start from
 * dion3_options_default(). */
typedef struct dion3_options {
  int32_t on_nonfinite;     /* dion3_nonfinite_policy; default RAISE */
  int32_t megabatch;        /* 1 (default): same-shape matrices share one orthogonalization and
                               one collective round; 0: each matrix alone (for benchmarks) */
  int32_t record;           /* 1 (default): each orthogonalization is recorded once and replayed
                               (a CUDA graph); 0: op by op */
  int32_t agree_on_names;   /* 1: distributed, the parameters' names join the ranks' agreement on
                               the plan (same-shape matrices registered in another order on one
                               rank are refused); only where every rank names them alike. 0
                               (default): names are labels for messages only */
  uint64_t workspace_limit; /* bytes the step may use beyond the state; 0 (default) = automatic */
} dion3_options;

/* ---- library ---------------------------------------------------------------------------- */

/* Message of the most recent failed call on this thread ("" if none). Never NULL; valid
 * until the next failing call on the same thread. */
DION3_API const char* dion3_last_error(void);
/* The DION3_C_API_VERSION the library was built with. */
DION3_API int dion3_api_version(void);
/* The library version, "major.minor.patch" (the repository's VERSION file). */
DION3_API const char* dion3_version(void);
/* 1 if this build has a CUDA backend and a device is visible. */
DION3_API int dion3_cuda_available(void);
/* Static name of a status code ("ok", "invalid argument", ...). */
DION3_API const char* dion3_status_name(int status);

/* ---- optimizer lifetime ---------------------------------------------------------------- */

/* device: DION3_DEVICE_CPU or DION3_DEVICE_CUDA (device_index, cuda_stream = cudaStream_t or
 * NULL for the default stream; both ignored for CPU). on_nonfinite: dion3_nonfinite_policy.
 * A CUDA request in a build without CUDA returns DION3_UNSUPPORTED. */
DION3_API dion3_status dion3_create(dion3_optimizer** out, int device, int device_index, void* cuda_stream,
                                    int on_nonfinite);
DION3_API void dion3_options_default(dion3_options* options);
/* dion3_create with every optimizer-wide setting (options NULL = the defaults). */
DION3_API dion3_status dion3_create_with_options(dion3_optimizer** out, int device, int device_index,
                                                 void* cuda_stream, const dion3_options* options);
/* NULL is allowed. */
DION3_API void dion3_destroy(dion3_optimizer* opt);
/* Re-bind the CUDA stream the optimizer enqueues on (no-op for CPU). */
DION3_API dion3_status dion3_set_stream(dion3_optimizer* opt, void* cuda_stream);

/* ---- communicators (distributed layouts) ------------------------------------------------ */

/* MPI over a duplicate of *mpi_comm (an MPI_Comm*; NULL = MPI_COMM_WORLD), CPU buffers, whose
 * MPI errors come back as statuses. MPI must be initialised and not finalised. timeout_seconds:
 * a collective running longer fails the step with DION3_INTERNAL naming it (0 = no limit); it
 * stays in flight (collectives cannot be cancelled), so the job should end (MPI_Abort) rather
 * than go on or free the optimizer's memory under it. DION3_UNSUPPORTED in builds without MPI. */
DION3_API dion3_status dion3_comm_create_mpi(dion3_comm** out, const void* mpi_comm, double timeout_seconds);
/* NCCL over an initialised ncclComm_t (not owned) whose rank uses CUDA device `device`.
 * DION3_UNSUPPORTED in builds without NCCL. */
DION3_API dion3_status dion3_comm_create_nccl(dion3_comm** out, void* nccl_comm, int device);
/* NULL is allowed. Destroy after every optimizer that uses it. */
DION3_API void dion3_comm_destroy(dion3_comm* comm);
DION3_API dion3_status dion3_comm_rank(const dion3_comm* comm, int* rank, int* size);

/* ---- groups and parameters ------------------------------------------------------------- */

DION3_API void dion3_group_config_default(dion3_group_config* cfg);
DION3_API dion3_status dion3_add_group(dion3_optimizer* opt, const dion3_group_config* cfg, int* group_index);
/* Read and replace a group's configuration between steps. The new one is validated first
 * (nothing changes when it is refused); algorithm, flatten, transposed and momentum_dtype
 * cannot change once the group has parameters. What depends on the step's plan as well, such as
 * the learning rate after adjust_lr (finite in float32 for every matrix shape), is checked by
 * the next step, which refuses it with nothing changed. */
DION3_API dion3_status dion3_get_group_config(const dion3_optimizer* opt, int group, dion3_group_config* out);
DION3_API dion3_status dion3_set_group_config(dion3_optimizer* opt, int group, const dion3_group_config* cfg);
/* Shortcut for learning-rate schedules. */
DION3_API dion3_status dion3_set_lr(dion3_optimizer* opt, int group, double lr);

/* Registers a parameter (weight updated in place, grad read at every step). name is copied,
 * must be unique in the optimizer and appears in error messages. grad has the weight's shape
 * and dtype float32, bfloat16 or float16 (read as float32); it may be NULL: bind it with
 * dion3_set_grad before the first step. A weight may not overlap another parameter's weight or
 * any gradient (it would be updated twice, or read after it was written). Every tensor's data
 * is aligned to its element size. param_index may be NULL. */
DION3_API dion3_status dion3_add_param(dion3_optimizer* opt, int group, const char* name,
                                       const dion3_tensor* weight, const dion3_tensor* grad, int* param_index);
/* dion3_add_param for a distributed parameter (layout NULL = local). Every rank must register
 * the same parameters in the same order with the same global shapes; every step compares the
 * ranks' plans in its first collective, and dion3_step fails on every rank, with nothing
 * modified, when they differ. */
DION3_API dion3_status dion3_add_param_layout(dion3_optimizer* opt, int group, const char* name,
                                              const dion3_tensor* weight, const dion3_tensor* grad,
                                              const dion3_layout* layout, int* param_index);
/* Re-binds the gradient of a parameter (the weight's shape; float32, bfloat16 or float16;
 * overlapping no weight). grad NULL: the parameter has no gradient this step, and steps leave it
 * and its state as they are until a gradient is bound again (matrix algorithms only; an AdamW or
 * Lion parameter is refused). Distributed, every rank must leave out the same parameters. */
DION3_API dion3_status dion3_set_grad(dion3_optimizer* opt, int param, const dion3_tensor* grad);
DION3_API dion3_status dion3_num_params(const dion3_optimizer* opt, int* count);

/* ---- step -------------------------------------------------------------------------------- */

/* One step over every parameter. *applied (may be NULL) is 1 if the step was applied and 0 if
 * it was skipped under DION3_NONFINITE_SKIP. Under RAISE a non-finite gradient returns
 * DION3_NON_FINITE; in both cases weights and state are untouched. */
DION3_API dion3_status dion3_step(dion3_optimizer* opt, int* applied);
/* For a rank of a distributed optimizer with no gradients this step while other ranks call
 * dion3_step: runs the step's collectives, reading no gradient (none need be bound) and writing
 * nothing, so that every rank refuses the step (DION3_INVALID_ARGUMENT here and in the others'
 * dion3_step) instead of pairing later collectives wrongly. DION3_OK, with nothing done, when every rank refused. */
DION3_API dion3_status dion3_refuse_step(dion3_optimizer* opt);
/* For a rank of a distributed optimizer that cannot step because the caller found something
 * invalid on this rank alone: runs the step's collectives as a refusal, writing nothing, so that
 * the others' dion3_step returns DION3_INVALID_ARGUMENT ("another rank refused this step")
 * instead of waiting for this rank. Returns DION3_OK; the caller reports its own error. (dion3_step
 * refuses so by itself for what it validates.) Does nothing before the first step (without a
 * plan), or when the others' next call fails for an earlier dion3_step_async (below). */
DION3_API dion3_status dion3_refuse_invalid(dion3_optimizer* opt);
/* Steps applied and skipped so far (either pointer may be NULL). On CUDA this waits for the
 * device; dion3_posted_steps does not. */
DION3_API dion3_status dion3_steps(const dion3_optimizer* opt, int64_t* taken, int64_t* skipped);

/* The step of dion3_step, only enqueued on the optimizer's stream: it does not wait for the
 * device, so a CUDA trainer's host runs ahead and the step can be captured in a CUDA graph. A
 * non-finite gradient drops the step on the device whatever the policy (counted as skipped).
 * Distributed, the first step after the plan was made (every step on the CPU) reads the ranks'
 * agreement and fails with DION3_INVALID_ARGUMENT, nothing modified, when their plans differ;
 * such a step cannot be captured. Otherwise a step whose ranks' plans (later steps) or
 * hyper-parameters (any step) differ is dropped on the device, and the next dion3_step,
 * dion3_step_async or dion3_refuse_step of every rank fails for it (DION3_INVALID_ARGUMENT)
 * before anything else: every rank must make the same kind of call at a step. */
DION3_API dion3_status dion3_step_async(dion3_optimizer* opt);
/* The counters of dion3_steps as they stood after the last step that was not being captured,
 * without waiting: *ready (not NULL) is 0 while they have not reached the host yet, and then
 * taken and skipped are left unchanged. */
DION3_API dion3_status dion3_posted_steps(const dion3_optimizer* opt, int64_t* taken, int64_t* skipped,
                                          int* ready);
/* A step captured in a CUDA graph reads the hyper-parameters when replayed: call this before
 * each replay (outside the graph) so that it follows the groups' current values (an lr
 * schedule). DION3_INVALID_ARGUMENT when a group changed a setting the captured plan depends on
 * (fraction, blocks, nesterov, cautious_wd, selection_scope, orthogonalizer): capture again. */
DION3_API dion3_status dion3_refresh_hyperparameters(dion3_optimizer* opt);
/* Changes whenever the step's plan is rebuilt: a step captured under another generation is
 * stale and must be captured again. */
DION3_API dion3_status dion3_plan_generation(const dion3_optimizer* opt, uint64_t* generation);

/* The megabatch plan. Writes min(capacity, n) entries to out (out may be NULL when capacity
 * is 0) and the total n to *count. */
DION3_API dion3_status dion3_plan(dion3_optimizer* opt, dion3_megabatch_info* out, size_t capacity,
                                  size_t* count);

/* ---- state --------------------------------------------------------------------------------- */

/* Bytes of optimizer state (momentum, variance, exp_avg, ...) held in device memory. */
DION3_API dion3_status dion3_state_size(const dion3_optimizer* opt, size_t* bytes);

/* Size of the serialized state that dion3_export_state writes. */
DION3_API dion3_status dion3_export_size(const dion3_optimizer* opt, size_t* bytes);
/* Serializes the state into buf (capacity bytes). *written (may be NULL) receives the size.
 * A too-small buffer returns DION3_INVALID_ARGUMENT and writes nothing.
 * Format (all integers little-endian):
 *   "DION3ST\0" | u32 version (1) | u32 reserved (0) | i64 steps | i64 skipped | u32 nparams
 *   per param:  u32 len, name | i64 step | u32 ntensors
 *     per tensor: u32 len, name | i32 dtype | u32 ndim | i64 shape[ndim] | u64 nbytes | bytes
 *   u64 FNV-1a hash of everything before it. */
DION3_API dion3_status dion3_export_state(const dion3_optimizer* opt, void* buf, size_t capacity,
                                          size_t* written);
/* Restores state written by dion3_export_state into an optimizer with the same parameters,
 * added in the same order (each one's name must match). The whole buffer is checked (format,
 * hash, reserved field, names, dtypes, shapes, values: no NaN/Inf and no negative second moment,
 * step counters: none negative or above 2^62) before anything changes; on failure the optimizer
 * is untouched. This rank's alone (no collective): distributed ranks agree on the outcome
 * themselves before the next step. */
DION3_API dion3_status dion3_import_state(dion3_optimizer* opt, const void* buf, size_t size);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DION3_DION3_H */
