#include "memory/staging_ring.h"

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace asteria::memory {
namespace detail {

struct RingState {
  struct Slot {
    bool leased = false;
    int pins = 0;
    std::vector<std::shared_ptr<Fence>> fences;
  };

  std::shared_ptr<HostBlock> block;
  size_t slot_bytes = 0;
  mutable std::mutex mu;
  std::condition_variable cv;  // a lease was released or a pin dropped
  std::vector<Slot> slots;
  int next = 0;  // where the next search starts
  int64_t acquires = 0;
  int64_t waited = 0;

  void unpin(int index) {
    {
      std::lock_guard<std::mutex> lock(mu);
      --slots[index].pins;
    }
    cv.notify_all();
  }

  void unlease(int index) {
    {
      std::lock_guard<std::mutex> lock(mu);
      slots[index].leased = false;
    }
    cv.notify_all();
  }

  std::vector<std::shared_ptr<Fence>> fences_of(int index) const {
    std::lock_guard<std::mutex> lock(mu);
    return slots[index].fences;
  }
};

}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;

// What a view's storage holds to keep its slot from being reused. It keeps the block alive, but
// the ring's state only weakly: a fence that owns a view of its slot (one that keeps its copy's
// destination alive) would otherwise close a cycle state -> fence -> view -> pin -> state.
struct Pin {
  std::weak_ptr<detail::RingState> state;
  std::shared_ptr<HostBlock> block;
  int index;
  Pin(const std::shared_ptr<detail::RingState>& s, int i) : state(s), block(s->block), index(i) {}
  ~Pin() {
    if (auto s = state.lock()) s->unpin(index);
  }
  Pin(const Pin&) = delete;
  Pin& operator=(const Pin&) = delete;
};

// Moves the complete fences of `fences` into `done` (queried, never destroyed, here).
void reap(std::vector<std::shared_ptr<Fence>>& fences, std::vector<std::shared_ptr<Fence>>& done) {
  auto pending = std::stable_partition(fences.begin(), fences.end(),
                                       [](const std::shared_ptr<Fence>& f) { return !f->query(); });
  std::move(pending, fences.end(), std::back_inserter(done));
  fences.erase(pending, fences.end());
}

std::string busy_message(const detail::RingState& s, double waited_s) {
  int leased = 0, views = 0, copies = 0;
  for (const auto& slot : s.slots) {
    if (slot.leased) {
      ++leased;
    } else if (!slot.fences.empty()) {
      ++copies;
    } else if (slot.pins > 0) {
      ++views;
    }
  }
  return "StagingRing.acquire: no slot became free in " + std::to_string(waited_s) + " s; of " +
         std::to_string(s.slots.size()) + " slots, " + std::to_string(leased) +
         " are leased (release them), " + std::to_string(views) +
         " are held by live tensor views (drop the views) and " + std::to_string(copies) +
         " wait for copies to complete (their events have not completed)";
}

}  // namespace

// ---- SlotLease ------------------------------------------------------------------------------

SlotLease::SlotLease(std::shared_ptr<detail::RingState> state, int index)
    : state_(std::move(state)), index_(index) {}

SlotLease::~SlotLease() { release(); }

size_t SlotLease::bytes() const { return state_->slot_bytes; }

size_t SlotLease::offset() const { return static_cast<size_t>(index_) * state_->slot_bytes; }

char* SlotLease::data() const { return state_->block->data() + offset(); }

const std::shared_ptr<HostBlock>& SlotLease::block() const { return state_->block; }

void SlotLease::check_held(const char* what) const {
  if (released()) {
    throw std::logic_error(std::string(what) + ": slot " + std::to_string(index_) +
                           " was released; acquire a slot again");
  }
}

std::shared_ptr<void> SlotLease::pin() {
  check_held("StagingSlot.view");
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->slots[index_].pins;
  }
  return std::make_shared<Pin>(state_, index_);
}

void SlotLease::add_fence(std::shared_ptr<Fence> fence) {
  check_held("StagingSlot.record");
  if (!fence) throw std::invalid_argument("StagingSlot.record: null fence");
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->slots[index_].fences.push_back(std::move(fence));
}

bool SlotLease::query() const {
  for (const auto& fence : state_->fences_of(index_)) {
    if (!fence->query()) return false;
  }
  return true;
}

bool SlotLease::wait_for(Timeout timeout) const {
  const auto deadline = timeout ? Clock::now() + *timeout : Clock::time_point::max();
  for (const auto& fence : state_->fences_of(index_)) {
    Timeout left;
    if (timeout) left = std::max(std::chrono::nanoseconds(0), deadline - Clock::now());
    if (!fence->wait_for(left)) return false;
  }
  return true;
}

