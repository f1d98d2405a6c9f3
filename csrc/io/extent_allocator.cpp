#include "io/extent_allocator.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

namespace asteria::io {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity), alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("ExtentAllocator: alignment must be a power of two, got " +
                                std::to_string(alignment));
  }
  if (capacity % alignment != 0) {
    throw std::invalid_argument("ExtentAllocator: capacity " + std::to_string(capacity) +
                                " is not a multiple of the alignment " + std::to_string(alignment));
  }
  if (capacity > 0) free_.emplace(0, capacity);
}

uint64_t ExtentAllocator::rounded(uint64_t bytes) const {
  return (std::max<uint64_t>(bytes, 1) + alignment_ - 1) & ~(alignment_ - 1);
}

std::optional<uint64_t> ExtentAllocator::allocate(uint64_t bytes) {
  const uint64_t need = rounded(bytes);
  if (need < bytes) return std::nullopt;  // overflow
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + need, rest);
    used_ += need;
    return offset;
  }
  return std::nullopt;
}

void ExtentAllocator::free(uint64_t offset, uint64_t bytes) {
  const uint64_t length = rounded(bytes);
  const auto bad = [&](const char* why) {
    return std::invalid_argument("ExtentAllocator::free(" + std::to_string(offset) + ", " +
                                 std::to_string(length) + "): " + why);
  };
  if (offset % alignment_ != 0) throw bad("misaligned offset");
  if (offset > capacity_ || length > capacity_ - offset) throw bad("outside the capacity");
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first < offset + length) throw bad("overlaps free space");
  auto prev = next == free_.begin() ? free_.end() : std::prev(next);
  if (prev != free_.end() && prev->first + prev->second > offset) throw bad("overlaps free space");
  uint64_t start = offset;
  uint64_t size = length;
  if (prev != free_.end() && prev->first + prev->second == offset) {
    start = prev->first;
    size += prev->second;
    free_.erase(prev);
  }
  if (next != free_.end() && next->first == offset + length) {
    size += next->second;
    free_.erase(next);
  }
  free_.emplace(start, size);
  used_ -= length;
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [offset, length] : free_) best = std::max(best, length);
  return best;
}

}  // namespace asteria::io
