// core/format.hpp — numbers in error messages, formatted without iostreams: no locale facets
// are touched (the PyTorch extension on the H200 image crashed inside ostream's locale code).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace dion3 {

// 6 significant digits, or 9 where 6 do not read back as v (as a float where v is one): a value
// just past a bound is not printed as the bound itself.
inline std::string format_number(double v) {
  const bool is_float = static_cast<double>(static_cast<float>(v)) == v;
  char buf[40];
  for (int digits : {6, 9}) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
    if (is_float ? std::strtof(buf, nullptr) == static_cast<float>(v) : std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

}  // namespace dion3
