// c_config.hpp — the one converter between the C API's dion3_group_config and GroupConfig. The C
// API and the Python extension (which fills the C struct from its dict) both go through it, so a
// setting is range-checked and mapped in one place before GroupConfig::validate.
#pragma once

#include <cstdint>
#include <string>

#include "dion3/config.hpp"
#include "dion3/dion3.h"
#include "dion3/error.hpp"

namespace dion3::capi {

// Throws InvalidArgument with `message` unless ok (the C API's argument checks).
inline void require(bool ok, const std::string& message) {
  if (!ok) fail(message);
}

// An int32_t field of a C struct as the enum E, checked against [lo, hi].
template <class E>
E to_enum(int32_t v, int32_t lo, int32_t hi, const std::string& what) {
  require(v >= lo && v <= hi, what + " is " + std::to_string(v) + ", expected " +
                                  std::to_string(lo) + ".." + std::to_string(hi));
  return static_cast<E>(v);
}

// A dion3_dtype value as a DType; throws InvalidArgument naming `what` when out of range.
DType dtype_from_c(int32_t v, const std::string& what);
// The group configuration a C struct describes (ranges and array lengths checked here; the
// settings' own rules by GroupConfig::validate, called by the optimizer).
GroupConfig config_from_c(const dion3_group_config& c);
// Every field of *c from g; throws where g holds more steps, restarts or blocks than the struct.
void config_to_c(const GroupConfig& g, dion3_group_config* c);

}  // namespace dion3::capi
