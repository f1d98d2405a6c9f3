#include "io/checksum.h"

#include <cstring>

namespace asteria::io {
namespace {

constexpr uint64_t kP1 = 11400714785074694791ULL;
constexpr uint64_t kP2 = 14029467366897019727ULL;
constexpr uint64_t kP3 = 1609587929392839161ULL;
constexpr uint64_t kP4 = 9650029242287828579ULL;
constexpr uint64_t kP5 = 2870177450012600261ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Little-endian loads, whatever the host's byte order.
inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

inline uint32_t load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}

inline uint64_t mix(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  acc = rotl(acc, 31);
  return acc * kP1;
}

inline uint64_t merge_round(uint64_t acc, uint64_t value) {
  acc ^= mix(0, value);
  return acc * kP1 + kP4;
}

// Consumes whole 32-byte stripes of [p, end); returns where it stopped.
inline const unsigned char* stripes(uint64_t* acc, const unsigned char* p,
                                    const unsigned char* end) {
  while (end - p >= 32) {
    acc[0] = mix(acc[0], load64(p));
    acc[1] = mix(acc[1], load64(p + 8));
    acc[2] = mix(acc[2], load64(p + 16));
    acc[3] = mix(acc[3], load64(p + 24));
    p += 32;
  }
  return p;
}

}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed) {
  acc_[0] = seed + kP1 + kP2;
  acc_[1] = seed + kP2;
  acc_[2] = seed;
  acc_[3] = seed - kP1;
}

void Xxh64::update(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* end = p + bytes;
  total_ += bytes;
  if (buffered_ + bytes < 32) {
    if (bytes > 0) std::memcpy(buffer_ + buffered_, p, bytes);
    buffered_ += bytes;
    return;
  }
  if (buffered_ > 0) {
    const size_t fill = 32 - buffered_;
    std::memcpy(buffer_ + buffered_, p, fill);
    stripes(acc_, buffer_, buffer_ + 32);
    p += fill;
    buffered_ = 0;
  }
  p = stripes(acc_, p, end);
  buffered_ = static_cast<size_t>(end - p);
  if (buffered_ > 0) std::memcpy(buffer_, p, buffered_);
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
    for (uint64_t a : acc_) h = merge_round(h, a);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  const unsigned char* p = buffer_;
  const unsigned char* end = buffer_ + buffered_;
  for (; end - p >= 8; p += 8) h = rotl(h ^ mix(0, load64(p)), 27) * kP1 + kP4;
  if (end - p >= 4) {
    h = rotl(h ^ (static_cast<uint64_t>(load32(p)) * kP1), 23) * kP2 + kP3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t bytes, uint64_t seed) {
  Xxh64 state(seed);
  state.update(data, bytes);
  return state.digest();
}

}  // namespace asteria::io
