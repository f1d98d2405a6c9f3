// XXH64, the 64-bit xxHash of Yann Collet (https://github.com/Cyan4973/xxHash, spec in
// doc/xxhash_spec.md), written here from the specification: the spill store's per-slot checksum.
// Portable C++ (no SIMD, no -march): 4.2-4.7 GB/s on one core of a loaded 2-core EPYC (256 MiB,
// best of 5, third_party/README.md), about 16 ms per 64 MiB slot on the store's I/O threads; its
// outputs match the reference implementation (tests/cpp/test_spill.cpp checks
// published values).
//
// Contract: Xxh64 hashes a byte stream fed in pieces of any size; digest() does not change the
// state, so it may be called again after more update()s. xxh64(data, n, seed) hashes one buffer.
// Not thread-safe per object. Torch-free.
#pragma once

#include <cstddef>
#include <cstdint>

namespace asteria::io {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  uint64_t total_ = 0;
  uint64_t acc_[4];
  unsigned char buffer_[32];
  size_t buffered_ = 0;
  uint64_t seed_;
};

uint64_t xxh64(const void* data, size_t bytes, uint64_t seed = 0);

}  // namespace asteria::io