void SlotLease::release() {
  if (!released_.exchange(true)) state_->unlease(index_);
}

// ---- StagingRing ----------------------------------------------------------------------------

StagingRing::StagingRing(int slots, size_t slot_bytes, HostPinning pinning)
    : state_(std::make_shared<detail::RingState>()) {
  if (slots < 1) {
    throw std::invalid_argument("StagingRing: slots must be >= 1, got " + std::to_string(slots));
  }
  if (slot_bytes < 1) throw std::invalid_argument("StagingRing: slot_bytes must be >= 1, got 0");
  const size_t rounded = round_up(slot_bytes);
  if (rounded < slot_bytes || rounded > std::numeric_limits<size_t>::max() / slots) {
    throw std::invalid_argument("StagingRing: slots * slot_bytes overflows");
  }
  state_->slot_bytes = rounded;
  // Each registration holds whole slots: the driver refuses a copy whose host range spans two
  // registrations (Note [Device views across registrations] in host_block.cpp), and a copy into
  // a slot is one such range. A slot larger than kMaxRegistrationBytes is a registration alone.
  const size_t per_chunk = std::max<size_t>(1, kMaxRegistrationBytes / rounded);
  state_->block = HostBlock::allocate(rounded * slots, pinning, per_chunk * rounded);
  state_->slots.resize(slots);
}

StagingRing::~StagingRing() = default;

int StagingRing::slots() const { return static_cast<int>(state_->slots.size()); }

size_t StagingRing::slot_bytes() const { return state_->slot_bytes; }

const std::shared_ptr<HostBlock>& StagingRing::block() const { return state_->block; }

std::unique_ptr<SlotLease> StagingRing::acquire(Timeout timeout) {
  constexpr auto kFenceSlice = std::chrono::milliseconds(2);
  const auto start = Clock::now();
  const auto deadline = timeout ? start + *timeout : Clock::time_point::max();
  detail::RingState& s = *state_;
  const int n = static_cast<int>(s.slots.size());
  bool waited = false;
  std::unique_lock<std::mutex> lock(s.mu);
  while (true) {
    std::vector<std::shared_ptr<Fence>> done;  // destroyed only with the lock released
    std::shared_ptr<Fence> pending;
    int take = -1;
    for (int k = 0; k < n; ++k) {
      const int i = (s.next + k) % n;
      auto& slot = s.slots[i];
      if (slot.leased) continue;
      reap(slot.fences, done);
      if (!slot.fences.empty()) {
        if (!pending) pending = slot.fences.front();
      } else if (slot.pins == 0 && take < 0) {
        take = i;
      }
    }
    if (take >= 0) {
      s.slots[take].leased = true;
      s.next = (take + 1) % n;
      ++s.acquires;
      if (waited) ++s.waited;
      lock.unlock();
      done.clear();
      return std::unique_ptr<SlotLease>(new SlotLease(state_, take));
    }
    if (!done.empty()) {  // dropping them may release pins: look again
      lock.unlock();
      done.clear();
      lock.lock();
      continue;
    }
    waited = true;
    const auto now = Clock::now();
    if (now >= deadline) {
      throw WaitTimeout(busy_message(s, std::chrono::duration<double>(now - start).count()));
    }
    if (pending) {
      // Wait in slices: a lease released or a view dropped meanwhile may free another slot.
      lock.unlock();
      pending->wait_for(std::min<std::chrono::nanoseconds>(kFenceSlice, deadline - now));
      pending.reset();
      lock.lock();
    } else if (timeout) {
      s.cv.wait_until(lock, deadline);
    } else {
      s.cv.wait(lock);
    }
  }
}

RingStats StagingRing::stats() const {
  const detail::RingState& s = *state_;
  RingStats out;
  out.slots = static_cast<int64_t>(s.slots.size());
  out.slot_bytes = static_cast<int64_t>(s.slot_bytes);
  out.pinned = s.block->pinned();
  std::lock_guard<std::mutex> lock(s.mu);
  for (const auto& slot : s.slots) {
    if (slot.leased) {
      ++out.leased;
      continue;
    }
    const bool pending = std::any_of(slot.fences.begin(), slot.fences.end(),
                                     [](const std::shared_ptr<Fence>& f) { return !f->query(); });
    if (pending) {
      ++out.pending_copies;
    } else if (slot.pins > 0) {
      ++out.held_by_views;
    }
  }
  out.acquires = s.acquires;
  out.waited = s.waited;
  return out;
}

}  // namespace asteria::memory
