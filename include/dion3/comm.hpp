// dion3/comm.hpp — the narrow communicator the distributed layouts (SPEC §3) will use.
//
// Megabatched Dion3 needs exactly two collectives over contiguous device buffers: an
// all-gather (replicated/DDP layout: every rank orthogonalizes a slice of the batch) and an
// all-to-all (row-sharded/FSDP2 layout: selected rows travel to the matrix's owner rank and
// back). Implementations: the in-process loopback below (a single rank, for unit tests and
// single-device runs); c10d and raw NCCL arrive with the distributed-layout issue.
#pragma once

#include <cstddef>
#include <memory>

namespace dion3 {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // recv holds size() blocks of `block_bytes`; block r comes from rank r's `send`.
  virtual void all_gather(const void* send, void* recv, std::size_t block_bytes) = 0;
  // send and recv hold size() blocks of `block_bytes`; block r of send goes to rank r, and
  // block r of recv comes from rank r.
  virtual void all_to_all(const void* send, void* recv, std::size_t block_bytes) = 0;
};

// One rank talking to itself: collectives are copies (host memory).
std::unique_ptr<Communicator> make_loopback_communicator();

}  // namespace dion3
