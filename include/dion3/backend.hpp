// dion3/backend.hpp — the narrow interface between the device-independent engine and a device.
//
// A backend implements the few operations Dion3, NorMuon, Muon, AdamW and Lion need: row
// scoring and selection, row gather/scatter, the orthogonalization primitives (GEMM, Gram
// product, symmetric product), the fused NorMuon-normalise-and-update and the element-wise
// optimizers. All operations are enqueued in order on the backend's stream; none synchronises
// with the host except read_flag() and the host copies. Mutating operations take `skip`, a
// device flag: when *skip != 0 they leave memory untouched (this is how a step with a
// non-finite gradient is dropped without a host round trip).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "dion3/config.hpp"
#include "dion3/export.h"
#include "dion3/view.hpp"

namespace dion3 {

// Device memory for workspace and engine-owned state. Injected so that front ends can lend
// their own allocator (PyTorch's caching allocator, which CUDA-graph capture needs).
class DION3_API Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes) = 0;
};

// Row index lists (selections) may hold padding: an entry >= the matrices' row count stands for
// a row of zeros. Sharded layouts send a fixed number of rows per matrix and pad the rest, so
// every rank's collective has the same size without a host round trip for the real counts.
// Lists stay ascending, with the padding last.
inline constexpr int32_t kPadRow = std::numeric_limits<int32_t>::max();

// One matrix of a matrix parameter, as a megabatch sees it (each view has batch == 1).
struct ParamMatrix {
  MatrixView weight;
  MatrixView grad;
  MatrixView momentum;
  float* variance = nullptr;  // one fp32 entry per set row (NorMuon second moment), null for Muon
};

// The matrices of one megabatch. Backends may derive from it to keep device-side copies of
// the pointer table; refresh() is called whenever `mats` changed.
struct DION3_API MatrixSet {
  virtual ~MatrixSet() = default;
  std::vector<ParamMatrix> mats;
  // Stepped by columns (Dion2 on a tall matrix; Dion3 and NorMuon on a transposed group's): row r
  // of the set is column r of every stored matrix, so rows() and cols() give the transposed shape,
  // and NorMuon's variance holds one entry per stored column. Only accumulate, gather_rows,
  // gather_normalized and apply_update take such sets; M, G and W keep their stored layout.
  bool columns = false;
  int64_t rows() const { return mats.empty() ? 0 : columns ? mats.front().weight.cols : mats.front().weight.rows; }
  int64_t cols() const { return mats.empty() ? 0 : columns ? mats.front().weight.rows : mats.front().weight.cols; }
};

#if defined(__CUDACC__)
#define DION3_HOST_DEVICE __host__ __device__
#else
#define DION3_HOST_DEVICE
#endif

// The factor algorithm.md §2 scales the Newton-Schulz input by, from its Frobenius norm.
template <class T>
DION3_HOST_DEVICE inline T inverse_norm_of(T norm, NormGuard g) {
  const T eps = static_cast<T>(g.eps);
  return T(1) / (g.floor ? (norm > eps ? norm : eps) : norm + eps);
}

// A hyper-parameter as an operation reads it: `value`, or, where `at` is set, the float there in
// the backend's memory, read when the operation runs. The engine keeps its groups' values in one
// such buffer and refreshes it between steps, so that a step captured in a CUDA graph follows a
// schedule when it is replayed.
struct Hyper {
  float value = 0.0f;
  const float* at = nullptr;
  Hyper() = default;
  Hyper(float v) : value(v) {}  // NOLINT(google-explicit-constructor): plain values convert
  Hyper(float v, const float* where) : value(v), at(where) {}
  DION3_HOST_DEVICE float get() const { return at ? *at : value; }
};

