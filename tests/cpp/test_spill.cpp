// Tests of the torch-free NVMe spill store (csrc/io): the checksum, the extent allocator, the I/O
// thread pool, and the spill file and store over real files in a temporary directory under /tmp
// (O_DIRECT where the filesystem allows it). Run by ctest, also under ThreadSanitizer and
// AddressSanitizer (CMakeLists.txt option ASTERIA_SANITIZE).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "io/checksum.h"
#include "io/extent_allocator.h"
#include "io/io_pool.h"
#include "io/spill_file.h"
#include "io/spill_store.h"
#include "memory/host_block.h"

using asteria::io::ChecksumError;
using asteria::io::ExtentAllocator;
using asteria::io::IoError;
using asteria::io::IoFuture;
using asteria::io::IoJob;
using asteria::io::IoMode;
using asteria::io::IoOp;
using asteria::io::IoPool;
using asteria::io::KeyNotFound;
using asteria::io::SpillFile;
using asteria::io::SpillOptions;
using asteria::io::SpillStore;
using asteria::io::StoreClosed;
using asteria::io::testing_fail_next;
using asteria::io::xxh64;
using asteria::io::Xxh64;
using asteria::memory::HostBlock;
using asteria::memory::HostPinning;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

constexpr size_t kMiB = size_t{1} << 20;

// A fresh directory under /tmp, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    char name[] = "/tmp/asteria-test-spill-XXXXXX";
    if (mkdtemp(name) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = name;
  }
  ~TempDir() {
    std::error_code ignored;
    fs::permissions(path_, fs::perms::owner_all, ignored);
    fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  int entries() const {
    int n = 0;
    for (const auto& entry : fs::directory_iterator(path_)) n += entry.exists() ? 1 : 0;
    return n;
  }

 private:
  std::string path_;
};

std::vector<char> pattern(size_t bytes, unsigned seed) {
  std::vector<char> out(bytes);
  uint32_t x = 2463534242u ^ seed;
  for (char& c : out) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    c = static_cast<char>(x);
  }
  return out;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Runs `fn` and returns the message of the exception of type E it throws ("" when none).
template <typename E, typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

int errno_of(const IoFuture& future) {
  try {
    future.rethrow_if_failed();
  } catch (const IoError& e) {
    return e.error_code();
  }
  return 0;
}

