// src/capi/dion3_c.cpp — the C API (include/dion3/dion3.h) over dion3::Optimizer.
//
// Every entry point runs its body inside guard(): C++ exceptions become a dion3_status plus a
// thread-local message, so nothing throws across the C boundary. Exported state travels in the
// binary format of dion3/state_format.hpp, parsed and checked completely before the engine's
// import_state() is called.
#include "dion3/dion3.h"
#include "dion3/comm.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

// The build passes the version read from the VERSION file, its one home.
#ifndef DION3_VERSION_STRING
#error "DION3_VERSION_STRING is not defined: build with CMake (it reads the VERSION file)"
#endif
#include <vector>

#include "core/c_config.hpp"
#include "dion3/config.hpp"
#include "dion3/error.hpp"
#include "dion3/optimizer.hpp"
#include "dion3/state_format.hpp"

struct dion3_optimizer {
  dion3::Optimizer engine;
  explicit dion3_optimizer(std::unique_ptr<dion3::Backend> backend, dion3::OptimizerOptions o)
      : engine(std::move(backend), o) {}
};

struct dion3_comm {
  std::shared_ptr<dion3::Communicator> comm;
};

namespace {

// A fixed buffer, trivially destructible: a thread's first error then needs no allocation (a
// thread_local std::string registers a destructor, which fails when memory is out).
thread_local char g_last_error[8192];

dion3_status set_error(dion3_status s, const char* prefix, const char* message) noexcept {
  const int n = std::snprintf(g_last_error, sizeof g_last_error, "%s%s", prefix, message);
  if (n >= static_cast<int>(sizeof g_last_error)) std::memcpy(g_last_error + sizeof g_last_error - 4, "...", 4);
  return s;
}

template <class F>
dion3_status guard(F&& body) noexcept {
  try {
    body();
    return DION3_OK;
  } catch (const dion3::Error& e) {
    return set_error(static_cast<dion3_status>(static_cast<int>(e.status())), "", e.what());
  } catch (const std::bad_alloc&) {
    return set_error(DION3_INTERNAL, "", "dion3: out of memory");
  } catch (const std::exception& e) {
    return set_error(DION3_INTERNAL, "dion3: internal error: ", e.what());
  } catch (...) {
    return set_error(DION3_INTERNAL, "", "dion3: internal error: unknown exception");
  }
}

using dion3::capi::require;
using dion3::capi::to_enum;

template <class T>
T* checked(T* p, const char* what) {
  require(p != nullptr, std::string(what) + " is NULL");
  return p;
}

dion3::TensorView to_view(const dion3_tensor* t, const std::string& what) {
  require(t != nullptr, what + " is NULL");
  require(t->ndim >= 0 && t->ndim <= DION3_MAX_DIMS,
          what + ": ndim " + std::to_string(t->ndim) + " is outside 0..8");
  dion3::TensorView v;
  v.data = t->data;
  v.dtype = dion3::capi::dtype_from_c(t->dtype, what);
  v.device = to_enum<dion3::Device>(t->device, DION3_DEVICE_CPU, DION3_DEVICE_CUDA, what + ": device");
  v.device_index = t->device_index;
  v.shape.assign(t->shape, t->shape + t->ndim);
  for (int64_t d : v.shape)
    require(d >= 0, what + ": negative dimension in shape " + dion3::shape_string(v.shape));
  require(v.data != nullptr || v.numel() == 0, what + ": data is NULL");
  return v;
}

void check_group(const dion3::Optimizer& e, int group) {
  require(group >= 0 && group < e.num_groups(), "group index " + std::to_string(group) +
                                                     " is out of range (the optimizer has " +
                                                     std::to_string(e.num_groups()) + " groups)");
}

void check_param(const dion3::Optimizer& e, int param) {
  require(param >= 0 && param < e.num_params(), "parameter index " + std::to_string(param) +
                                                     " is out of range (the optimizer has " +
                                                     std::to_string(e.num_params()) + " parameters)");
}

}  // namespace

// ============================================================================================

