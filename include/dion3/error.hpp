// dion3/error.hpp — the one exception type the library throws.
//
// Messages name the offending parameter or argument, what was expected and what was given,
// e.g. "dion3: parameter 3 'mlp.up.weight' has shape [4096] but dion3 needs a matrix; ...".
#pragma once

#include <stdexcept>
#include <string>

#include "dion3/export.h"

namespace dion3 {

enum class Status : int {
  Ok = 0,
  InvalidArgument = 1,   // bad hyper-parameter, shape, dtype or state
  NonFinite = 2,         // a gradient held NaN or Inf, or the state would overflow, under Raise
  Unsupported = 3,       // a valid request this build cannot serve (e.g. no CUDA)
  Internal = 4,          // a backend failure (BLAS, CUDA, allocation)
};

class DION3_API Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message)
      : std::runtime_error("dion3: " + message), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

[[noreturn]] inline void fail(const std::string& message, Status status = Status::InvalidArgument) {
  throw Error(status, message);
}

}  // namespace dion3