// Scalars of the matrix update (algorithm.md §1 steps 6–8, Muon/NorMuon variants).
struct UpdateParams {
  Hyper decay = 1.0f;        // weight decay factor 1 - lr*weight_decay (lr: the base lr)
  Hyper adjusted_lr = 0.0f;  // lr' of the orthogonalized update
  bool normuon = false;      // apply the NorMuon row normalisation with variance
  Hyper beta2 = 0.95f;
  bool cautious_wd = false;
  // Column-sharded weights: O holds whole rows (O.cols >= the weights' cols); the NorMuon
  // statistics span all of O's columns and the weights take columns [o_col_offset, + cols).
  int64_t o_col_offset = 0;
};

// A flat element-wise parameter (AdamW / Lion); views are 1 x numel.
struct ElementwiseParam {
  MatrixView weight;
  MatrixView grad;
  MatrixView exp_avg;
  MatrixView exp_avg_sq;  // AdamW only
  // Optional, in device memory, floats that each applied step raises to at least the largest
  // |exp_avg| and (AdamW) the largest exp_avg_sq it stores (StepCheck::state_bound): two for
  // AdamW, one for Lion.
  float* state_bound = nullptr;
};

// Throws InvalidArgument, before anything is written, unless every parameter's views (and, with
// second_moment, AdamW's exp_avg_sq) are flat (1 x 1 x n, n the weight's), of a float dtype and
// with data. `what` names the call in the message. Backends call it first.
DION3_API void check_elementwise_params(std::span<const ElementwiseParam> ps, bool second_moment, const char* what);

struct AdamWParams {
  float lr, beta1, beta2, weight_decay, epsilon;
  // Bias correction 1 - beta^t with t = *applied_steps - step_offset + 1, read on the device
  // so that a captured step is still right when it is replayed.
  const int64_t* applied_steps;
  int64_t step_offset;
  // If set: {lr, beta1, beta2, weight_decay, epsilon} in the backend's memory, read instead of
  // the values above when the update runs (see Hyper).
  const float* live = nullptr;
  DION3_HOST_DEVICE AdamWParams resolved() const {
    AdamWParams h = *this;
    if (live) h = {live[0], live[1], live[2], live[3], live[4], applied_steps, step_offset, nullptr};
    return h;
  }
};

// t of an AdamW step (see AdamWParams), for backends and tests.
DION3_HOST_DEVICE inline double adamw_step_number(const AdamWParams& h, int64_t applied_steps) {
  return static_cast<double>(applied_steps - h.step_offset + 1);
}
struct LionParams {
  float lr, beta1, beta2, weight_decay;
  const float* live = nullptr;  // as AdamWParams::live: {lr, beta1, beta2, weight_decay}
  DION3_HOST_DEVICE LionParams resolved() const {
    return live ? LionParams{live[0], live[1], live[2], live[3], nullptr} : *this;
  }
};

// The step's flag bit of a distributed step that some rank refused for want of gradients
// (Optimizer::refuse_step; the agreement is described in comm.hpp).
inline constexpr int kRankWithoutGradients = 2;
// ... of a distributed step whose ranks planned different steps: nothing is written and the step
// is not counted (the agreement carries each rank's plan digest, comm.hpp).
inline constexpr int kPlansDiffer = 4;
// ... of a step some rank refused because a setting or input was invalid there (it raised the
// reason itself, after running the step's collectives so that the others do not wait for it).
inline constexpr int kRankRefused = 8;
// ... of a step whose ranks planned alike but hold different hyper-parameters (lr, decay, betas):
// applied, it would part replicas and shards; the collectives still pair, so it runs to its end.
inline constexpr int kHyperDiffer = 16;
// The verdicts that are no step at all: neither applied nor counted as dropped.
inline constexpr int kNotAStep = kRankWithoutGradients | kPlansDiffer | kRankRefused | kHyperDiffer;
// A region's digest: a 64-bit hash and a 32-bit count of the plan, then a 32-bit hash of the
// hyper-parameters, 16 bits a word.
inline constexpr int kDigestWords = 8;
inline constexpr int kPlanDigestWords = 6;  // the first ones: the plan's
inline constexpr int kAgreementWords = 2 + 2 * kDigestWords;
// Regions in every distributed agreement, however many communicators the rank's parameters span
// (the unused ones hold an empty digest): the all-reduce has one length on every rank, so a rank
// whose communicators differ in number is refused by the digests instead of a truncated message.
inline constexpr int kAgreementRegions = 8;
// Whether the ranks' digest words [first, last) in one reduced region of the agreement differ.
DION3_HOST_DEVICE inline bool agreement_words_differ(const int* region, int first, int last) {
  const int* d = region + 2;
  bool differ = false;
  for (int i = first; i < last; ++i) differ |= d[i] + d[kDigestWords + i] != 0xFFFF;
  return differ;
}
DION3_HOST_DEVICE inline bool agreement_plans_differ(const int* region) {
  return agreement_words_differ(region, 0, kPlanDigestWords);
}
DION3_HOST_DEVICE inline bool agreement_hypers_differ(const int* region) {
  return agreement_words_differ(region, kPlanDigestWords, kDigestWords);
}
// Backend::settle_agreement's rule, for backends to share.
DION3_HOST_DEVICE inline void settle_agreement_words(int* words, int regions) {
  int verdict = 0;
  for (int r = 0; r < regions; ++r) {
    if (agreement_plans_differ(words + r * kAgreementWords)) verdict |= kPlansDiffer;
    if (agreement_hypers_differ(words + r * kAgreementWords)) verdict |= kHyperDiffer;
  }
  words[0] |= verdict;
}

