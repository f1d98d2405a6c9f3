#include "memory/fence.h"

#include <algorithm>
#include <thread>

namespace asteria::memory {
namespace {

class CompleteFence : public Fence {
 public:
  bool query() override { return true; }
  bool wait_for(Timeout) override { return true; }
};

std::mutex g_hold_mu;
std::shared_ptr<ManualFence::Latch> g_held;  // non-null between hold and release

}  // namespace

bool ManualFence::query() {
  std::lock_guard<std::mutex> lock(latch_->mu);
  return latch_->open;
}

bool ManualFence::wait_for(Timeout timeout) {
  std::unique_lock<std::mutex> lock(latch_->mu);
  if (!timeout) {
    latch_->cv.wait(lock, [this] { return latch_->open; });
    return true;
  }
  return latch_->cv.wait_for(lock, *timeout, [this] { return latch_->open; });
}

void ManualFence::complete() {
  std::lock_guard<std::mutex> lock(latch_->mu);
  latch_->open = true;
  latch_->cv.notify_all();
}

std::shared_ptr<Fence> stand_in_fence() {
  static const auto complete = std::make_shared<CompleteFence>();
  std::lock_guard<std::mutex> lock(g_hold_mu);
  if (g_held) return std::make_shared<ManualFence>(g_held);
  return complete;
}

bool poll_until(const std::function<bool()>& done, Timeout timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = timeout ? Clock::now() + *timeout : Clock::time_point::max();
  auto nap = std::chrono::microseconds(50);
  while (true) {
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(nap, deadline - now));
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

void testing_hold_fences() {
  std::lock_guard<std::mutex> lock(g_hold_mu);
  if (!g_held) g_held = std::make_shared<ManualFence::Latch>();
}

void testing_release_fences() {
  std::shared_ptr<ManualFence::Latch> held;
  {
    std::lock_guard<std::mutex> lock(g_hold_mu);
    held.swap(g_held);
  }
  if (held) ManualFence(held).complete();
}

}  // namespace asteria::memory
