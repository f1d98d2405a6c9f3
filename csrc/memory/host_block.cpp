#include "memory/host_block.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <list>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

#include "cuda/host_memory.h"

namespace asteria::memory {
namespace {

struct Counters {
  std::atomic<int64_t> live_blocks{0};
  std::atomic<int64_t> live_bytes{0};
  std::atomic<int64_t> registered_blocks{0};
  std::atomic<int64_t> registered_bytes{0};
  std::atomic<int64_t> peak_bytes{0};
  std::atomic<int64_t> allocated_blocks{0};
  std::atomic<int64_t> cached_blocks{0};
  std::atomic<int64_t> cached_bytes{0};
  std::atomic<int64_t> reused_blocks{0};
};

Counters& counters() {
  static Counters c;
  return c;
}

void note_live(int64_t bytes) {
  Counters& c = counters();
  c.live_blocks.fetch_add(1);
  const int64_t live = c.live_bytes.fetch_add(bytes) + bytes;
  int64_t peak = c.peak_bytes.load();
  while (live > peak && !c.peak_bytes.compare_exchange_weak(peak, live)) {
  }
}

// Note [Reused host blocks]: the bases window keeps the bases in use in pinned host memory and
// replaces a block's bases at every install (new tensors, so that a copy still reading the old
// ones is never overwritten: Note [Bases window]). Registering fresh memory with the driver costs
// milliseconds per megabyte range (on the H200 machine 6 registrations and unregistrations a step
// of the tiny preset took 2.2 ms, and OLMo-2-style models have bases of tens of megabytes), so a
// block allocated with `reuse` is cached when its last owner drops it and handed to the next
// `reuse` allocation of the same size, pinning, chunking and device. Reusing is as safe as
// freeing: an owner keeps a block alive until the copies that read or write it completed (the
// window retires a slot's sources with their copy's event; the runtime keeps a pending copy's
// destination in the block's state), so the last owner drops it only once nothing uses it. The
// cache is never destroyed (a block stays registered until the process exits, so nothing is
// unregistered after the CUDA runtime has shut down); it holds at most kMaxCachedHostBytes.
struct HostCache {
  std::mutex mu;
  std::list<HostBlock*> blocks;  // the oldest first
  size_t bytes = 0;
};

HostCache& host_cache() {
  static auto* cache = new HostCache;  // never destroyed (see the Note)
  return *cache;
}

}  // namespace

namespace detail {

std::vector<std::pair<size_t, size_t>> split_chunks(size_t total, size_t max_chunk) {
  if (max_chunk == 0) throw std::invalid_argument("split_chunks: max_chunk must be positive");
  std::vector<std::pair<size_t, size_t>> pieces;
  for (size_t offset = 0; offset < total; offset += max_chunk) {
    pieces.emplace_back(offset, std::min(max_chunk, total - offset));
  }
  return pieces;
}

void register_pieces(char* base, const std::vector<std::pair<size_t, size_t>>& pieces,
                     const RangeFn& reg, const RangeFn& unreg) {
  size_t done = 0;
  try {
    for (; done < pieces.size(); ++done) reg(base + pieces[done].first, pieces[done].second);
  } catch (...) {
    while (done > 0) {
      --done;
      unreg(base + pieces[done].first, pieces[done].second);
    }
    throw;
  }
}

}  // namespace detail

std::shared_ptr<HostBlock> HostBlock::allocate(size_t bytes, HostPinning pinning,
                                               size_t chunk_bytes, bool reuse) {
  if (chunk_bytes == 0 || chunk_bytes % kHostAlignment != 0) {
    throw std::invalid_argument("HostBlock: chunk_bytes must be a positive multiple of " +
                                std::to_string(kHostAlignment) + ", got " +
                                std::to_string(chunk_bytes));
  }
  const size_t size = round_up(std::max<size_t>(bytes, 1));
  if (size < bytes) throw std::bad_alloc();  // the rounding overflowed
  const bool pin = pinning == HostPinning::kPinned ||
                   (pinning == HostPinning::kAuto && cuda::host_registration_available());
  if (reuse) {  // Note [Reused host blocks]
    const int device = pin ? cuda::host_current_device() : -1;
    HostCache& cache = host_cache();
    HostBlock* hit = nullptr;
    {
      std::lock_guard<std::mutex> lock(cache.mu);
      for (auto it = cache.blocks.begin(); it != cache.blocks.end(); ++it) {
        HostBlock* b = *it;
        if (b->size_ == size && b->chunk_bytes_ == chunk_bytes && b->pinned() == pin &&
            b->device_ == device) {
          hit = b;
          cache.blocks.erase(it);
          cache.bytes -= size;
          break;
        }
      }
      if (hit != nullptr) {
        hit->cached_ = false;
        Counters& c = counters();
        c.cached_blocks.fetch_sub(1);
        c.cached_bytes.fetch_sub(static_cast<int64_t>(size));
        c.reused_blocks.fetch_add(1);
        note_live(static_cast<int64_t>(size));
      }
    }
    if (hit != nullptr) return std::shared_ptr<HostBlock>(hit, &HostBlock::recycle);
  }
  void* data = nullptr;
  if (posix_memalign(&data, kHostAlignment, size) != 0) throw std::bad_alloc();
  std::unique_ptr<HostBlock> block(new HostBlock(static_cast<char*>(data), size, chunk_bytes));
  counters().allocated_blocks.fetch_add(1);
  note_live(static_cast<int64_t>(size));
  if (pin) block->pin(cuda::host_current_device());  // on failure ~HostBlock frees the memory
  if (reuse) return std::shared_ptr<HostBlock>(block.release(), &HostBlock::recycle);
  return std::shared_ptr<HostBlock>(block.release());
}

void HostBlock::recycle(HostBlock* block) {
  const size_t size = block->size_;
  if (size > kMaxCachedHostBytes) {
    delete block;
    return;
  }
  HostCache& cache = host_cache();
  std::vector<HostBlock*> evicted;
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    block->cached_ = true;
    Counters& c = counters();
    c.live_blocks.fetch_sub(1);
    c.live_bytes.fetch_sub(static_cast<int64_t>(size));
    c.cached_blocks.fetch_add(1);
    c.cached_bytes.fetch_add(static_cast<int64_t>(size));
    cache.blocks.push_back(block);
    cache.bytes += size;
    while (cache.bytes > kMaxCachedHostBytes) {
      evicted.push_back(cache.blocks.front());
      cache.bytes -= cache.blocks.front()->size_;
      cache.blocks.pop_front();
    }
  }
  for (HostBlock* b : evicted) delete b;  // unregistering takes time: outside the lock
}