// One parameter's share of Backend::check_step: the state its step would store, evaluated
// but not written. Views are flat (1 x n), all of one length.
struct StepCheck {
  enum Rule : int {
    Momentum = 0,  // M' = a*M + c*G; with b != 0 also the Nesterov mix b*M' + c*G
    AdamW = 1,     // exp_avg and exp_avg_sq of AdamWElem with beta1 = a, beta2 = b
    Lion = 2,      // exp_avg' = M + (1 - b)*(G - M)
  };
  Rule rule = Momentum;
  MatrixView grad;
  MatrixView state;   // momentum / exp_avg
  MatrixView state2;  // AdamW's exp_avg_sq
  Hyper a = 0.0f, b = 0.0f;
  Hyper c = 1.0f;  // Momentum rule: the gradient's coefficient (1 - mu for an averaged momentum)
  // Optional, in device memory. Momentum rule: one float that, when > 0, is at least the largest
  // |state| element (the optimizer keeps one per matrix between steps). AdamW rule: two, bounds
  // on |state| and on state2 (ElementwiseParam::state_bound), and a state2 that is >= 0. Lion
  // rule: one, a bound on |state|. Where a
  // gradient element is small enough against them that no state so bounded could overflow, the
  // state is not read. 0, NaN, Inf or a null pointer: unknown, the state is read.
  const float* state_bound = nullptr;
};

// The largest finite value of a floating dtype.
DION3_HOST_DEVICE inline float largest_finite(DType t) {
  switch (t) {
    case DType::F16: return 65504.0f;
    case DType::BF16: return 3.3895313892515355e38f;  // 0x7F7F
    default: return 3.4028234663852886e38f;           // FLT_MAX
  }
}

// a * b rounded on its own, also on the device, where nvcc would otherwise fuse a product into the
// sum it feeds (fma): the CUDA check computes each gradient limit in two kernels, and both must
// get the same value to agree on which of them reads a segment.
DION3_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// A |g| up to which a * m + g and the Nesterov mix b * (a * m + g) + g both stay within a quarter
// of `limit` (a state dtype's largest finite value) whatever m with |m| <= bound, so that float
// rounding cannot carry either past it (so also with a gradient coefficient |c| <= 1). Negative or
// NaN (no gradient passes) when the bound is unknown or too large.
DION3_HOST_DEVICE inline float momentum_gradient_limit(float bound, float a, float b, float limit) {
  if (!(bound > 0.0f)) return -1.0f;
  const float fa = a < 0.0f ? -a : a, fb = b < 0.0f ? -b : b;
  return (0.25f * limit - mul_rn(mul_rn(fa, fb > 1.0f ? fb : 1.0f), bound)) / (1.0f + fb);
}