std::string error_of(const IoFuture& future) {
  try {
    future.rethrow_if_failed();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

SpillOptions options(const std::string& dir, uint64_t capacity, int threads = 2,
                     IoMode mode = IoMode::kAuto) {
  SpillOptions o;
  o.dir = dir;
  o.capacity_bytes = capacity;
  o.io_threads = threads;
  o.mode = mode;
  return o;
}

std::vector<char> read_all(SpillStore& store, const std::string& key) {
  auto future = store.read(key, nullptr, 0, nullptr);
  future->wait();
  future->rethrow_if_failed();
  const char* data = future->block()->data();
  return std::vector<char>(data, data + future->nbytes());
}

}  // namespace

TEST(xxh64_matches_reference_values) {
  // Reference values from the xxhash package (python-xxhash 3.x, xxh64_intdigest).
  CHECK_EQ(xxh64("", 0), 0xef46db3751d8e999ULL);
  CHECK_EQ(xxh64("a", 1), 0xd24ec4f1a98c6e5bULL);
  CHECK_EQ(xxh64("abc", 3), 0x44bc2cf5ad770999ULL);
  CHECK_EQ(xxh64("123456789", 9), 0x8cb841db40e6ae83ULL);
  CHECK_EQ(xxh64("", 0, 2654435761ULL), 0xac75fda2929b17efULL);
  CHECK_EQ(xxh64("abc", 3, 2654435761ULL), 0x1318df30094a85fdULL);
  std::string long_input;
  for (int rep = 0; rep < 5; ++rep) {
    for (int i = 0; i < 256; ++i) long_input.push_back(static_cast<char>(i));
  }
  long_input += "xyz";  // 1283 bytes: stripes, 8-, 4- and 1-byte tails
  CHECK_EQ(xxh64(long_input.data(), long_input.size()), 0xafd18a3957d3670aULL);
  CHECK_EQ(xxh64(long_input.data(), long_input.size(), 2654435761ULL), 0x6f0d8cd52e8b4bcbULL);
}

TEST(xxh64_streaming_equals_one_shot) {
  const auto data = pattern(10007, 1);
  const uint64_t expected = xxh64(data.data(), data.size());
  for (size_t piece : {1, 3, 7, 31, 32, 33, 100, 4096}) {
    Xxh64 state;
    for (size_t pos = 0; pos < data.size(); pos += piece) {
      state.update(data.data() + pos, std::min(piece, data.size() - pos));
    }
    CHECK_EQ(state.digest(), expected);
    CHECK_EQ(state.digest(), expected);  // digest leaves the state alone
  }
  Xxh64 state;
  state.update(data.data(), 100);
  (void)state.digest();
  state.update(data.data() + 100, data.size() - 100);
  CHECK_EQ(state.digest(), expected);
}

TEST(extent_allocator_first_fit_and_coalescing) {
  const uint64_t block = 4096;
  ExtentAllocator a(16 * block, block);
  CHECK_EQ(a.allocate(1).value(), uint64_t{0});
  CHECK_EQ(a.allocate(block + 1).value(), block);  // takes two blocks
  CHECK_EQ(a.allocate(block).value(), 3 * block);
  CHECK_EQ(a.used(), 4 * block);
  a.free(block, block + 1);
  CHECK_EQ(a.allocate(block).value(), block);          // first fit: the hole
  CHECK_EQ(a.allocate(2 * block).value(), 4 * block);  // the hole's one block is too small
  CHECK_EQ(a.free_extents(), size_t{2});
  a.free(0, 1);
  a.free(block, block);
  a.free(3 * block, block);
  a.free(4 * block, 2 * block);
  CHECK_EQ(a.used(), uint64_t{0});
  CHECK_EQ(a.free_extents(), size_t{1});
  CHECK_EQ(a.largest_free(), 16 * block);
  CHECK(!a.allocate(16 * block + 1).has_value());
  CHECK_EQ(a.allocate(16 * block).value(), uint64_t{0});
  CHECK(!a.allocate(1).has_value());
  CHECK_EQ(a.largest_free(), uint64_t{0});
}

TEST(extent_allocator_rejects_bad_frees) {
  ExtentAllocator a(8 * 4096, 4096);
  const uint64_t x = a.allocate(4096).value();
  a.free(x, 4096);
  CHECK_THROWS(a.free(x, 4096), std::invalid_argument);         // double free
  CHECK_THROWS(a.free(100, 4096), std::invalid_argument);       // misaligned
  CHECK_THROWS(a.free(8 * 4096, 4096), std::invalid_argument);  // outside
  CHECK_THROWS(ExtentAllocator(4096, 3000), std::invalid_argument);
  CHECK_THROWS(ExtentAllocator(5000, 4096), std::invalid_argument);
}

TEST(io_pool_starts_jobs_in_fifo_order) {
  {
    IoPool pool(1);
    std::mutex mu;
    std::vector<int> order;
    std::vector<std::shared_ptr<IoFuture>> futures;
    for (int i = 0; i < 50; ++i) {
      auto future = std::make_shared<IoFuture>();
      futures.push_back(future);
      pool.submit({[&, i, future](int worker) {
                     {
                       std::lock_guard<std::mutex> lock(mu);
                       order.push_back(i);
                     }
                     CHECK_EQ(worker, 0);
                     future->succeed();
                   },
                   nullptr});
    }
    for (auto& f : futures) f->wait();
    std::vector<int> expected(50);
    for (int i = 0; i < 50; ++i) expected[i] = i;
    CHECK(order == expected);
  }
  // Each job waits for its predecessor to finish: this completes only if jobs start in order.
  IoPool pool(3);
  std::vector<std::shared_ptr<IoFuture>> chain;
  for (int i = 0; i < 100; ++i) {
    auto future = std::make_shared<IoFuture>();
    auto previous = chain.empty() ? nullptr : chain.back();
    chain.push_back(future);
    pool.submit({[future, previous](int) {
                   if (previous) previous->wait();
                   future->succeed();
                 },
                 nullptr});
  }
  CHECK(chain.back()->wait_for(30s));
}

TEST(io_pool_shutdown_cancels_queued_jobs) {
  IoPool pool(1);
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  bool entered = false;
  pool.submit({[&](int) {
                 std::unique_lock<std::mutex> lock(mu);
                 entered = true;
                 cv.notify_all();
                 cv.wait(lock, [&] { return open; });
               },
               nullptr});
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered; });
  }
  std::atomic<int> ran{0};
  std::atomic<int> cancelled{0};
  std::string reason;
  for (int i = 0; i < 5; ++i) {
    pool.submit({[&](int) { ++ran; },
                 [&](const std::string& why) {
                   std::lock_guard<std::mutex> lock(mu);
                   reason = why;
                   ++cancelled;
                 }});
  }
  CHECK_EQ(pool.queued(), size_t{5});
  std::thread stopper([&] { pool.shutdown("closing"); });
  while (cancelled.load() < 5) std::this_thread::sleep_for(1ms);
  {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
  }
  cv.notify_all();
  stopper.join();
  CHECK_EQ(ran.load(), 0);
  CHECK_EQ(reason, std::string("closing"));
  CHECK_THROWS(pool.submit({[](int) {}, nullptr}), std::runtime_error);
  pool.shutdown();  // again: nothing happens
}

