// The spill file: one preallocated scratch file that the spill store (io/spill_store.h) reads and
// writes with positional I/O, bypassing the page cache (O_DIRECT) where the filesystem allows it.
//
// Contract
// --------
// * create(dir, capacity, mode) checks `dir` (exists, is a directory, writable) and the free space
//   on it (capacity above it is refused), each with a std::invalid_argument that says what to
//   change; then creates a new file of a unique name in `dir` (O_EXCL) and preallocates `capacity`
//   bytes (rounded up to kIoAlignment) with fallocate, or ftruncate where fallocate is unsupported.
// * Modes: kDirect opens with O_DIRECT and fails if the filesystem refuses it; kBuffered never uses
//   it; kAuto tries O_DIRECT and falls back to buffered I/O when the open fails with EINVAL or a
//   probe write of one aligned block does (tmpfs before Linux 6.6, some overlay and network
//   filesystems). direct() and mode_reason() report the outcome.
// * write(offset, src, n) / read(offset, dst, n): the whole range, retrying short transfers and
//   EINTR, thread-safe (pread/pwrite share no file offset). In direct mode offset, n and the buffer
//   address must be multiples of kIoAlignment (the store guarantees it; std::invalid_argument
//   otherwise). Failures throw IoError carrying the errno and naming the operation, the range and
//   the path.
// * close() closes and deletes the file; idempotent; the destructor calls it. The file is scratch:
//   nothing in it survives the process, and nothing is fsync'd.
// * Test hook: testing_fail_next(n, err, op) makes the next n operations of kind `op` fail with
//   errno `err` before they touch the file (kWrite: pwrite, including the O_DIRECT probe;
//   kRead: pread; kOpenDirect: the open with O_DIRECT). Process-wide.
//
// Torch-free: built by setup.py and by CMakeLists.txt (tests/cpp/test_spill.cpp). Linux.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace asteria::io {

constexpr size_t kIoAlignment = 4096;

enum class IoMode { kAuto, kDirect, kBuffered };
enum class IoOp { kWrite, kRead, kOpenDirect };

// "auto" | "direct" | "buffered" (std::invalid_argument otherwise).
IoMode parse_io_mode(const std::string& mode);
const char* to_string(IoMode mode);

// An I/O system call failed (asteria._C.SpillIOError, an OSError with this errno, in Python).
class IoError : public std::runtime_error {
 public:
  IoError(int error_code, const std::string& message)
      : std::runtime_error(message), error_code_(error_code) {}
  int error_code() const { return error_code_; }

 private:
  int error_code_;
};

class SpillFile {
 public:
  static std::unique_ptr<SpillFile> create(const std::string& dir, uint64_t capacity, IoMode mode);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  void write(uint64_t offset, const void* src, size_t bytes);
  void read(uint64_t offset, void* dst, size_t bytes);
  void close();

  bool direct() const { return direct_; }
  bool closed() const { return fd_ < 0; }
  const std::string& path() const { return path_; }
  const std::string& mode_reason() const { return mode_reason_; }
  uint64_t capacity() const { return capacity_; }

 private:
  SpillFile(int fd, std::string path, uint64_t capacity, bool direct, std::string reason)
      : fd_(fd),
        path_(std::move(path)),
        capacity_(capacity),
        direct_(direct),
        mode_reason_(std::move(reason)) {}
  void check_range(const char* op, uint64_t offset, const void* buffer, size_t bytes) const;

  int fd_;
  std::string path_;
  uint64_t capacity_;
  bool direct_;
  std::string mode_reason_;
};

void testing_fail_next(int n, int error_code, IoOp op);

}  // namespace asteria::io