// A |g| up to which m + (1 - beta)*(g - m) stays within `room` whatever m with |m| <= bm (and
// g - m within twice it): the new exp_avg of AdamW and Lion. At most `room`; negative or NaN
// (no gradient passes) when the bound is too large or beta is NaN or infinite.
DION3_HOST_DEVICE inline float lerp_gradient_limit(float bm, float beta, float room) {
  const float f = beta > 1.0f ? beta - 1.0f : 1.0f - beta;  // |1 - beta|
  if (!(f >= 0.0f)) return -1.0f;  // NaN beta: the new exp_avg is NaN
  const float l = f > 0.0f ? (room - mul_rn(1.0f + f, bm)) / f : (bm <= room ? room : -1.0f);
  return l >= room ? room : l;  // a NaN l (infinite beta) stays NaN: callers pass only l >= 0
}

// The AdamW rule's counterpart (StepCheck::state_bound, two floats): a |g| up to which the new
// exp_avg (m + (1 - beta1)*(g - m), |m| <= bounds[0]) and exp_avg_sq (beta2*v + (1 - beta2)*g*g,
// 0 <= v <= bounds[1]) stay within a quarter of `limit`, and exp_avg_sq >= 0 (0 <= beta2 <= 1).
// At most a quarter of `limit`; negative when a bound is unknown, or so large that no gradient
// passes, or beta1 is NaN, or beta2 is outside [0, 1].
DION3_HOST_DEVICE inline float adamw_gradient_limit(const float* bounds, float beta1, float beta2, float limit) {
  const float bm = bounds[0], bv = bounds[1], room = 0.25f * limit;
  if (!(bm > 0.0f) || !(bv > 0.0f) || !(beta2 >= 0.0f && beta2 <= 1.0f)) return -1.0f;
  const float lm = lerp_gradient_limit(bm, beta1, room);
  const float rv = room - mul_rn(beta2, bv), f2 = 1.0f - beta2;
  // sqrt(rv) / sqrt(f2), not sqrt(rv / f2): the quotient may overflow where the limit does not.
  const float lv = !(rv >= 0.0f) ? -1.0f : f2 > 0.0f ? sqrtf(rv) / sqrtf(f2) : room;
  if (!(lm >= 0.0f) || !(lv >= 0.0f)) return -1.0f;
  const float l = lm < lv ? lm : lv;
  return l < room ? l : room;  // finite (lm or lv overflow where they exceed it): an Inf gradient is read
}

// A StepCheck's gradient limit by its rule, from its state_bound (a, b as StepCheck holds them):
// the |g| below which its state need not be read; negative or NaN where the bound is unknown or
// no gradient passes.
DION3_HOST_DEVICE inline float state_gradient_limit(StepCheck::Rule rule, const float* bound, float a, float b,
                                                    float limit) {
  switch (rule) {
    case StepCheck::Momentum: return momentum_gradient_limit(*bound, a, b, limit);
    case StepCheck::AdamW: return adamw_gradient_limit(bound, a, b, limit);
    default: return *bound > 0.0f ? lerp_gradient_limit(*bound, b, 0.25f * limit) : -1.0f;  // Lion: b = beta2
  }
}

