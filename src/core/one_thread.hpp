// one_thread.hpp — an object used from one thread at a time: it holds a ThreadOwner, and each of
// its entry points a ThreadOwner::Use, which fails with the given status and message where another
// thread is inside one (instead of racing it). The thread inside may call in again.
#pragma once

#include <atomic>
#include <string>
#include <thread>

#include "dion3/error.hpp"

namespace dion3 {

class ThreadOwner {
 public:
  class Use {
   public:
    Use(const ThreadOwner& owner, Status status, const char* message) : owner_(owner) {
      std::thread::id none{};
      if (owner.user_.compare_exchange_strong(none, std::this_thread::get_id())) held_ = true;
      else if (none != std::this_thread::get_id()) throw Error(status, message);
    }
    ~Use() {
      if (held_) owner_.user_.store(std::thread::id{});
    }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    const ThreadOwner& owner_;
    bool held_ = false;
  };

 private:
  mutable std::atomic<std::thread::id> user_{};
};

}  // namespace dion3
