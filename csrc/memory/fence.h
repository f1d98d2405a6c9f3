// Fences: has the asynchronous copy that last touched some host memory completed?
//
// Contract
// --------
// * Fence::query() never blocks and may be called from any thread; once it returned true it keeps
//   returning true.
// * Fence::wait_for(timeout) blocks the calling thread at most `timeout` (std::nullopt: without a
//   limit) and returns query(). Nothing here takes the GIL; callers release it before waiting.
// * Kinds: a CUDA event recorded on a stream (cuda/host_memory.h, CUDA build) and the CPU
//   stand-in made by stand_in_fence(), which is complete at once. The staging ring
//   (memory/staging_ring.h) treats them alike.
// * Test hook: between testing_hold_fences() and testing_release_fences(), stand_in_fence() returns
//   fences that stay pending until the release. CPU-only tests use it to exercise the ordering
//   logic that real CUDA events drive on a GPU.
//
// Torch-free: built by setup.py and by CMakeLists.txt (tests/cpp/test_memory.cpp).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>

namespace asteria::memory {

using Timeout = std::optional<std::chrono::nanoseconds>;

// A bounded wait ran out of time (asteria._C.WaitTimeoutError, a TimeoutError, in Python).
class WaitTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Fence {
 public:
  virtual ~Fence() = default;
  virtual bool query() = 0;
  virtual bool wait_for(Timeout timeout) = 0;
};

// A fence completed by hand: complete() wakes every waiter. Fences made from the same latch
// complete together (the test hook's held fences share one).
class ManualFence : public Fence {
 public:
  struct Latch {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
  };

  ManualFence() : latch_(std::make_shared<Latch>()) {}
  explicit ManualFence(std::shared_ptr<Latch> latch) : latch_(std::move(latch)) {}

  bool query() override;
  bool wait_for(Timeout timeout) override;
  void complete();

 private:
  std::shared_ptr<Latch> latch_;
};

// The CPU stand-in's fence: complete, unless the test hook holds fences.
std::shared_ptr<Fence> stand_in_fence();

// Polls `done` with a growing sleep (50 us up to 1 ms) until it returns true or `timeout` passes;
// returns its last answer. For fences that offer no blocking wait with a timeout (CUDA events).
bool poll_until(const std::function<bool()>& done, Timeout timeout);

// Test hooks (see the contract).
void testing_hold_fences();
void testing_release_fences();

}  // namespace asteria::memory
