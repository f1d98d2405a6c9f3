// Tests of the torch-free host memory core (csrc/memory) over the CPU stand-in of
// csrc/cuda/host_memory (no registration; the CUDA build is checked by tests/gpu). Run by ctest,
// also under ThreadSanitizer and AddressSanitizer (CMakeLists.txt option ASTERIA_SANITIZE).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda/host_memory.h"
#include "harness.h"
#include "memory/fence.h"
#include "memory/host_block.h"
#include "memory/staging_ring.h"

using asteria::memory::HostBlock;
using asteria::memory::HostPinning;
using asteria::memory::kHostAlignment;
using asteria::memory::kMaxRegistrationBytes;
using asteria::memory::ManualFence;
using asteria::memory::StagingRing;
using asteria::memory::WaitTimeout;
namespace detail = asteria::memory::detail;
namespace memory = asteria::memory;
using namespace std::chrono_literals;

namespace {

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kHostAlignment == 0; }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(host_block_is_aligned_and_rounded) {
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{1} << 20}) {
    auto block = HostBlock::allocate(n, HostPinning::kPageable);
    CHECK(aligned(block->data()));
    CHECK_EQ(block->size(), std::max(memory::round_up(n), kHostAlignment));
    CHECK(!block->pinned());
    CHECK_EQ(block->device(), -1);
    std::memset(block->data(), 0xab, block->size());  // all of the rounded size is usable (ASan)
  }
}

TEST(host_block_counters_track_live_memory) {
  const auto before = memory::host_memory_stats();
  {
    auto a = HostBlock::allocate(10000, HostPinning::kPageable);  // 12288 bytes
    auto shared = a;
    auto b = HostBlock::allocate(1, HostPinning::kAuto);  // 4096, pageable without CUDA
    const auto mid = memory::host_memory_stats();
    CHECK_EQ(mid.live_blocks - before.live_blocks, 2);
    CHECK_EQ(mid.live_bytes - before.live_bytes, 12288 + 4096);
    CHECK_EQ(mid.allocated_blocks - before.allocated_blocks, 2);
    CHECK(mid.peak_bytes >= mid.live_bytes);
    CHECK_EQ(mid.registered_bytes, before.registered_bytes);
    a.reset();
    CHECK_EQ(memory::host_memory_stats().live_blocks - before.live_blocks, 2);  // `shared` holds it
  }
  const auto after = memory::host_memory_stats();
  CHECK_EQ(after.live_blocks, before.live_blocks);
  CHECK_EQ(after.live_bytes, before.live_bytes);
}

TEST(split_chunks_bounds_each_registration) {
  const size_t mib = size_t{1} << 20;
  const auto pieces = detail::split_chunks(600 * mib, kMaxRegistrationBytes);
  CHECK_EQ(pieces.size(), size_t{3});
  CHECK(pieces[0] == std::make_pair(size_t{0}, 256 * mib));
  CHECK(pieces[1] == std::make_pair(256 * mib, 256 * mib));
  CHECK(pieces[2] == std::make_pair(512 * mib, 88 * mib));
  CHECK_EQ(detail::split_chunks(512 * mib, kMaxRegistrationBytes).size(), size_t{2});
  CHECK(detail::split_chunks(0, kMaxRegistrationBytes).empty());
  CHECK_THROWS(detail::split_chunks(1, 0), std::invalid_argument);
}

TEST(register_pieces_rolls_back_on_failure) {
  char base[100];
  const auto pieces = detail::split_chunks(100, 30);  // at 0, 30, 60, 90
  std::vector<std::string> log;
  const auto offset = [&base](void* p) { return std::to_string(static_cast<char*>(p) - base); };
  const detail::RangeFn reg = [&](void* p, size_t) {
    if (offset(p) == "60") throw std::runtime_error("refused");
    log.push_back("reg " + offset(p));
  };
  const detail::RangeFn unreg = [&](void* p, size_t) { log.push_back("unreg " + offset(p)); };
  CHECK_THROWS(detail::register_pieces(base, pieces, reg, unreg), std::runtime_error);
  CHECK(log == std::vector<std::string>({"reg 0", "reg 30", "unreg 30", "unreg 0"}));

  log.clear();
  const detail::RangeFn ok = [&](void* p, size_t) { log.push_back("reg " + offset(p)); };
  detail::register_pieces(base, pieces, ok, unreg);
  CHECK(log == std::vector<std::string>({"reg 0", "reg 30", "reg 60", "reg 90"}));
}

