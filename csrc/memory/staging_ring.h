// Staging ring: a fixed set of equal host slots, cut from one host block, that copies between the
// device and the host go through. A slot is handed out again only when reusing it is safe.
//
// Contract
// --------
// * Slots: `slots` slots of `slot_bytes` bytes each (rounded up to kHostAlignment, so every slot
//   is O_DIRECT-aligned) in one HostBlock, pinned per `pinning`. The block is allocated and
//   registered once, at construction: registration is slow, reuse is the point.
// * acquire(timeout) leases a free slot. A slot is free when (a) no lease holds it, (b) no pin of
//   it is alive, and (c) every fence recorded on it since it was last acquired has completed.
//   Every torch tensor over a slot holds a pin through its storage (memory/host_tensor.h), so (b)
//   means "no view of the slot is alive anywhere, Python included". Among free slots it takes the
//   first in ring order after the one it handed out last (the one whose copies had the longest to
//   finish). It waits, on fences, for pins to drop and for leases to be released, up to `timeout`
//   (std::nullopt: no limit), then throws WaitTimeout saying how many slots are leased, held by
//   live views, or waiting on copies.
// * SlotLease: the right to use one slot until release() (or destruction). pin() makes a pin for a
//   new view; add_fence() records a copy that touches the slot. Both throw std::logic_error after
//   release. Releasing does not wait: the slot becomes free once (b) and (c) hold.
// * Fences are dropped, outside the ring's lock, as soon as they are seen complete. A fence may own
//   tensors over its slot (one that keeps a copy's destination alive), so dropping one can
//   release pins; a pin held only by a completed fence never keeps a slot busy.
// * Lifetimes: leases share ownership of the ring's state; pins keep the block alive but hold the
//   state only weakly, so memory stays valid while any lease or view lives, even after the
//   StagingRing is gone, and a fence that owns a view of its own slot cannot keep a dropped ring
//   alive through a reference cycle (pending fences are then waited for as they are destroyed).
// * Thread safety: every member may be called from any thread, concurrently; pins are dropped by
//   tensor deleters on whatever thread releases the last view. Nothing here takes the GIL.
//
// Torch-free: built by setup.py and by CMakeLists.txt (tests/cpp/test_memory.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "memory/fence.h"
#include "memory/host_block.h"

namespace asteria::memory {

namespace detail {
struct RingState;
}

struct RingStats {
  int64_t slots = 0;
  int64_t slot_bytes = 0;
  int64_t leased = 0;          // slots under a lease
  int64_t held_by_views = 0;   // released slots that live views still pin
  int64_t pending_copies = 0;  // released slots with a fence not complete yet
  int64_t acquires = 0;        // leases handed out
  int64_t waited = 0;          // acquires that found no free slot at first
  bool pinned = false;
};

class SlotLease {
 public:
  ~SlotLease();
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;

  int index() const { return index_; }
  size_t bytes() const;
  size_t offset() const;  // of the slot in block()
  char* data() const;
  const std::shared_ptr<HostBlock>& block() const;

  std::shared_ptr<void> pin();
  void add_fence(std::shared_ptr<Fence> fence);
  bool query() const;                    // every fence recorded on the slot has completed
  bool wait_for(Timeout timeout) const;  // waits for them; returns query()
  void release();                        // idempotent
  bool released() const { return released_.load(); }

 private:
  friend class StagingRing;
  SlotLease(std::shared_ptr<detail::RingState> state, int index);
  void check_held(const char* what) const;

  std::shared_ptr<detail::RingState> state_;
  int index_;
  std::atomic<bool> released_{false};
};

class StagingRing {
 public:
  StagingRing(int slots, size_t slot_bytes, HostPinning pinning);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  std::unique_ptr<SlotLease> acquire(Timeout timeout = std::nullopt);
  RingStats stats() const;
  int slots() const;
  size_t slot_bytes() const;
  const std::shared_ptr<HostBlock>& block() const;

 private:
  std::shared_ptr<detail::RingState> state_;
};

}  // namespace asteria::memory
