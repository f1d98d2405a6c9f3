#include "io/spill_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace asteria::io {
namespace {

constexpr size_t kMaxTransfer = size_t{1} << 30;  // below Linux's 0x7ffff000 per call

// strerror_r is the GNU variant (char*) or the POSIX one (int) depending on the C library.
[[maybe_unused]] const char* strerror_text(int rc, const char* buf) {
  return rc == 0 ? buf : "unknown error";
}
[[maybe_unused]] const char* strerror_text(const char* text, const char*) { return text; }

std::string errno_text(int err) {
  char buf[256] = {0};
  return std::string(strerror_text(strerror_r(err, buf, sizeof(buf)), buf)) + " (errno " +
         std::to_string(err) + ")";
}

struct Injection {
  std::mutex mu;
  int remaining[3] = {0, 0, 0};
  int error_code[3] = {0, 0, 0};
};

Injection& injection() {
  static Injection state;
  return state;
}

// The errno to fail the next operation of kind `op` with, or 0.
int injected_failure(IoOp op) {
  Injection& state = injection();
  const int i = static_cast<int>(op);
  std::lock_guard<std::mutex> lock(state.mu);
  if (state.remaining[i] <= 0) return 0;
  --state.remaining[i];
  return state.error_code[i];
}

std::string gib(uint64_t bytes) {
  return std::to_string(static_cast<double>(bytes) / static_cast<double>(uint64_t{1} << 30));
}

std::string not_writable(const std::string& dir, int err) {
  return "nvme_path '" + dir + "' is not writable by this process (" + errno_text(err) +
         "): set nvme_path to a directory you can write to, or change its permissions";
}

int open_new(const std::string& path, bool direct) {
  int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  if (direct) {
    if (const int err = injected_failure(IoOp::kOpenDirect)) {
      errno = err;
      return -1;
    }
    flags |= O_DIRECT;
  }
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0600);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Creates a file of a fresh name in `dir`; returns the fd (or -1 with errno set) and the path.
int open_unique(const std::string& dir, bool direct, std::string& path) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    path = dir + (dir.back() == '/' ? "" : "/") + "asteria-spill-" + std::to_string(::getpid()) +
           "-" + std::to_string(counter.fetch_add(1)) + ".bin";
    const int fd = open_new(path, direct);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

// 0 or the errno of the failure.
int preallocate(int fd, uint64_t bytes) {
  int rc;
  do {
    rc = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return 0;
  if (errno != EOPNOTSUPP && errno != ENOSYS) return errno;
  return ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
}

// 0 when one aligned block can be written and read back with this (O_DIRECT) fd, else the errno.
int probe_direct(int fd) {
  void* buf = nullptr;
  if (posix_memalign(&buf, kIoAlignment, kIoAlignment) != 0) return ENOMEM;
  std::memset(buf, 0, kIoAlignment);
  int err = injected_failure(IoOp::kWrite);
  errno = 0;
  if (err == 0 && ::pwrite(fd, buf, kIoAlignment, 0) != static_cast<ssize_t>(kIoAlignment)) {
    err = errno != 0 ? errno : EIO;
  }
  errno = 0;
  if (err == 0 && ::pread(fd, buf, kIoAlignment, 0) != static_cast<ssize_t>(kIoAlignment)) {
    err = errno != 0 ? errno : EIO;
  }
  std::free(buf);
  return err;
}

void check_dir(const std::string& dir, uint64_t size) {
  if (dir.empty()) {
    throw std::invalid_argument(
        "nvme_path is empty: set it to a directory, ideally on a local NVMe");
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      throw std::invalid_argument("nvme_path '" + dir +
                                  "' does not exist: create the directory, or set nvme_path to an "
                                  "existing directory (ideally on a local NVMe drive)");
    }
    throw std::invalid_argument("nvme_path '" + dir + "' cannot be inspected (" + errno_text(err) +
                                "): set nvme_path to a directory this process can use");
  }
  if (!S_ISDIR(st.st_mode)) {
    throw std::invalid_argument("nvme_path '" + dir +
                                "' is not a directory: set nvme_path to a directory (the spill "
                                "file is created inside it)");
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw std::invalid_argument(not_writable(dir, errno));
  struct statvfs vfs;
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (size > free_bytes) {
      throw std::invalid_argument(
          "capacity_bytes=" + std::to_string(size) + " (" + gib(size) +
          " GiB) exceeds the free space on nvme_path '" + dir + "' (" + std::to_string(free_bytes) +
          " bytes, " + gib(free_bytes) +
          " GiB free): lower capacity_bytes, or set nvme_path to a drive with more room");
    }
  }
}

}  // namespace

IoMode parse_io_mode(const std::string& mode) {
  if (mode == "auto") return IoMode::kAuto;
  if (mode == "direct") return IoMode::kDirect;
  if (mode == "buffered") return IoMode::kBuffered;
  throw std::invalid_argument("mode must be 'auto', 'direct' or 'buffered', got '" + mode + "'");
}

const char* to_string(IoMode mode) {
  switch (mode) {
    case IoMode::kAuto:
      return "auto";
    case IoMode::kDirect:
      return "direct";
    case IoMode::kBuffered:
      return "buffered";
  }
  return "?";
}