TEST(pinning_without_cuda) {
  CHECK(!asteria::cuda::host_registration_available());
  CHECK_EQ(asteria::cuda::host_current_device(), -1);
  const auto before = memory::host_memory_stats();
  CHECK_THROWS(HostBlock::allocate(4096, HostPinning::kPinned), std::runtime_error);
  const auto after = memory::host_memory_stats();
  CHECK_EQ(after.live_blocks, before.live_blocks);  // the refused block was freed
  CHECK_EQ(after.live_bytes, before.live_bytes);
  CHECK(!HostBlock::allocate(4096, HostPinning::kAuto)->pinned());
}

TEST(device_pointer_needs_pinned_memory) {
  auto block = HostBlock::allocate(8192, HostPinning::kPageable);
  CHECK_THROWS(block->device_pointer(0, 4096, 0), std::invalid_argument);
  CHECK_THROWS(asteria::cuda::host_device_pointer(block->data(), 0), std::runtime_error);
  CHECK_THROWS(asteria::cuda::record_stream_fence(0, 0), std::runtime_error);
  CHECK(asteria::cuda::record_stream_fence(0, -1)->query());
}

TEST(stand_in_fences_and_the_hold_hook) {
  CHECK(memory::stand_in_fence()->query());
  memory::testing_hold_fences();
  auto held = memory::stand_in_fence();
  auto held_too = memory::stand_in_fence();
  CHECK(!held->query());
  CHECK(!held->wait_for(1ms));
  std::thread releaser([] {
    std::this_thread::sleep_for(5ms);
    memory::testing_release_fences();
  });
  CHECK(held->wait_for(std::nullopt));
  releaser.join();
  CHECK(held_too->query());
  CHECK(memory::stand_in_fence()->query());  // no longer holding

  ManualFence manual;
  CHECK(!manual.query());
  manual.complete();
  CHECK(manual.wait_for(0ns));
  int calls = 0;
  CHECK(memory::poll_until([&calls] { return ++calls == 3; }, 1s));
  CHECK(!memory::poll_until([] { return false; }, 1ms));
}

TEST(ring_hands_out_slots_in_order) {
  StagingRing ring(3, 1000, HostPinning::kPageable);
  CHECK_EQ(ring.slot_bytes(), size_t{4096});
  CHECK_EQ(ring.slots(), 3);
  auto a = ring.acquire(0ns);
  auto b = ring.acquire(0ns);
  auto c = ring.acquire(0ns);
  CHECK_EQ(a->index(), 0);
  CHECK_EQ(b->index(), 1);
  CHECK_EQ(c->index(), 2);
  CHECK(aligned(b->data()));
  CHECK(a->data() + 4096 == b->data());
  CHECK_EQ(b->offset(), size_t{4096});
  b->release();
  auto d = ring.acquire(0ns);
  CHECK_EQ(d->index(), 1);
  a.reset();  // destroying a lease releases it
  auto e = ring.acquire(0ns);
  CHECK_EQ(e->index(), 0);
  CHECK_EQ(ring.stats().leased, 3);
  CHECK_EQ(ring.stats().acquires, 5);
  c->release();
  d->release();
  e->release();
  // The search resumes after the slot handed out last (0): 1, 2, then 0.
  auto f = ring.acquire(0ns);
  auto g = ring.acquire(0ns);
  auto h = ring.acquire(0ns);
  CHECK_EQ(f->index(), 1);
  CHECK_EQ(g->index(), 2);
  CHECK_EQ(h->index(), 0);
}

