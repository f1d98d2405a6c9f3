// Host blocks: aligned host memory that Asteria allocates and owns, page-locked and mapped for the
// GPU in CUDA builds.
//
// Contract
// --------
// * Allocation: HostBlock::allocate(bytes, pinning) gives at least `bytes` bytes (rounded up to a
//   multiple of kHostAlignment; a block is never empty) aligned to kHostAlignment, 4 KiB: what
//   O_DIRECT asks of buffers. Contents are uninitialized. posix_memalign, never torch's caching
//   host allocator (which rounds pinned requests up to a power of two).
// * Pinning: kPinned registers the block with the CUDA driver (cuda/host_memory.h, Mapped |
//   Portable) in chunks of `chunk_bytes` (default kMaxRegistrationBytes; a caller that copies
//   fixed-size pieces, the staging ring, passes a multiple of their size so that no piece spans
//   two registrations: Note [Device views across registrations]), unregistering the chunks already
//   done if one fails, and throws when this build or machine cannot pin. kAuto pins where it can (a
//   CUDA build that sees a GPU) and is pageable elsewhere; kPageable never pins. A pinned block is
//   also madvise(MADV_DONTFORK)'d, so fork() does not copy its locked pages into the child (the
//   child must not touch it). On free the chunks are unregistered, on the device they were
//   registered on, before the memory goes back to the C library.
// * Lifetime: blocks are shared (std::shared_ptr); the last owner frees, on whatever thread it
//   runs. Torch tensors over a block hold it through their storage (memory/host_tensor.h). Freeing
//   does not wait for the GPU: keep a block alive until kernels and copies that use it completed
//   (the staging ring's fences do that for its slots).
// * Accounting: process-wide counters of live blocks and bytes (allocated size) and of registered
//   blocks and bytes, updated on allocation and free; host_memory_stats() reads them. Thread-safe.
// * Reuse (Note [Reused host blocks] in host_block.cpp): a block allocated with `reuse` goes, when
//   its last owner drops it, to a process-wide cache instead of back to the C library (still
//   registered when pinned), and a later `reuse` allocation of the same size, pinning, chunking
//   and device takes it back: registering and unregistering pinned memory costs milliseconds per
//   megabyte range, which a runtime replacing its bases at every install must not pay. The cache
//   holds at most kMaxCachedHostBytes (the oldest blocks are freed first); release_host_cache()
//   frees it all. Cached blocks count as cached_*, not live_*, and stay in registered_*.
// * Device addresses: device_pointer(offset, bytes, device) is where the GPU sees a byte range of a
//   pinned block (cudaHostGetDevicePointer). A range must lie inside one registration chunk
//   (Note [Device views across registrations] in host_block.cpp); otherwise it throws.
//
// Torch-free: built by setup.py and by CMakeLists.txt (tests/cpp/test_memory.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace asteria::memory {

constexpr size_t kHostAlignment = 4096;
constexpr size_t kMaxRegistrationBytes = size_t{256} << 20;
constexpr size_t kMaxCachedHostBytes = size_t{4} << 30;

enum class HostPinning { kPageable, kPinned, kAuto };

// `bytes` rounded up to a multiple of `alignment` (a power of two).
constexpr size_t round_up(size_t bytes, size_t alignment = kHostAlignment) {
  return (bytes + alignment - 1) & ~(alignment - 1);
}

class HostBlock {
 public:
  // `chunk_bytes`: the size of each registration (a multiple of kHostAlignment, > 0); `reuse`:
  // from and back to the cache of reused blocks (see Reuse above).
  static std::shared_ptr<HostBlock> allocate(size_t bytes, HostPinning pinning,
                                             size_t chunk_bytes = kMaxRegistrationBytes,
                                             bool reuse = false);
  ~HostBlock();
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return !chunks_.empty(); }
  int device() const { return device_; }  // the device it was registered on; -1 when pageable
  size_t chunk_bytes() const { return chunk_bytes_; }  // of each registration (when pinned)
  void* device_pointer(size_t offset, size_t bytes, int device) const;

 private:
  struct Chunk {
    size_t offset;
    size_t bytes;
  };
  HostBlock(char* data, size_t size, size_t chunk_bytes)
      : data_(data), size_(size), chunk_bytes_(chunk_bytes) {}
  void pin(int device);
  static void recycle(HostBlock* block);  // the deleter of a block allocated with `reuse`

  char* data_;
  size_t size_;
  size_t chunk_bytes_;
  int device_ = -1;
  std::vector<Chunk> chunks_;  // registered chunks; empty when pageable
  bool cached_ = false;        // in the cache of reused blocks (not live)
};

// Frees every block in the cache of reused blocks; returns the bytes freed.
size_t release_host_cache();

struct HostMemoryStats {
  int64_t live_blocks = 0;
  int64_t live_bytes = 0;
  int64_t registered_blocks = 0;
  int64_t registered_bytes = 0;
  int64_t peak_bytes = 0;        // the most live bytes at any time so far
  int64_t allocated_blocks = 0;  // blocks allocated since the process started
  int64_t cached_blocks = 0;     // in the cache of reused blocks
  int64_t cached_bytes = 0;
  int64_t reused_blocks = 0;  // allocations served from that cache since the start
};

HostMemoryStats host_memory_stats();

namespace detail {

using RangeFn = std::function<void(void* ptr, size_t bytes)>;

// [offset, bytes) pieces of `total` bytes, each at most `max_chunk` bytes.
std::vector<std::pair<size_t, size_t>> split_chunks(size_t total, size_t max_chunk);

// Calls `reg` on each piece in order. If one throws, calls `unreg` on the pieces already
// registered (last first) and rethrows.
void register_pieces(char* base, const std::vector<std::pair<size_t, size_t>>& pieces,
                     const RangeFn& reg, const RangeFn& unreg);

}  // namespace detail
}  // namespace asteria::memory