extern "C" {

const char* dion3_last_error(void) { return g_last_error; }

int dion3_api_version(void) { return DION3_C_API_VERSION; }

const char* dion3_version(void) { return DION3_VERSION_STRING; }

int dion3_cuda_available(void) {
  try {
    return dion3::cuda_available() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

const char* dion3_status_name(int status) {
  switch (status) {
    case DION3_OK: return "ok";
    case DION3_INVALID_ARGUMENT: return "invalid argument";
    case DION3_NON_FINITE: return "non-finite gradient or state";
    case DION3_UNSUPPORTED: return "unsupported";
    case DION3_INTERNAL: return "internal error";
    default: return "unknown status";
  }
}

void dion3_options_default(dion3_options* options) {
  if (!options) return;
  const dion3::OptimizerOptions o;  // the C++ defaults are the single source of truth
  std::memset(options, 0, sizeof *options);
  options->on_nonfinite = static_cast<int32_t>(o.on_nonfinite);
  options->megabatch = o.megabatch;
  options->record = o.record_orthogonalizer;
  options->agree_on_names = o.agree_on_names;
  options->workspace_limit = o.workspace_limit;
}

dion3_status dion3_create_with_options(dion3_optimizer** out, int device, int device_index, void* cuda_stream,
                                       const dion3_options* options) {
  return guard([&] {
    checked(out, "dion3_create: out");
    *out = nullptr;
    dion3_options c;
    dion3_options_default(&c);
    if (options) c = *options;
    auto dev = to_enum<dion3::Device>(device, DION3_DEVICE_CPU, DION3_DEVICE_CUDA, "dion3_create: device");
    dion3::OptimizerOptions o;
    o.on_nonfinite = to_enum<dion3::NonFinitePolicy>(c.on_nonfinite, 0, 1, "dion3_create: on_nonfinite");
    require(c.megabatch == 0 || c.megabatch == 1, "dion3_create: options.megabatch is " +
                                                      std::to_string(c.megabatch) + ", expected 0 or 1");
    require(c.record == 0 || c.record == 1,
            "dion3_create: options.record is " + std::to_string(c.record) + ", expected 0 or 1");
    require(c.agree_on_names == 0 || c.agree_on_names == 1, "dion3_create: options.agree_on_names is " +
                                                                std::to_string(c.agree_on_names) + ", expected 0 or 1");
    o.megabatch = c.megabatch != 0;
    o.record_orthogonalizer = c.record != 0;
    o.agree_on_names = c.agree_on_names != 0;
    o.workspace_limit = static_cast<std::size_t>(c.workspace_limit);
    std::unique_ptr<dion3::Backend> backend =
        dev == dion3::Device::CPU ? dion3::make_cpu_backend()
                                  : dion3::make_cuda_backend(device_index, cuda_stream, nullptr);
    *out = new dion3_optimizer(std::move(backend), o);
  });
}

dion3_status dion3_create(dion3_optimizer** out, int device, int device_index, void* cuda_stream,
                          int on_nonfinite) {
  dion3_options o;
  dion3_options_default(&o);
  o.on_nonfinite = on_nonfinite;
  return dion3_create_with_options(out, device, device_index, cuda_stream, &o);
}

void dion3_destroy(dion3_optimizer* opt) {
  try {
    delete opt;
  } catch (...) {
    // A destructor that throws has nowhere to report to; swallow rather than terminate.
  }
}

dion3_status dion3_set_stream(dion3_optimizer* opt, void* cuda_stream) {
  return guard([&] { checked(opt, "optimizer")->engine.backend().set_stream(cuda_stream); });
}

dion3_status dion3_add_group(dion3_optimizer* opt, const dion3_group_config* cfg, int* group_index) {
  return guard([&] {
    checked(opt, "optimizer");
    int g = opt->engine.add_group(dion3::capi::config_from_c(*checked(cfg, "group config")));
    if (group_index) *group_index = g;
  });
}

dion3_status dion3_get_group_config(const dion3_optimizer* opt, int group, dion3_group_config* out) {
  return guard([&] {
    checked(opt, "optimizer");
    checked(out, "out");
    check_group(opt->engine, group);
    dion3_group_config tmp;
    dion3::capi::config_to_c(opt->engine.group(group), &tmp);
    *out = tmp;
  });
}

dion3_status dion3_set_group_config(dion3_optimizer* opt, int group, const dion3_group_config* cfg) {
  return guard([&] {
    checked(opt, "optimizer");
    check_group(opt->engine, group);
    opt->engine.set_group(group, dion3::capi::config_from_c(*checked(cfg, "group config")));
  });
}

dion3_status dion3_set_lr(dion3_optimizer* opt, int group, double lr) {
  return guard([&] {
    checked(opt, "optimizer");
    check_group(opt->engine, group);
    dion3::GroupConfig g = opt->engine.group(group);
    g.lr = lr;
    opt->engine.set_group(group, g);
  });
}

dion3_status dion3_add_param(dion3_optimizer* opt, int group, const char* name,
                             const dion3_tensor* weight, const dion3_tensor* grad, int* param_index) {
  return dion3_add_param_layout(opt, group, name, weight, grad, nullptr, param_index);
}

dion3_status dion3_add_param_layout(dion3_optimizer* opt, int group, const char* name,
                                    const dion3_tensor* weight, const dion3_tensor* grad,
                                    const dion3_layout* layout, int* param_index) {
  return guard([&] {
    checked(opt, "optimizer");
    checked(name, "parameter name");
    check_group(opt->engine, group);
    std::string n(name);
    dion3::ParamSpec spec;
    spec.name = n;
    spec.weight = to_view(weight, "parameter '" + n + "': weight");
    if (grad) spec.grad = to_view(grad, "parameter '" + n + "': grad");  // else bound later
    if (layout) {
      spec.layout.kind = to_enum<dion3::Layout>(layout->kind, 0, 4, "parameter '" + n + "': layout kind");
      if (layout->col_comm) spec.layout.col_comm = layout->col_comm->comm;
      spec.layout.global_rows = layout->global_rows;
      spec.layout.global_cols = layout->global_cols;
      if (layout->comm) spec.layout.comm = layout->comm->comm;
      require(layout->row_chunk >= 0, "parameter '" + n + "': layout row_chunk is " +
                                          std::to_string(layout->row_chunk) + ", expected >= 0");
      // As the C++ ParamLayout: an offset without a chunk is no cut, not the standard one.
      require(layout->row_chunk > 0 || layout->row_offset == 0,
              "parameter '" + n + "': layout row_offset is " + std::to_string(layout->row_offset) +
                  " but row_chunk is 0 (the standard cut, which takes no offset); give the largest shard's "
                  "rows in row_chunk");
      if (layout->row_chunk > 0) {  // a row cut of its own
        require(layout->kind == DION3_LAYOUT_ROW_SHARD,
                "parameter '" + n + "': row_offset / row_chunk describe a ROW_SHARD cut; this layout is " +
                    dion3::layout_name(spec.layout.kind));
        require(layout->row_offset >= 0 && layout->row_offset <= layout->global_rows,
                "parameter '" + n + "': layout row_offset is " + std::to_string(layout->row_offset) +
                    ", expected 0.." + std::to_string(layout->global_rows));
        spec.layout.row_offset = layout->row_offset;
        spec.layout.row_chunk = layout->row_chunk;
      }
    }
    int p = opt->engine.add_param(group, spec);
    if (param_index) *param_index = p;
  });
}

dion3_status dion3_comm_create_mpi(dion3_comm** out, const void* mpi_comm, double timeout_seconds) {
  return guard([&] {
    checked(out, "out");
    *out = nullptr;
    require(timeout_seconds >= 0, "timeout_seconds must be >= 0");
    *out = new dion3_comm{dion3::make_mpi_communicator(mpi_comm, timeout_seconds)};
  });
}

dion3_status dion3_comm_create_nccl(dion3_comm** out, void* nccl_comm, int device) {
  return guard([&] {
    checked(out, "out");
    *out = nullptr;
    *out = new dion3_comm{dion3::make_nccl_communicator(nccl_comm, device)};
  });
}

void dion3_comm_destroy(dion3_comm* comm) { delete comm; }

dion3_status dion3_comm_rank(const dion3_comm* comm, int* rank, int* size) {
  return guard([&] {
    checked(comm, "communicator");
    if (rank) *rank = comm->comm->rank();
    if (size) *size = comm->comm->size();
  });
}

dion3_status dion3_set_grad(dion3_optimizer* opt, int param, const dion3_tensor* grad) {
  return guard([&] {
    checked(opt, "optimizer");
    check_param(opt->engine, param);
    if (grad == nullptr) opt->engine.clear_grad(param);
    else opt->engine.set_grad(param, to_view(grad, "parameter '" + opt->engine.param_name(param) + "': grad"));
  });
}

dion3_status dion3_num_params(const dion3_optimizer* opt, int* count) {
  return guard([&] { *checked(count, "count") = checked(opt, "optimizer")->engine.num_params(); });
}

dion3_status dion3_step(dion3_optimizer* opt, int* applied) {
  if (applied) *applied = 0;
  return guard([&] {
    bool ok = checked(opt, "optimizer")->engine.step();
    if (applied) *applied = ok ? 1 : 0;
  });
}

dion3_status dion3_refuse_step(dion3_optimizer* opt) {
  return guard([&] { checked(opt, "optimizer")->engine.refuse_step(); });
}

dion3_status dion3_refuse_invalid(dion3_optimizer* opt) {
  return guard([&] { checked(opt, "optimizer")->engine.refuse_invalid(); });
}

dion3_status dion3_step_async(dion3_optimizer* opt) {
  return guard([&] { checked(opt, "optimizer")->engine.step_async(); });
}

dion3_status dion3_posted_steps(const dion3_optimizer* opt, int64_t* taken, int64_t* skipped, int* ready) {
  return guard([&] {
    checked(opt, "optimizer");
    checked(ready, "ready");
    int64_t c[2];
    *ready = opt->engine.posted_counters(c) ? 1 : 0;
    if (!*ready) return;
    if (taken) *taken = c[0];
    if (skipped) *skipped = c[1];
  });
}

dion3_status dion3_refresh_hyperparameters(dion3_optimizer* opt) {
  return guard([&] { checked(opt, "optimizer")->engine.refresh_hyperparameters(); });
}

dion3_status dion3_plan_generation(const dion3_optimizer* opt, uint64_t* generation) {
  return guard([&] { *checked(generation, "generation") = checked(opt, "optimizer")->engine.plan_generation(); });
}

dion3_status dion3_steps(const dion3_optimizer* opt, int64_t* taken, int64_t* skipped) {
  return guard([&] {
    checked(opt, "optimizer");
    if (taken) *taken = opt->engine.steps_taken();
    if (skipped) *skipped = opt->engine.steps_skipped();
  });
}

dion3_status dion3_plan(dion3_optimizer* opt, dion3_megabatch_info* out, size_t capacity,
                        size_t* count) {
  return guard([&] {
    checked(opt, "optimizer");
    checked(count, "count");
    require(out != nullptr || capacity == 0, "out is NULL but capacity is " + std::to_string(capacity));
    std::vector<dion3::MegabatchInfo> plan = opt->engine.plan();
    for (size_t i = 0; i < plan.size() && i < capacity; ++i) {
      const auto& m = plan[i];
      dion3_megabatch_info& o = out[i];
      o.group = m.group;
      o.algorithm = static_cast<int32_t>(m.algorithm);
      o.rows = m.rows;
      o.cols = m.cols;
      o.dtype = static_cast<int32_t>(m.dtype);
      o.count = m.count;
      o.selected_rows = m.selected_rows;
      o.method = static_cast<int32_t>(m.method);
      o.iteration_dtype = static_cast<int32_t>(m.iteration_dtype);
      o.workspace_bytes = m.workspace_bytes;
      o.columns = m.columns ? 1 : 0;
    }
    *count = plan.size();
  });
}

dion3_status dion3_state_size(const dion3_optimizer* opt, size_t* bytes) {
  return guard([&] {
    checked(opt, "optimizer");
    checked(bytes, "bytes");
    size_t total = 0;
    for (int p = 0; p < opt->engine.num_params(); ++p)
      for (const auto& [name, view] : opt->engine.state_views(p)) total += view.bytes();
    *bytes = total;
  });
}

dion3_status dion3_export_size(const dion3_optimizer* opt, size_t* bytes) {
  return guard([&] {
    checked(opt, "optimizer");
    checked(bytes, "bytes");
    *bytes = dion3::serialize_state(opt->engine.export_state(), nullptr);
  });
}

dion3_status dion3_export_state(const dion3_optimizer* opt, void* buf, size_t capacity,
                                size_t* written) {
  return guard([&] {
    checked(opt, "optimizer");
    dion3::OptimizerState st = opt->engine.export_state();
    size_t need = dion3::serialize_state(st, nullptr);
    require(buf != nullptr, "buffer is NULL");
    require(capacity >= need, "buffer holds " + std::to_string(capacity) + " bytes but the state needs " +
                                  std::to_string(need) + " (see dion3_export_size)");
    dion3::serialize_state(st, static_cast<unsigned char*>(buf));
    if (written) *written = need;
  });
}

dion3_status dion3_import_state(dion3_optimizer* opt, const void* buf, size_t size) {
  return guard([&] {
    checked(opt, "optimizer");
    checked(buf, "buffer");
    dion3::OptimizerState st = dion3::parse_state(static_cast<const unsigned char*>(buf), size);
    opt->engine.import_state(st);  // checks names, dtypes and shapes before copying
  });
}

}  // extern "C"