TEST(spill_file_pread_pwrite_roundtrip) {
  TempDir dir;
  auto file = SpillFile::create(dir.path(), kMiB - 100, IoMode::kBuffered);
  CHECK(!file->direct());
  CHECK(contains(file->mode_reason(), "buffered"));
  CHECK_EQ(file->capacity(), uint64_t{kMiB});
  struct stat st;
  CHECK_EQ(::stat(file->path().c_str(), &st), 0);
  CHECK_EQ(static_cast<uint64_t>(st.st_size), uint64_t{kMiB});  // preallocated
  CHECK_EQ(dir.entries(), 1);
  const auto data = pattern(50000, 2);
  file->write(12345, data.data(), data.size());  // buffered: any offset and length
  std::vector<char> back(data.size());
  file->read(12345, back.data(), back.size());
  CHECK(back == data);
  CHECK_THROWS(file->write(kMiB - 10, data.data(), 100), std::invalid_argument);
  file->close();
  CHECK_EQ(dir.entries(), 0);  // deleted on close
  CHECK(message_of<IoError>([&] { file->write(0, data.data(), 1); }).find("closed") !=
        std::string::npos);
  file->close();  // idempotent
}

TEST(spill_file_direct_or_reported_fallback) {
  TempDir dir;
  auto file = SpillFile::create(dir.path(), kMiB, IoMode::kAuto);
  std::printf("   /tmp: %s (%s)\n", file->direct() ? "direct" : "buffered",
              file->mode_reason().c_str());
  if (!file->direct()) {
    CHECK(contains(file->mode_reason(), "refused O_DIRECT"));
    return;
  }
  auto buf = HostBlock::allocate(8192, HostPinning::kPageable);
  const auto data = pattern(8192, 3);
  std::memcpy(buf->data(), data.data(), data.size());
  file->write(4096, buf->data(), 8192);
  std::memset(buf->data(), 0, 8192);
  file->read(4096, buf->data(), 8192);
  CHECK(std::memcmp(buf->data(), data.data(), data.size()) == 0);
  CHECK_THROWS(file->write(100, buf->data(), 4096), std::invalid_argument);    // offset
  CHECK_THROWS(file->write(0, buf->data(), 100), std::invalid_argument);       // length
  CHECK_THROWS(file->write(0, buf->data() + 1, 4096), std::invalid_argument);  // address
}

TEST(spill_file_injected_open_direct_einval_falls_back) {
  TempDir dir;
  testing_fail_next(1, EINVAL, IoOp::kOpenDirect);  // as tmpfs before Linux 6.6 answers
  auto file = SpillFile::create(dir.path(), kMiB, IoMode::kAuto);
  CHECK(!file->direct());
  CHECK(contains(file->mode_reason(), "refused O_DIRECT at open"));
  CHECK_EQ(dir.entries(), 1);
  const auto data = pattern(777, 4);
  file->write(1, data.data(), data.size());
  std::vector<char> back(data.size());
  file->read(1, back.data(), back.size());
  CHECK(back == data);
  testing_fail_next(1, EINVAL, IoOp::kOpenDirect);
  CHECK(contains(message_of<std::invalid_argument>(
                     [&] { SpillFile::create(dir.path(), kMiB, IoMode::kDirect); }),
                 "refuses O_DIRECT"));
  testing_fail_next(0, 0, IoOp::kOpenDirect);
  CHECK_EQ(dir.entries(), 1);  // the refused attempt left no file behind
}

