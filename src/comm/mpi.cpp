// mpi.cpp — the MPI Communicator (CPU buffers), for native trainers on CPUs: non-blocking
// MPI_Iallgather / MPI_Ialltoall / MPI_Iallreduce on a duplicate of the caller's communicator,
// waited with a deadline so that a rank that never joins surfaces as an error naming the
// collective instead of a hang. Built when CMake finds MPI (DION3_HAVE_MPI); otherwise the
// factory says so.
#include "core/format.hpp"
#include "dion3/comm.hpp"
#include "dion3/error.hpp"

#ifdef DION3_HAVE_MPI
#include <mpi.h>

#include <chrono>
#include <climits>
#include <memory>
#include <string>
#include <thread>

namespace dion3 {
namespace {

void check_mpi(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail(what + ": MPI error: " + std::string(text, static_cast<std::size_t>(len)), Status::Internal);
}

int checked_count(std::size_t bytes, const std::string& label) {
  if (bytes > static_cast<std::size_t>(INT_MAX))
    fail(label + ": a block of " + std::to_string(bytes) + " bytes exceeds MPI's int count; lower "
         "workspace_limit or shard over more ranks", Status::Unsupported);
  return static_cast<int>(bytes);
}

class MpiRequest final : public CommRequest {
 public:
  MpiRequest(MPI_Request req, std::string label, double timeout, std::shared_ptr<std::string> broken)
      : req_(req), label_(std::move(label)), timeout_(timeout), broken_(std::move(broken)) {}
  ~MpiRequest() override {
    // A request dropped without wait() (an exception unwound the step) must still complete
    // before its buffers are reused; once a collective timed out, waiting could last forever
    // (the job should end, see make_mpi_communicator): the request is left.
    if (req_ != MPI_REQUEST_NULL && broken_->empty()) MPI_Wait(&req_, MPI_STATUS_IGNORE);
  }
  void wait() override {
    if (req_ == MPI_REQUEST_NULL) return;
    if (timeout_ <= 0) {
      check_mpi(MPI_Wait(&req_, MPI_STATUS_IGNORE), label_);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      int done = 0;
      check_mpi(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), label_);
      if (done) return;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_) {
        // The request cannot be cancelled portably (collectives); forget it so the destructor
        // does not wait forever, and refuse the communicator's later collectives: they would
        // pair with this one on the ranks that are late.
        req_ = MPI_REQUEST_NULL;
        *broken_ = label_;
        fail(label_ + ": timed out after " + format_number(timeout_) +
                 " s (another rank did not join this collective; the collective stays in flight: end the job)",
             Status::Internal);
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  MPI_Request req_;
  std::string label_;
  double timeout_;
  std::shared_ptr<std::string> broken_;  // the communicator's
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, double timeout) : timeout_(timeout) {
    int init = 0, finalized = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&finalized);
    if (!init || finalized)
      fail(std::string("make_mpi_communicator: MPI is ") + (finalized ? "finalised" : "not initialised (call MPI_Init first)"));
    if (comm == MPI_COMM_NULL) fail("make_mpi_communicator: the communicator is MPI_COMM_NULL");
    // Errors come back as return codes, raised as dion3::Error, rather than ending the job.
    MPI_Errhandler previous;
    MPI_Comm_get_errhandler(comm, &previous);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    const int rc = MPI_Comm_dup(comm, &comm_);
    MPI_Comm_set_errhandler(comm, previous);
    MPI_Errhandler_free(&previous);
    check_mpi(rc, "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    // After a timeout a collective is still in flight on comm_: freeing it under that collective
    // crashes MPI later (the job is ending anyway), so a broken communicator is left to MPI.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && broken_->empty()) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::CPU; }
  std::string describe() const override { return "MPI, " + std::to_string(size_) + " ranks"; }

  std::unique_ptr<CommRequest> all_gather(const void* send, void* recv, std::size_t bytes, void*,
                                          const std::string& label) override {
    usable(label);
    const int n = checked_count(bytes, label);
    MPI_Request r;
    // In place when send is this rank's block of recv (MPI forbids overlapping buffers otherwise).
    const bool in_place = send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    check_mpi(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r), label);
    return std::make_unique<MpiRequest>(r, label, timeout_, broken_);
  }
  std::unique_ptr<CommRequest> all_to_all(const void* send, void* recv, std::size_t bytes, void*,
                                          const std::string& label) override {
    usable(label);
    const int n = checked_count(bytes, label);
    MPI_Request r;
    check_mpi(MPI_Ialltoall(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r), label);
    return std::make_unique<MpiRequest>(r, label, timeout_, broken_);
  }
  std::unique_ptr<CommRequest> all_reduce_max(int32_t* data, std::size_t count, void*,
                                              const std::string& label) override {
    usable(label);
    MPI_Request r;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, checked_count(count, label), MPI_INT32_T, MPI_MAX, comm_, &r),
              label);
    return std::make_unique<MpiRequest>(r, label, timeout_, broken_);
  }

 private:
  void usable(const std::string& label) const {
    if (!broken_->empty())
      fail(label + ": this MPI communicator's collective '" + *broken_ + "' timed out, and it cannot be "
               "cancelled; end the job (MPI_Abort) rather than go on",
           Status::Internal);
  }
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_;
  std::shared_ptr<std::string> broken_ = std::make_shared<std::string>();  // set by a timed-out request
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_communicator(const void* mpi_comm, double timeout_seconds) {
  const MPI_Comm comm = mpi_comm ? *static_cast<const MPI_Comm*>(mpi_comm) : MPI_COMM_WORLD;
  return std::make_shared<MpiCommunicator>(comm, timeout_seconds);
}
bool mpi_built() { return true; }

}  // namespace dion3

#else  // no MPI in this build

namespace dion3 {

std::shared_ptr<Communicator> make_mpi_communicator(const void*, double) {
  fail("this build of dion3 has no MPI communicator; install an MPI (libopenmpi-dev) and rebuild",
       Status::Unsupported);
}
bool mpi_built() { return false; }

}  // namespace dion3

#endif