// Note [Reused host blocks]: a reuse block goes back to the cache when its last owner drops it and
// is handed to the next reuse allocation of its size (and pinning); others never enter the cache.
TEST(reused_blocks_come_back_from_the_cache) {
  memory::release_host_cache();
  const auto before = memory::host_memory_stats();
  void* first = nullptr;
  {
    auto a = HostBlock::allocate(3 * 4096, HostPinning::kPageable, kMaxRegistrationBytes, true);
    first = a->data();
    auto plain = HostBlock::allocate(3 * 4096, HostPinning::kPageable);  // never cached
  }
  auto cached = memory::host_memory_stats();
  CHECK_EQ(cached.cached_blocks, before.cached_blocks + 1);
  CHECK_EQ(cached.cached_bytes, before.cached_bytes + 3 * 4096);
  CHECK_EQ(cached.live_blocks, before.live_blocks);
  auto other = HostBlock::allocate(4 * 4096, HostPinning::kPageable, kMaxRegistrationBytes, true);
  CHECK(other->data() != first);  // another size: a fresh block
  auto again = HostBlock::allocate(3 * 4096 - 5, HostPinning::kPageable, kMaxRegistrationBytes,
                                   true);  // rounds to the same size
  CHECK(again->data() == first);
  auto after = memory::host_memory_stats();
  CHECK_EQ(after.reused_blocks, before.reused_blocks + 1);
  CHECK_EQ(after.cached_blocks, before.cached_blocks);
  CHECK_EQ(after.live_blocks, before.live_blocks + 2);
  CHECK_EQ(after.allocated_blocks, before.allocated_blocks + 3);
  other.reset();
  again.reset();
  CHECK_EQ(memory::release_host_cache(), size_t{7 * 4096});
  const auto released = memory::host_memory_stats();
  CHECK_EQ(released.cached_blocks, 0);
  CHECK_EQ(released.live_bytes, before.live_bytes);
}

TEST(the_reuse_cache_frees_the_oldest_blocks_beyond_its_bound) {
  memory::release_host_cache();
  const size_t big = memory::kMaxCachedHostBytes / 2;
  {
    auto a = HostBlock::allocate(big, HostPinning::kPageable, kMaxRegistrationBytes, true);
    auto b = HostBlock::allocate(big, HostPinning::kPageable, kMaxRegistrationBytes, true);
    auto c = HostBlock::allocate(4096, HostPinning::kPageable, kMaxRegistrationBytes, true);
    a.reset();  // cached first: the one freed when c pushes the cache over its bound
    b.reset();
  }
  const auto stats = memory::host_memory_stats();
  CHECK(stats.cached_bytes <= static_cast<int64_t>(memory::kMaxCachedHostBytes));
  CHECK_EQ(stats.cached_blocks, 2);  // b and c; a was freed
  CHECK_EQ(stats.cached_bytes, static_cast<int64_t>(big + 4096));
  auto d = HostBlock::allocate(big, HostPinning::kPageable, kMaxRegistrationBytes, true);
  CHECK_EQ(memory::host_memory_stats().reused_blocks, stats.reused_blocks + 1);  // b's block
  CHECK_EQ(memory::host_memory_stats().cached_blocks, 1);
  d.reset();
  memory::release_host_cache();
  CHECK_EQ(memory::host_memory_stats().cached_blocks, 0);
}