size_t release_host_cache() {
  HostCache& cache = host_cache();
  std::list<HostBlock*> blocks;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    blocks.swap(cache.blocks);
    bytes = cache.bytes;
    cache.bytes = 0;
  }
  for (HostBlock* b : blocks) delete b;
  return bytes;
}

void HostBlock::pin(int device) {
  const auto pieces = detail::split_chunks(size_, chunk_bytes_);
  chunks_.reserve(pieces.size());
  detail::register_pieces(
      data_, pieces, [device](void* p, size_t n) { cuda::host_register(p, n, device); },
      [device](void* p, size_t n) { cuda::host_unregister(p, n, device); });
  device_ = device;
  for (const auto& [offset, bytes] : pieces) chunks_.push_back({offset, bytes});
  madvise(data_, size_, MADV_DONTFORK);  // best effort: an old kernel may refuse
  counters().registered_blocks.fetch_add(1);
  counters().registered_bytes.fetch_add(static_cast<int64_t>(size_));
}

HostBlock::~HostBlock() {
  if (!chunks_.empty()) {
    madvise(data_, size_, MADV_DOFORK);  // the C library may hand these pages out again
    for (auto it = chunks_.rbegin(); it != chunks_.rend(); ++it) {
      cuda::host_unregister(data_ + it->offset, it->bytes, device_);
    }
    counters().registered_blocks.fetch_sub(1);
    counters().registered_bytes.fetch_sub(static_cast<int64_t>(size_));
  }
  std::free(data_);
  Counters& c = counters();
  if (cached_) {
    c.cached_blocks.fetch_sub(1);
    c.cached_bytes.fetch_sub(static_cast<int64_t>(size_));
  } else {
    c.live_blocks.fetch_sub(1);
    c.live_bytes.fetch_sub(static_cast<int64_t>(size_));
  }
}

void* HostBlock::device_pointer(size_t offset, size_t bytes, int device) const {
  if (chunks_.empty()) {
    throw std::invalid_argument(
        "this host memory is not pinned (allocated pageable, or on a machine without a GPU); "
        "allocate it pinned to get a device view");
  }
  if (offset > size_ || bytes > size_ - offset) {
    throw std::out_of_range("device_pointer: range [" + std::to_string(offset) + ", +" +
                            std::to_string(bytes) + ") is outside a block of " +
                            std::to_string(size_) + " bytes");
  }
  // Note [Device views across registrations]: each chunk is its own registration, and the CUDA
  // driver refuses a copy whose range spans two of them (cudaErrorInvalidValue on an H200,
  // driver 580, 2026-12-04) even where their device addresses are contiguous; a view must stay
  // inside one chunk.
  const size_t last = offset + std::max<size_t>(bytes, 1) - 1;
  const size_t first_chunk = offset / chunk_bytes_;
  const size_t last_chunk = std::min(last / chunk_bytes_, chunks_.size() - 1);
  if (last_chunk != first_chunk) {
    throw std::invalid_argument(
        "device view of bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
        ") spans " + std::to_string(last_chunk - first_chunk + 1) +
        " host registration chunks (each at most " + std::to_string(chunk_bytes_ >> 20) +
        " MiB); the CUDA driver refuses copies across registrations: take device views of "
        "slices that stay inside one chunk");
  }
  const Chunk& head = chunks_[first_chunk];
  char* base = static_cast<char*>(cuda::host_device_pointer(data_ + head.offset, device));
  return base + (offset - head.offset);
}

HostMemoryStats host_memory_stats() {
  const Counters& c = counters();
  HostMemoryStats s;
  s.live_blocks = c.live_blocks.load();
  s.live_bytes = c.live_bytes.load();
  s.registered_blocks = c.registered_blocks.load();
  s.registered_bytes = c.registered_bytes.load();
  s.peak_bytes = c.peak_bytes.load();
  s.allocated_blocks = c.allocated_blocks.load();
  s.cached_blocks = c.cached_blocks.load();
  s.cached_bytes = c.cached_bytes.load();
  s.reused_blocks = c.reused_blocks.load();
  return s;
}

}  // namespace asteria::memory
