// core/format.hpp — numbers in error messages, formatted without iostreams: no locale facets
// are touched (the PyTorch extension on the H200 image crashed inside ostream's locale code).
#pragma once

#include <cstdio>
#include <string>

namespace dion3 {

inline std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace dion3