// Note [Device views across registrations]: a copy into a slot is one host range, and the driver
// refuses a range across two registrations, so each registration chunk of the ring's block holds
// whole slots, for slots of every size (smaller than a chunk, not dividing it, larger than it).
TEST(ring_slots_never_span_two_registration_chunks) {
  const size_t mib = size_t{1} << 20;
  for (const size_t bytes :
       {size_t{2362368}, 3 * mib + 4096, 100 * mib, 255 * mib + 1, 300 * mib}) {
    const int slots = static_cast<int>(std::max<size_t>(2, 3 * kMaxRegistrationBytes / bytes));
    StagingRing ring(slots, bytes, HostPinning::kPageable);
    const size_t chunk = ring.block()->chunk_bytes();
    CHECK(chunk % ring.slot_bytes() == 0);
    CHECK(chunk <= std::max(kMaxRegistrationBytes, ring.slot_bytes()));
    for (int i = 0; i < slots; ++i) {
      auto lease = ring.acquire(0ns);
      const size_t first = lease->offset();
      const size_t last = first + ring.slot_bytes() - 1;
      CHECK_EQ(first / chunk, last / chunk);
      CHECK(last < ring.block()->size());
    }
  }
  CHECK_THROWS(HostBlock::allocate(4096, HostPinning::kPageable, 0), std::invalid_argument);
  CHECK_THROWS(HostBlock::allocate(4096, HostPinning::kPageable, 4097), std::invalid_argument);
  CHECK_EQ(HostBlock::allocate(4096, HostPinning::kPageable)->chunk_bytes(), kMaxRegistrationBytes);
}

TEST(ring_waits_for_pins) {
  StagingRing ring(1, 4096, HostPinning::kPageable);
  auto lease = ring.acquire(0ns);
  auto pin = lease->pin();
  lease->release();
  CHECK_THROWS(ring.acquire(1ms), WaitTimeout);
  CHECK_EQ(ring.stats().held_by_views, 1);
  pin.reset();
  auto again = ring.acquire(0ns);
  CHECK_EQ(again->index(), 0);
}

TEST(ring_waits_for_fences) {
  StagingRing ring(1, 4096, HostPinning::kPageable);
  auto fence = std::make_shared<ManualFence>();
  {
    auto lease = ring.acquire(0ns);
    lease->add_fence(fence);
    CHECK(!lease->query());
    CHECK(!lease->wait_for(1ms));
  }
  CHECK_THROWS(ring.acquire(5ms), WaitTimeout);
  CHECK_EQ(ring.stats().pending_copies, 1);
  fence->complete();
  auto lease = ring.acquire(0ns);
  CHECK(lease->query());
  CHECK_EQ(fence.use_count(), 1);  // the ring dropped its reference
}

TEST(ring_fence_holding_a_pin_does_not_deadlock) {
  // A fence that owns a view of its slot (one that keeps its copy's destination alive).
  struct OwningFence : ManualFence {
    std::shared_ptr<void> pin;
  };
  StagingRing ring(1, 4096, HostPinning::kPageable);
  auto fence = std::make_shared<OwningFence>();
  {
    auto lease = ring.acquire(0ns);
    fence->pin = lease->pin();
    lease->add_fence(fence);
  }
  CHECK_THROWS(ring.acquire(1ms), WaitTimeout);
  fence->complete();
  std::weak_ptr<OwningFence> weak = fence;
  fence.reset();  // only the ring holds it now
  auto lease = ring.acquire(1s);
  CHECK(weak.expired());
}

TEST(ring_timeout_says_what_holds_the_slots) {
  StagingRing ring(3, 4096, HostPinning::kPageable);
  auto fence = std::make_shared<ManualFence>();
  auto leased = ring.acquire(0ns);
  auto viewed = ring.acquire(0ns);
  auto pin = viewed->pin();
  viewed->release();
  auto fenced = ring.acquire(0ns);
  fenced->add_fence(fence);
  fenced->release();
  bool thrown = false;
  try {
    ring.acquire(2ms);
  } catch (const WaitTimeout& e) {
    thrown = true;
    const std::string message = e.what();
    CHECK(contains(message, "1 are leased"));
    CHECK(contains(message, "1 are held by live tensor views"));
    CHECK(contains(message, "1 wait for copies"));
  }
  CHECK(thrown);
  fence->complete();
}