// The element-wise rules of AdamW and Lion, shared by every backend and by check_step so that
// the check sees exactly the values the update stores. The second moment multiplies (1 - beta2)
// into g before squaring: g*g overflows float32 from |g| ~ 2e19, this only from ~ 8e19 at
// beta2 = 0.95 (~ 6e20 at 0.999). The update divides sqrt(v) by sqrt(1 - beta2^t) (as torch):
// v / (1 - beta2^t) itself overflows from |g| ~ 1.8e19 and would stop those elements. The bias
// corrections come from a double pow, rounded once to float; lr / (1 - beta1^t) is one factor
// (torch's step size), so that an element costs two divisions.
struct AdamWRule {
  DION3_HOST_DEVICE static float exp_avg(float m, float g, float beta1) { return m + (1.0f - beta1) * (g - m); }
  DION3_HOST_DEVICE static float exp_avg_sq(float v, float g, float beta2) {
    return beta2 * v + ((1.0f - beta2) * g) * g;
  }
  DION3_HOST_DEVICE static float step_size(float lr, float beta1, double t) {
    return static_cast<float>(static_cast<double>(lr) / (1.0 - pow(static_cast<double>(beta1), t)));
  }
  DION3_HOST_DEVICE static float sqrt_bias_correction2(float beta2, double t) {
    return static_cast<float>(sqrt(1.0 - pow(static_cast<double>(beta2), t)));
  }
  // The weight after the step, from the new moments; decay = 1 - lr * weight_decay.
  DION3_HOST_DEVICE static float weight(float w, float m, float v, float step_size, float decay, float epsilon,
                                        float sqrt_bc2) {
    return w * decay - step_size * m / (sqrtf(v) / sqrt_bc2 + epsilon);
  }
};
struct LionRule {
  // The step's direction: the sign of momentum and gradient interpolated by beta1 (0 where it is 0 or NaN).
  DION3_HOST_DEVICE static float direction(float m, float g, float beta1) {
    const float c = m + (1.0f - beta1) * (g - m);
    return static_cast<float>((c > 0.0f) - (c < 0.0f));
  }
  DION3_HOST_DEVICE static float exp_avg(float m, float g, float beta2) { return m + (1.0f - beta2) * (g - m); }
  // The weight after the step; decay = 1 - lr * weight_decay.
  DION3_HOST_DEVICE static float weight(float w, float direction, float lr, float decay) {
    return w * decay - lr * direction;
  }
};

// Ops recorded by Backend::record.
class DION3_API Recording {
 public:
  virtual ~Recording() = default;
  // Enqueues the recorded ops on the backend's stream. False, with nothing enqueued, when memory
  // the backend itself lent the ops (its scratch buffers) has moved, or its kernel choices
  // changed, since they were recorded: record them again.
  virtual bool replay() = 0;
};

// A copy of a few bytes of device memory to the host that the caller polls instead of waiting
// for (Backend::new_host_copy).
class DION3_API HostCopy {
 public:
  virtual ~HostCopy() = default;
  // Enqueues the copy of the bytes at src (device memory) on the backend's stream.
  virtual void start(const void* src) = 0;
  // The copied bytes once the last start() has arrived on the host; null until then (or when
  // nothing was started). Never waits.
  virtual const void* ready() = 0;
  // The same, waiting for the last start() to arrive (only for it, not for later work).
  virtual const void* wait() = 0;
};