TEST(spill_file_probe_einval_falls_back) {
  TempDir dir;
  if (!SpillFile::create(dir.path(), kMiB, IoMode::kAuto)->direct()) {
    std::printf("   skipped: /tmp refuses O_DIRECT at open, the probe never runs\n");
    return;
  }
  // The filesystem takes O_DIRECT at open but refuses the first direct write.
  testing_fail_next(1, EINVAL, IoOp::kWrite);
  auto file = SpillFile::create(dir.path(), kMiB, IoMode::kAuto);
  CHECK(!file->direct());
  CHECK(contains(file->mode_reason(), "refused direct I/O"));
  CHECK_EQ(dir.entries(), 1);
  testing_fail_next(1, EINVAL, IoOp::kWrite);
  CHECK_THROWS(SpillFile::create(dir.path(), kMiB, IoMode::kDirect), std::invalid_argument);
  testing_fail_next(1, EIO, IoOp::kWrite);  // any other error is an error
  CHECK_EQ(message_of<IoError>([&] { SpillFile::create(dir.path(), kMiB, IoMode::kAuto); }).empty(),
           false);
  testing_fail_next(0, 0, IoOp::kWrite);
  CHECK_EQ(dir.entries(), 1);
}

TEST(spill_file_bad_directory_errors) {
  TempDir dir;
  const std::string missing = dir.path() + "/missing";
  CHECK(contains(
      message_of<std::invalid_argument>([&] { SpillFile::create(missing, kMiB, IoMode::kAuto); }),
      "does not exist: create the directory"));
  const std::string file_path = dir.path() + "/plain-file";
  std::fclose(std::fopen(file_path.c_str(), "w"));
  CHECK(contains(
      message_of<std::invalid_argument>([&] { SpillFile::create(file_path, kMiB, IoMode::kAuto); }),
      "is not a directory"));
  CHECK(contains(
      message_of<std::invalid_argument>([&] { SpillFile::create(dir.path(), 0, IoMode::kAuto); }),
      "capacity_bytes must be > 0"));
  if (::geteuid() == 0) {
    std::printf("   not-writable case skipped: root may write anywhere\n");
    return;
  }
  const std::string locked = dir.path() + "/locked";
  fs::create_directory(locked);
  fs::permissions(locked, fs::perms::owner_read | fs::perms::owner_exec);
  CHECK(contains(
      message_of<std::invalid_argument>([&] { SpillFile::create(locked, kMiB, IoMode::kAuto); }),
      "is not writable"));
  fs::permissions(locked, fs::perms::owner_all);
}

TEST(spill_file_capacity_above_free_space) {
  TempDir dir;
  struct statvfs vfs;
  CHECK_EQ(::statvfs(dir.path().c_str(), &vfs), 0);
  const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  const std::string message = message_of<std::invalid_argument>(
      [&] { SpillFile::create(dir.path(), free_bytes + (uint64_t{1} << 40), IoMode::kAuto); });
  CHECK(contains(message, "exceeds the free space"));
  CHECK(contains(message, "lower capacity_bytes"));
  CHECK_EQ(dir.entries(), 0);
}