std::unique_ptr<SpillFile> SpillFile::create(const std::string& dir, uint64_t capacity,
                                             IoMode mode) {
  if (capacity == 0) throw std::invalid_argument("capacity_bytes must be > 0, got 0");
  const uint64_t size = (capacity + kIoAlignment - 1) / kIoAlignment * kIoAlignment;
  check_dir(dir, size);

  std::string path;
  bool direct = mode != IoMode::kBuffered;
  std::string reason = direct ? "O_DIRECT: reads and writes bypass the page cache"
                              : "buffered I/O through the page cache (mode='buffered')";
  const std::string refused_hint =
      ": use mode='auto' or 'buffered', or an nvme_path on a local disk filesystem (ext4, xfs)";
  int fd = open_unique(dir, direct, path);
  if (fd < 0 && direct && errno == EINVAL) {
    if (mode == IoMode::kDirect) {
      throw std::invalid_argument("the filesystem of nvme_path '" + dir +
                                  "' refuses O_DIRECT (open failed with EINVAL)" + refused_hint);
    }
    ::unlink(path.c_str());  // in case the refused open created it
    direct = false;
    reason =
        "the filesystem refused O_DIRECT at open (EINVAL): buffered I/O through the page cache";
    fd = open_unique(dir, false, path);
  }
  if (fd < 0) {
    const int err = errno;
    if (err == EACCES || err == EPERM || err == EROFS) {
      throw std::invalid_argument(not_writable(dir, err));
    }
    throw IoError(err, "cannot create a spill file in nvme_path '" + dir + "': " + errno_text(err));
  }
  const auto discard = [&] {
    ::close(fd);
    ::unlink(path.c_str());
  };
  const auto allocate = [&] {
    if (const int err = preallocate(fd, size)) {
      discard();
      throw IoError(err, "cannot preallocate capacity_bytes=" + std::to_string(size) + " (" +
                             gib(size) + " GiB) in nvme_path '" + dir + "': " + errno_text(err) +
                             "; lower capacity_bytes or free space on the drive");
    }
  };
  allocate();
  if (direct) {
    if (const int err = probe_direct(fd)) {
      discard();
      if (err != EINVAL) {
        throw IoError(
            err, "the first write to the spill file in '" + dir + "' failed: " + errno_text(err));
      }
      if (mode == IoMode::kDirect) {
        throw std::invalid_argument("the filesystem of nvme_path '" + dir +
                                    "' refuses O_DIRECT I/O (EINVAL)" + refused_hint);
      }
      direct = false;
      reason =
          "the filesystem accepted O_DIRECT at open but refused direct I/O (EINVAL): buffered I/O "
          "through the page cache";
      fd = open_unique(dir, false, path);
      if (fd < 0) {
        const int open_err = errno;
        throw IoError(open_err, "cannot create a spill file in nvme_path '" + dir +
                                    "': " + errno_text(open_err));
      }
      allocate();
    }
  }
  return std::unique_ptr<SpillFile>(new SpillFile(fd, path, size, direct, reason));
}

SpillFile::~SpillFile() { close(); }

void SpillFile::close() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(path_.c_str());
  fd_ = -1;
}

void SpillFile::check_range(const char* op, uint64_t offset, const void* buffer,
                            size_t bytes) const {
  if (fd_ < 0) throw IoError(EBADF, std::string(op) + ": the spill file '" + path_ + "' is closed");
  if (offset > capacity_ || bytes > capacity_ - offset) {
    throw std::invalid_argument(std::string(op) + ": range [" + std::to_string(offset) + ", +" +
                                std::to_string(bytes) + ") is outside the spill file's " +
                                std::to_string(capacity_) + " bytes");
  }
  if (direct_ && (offset % kIoAlignment != 0 || bytes % kIoAlignment != 0 ||
                  reinterpret_cast<uintptr_t>(buffer) % kIoAlignment != 0)) {
    throw std::invalid_argument(std::string(op) +
                                ": O_DIRECT needs the offset, length and buffer aligned to " +
                                std::to_string(kIoAlignment) + " bytes");
  }
}

void SpillFile::write(uint64_t offset, const void* src, size_t bytes) {
  check_range("write", offset, src, bytes);
  const auto fail = [&](int err) {
    return IoError(err, "pwrite of " + std::to_string(bytes) + " bytes at offset " +
                            std::to_string(offset) + " of '" + path_ +
                            "' failed: " + errno_text(err));
  };
  if (const int err = injected_failure(IoOp::kWrite)) throw fail(err);
  const char* p = static_cast<const char*>(src);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(fd_, p + done, std::min(bytes - done, kMaxTransfer),
                               static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw fail(errno);
    if (n == 0) throw fail(EIO);
    done += static_cast<size_t>(n);
  }
}

void SpillFile::read(uint64_t offset, void* dst, size_t bytes) {
  check_range("read", offset, dst, bytes);
  const auto fail = [&](int err) {
    return IoError(err, "pread of " + std::to_string(bytes) + " bytes at offset " +
                            std::to_string(offset) + " of '" + path_ +
                            "' failed: " + errno_text(err));
  };
  if (const int err = injected_failure(IoOp::kRead)) throw fail(err);
  char* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, p + done, std::min(bytes - done, kMaxTransfer),
                              static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw fail(errno);
    if (n == 0) throw fail(EIO);  // the file is preallocated: an early end means it was cut
    done += static_cast<size_t>(n);
  }
}

void testing_fail_next(int n, int error_code, IoOp op) {
  if (n < 0) throw std::invalid_argument("testing_fail_next: n must be >= 0");
  if (n > 0 && error_code <= 0) {
    throw std::invalid_argument("testing_fail_next: errno must be positive, got " +
                                std::to_string(error_code));
  }
  Injection& state = injection();
  const int i = static_cast<int>(op);
  std::lock_guard<std::mutex> lock(state.mu);
  state.remaining[i] = n;
  state.error_code[i] = error_code;
}

}  // namespace asteria::io