class DION3_API Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual int device_index() const { return 0; }  // the CUDA ordinal the backend runs on
  virtual Allocator& allocator() = 0;
  virtual void set_stream(void* stream) { (void)stream; }
  // The stream every op is enqueued on (CUDA), null on the CPU: communicators order their
  // collectives on it.
  virtual void* stream() const { return nullptr; }
  // Whether the stream is being captured into a CUDA graph (operations then run only on replay).
  virtual bool capturing() const { return false; }
  // Records the ops `work` enqueues, without running them, for replay as one unit (a CUDA graph
  // on the CUDA backend): a sequence launched op by op costs host time per op, a recording one
  // launch. The ops must touch the same memory on every replay. Null where the backend does not
  // record (the caller then runs `work` itself).
  virtual std::unique_ptr<Recording> record(const std::function<void()>& work) {
    (void)work;
    return nullptr;
  }
  // A named range around the ops enqueued between push and pop, for the device's profiler
  // (NVTX on CUDA); nothing by default.
  virtual void range_push(const char* name) { (void)name; }
  virtual void range_pop() {}

  // Around each step: begin_step() before it writes anything, end_step() after it, failed or
  // not. A backend whose ops take memory as they go reserves it in begin_step, so that running
  // out part way cannot leave the state half updated.
  virtual void begin_step() {}
  virtual void end_step() noexcept {}

  // --- memory --------------------------------------------------------------------------
  virtual void fill_zero(void* ptr, std::size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, std::size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, std::size_t bytes) = 0;
  // The same copy in the stream's order, host_src reusable as soon as it returns, without waiting
  // for the stream to drain (CUDA: through a few pinned staging buffers, so it waits at most for
  // the copy that last used the buffer). Not while the stream is being captured. What a step
  // uploads every time a value changes (hyper-parameters) takes this path, so that an lr
  // schedule does not hold the host until the GPU is idle.
  virtual void upload(void* dst, const void* host_src, std::size_t bytes) { copy_from_host(dst, host_src, bytes); }
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  // `height` rows of `width` bytes from src (rows `src_pitch` bytes apart) to dst (rows
  // `dst_pitch` apart): the block permutations around a collective.
  virtual void copy_2d(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                       std::size_t width, std::size_t height) = 0;
  // Row i (i < rows) of `width` bytes: dst row dst_idx[i] = src row src_idx[i] (null index:
  // i), rows `dst_pitch` / `src_pitch` bytes apart. Compacts the rows a selection spread over
  // padded blocks, and spreads them back.
  virtual void copy_rows(void* dst, std::size_t dst_pitch, const int32_t* dst_idx, const void* src,
                         std::size_t src_pitch, const int32_t* src_idx, std::size_t width, int64_t rows) = 0;
  virtual int read_flag(const int* flag) = 0;  // synchronises
  // A polled copy of `bytes` bytes to the host (pinned memory and an event on CUDA): the verdict
  // of steps that do not wait comes back this way.
  virtual std::unique_ptr<HostCopy> new_host_copy(std::size_t bytes) = 0;
  // Ends a step: counters[0] += 1 when *flag == 0 (the step was applied), else counters[1] += 1
  // if count_dropped and the flag carries no kNotAStep bit (a step some rank refused, or the
  // ranks disagreed on, is not a dropped one). A step that is raised (on_nonfinite == Raise) is not
  // counted: it changes nothing, counters included. Checks OR 1 into the flag, keeping what else
  // it holds.
  virtual void finish_step(const int* flag, int64_t* counters, bool count_dropped) = 0;
  // Settles a distributed step's agreement (comm.hpp): `words` holds `regions` regions of
  // kAgreementWords ints (region 0 first holds the verdict and took-part), all of them reduced
  // over every communicator in turn. ORs kPlansDiffer into the verdict where some region's plan
  // digest words differ between ranks, kHyperDiffer where its hyper-parameter words do.
  virtual void settle_agreement(int* words, int regions) = 0;
  virtual std::unique_ptr<MatrixSet> new_matrix_set() { return std::make_unique<MatrixSet>(); }
  virtual void refresh(MatrixSet& set) { (void)set; }

  // --- step, parameter side ------------------------------------------------------------
  // *flag |= 1 if any element of any view is NaN or Inf.
  virtual void check_finite(std::span<const MatrixView> xs, int* flag) = 0;
  // *flag |= 1 if any gradient element is NaN or Inf, or any state element the step would
  // store (rounded to the state's dtype) would be, or an AdamW second moment would be negative
  // (before rounding, as the update's square root takes it): a finite gradient can still
  // overflow the momentum or a second moment, and such a step must be dropped before anything
  // is written.
  virtual void check_step(std::span<const StepCheck> xs, int* flag) = 0;
  // M = decay*M + grad_scale*G for each matrix; if scores != null, scores[i*rows + r] =
  // sum_j |M_i[r,j]| taken after the update; if row_sumsq != null, row_sumsq[i*rows + r] =
  // sum_j M_i[r,j]^2 (both of the values as stored); if largest != null, largest[i] is raised to
  // the largest |M_i| element stored where that is larger, never lowered (a momentum bound for
  // StepCheck::state_bound: M changes nowhere else).
  virtual void accumulate(const MatrixSet& set, Hyper decay, Hyper grad_scale, float* scores, float* row_sumsq,
                          float* largest, const int* skip) = 0;
  // For each of `count` score vectors of length m: the k rows of largest score, ties to the
  // lower index, written to idx[i*k ...] in ascending row order; with `largest` (may be null),
  // also largest[i] = its largest score plus one (a StepCheck::state_bound, > 0); with row_sumsq
  // (may be null), also selected_sumsq[i] = the sum of row_sumsq[i*m + r] over the selected rows
  // r (gather_normalized's squared norm, summed while the rows are picked).
  virtual void select_rows(const float* scores, int64_t count, int64_t m, int64_t k, int32_t* idx,
                           const int* skip, float* largest, const float* row_sumsq, float* selected_sumsq) = 0;
  // For each of `count` ascending lists in[i*k_in ...]: its entries e with lo <= e < hi, as
  // e - lo, then kPadRow up to k_out entries (out[i*k_out ...]). A shard's part of a selection
  // made on the whole matrix, or a short shard's selection padded to the common row count.
  virtual void remap_rows(const int32_t* in, int64_t count, int64_t k_in, int64_t lo, int64_t hi,
                          int64_t k_out, int32_t* out, const int* skip) = 0;
  // Where the selected rows of `count` matrices lie in a row-sharded exchange buffer: selection
  // i (idx[i*k ...], ascending rows of the whole matrix, shards of c rows) puts its row t, of
  // shard s = idx/c, at slot row ((s*block + first_slot + i)*piece + t - start_s), start_s = the
  // selection's first entry in shard s. out[i*k + t] = that slot row.
  virtual void selection_slots(const int32_t* idx, int64_t count, int64_t k, int64_t c, int64_t piece,
                               int64_t block, int64_t first_slot, int32_t* out, const int* skip) = 0;
  // out[i] (k x cols) = scale_m*M_i[idx_i] + scale_g*G_i[idx_i], then M_i[idx_i] *= decay.
  // idx == null selects all rows in order (k == rows). out is contiguous, any float dtype; with
  // out.data == null only the decay is applied. Padding entries of idx give zero rows.
  // row_sumsq, if not null: [i*k + s] = the sum of squares of out[i]'s row s as stored (rounded
  // to out's dtype), for normalize (spares it a pass over out).
  virtual void gather_rows(const MatrixSet& set, const int32_t* idx, int64_t k, Hyper scale_m,
                           Hyper scale_g, Hyper decay, MatrixView out, float* row_sumsq, const int* skip) = 0;
  // out[i] (k x cols) = M_i[idx_i] * inverse_norm_of(sqrt(selected_sumsq[i]), norm), rounded to out's dtype, then
  // M_i[idx_i] *= decay: the gather and the normalisation of algorithm.md §2 in one pass, with the
  // selected rows' sum of squares select_rows() gave. out is contiguous, any float dtype. Padding
  // entries of idx give zero rows.
  virtual void gather_normalized(const MatrixSet& set, const int32_t* idx, int64_t k, Hyper decay,
                                 const float* selected_sumsq, NormGuard norm, MatrixView out, const int* skip) = 0;
  // Per matrix i with rows idx_i (null = all): optional NorMuon normalisation of O_i with the
  // variance rows idx_i, then W_i *= (1 - lr*wd) on all rows and W_i[idx_i] -= lr' * O_i.
  // Rows of O at padding entries of idx are ignored (neither normalised nor applied). O may be
  // wider than the weights (UpdateParams::o_col_offset); the weights may have no columns at all
  // (a rank without columns of a column-sharded matrix), and the variance still moves.
  virtual void apply_update(const MatrixSet& set, const int32_t* idx, int64_t k, MatrixView O,
                            const UpdateParams& p, const int* skip) = 0;

  // --- orthogonalization primitives (contiguous batches, fp32 accumulation) -------------
  // out[b] = in[b] * inverse_norm_of(||in[b]||_F, norm), rounded to out.dtype; with `transpose`, its transpose (out
  // has in's shape transposed: a tall input is turned wide in the same pass). With row_sumsq
  // (in.batch x in.rows, each row's sum of squares, as gather_rows gives them) ||in[b]||_F comes
  // from those sums.
  virtual void normalize(MatrixView in, MatrixView out, NormGuard norm, const float* row_sumsq, bool transpose) = 0;
  // out = in (or in^T when `transpose`), converting between any float dtypes.
  virtual void convert(MatrixView in, MatrixView out, bool transpose) = 0;
  // C = alpha*op(A)*op(B) + beta*C.
  virtual void gemm(bool trans_a, bool trans_b, float alpha, MatrixView A, MatrixView B,
                    float beta, MatrixView C) = 0;
  // Symmetric p x p results may be kept "banded" where symmetric_banded(dtype, p): the lower
  // triangle and the diagonal blocks of some band width stored, the rest of the upper triangle
  // not (the CUDA kernel then skips most of its mirrored stores). A banded matrix may only be
  // read by sym_product with banded_in (as A, B or D); gemm, convert and the host need full ones.
  virtual bool symmetric_banded(DType dtype, int64_t p) const {
    (void)dtype;
    (void)p;
    return false;
  }
  // C = X*X^T (symmetric; both triangles written, or banded with banded_out).
  virtual void gram(MatrixView X, MatrixView C, bool banded_out) = 0;
  // C = alpha*A*B^T + beta*D + gamma*I from its lower triangle, mirrored, for A and D symmetric and
  // A*B^T symmetric: B symmetric and commuting with A, or B = A*S with S symmetric (then C is
  // A*S*A). D may be null. C must not alias A or B; it may alias D. banded_in: A, B and D are
  // symmetric and may be banded; banded_out: C may be written banded.
  virtual void sym_product(float alpha, MatrixView A, MatrixView B, float beta, const MatrixView* D,
                           float gamma, MatrixView C, bool banded_in, bool banded_out) = 0;
  // C = X + gamma*I (square matrices; C may alias X).
  virtual void add_identity(MatrixView X, float gamma, MatrixView C) = 0;
  // Cost of a symmetric product relative to the full GEMM of the same size (1 = no savings).
  virtual double symmetric_cost_factor() const { return 1.0; }
  // Iteration dtype when the user leaves it open.
  virtual DType default_iteration_dtype(bool gram) const = 0;

  // --- element-wise optimizers ----------------------------------------------------------
  // Parameter ps[i] with hyperparameters hs[i] (ps.size() == hs.size()), all in as few launches
  // as their dtypes allow: a model's many small vectors cost one launch, not one each.
  virtual void adamw(std::span<const ElementwiseParam> ps, std::span<const AdamWParams> hs, const int* skip) = 0;
  virtual void lion(std::span<const ElementwiseParam> ps, std::span<const LionParams> hs, const int* skip) = 0;
};

// The CPU backend (always built). It works on the calling thread's OpenMP threads
// (omp_get_max_threads(): OMP_NUM_THREADS, omp_set_num_threads; in PyTorch, the intra-op threads
// that torch.set_num_threads sets), BLAS single-threaded inside them; results are the same
// whatever the number of threads.
DION3_API std::unique_ptr<Backend> make_cpu_backend();
// The CUDA backend; throws dion3::Error(Unsupported) when built without CUDA.
DION3_API std::unique_ptr<Backend> make_cuda_backend(int device_index = 0, void* stream = nullptr,
                                                     Allocator* allocator = nullptr);
DION3_API bool cuda_available();

}  // namespace dion3

namespace dion3 {

// Owning handle on memory from a backend's allocator (workspace and engine-owned state).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Allocator& alloc, std::size_t bytes) : alloc_(&alloc), bytes_(bytes) {
    ptr_ = bytes ? alloc.allocate(bytes) : nullptr;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept { swap(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    DeviceBuffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_) alloc_->deallocate(ptr_, bytes_);
  }
  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void swap(DeviceBuffer& o) noexcept {
    std::swap(alloc_, o.alloc_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
  }
  Allocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace dion3