TEST(spill_store_roundtrip_aligned_and_unaligned) {
  const std::vector<size_t> sizes = {0, 1, 4095, 4096, 4097, 5 * kMiB + 123, 9 * kMiB};
  for (IoMode mode : {IoMode::kBuffered, IoMode::kAuto}) {
    TempDir dir;
    SpillStore store(options(dir.path(), 64 * kMiB, 2, mode));
    std::vector<std::shared_ptr<HostBlock>> aligned_src;
    std::vector<std::vector<char>> unaligned_src;
    std::vector<std::shared_ptr<IoFuture>> writes;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto data = pattern(sizes[i], static_cast<unsigned>(i));
      aligned_src.push_back(HostBlock::allocate(sizes[i], HostPinning::kPageable));
      if (!data.empty()) std::memcpy(aligned_src.back()->data(), data.data(), data.size());
      unaligned_src.emplace_back(data.size() + 1);
      if (!data.empty()) std::memcpy(unaligned_src.back().data() + 1, data.data(), data.size());
      writes.push_back(store.write("a" + std::to_string(i), aligned_src.back()->data(), sizes[i],
                                   aligned_src.back()));
      writes.push_back(
          store.write("u" + std::to_string(i), unaligned_src.back().data() + 1, sizes[i], nullptr));
    }
    for (auto& w : writes) {
      CHECK(w->wait_for(30s));
      CHECK_EQ(error_of(*w), std::string());
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto data = pattern(sizes[i], static_cast<unsigned>(i));
      for (const std::string prefix : {"a", "u"}) {
        const std::string key = prefix + std::to_string(i);
        CHECK(read_all(store, key) == data);  // into a fresh aligned block
        std::vector<char> unaligned(sizes[i] + 1);
        auto r = store.read(key, unaligned.data() + 1, sizes[i], nullptr);
        r->wait();
        CHECK_EQ(error_of(*r), std::string());
        // (memcmp must not see the null data() of an empty vector, even for 0 bytes: UBSan)
        CHECK(data.empty() || std::memcmp(unaligned.data() + 1, data.data(), data.size()) == 0);
        auto exact = HostBlock::allocate(sizes[i], HostPinning::kPageable);  // aligned, and
        auto e = store.read(key, exact->data(), std::max<size_t>(sizes[i], 1), nullptr);  // tight
        e->wait();
        CHECK_EQ(error_of(*e), std::string());
        CHECK(data.empty() || std::memcmp(exact->data(), data.data(), data.size()) == 0);
      }
    }
    const auto stats = store.stats();
    size_t total = 0;
    for (size_t s : sizes) total += s;
    CHECK_EQ(stats.bytes_written, static_cast<int64_t>(2 * total));
    CHECK_EQ(stats.bytes_read, static_cast<int64_t>(6 * total));
    CHECK_EQ(stats.keys, static_cast<int64_t>(2 * sizes.size()));
    CHECK_EQ(stats.checksum_failures, 0);
    std::vector<char> small(10);
    CHECK_THROWS(store.read("a6", small.data(), small.size(), nullptr), std::invalid_argument);
    CHECK_THROWS(store.read("nope", nullptr, 0, nullptr), KeyNotFound);
  }
}

TEST(spill_store_detects_corruption) {
  TempDir dir;
  SpillStore store(options(dir.path(), 4 * kMiB));
  const auto data = pattern(10000, 5);
  auto w = store.write("layer.0/L", data.data(), data.size(), nullptr);
  w->wait();
  CHECK(!w->failed());
  const auto [offset, extent] = store.extent("layer.0/L").value();
  CHECK_EQ(extent, uint64_t{12288});
  const int fd = ::open(store.path().c_str(), O_RDWR);
  CHECK(fd >= 0);
  char byte = 0;
  CHECK_EQ(::pread(fd, &byte, 1, static_cast<off_t>(offset + 5000)), ssize_t{1});
  byte = static_cast<char>(byte ^ 0x10);
  CHECK_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(offset + 5000)), ssize_t{1});
  ::fsync(fd);
  ::close(fd);
  auto r = store.read("layer.0/L", nullptr, 0, nullptr);
  r->wait();
  bool caught = false;
  try {
    r->rethrow_if_failed();
  } catch (const ChecksumError& e) {
    caught = true;
    CHECK_EQ(e.key(), std::string("layer.0/L"));
    CHECK(contains(e.what(), "'layer.0/L'"));
    CHECK(contains(e.what(), "offset " + std::to_string(offset)));
    CHECK(contains(e.what(), "corrupt"));
  }
  CHECK(caught);
  CHECK_EQ(store.stats().checksum_failures, 1);
  store.write("layer.0/L", data.data(), data.size(), nullptr)->wait();  // the caller recomputes
  CHECK(read_all(store, "layer.0/L") == data);
}

TEST(spill_store_write_failure_carries_errno) {
  TempDir dir;
  SpillStore store(options(dir.path(), 4 * kMiB));
  const auto data = pattern(3 * 4096, 6);
  for (int err : {ENOSPC, EIO}) {
    testing_fail_next(1, err, IoOp::kWrite);
    auto w = store.write("k", data.data(), data.size(), nullptr);
    w->wait();
    CHECK(w->failed());
    CHECK_EQ(errno_of(*w), err);
    CHECK(contains(error_of(*w), "writing key 'k' failed"));
    CHECK(!store.contains("k"));
    CHECK_THROWS(store.read("k", nullptr, 0, nullptr), KeyNotFound);
  }
  CHECK_EQ(store.stats().write_failures, 2);
  CHECK_EQ(store.stats().used_bytes, 0);  // the failed writes' extents came back
  store.write("k", data.data(), data.size(), nullptr)->wait();
  CHECK(read_all(store, "k") == data);
}

