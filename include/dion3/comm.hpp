// dion3/comm.hpp — the narrow communicator the distributed layouts (algorithm.md §3) run on.
//
// Megabatched Dion3 needs three collectives over contiguous buffers in the backend's memory:
// all-gather (replicated/DDP layout: every rank orthogonalizes a slice of the batch and gets the
// others' results back; global-scope scores), all-to-all (row-sharded/FSDP2 layout: selected
// rows travel to their matrix's owner rank and back) and an all-reduce-max of a few ints (every
// rank takes the same skip/raise decision on a non-finite gradient, the ranks' plans and
// hyper-parameters are compared, and a rank's refusal reaches the others: the step's agreement,
// below).
//
// Collectives are asynchronous: a call starts one after the work already enqueued on `stream`
// (CUDA; null on the CPU) and returns a request; wait() orders its completion before the work
// enqueued afterwards — a stream wait on CUDA (no host synchronisation), a blocking wait on the
// CPU. Every rank must start the same collectives in the same order. `label` names the
// collective and the megabatch; failures and timeouts are raised as dion3::Error carrying it.
//
// Implementations: loopback (one rank; unit tests, world size 1), MPI (native trainers on CPUs,
// when built with MPI), NCCL (native trainers on GPUs, CUDA builds) and, in the PyTorch binding,
// torch.distributed process groups (NCCL or gloo: the user's own group).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dion3/export.h"
#include "dion3/view.hpp"

namespace dion3 {

// A step's agreement, its first collectives: one region of kAgreementWords ints per communicator
// of the optimizer, {verdict, took part, digest, complement} (verdict and took part are the first
// region's), padded with empty regions to kAgreementRegions so that it has one length on every
// rank, the whole buffer all-reduced (max) over every communicator in turn. Verdict: 0, 1
// for a non-finite gradient, kRankWithoutGradients from a rank that runs the step's collectives
// without gradients of its own (Optimizer::refuse_step), kRankRefused from one that runs them
// because a setting is invalid there (Optimizer::refuse_invalid); took part: 1 from a rank that
// steps, 0 from one that refuses. A region's digest is the rank's plan over that communicator
// (its megabatches, their groups' plan settings, every parameter's algorithm) and the
// hyper-parameters those read, in 16-bit words, the complement 0xFFFF minus each: after the
// maximum, a word and its complement sum to 0xFFFF exactly when every rank had the same word
// (kPlansDiffer, kHyperDiffer: backend.hpp).
// Reducing every region over every communicator carries a difference found in one communicator to
// the ranks of the others too (on a mesh of several dimensions each rank ends with the maximum over
// all ranks), so all of them drop the step. The check so rides on collectives every step makes
// anyway, and a rank that planned anew pairs with ranks that did not.

class DION3_API CommRequest {
 public:
  virtual ~CommRequest() = default;
  // Completion ordered before later work on the stream the collective was started on. Throws
  // dion3::Error (Status::Internal) naming the collective on failure or timeout.
  virtual void wait() = 0;
};

class DION3_API Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where the buffers handed to the collectives live.
  virtual Device device() const = 0;
  // recv holds size() blocks of block_bytes; block r comes from rank r's send. send may be this
  // rank's own block of recv (in place).
  virtual std::unique_ptr<CommRequest> all_gather(const void* send, void* recv, std::size_t block_bytes,
                                                  void* stream, const std::string& label) = 0;
  // send and recv hold size() blocks of block_bytes: block r of send goes to rank r, block r of
  // recv comes from rank r. send and recv must not overlap.
  virtual std::unique_ptr<CommRequest> all_to_all(const void* send, void* recv, std::size_t block_bytes,
                                                  void* stream, const std::string& label) = 0;
  // data[i] = max over ranks of data[i], in place.
  virtual std::unique_ptr<CommRequest> all_reduce_max(int32_t* data, std::size_t count, void* stream,
                                                      const std::string& label) = 0;
  // Short description for messages ("MPI, 4 ranks").
  virtual std::string describe() const = 0;
  // Returns once every collective started so far has finished, or raises naming the oldest that
  // did not within the communicator's timeout. Optimizer::step calls it before it reads the step's
  // verdict, so a rank that never joins a stream-ordered collective surfaces as an error instead
  // of a hang. Communicators whose wait() blocks (MPI, gloo) have nothing left to do here.
  virtual void settle() {}
};

// One rank talking to itself: collectives are copies. device: where its buffers live (CPU, or
// CUDA with stream-ordered copies in CUDA builds).
DION3_API std::shared_ptr<Communicator> make_loopback_communicator(Device device = Device::CPU);

// MPI (CPU buffers) over a duplicate of `mpi_comm`, a pointer to an MPI_Comm (MPI_COMM_WORLD if
// null). MPI must be initialised. Throws Status::Unsupported in builds without MPI.
// timeout_seconds: how long wait() lets a collective run before it raises (0 = no limit). A
// timed-out collective cannot be cancelled (a late rank may still complete it, writing into its
// buffers): every later collective of the communicator raises, and the job should end.
DION3_API std::shared_ptr<Communicator> make_mpi_communicator(const void* mpi_comm = nullptr, double timeout_seconds = 600.0);
DION3_API bool mpi_built();

// NCCL (CUDA buffers) over an initialised ncclComm_t (not owned) whose rank uses `device`.
// Collectives run on a stream of the communicator's own, ordered after and before the caller's
// stream with events. A collective unfinished after timeout_seconds at settle() aborts the
// ncclComm_t (ncclCommAbort frees it: do not destroy it afterwards) and raises; every later
// collective then raises too. Throws Status::Unsupported in builds without NCCL.
DION3_API std::shared_ptr<Communicator> make_nccl_communicator(void* nccl_comm, int device, double timeout_seconds = 600.0);

}  // namespace dion3