TEST(ring_wakes_a_waiter_from_another_thread) {
  StagingRing ring(1, 4096, HostPinning::kPageable);
  auto lease = ring.acquire(0ns);
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    auto next = ring.acquire(10s);
    got = true;
  });
  std::this_thread::sleep_for(20ms);
  CHECK(!got.load());
  lease->release();
  waiter.join();
  CHECK(got.load());
  CHECK(ring.stats().waited >= 1);

  auto fenced = ring.acquire(0ns);
  auto fence = std::make_shared<ManualFence>();
  fenced->add_fence(fence);
  fenced->release();
  std::thread completer([fence] {
    std::this_thread::sleep_for(10ms);
    fence->complete();
  });
  auto after_fence = ring.acquire(10s);
  completer.join();
  CHECK(fence->query());
}

TEST(ring_memory_outlives_the_ring) {
  const auto before = memory::host_memory_stats();
  std::shared_ptr<void> pin;
  char* data = nullptr;
  {
    StagingRing ring(2, 8192, HostPinning::kPageable);
    auto lease = ring.acquire(0ns);
    pin = lease->pin();
    data = lease->data();
    std::memset(data, 7, lease->bytes());
  }
  CHECK_EQ(memory::host_memory_stats().live_blocks - before.live_blocks, 1);
  CHECK_EQ(static_cast<int>(data[8191]), 7);  // still ours (ASan would flag a use after free)
  pin.reset();
  CHECK_EQ(memory::host_memory_stats().live_blocks, before.live_blocks);
}

TEST(dropped_ring_with_a_fence_owning_a_view_is_freed) {
  // state -> fence -> view's pin -> state would be a cycle if pins owned the ring's state.
  struct OwningFence : ManualFence {
    std::shared_ptr<void> pin;
  };
  const auto before = memory::host_memory_stats();
  std::weak_ptr<OwningFence> weak;
  {
    StagingRing ring(1, 4096, HostPinning::kPageable);
    auto fence = std::make_shared<OwningFence>();
    weak = fence;
    auto lease = ring.acquire(0ns);
    fence->pin = lease->pin();
    lease->add_fence(std::move(fence));
  }  // never completed, never reaped
  CHECK(weak.expired());
  CHECK_EQ(memory::host_memory_stats().live_blocks, before.live_blocks);
}

TEST(released_lease_refuses_new_pins) {
  StagingRing ring(1, 4096, HostPinning::kPageable);
  auto lease = ring.acquire(0ns);
  lease->release();
  lease->release();  // idempotent
  CHECK(lease->released());
  CHECK_THROWS(lease->pin(), std::logic_error);
  CHECK_THROWS(lease->add_fence(memory::stand_in_fence()), std::logic_error);
  CHECK_THROWS(StagingRing(0, 4096, HostPinning::kPageable), std::invalid_argument);
  CHECK_THROWS(StagingRing(1, 0, HostPinning::kPageable), std::invalid_argument);
}

TEST(ring_under_concurrent_users) {
  constexpr int kSlots = 3;
  constexpr int kThreads = 4;
  constexpr int kRounds = 300;
  StagingRing ring(kSlots, 4096, HostPinning::kPageable);
  std::vector<std::atomic<int>> owner(kSlots);
  for (auto& o : owner) o = -1;
  std::atomic<int> overlaps{0};
  std::atomic<int> corrupted{0};
  std::vector<std::thread> users;
  for (int t = 0; t < kThreads; ++t) {
    users.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        auto lease = ring.acquire(30s);
        const int slot = lease->index();
        if (owner[slot].exchange(t) != -1) ++overlaps;
        std::memset(lease->data(), t, lease->bytes());
        auto pin = lease->pin();
        auto fence = std::make_shared<ManualFence>();
        lease->add_fence(fence);
        lease->release();
        fence->complete();
        // Pinned: nobody may have taken the slot, so the bytes are still ours.
        if (lease->data()[lease->bytes() - 1] != static_cast<char>(t)) ++corrupted;
        owner[slot] = -1;
        pin.reset();
      }
    });
  }
  for (auto& user : users) user.join();
  CHECK_EQ(overlaps.load(), 0);
  CHECK_EQ(corrupted.load(), 0);
  CHECK_EQ(ring.stats().acquires, int64_t{kThreads} * kRounds);
}

int main(int argc, char** argv) { return harness::run_tests(argc, argv); }