TEST(spill_store_read_failure_carries_errno) {
  TempDir dir;
  SpillStore store(options(dir.path(), 4 * kMiB));
  const auto data = pattern(5000, 7);
  store.write("k", data.data(), data.size(), nullptr)->wait();
  testing_fail_next(1, EIO, IoOp::kRead);
  auto r = store.read("k", nullptr, 0, nullptr);
  r->wait();
  CHECK_EQ(errno_of(*r), EIO);
  CHECK(contains(error_of(*r), "reading key 'k' failed"));
  CHECK_EQ(store.stats().read_failures, 1);
  CHECK(read_all(store, "k") == data);  // a later read is fine
}

TEST(spill_store_full_is_enospc) {
  TempDir dir;
  SpillStore store(options(dir.path(), 3 * 4096));
  const auto data = pattern(8192, 8);
  store.write("a", data.data(), data.size(), nullptr)->wait();
  int code = 0;
  std::string message;
  try {
    store.write("b", data.data(), data.size(), nullptr);
  } catch (const IoError& e) {
    code = e.error_code();
    message = e.what();
  }
  CHECK_EQ(code, ENOSPC);
  CHECK(contains(message, "spill store is full"));
  CHECK(contains(message, "raise capacity_bytes or delete keys"));
  CHECK(store.remove("a"));
  CHECK(!store.remove("a"));
  store.write("b", data.data(), data.size(), nullptr)->wait();
  CHECK(read_all(store, "b") == data);
}

TEST(spill_store_replace_while_reading) {
  TempDir dir;
  SpillStore store(options(dir.path(), 64 * kMiB, 1));
  const auto first = pattern(8 * kMiB, 9);
  const auto second = pattern(3 * kMiB, 10);
  auto w1 = store.write("k", first.data(), first.size(), nullptr);
  auto r1 = store.read("k", nullptr, 0, nullptr);  // queued behind w1; waits for it
  auto w2 = store.write("k", second.data(), second.size(), nullptr);
  auto r2 = store.read("k", nullptr, 0, nullptr);
  CHECK(store.remove("k"));  // r2 still reads the second value
  for (auto& f : {w1, r1, w2, r2}) {
    CHECK(f->wait_for(30s));
    CHECK_EQ(error_of(*f), std::string());
  }
  CHECK_EQ(r1->nbytes(), first.size());
  CHECK(std::memcmp(r1->block()->data(), first.data(), first.size()) == 0);
  CHECK_EQ(r2->nbytes(), second.size());
  CHECK(std::memcmp(r2->block()->data(), second.data(), second.size()) == 0);
  w1.reset();
  r1.reset();
  w2.reset();
  r2.reset();
  CHECK_EQ(store.stats().used_bytes, 0);  // both extents came back once their reads finished
}

TEST(spill_store_close_cancels_and_deletes) {
  TempDir dir;
  std::string path;
  {
    SpillStore store(options(dir.path(), 64 * kMiB, 1));
    path = store.path();
    CHECK(fs::exists(path));
    const auto data = pattern(kMiB, 11);
    std::vector<std::shared_ptr<IoFuture>> futures;
    for (int i = 0; i < 40; ++i) {
      futures.push_back(store.write("k" + std::to_string(i), data.data(), data.size(), nullptr));
    }
    store.close();
    int done = 0, closed = 0;
    for (auto& f : futures) {
      CHECK(f->done());
      if (!f->failed()) {
        ++done;
        continue;
      }
      try {
        f->rethrow_if_failed();
      } catch (const StoreClosed&) {
        ++closed;
      }
    }
    CHECK_EQ(done + closed, 40);
    CHECK(!fs::exists(path));
    CHECK_THROWS(store.write("x", data.data(), 1, nullptr), StoreClosed);
    CHECK_THROWS(store.read("k0", nullptr, 0, nullptr), StoreClosed);
    store.close();
  }
  {
    SpillStore store(options(dir.path(), kMiB));
    path = store.path();
    CHECK(fs::exists(path));
  }
  CHECK(!fs::exists(path));  // the destructor deletes the file too
  CHECK_EQ(dir.entries(), 0);
}

int main(int argc, char** argv) { return harness::run_tests(argc, argv); }
