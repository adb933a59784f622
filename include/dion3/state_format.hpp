// dion3/state_format.hpp — optimizer state as one self-describing byte buffer (for checkpoints
// of native trainers and the C API): magic "DION3ST", format version, step counters, then per
// parameter its name, step and tensors (name, dtype, shape, bytes), and an FNV-1a hash of all
// of it. parse_state() checks everything (hash, bounds, the reserved field, shapes against byte
// counts, trailing bytes) and throws dion3::Error naming what is wrong; Optimizer::import_state()
// then checks the result against the optimizer's own parameters, and its values and counters.
#pragma once

#include <cstddef>

#include "dion3/export.h"
#include "dion3/optimizer.hpp"

namespace dion3 {

// Writes the buffer to `out` and returns its size; with out == nullptr only the size.
DION3_API std::size_t serialize_state(const OptimizerState& state, unsigned char* out);
DION3_API OptimizerState parse_state(const unsigned char* buffer, std::size_t size);

}  // namespace dion3
