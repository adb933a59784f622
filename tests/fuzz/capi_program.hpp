// tests/fuzz/capi_program.hpp — the byte language of the C API fuzzer (fuzz_capi.cpp), shared
// with the seed generator (make_seeds.cpp), which writes programs in it.
//
// A program is: device (int_field 0..0), on_nonfinite (int_field 0..1) for the optimizer it
// starts with, then operations until the input ends. Each operation is one byte (op % kOpCount)
// followed by its arguments, read in the order listed below (fuzz_input.hpp says how one value
// is read). A tensor is:
//   ndim (int_field 0..4), min(max(ndim, 0), 8) dims (dim, 0..6 typical), dtype (int_field 0..2),
//   device (int_field 0..0), data mode (pick kDataModes), [buffer index byte when kDataAlias],
//   fill kind (pick kFillKinds), fill seed (byte).
#pragma once

#include <cstdint>

namespace fuzz {

enum Op : uint8_t {
  kCreate,          // device, on_nonfinite, out_is_null (flag): replaces the optimizer
  kAddGroup,        // config_is_null (flag), config edits, index_is_null (flag)
  kSetGroupConfig,  // group (int_field 0..7), config_is_null (flag), from_current (flag), config edits
  kSetLr,           // group (int_field 0..7), lr (real)
  kAddParam,        // group (int_field 0..7), name (pick kNames), weight tensor, grad, layout, index_is_null (flag)
  kSetGrad,         // param (int_field 0..7), grad
  kFill,            // buffer (byte % buffers), fill kind (pick kFillKinds), fill seed (byte)
  kStep,            // applied_is_null (flag)
  kExportImport,    // export mode (pick 4), import mode (pick 3)
  kImportMutated,   // mutations (byte % 8) x {offset (u16), value (byte)}, fix_hash (flag)
  kImportRaw,       // bytes (u16 length, at most 4096), buffer_is_null (flag)
  kPlan,            // capacity mode (pick 4), count_is_null (flag)
  kGetGroupConfig,  // group (int_field 0..7), out_is_null (flag)
  kQueries,         // (none): counts, steps, sizes, each with NULL outputs too
  kDestroy,         // (none): later calls get a NULL optimizer
  kMisc,            // status (int_field 0..4), timeout (real): names, version, NULL communicators
  kOpCount
};

// Config edits: count (byte % kMaxEdits), then per edit a field (pick kConfigFields) and its value.
enum ConfigField : uint8_t {
  kAlgorithm,        // int_field 0..5
  kLr,               // real (the next seven too)
  kFraction,
  kMu,
  kMuonBeta2,
  kBeta0,
  kBeta1,
  kWeightDecay,
  kEpsilon,
  kAdjustLr,         // int_field 0..2
  kFlatten,          // int_field 0..1 (the next three too)
  kNesterov,
  kCautiousWd,
  kScaleLrByFraction,
  kMomentumDtype,    // int_field -1..2
  kOrthMethod,       // int_field 0..2
  kOrthCoefficients, // int_field 0..2
  kOrthNumCustom,    // int_field 1..16
  kOrthCustom,       // step (pick 16), coefficient (pick 3), real
  kOrthNumRestarts,  // int_field 0..4
  kOrthRestart,      // slot (pick 16), int_field 0..6
  kOrthIterDtype,    // int_field -1..2
  kSelectionScope,   // int_field 0..1
  kTransposed,       // int_field 0..1
  kConfigFields
};
inline constexpr unsigned kMaxEdits = 6;

// Where a tensor's data points.
enum DataMode : uint8_t { kDataOwn, kDataNull, kDataAlias /* an earlier buffer, when it is large enough */, kDataModes };

// A gradient: kGradSpec reads a tensor of its own; the others reuse the weight's description.
enum GradMode : uint8_t {
  kGradNull,        // no gradient (bound later with set_grad)
  kGradOwn,         // a buffer of its own, the weight's shape and dtype
  kGradSpec,        // a tensor read from the input (shape or dtype may differ)
  kGradIsWeight,    // the weight's own buffer
  kGradAlias,       // buffer (byte % buffers), when it is large enough
  kGradModes
};

// Layout of kAddParam: dion3_add_param, dion3_add_param_layout with NULL, or with a struct of
// kind (int_field 0..4), global_rows and global_cols (dims); communicators are always NULL.
enum LayoutMode : uint8_t { kLayoutNone, kLayoutNull, kLayoutStruct, kLayoutModes };

enum FillKind : uint8_t {
  kFillZero,
  kFillNoise,      // [-1, 1)
  kFillLarge,      // noise * 1e3
  kFillNaN,        // noise, one NaN
  kFillInf,        // noise, one +Inf
  kFillHuge,       // +-3e38: sums overflow fp32
  kFillTiny,       // noise * 1e-40 (fp32 subnormals)
  kFillVeryLarge,  // noise * 1e20
  kFillKinds
};

// Names: NULL, "", four short ones (that collide on purpose), a long one, one with odd bytes.
inline constexpr unsigned kNames = 8;

}  // namespace fuzz
