// Spill store: named byte payloads in one preallocated scratch file (io/spill_file.h), written
// and read by a small pool of I/O threads (io/io_pool.h), checked against a checksum on every read.
// The NVMe tier of the memory tiers (docs/memory.md); asteria/memory/nvme.py is its Python face.
//
// Contract
// --------
// * Keys are strings; a key holds one payload of any size, 0 included.
// * write(key, src, n, keepalive) allocates an extent at once (first fit, 4 KiB aligned; when none
//   fits it throws IoError(ENOSPC) naming the sizes), makes `key` name the new payload and queues
//   the write. `keepalive` is held until the write finished; the caller must not modify `src`
//   before the returned future resolves. If the write fails, the future fails with IoError (errno
//   kept, key named) and the key is dropped, unless a newer write replaced it meanwhile.
// * read(key, dst, capacity, keepalive) queues a read of the key's current payload (KeyNotFound
//   when there is none) into `dst`, which must hold at least the payload (std::invalid_argument
//   otherwise), or, when dst is null, into a fresh pageable HostBlock that the future returns. A
//   read of a key whose write is still in flight waits for that write (Note [FIFO start order] in
//   io/io_pool.h) and fails with its error if it failed.
// * Checksums: XXH64 of each payload (io/checksum.h), taken while writing and checked on every
//   read. A mismatch fails the read with ChecksumError naming the key, the slot's offset and size
//   and the file; the data is not trusted, and the caller decides whether to recompute.
// * Extents are shared by the index and the operations in flight: remove() and replacement give an
//   extent back only after the reads that use it finished, so a read never sees another key's data.
// * Direct mode: payloads go straight between the caller's buffer and the disk when the buffer is
//   4 KiB aligned (HostBlock memory is); unaligned buffers and a payload's last partial block pass
//   through a 4 MiB aligned bounce buffer per I/O thread.
// * close(): later calls throw StoreClosed; queued operations fail with StoreClosed; running ones
//   finish; then the file is closed and deleted. Idempotent; the destructor calls it.
// * Thread safety: every member may be called from any thread, concurrently. Nothing here takes
//   the GIL; the bindings release it while waiting.
//
// Torch-free: built by setup.py and by CMakeLists.txt (tests/cpp/test_spill.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/io_pool.h"
#include "io/spill_file.h"
#include "memory/host_block.h"

namespace asteria::io {

// The key is not in the store (asteria._C.SpillKeyError, a KeyError, in Python).
class KeyNotFound : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// A read's data did not match the checksum taken when it was written (SpillChecksumError).
class ChecksumError : public std::runtime_error {
 public:
  ChecksumError(std::string key, const std::string& message)
      : std::runtime_error(message), key_(std::move(key)) {}
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

// The store was closed (a RuntimeError in Python).
class StoreClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SpillOptions {
  std::string dir;
  uint64_t capacity_bytes = 0;
  int io_threads = 2;
  IoMode mode = IoMode::kAuto;
};

struct SpillStats {
  int64_t bytes_written = 0;
  int64_t bytes_read = 0;
  int64_t writes = 0;
  int64_t reads = 0;
  int64_t write_failures = 0;
  int64_t read_failures = 0;  // I/O errors; checksum mismatches are counted apart
  int64_t checksum_failures = 0;
  int64_t keys = 0;
  int64_t used_bytes = 0;  // allocated extents, in-flight replaced ones included
  int64_t capacity_bytes = 0;
  int64_t queued = 0;  // operations waiting for an I/O thread
};

class SpillStore {
 public:
  explicit SpillStore(const SpillOptions& options);
  ~SpillStore();
  SpillStore(const SpillStore&) = delete;
  SpillStore& operator=(const SpillStore&) = delete;

  std::shared_ptr<IoFuture> write(const std::string& key, const void* src, size_t bytes,
                                  std::shared_ptr<const void> keepalive);
  std::shared_ptr<IoFuture> read(const std::string& key, void* dst, size_t capacity,
                                 std::shared_ptr<const void> keepalive);
  bool remove(const std::string& key);
  bool contains(const std::string& key) const;
  std::optional<size_t> nbytes(const std::string& key) const;
  // The key's extent in the file: (offset, bytes). For diagnostics and tests.
  std::optional<std::pair<uint64_t, uint64_t>> extent(const std::string& key) const;
  std::vector<std::string> keys() const;  // sorted
  void close();
  bool closed() const;

  SpillStats stats() const;
  const std::string& path() const { return file_->path(); }
  bool direct() const { return file_->direct(); }
  const std::string& mode_reason() const { return file_->mode_reason(); }
  int io_threads() const { return pool_->threads(); }

 private:
  struct Entry;
  struct Extents;

  std::shared_ptr<Entry> lookup_locked(const std::string& key) const;
  void check_open_locked(const char* what) const;
  void forget(const std::shared_ptr<Entry>& entry);
  void run_write(int worker, Entry& entry, const char* src, size_t bytes);
  void run_read(int worker, std::shared_ptr<Entry> entry, char* dst, size_t capacity,
                std::shared_ptr<const void> keepalive, IoFuture& future);
  uint64_t write_payload(int worker, uint64_t offset, const char* src, size_t bytes);
  uint64_t read_payload(int worker, uint64_t offset, char* dst, size_t bytes, size_t capacity);

  std::unique_ptr<SpillFile> file_;
  std::shared_ptr<Extents> extents_;
  std::vector<std::shared_ptr<memory::HostBlock>> bounce_;  // one per I/O thread, direct mode only
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Entry>> index_;
  bool closed_ = false;
  std::atomic<int64_t> bytes_written_{0};
  std::atomic<int64_t> bytes_read_{0};
  std::atomic<int64_t> writes_{0};
  std::atomic<int64_t> reads_{0};
  std::atomic<int64_t> write_failures_{0};
  std::atomic<int64_t> read_failures_{0};
  std::atomic<int64_t> checksum_failures_{0};
  std::unique_ptr<IoPool> pool_;  // declared last: its threads stop before the rest goes
};

}  // namespace asteria::io
