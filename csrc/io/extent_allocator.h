// Extent allocator: first-fit placement of aligned extents in a file of fixed capacity, for the
// spill store (io/spill_store.h).
//
// Contract: allocate(bytes) rounds `bytes` up to the alignment and returns the lowest offset where
// that many free bytes start (first fit keeps a stream of writes sequential on disk), or nullopt
// when no free extent is large enough. free(offset, bytes) returns an extent (bytes rounded as in
// allocate) and merges it with free neighbours; freeing what is not allocated (out of range,
// misaligned, overlapping free space) throws std::invalid_argument. Not thread-safe: the owner
// locks. Torch-free.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace asteria::io {

class ExtentAllocator {
 public:
  ExtentAllocator(uint64_t capacity, uint64_t alignment);

  std::optional<uint64_t> allocate(uint64_t bytes);
  void free(uint64_t offset, uint64_t bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t used() const { return used_; }
  uint64_t largest_free() const;
  size_t free_extents() const { return free_.size(); }
  uint64_t rounded(uint64_t bytes) const;

 private:
  uint64_t capacity_;
  uint64_t alignment_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, disjoint and never adjacent
};

}  // namespace asteria::io
