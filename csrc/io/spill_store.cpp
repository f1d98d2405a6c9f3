#include "io/spill_store.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "io/checksum.h"
#include "io/extent_allocator.h"

namespace asteria::io {
namespace {

constexpr size_t kIoChunk = size_t{4} << 20;      // bytes per system call; also hashed per chunk
constexpr size_t kBounceBytes = size_t{4} << 20;  // per I/O thread, direct mode
constexpr int kMaxIoThreads = 64;

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kIoAlignment == 0; }

size_t round_io(size_t bytes) { return (bytes + kIoAlignment - 1) / kIoAlignment * kIoAlignment; }

std::string hex(uint64_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << value;
  return out.str();
}

}  // namespace

struct SpillStore::Extents {
  std::mutex mu;
  ExtentAllocator allocator;
  explicit Extents(uint64_t capacity) : allocator(capacity, kIoAlignment) {}
};

struct SpillStore::Entry {
  std::string key;
  uint64_t offset = 0;
  uint64_t extent = 0;
  size_t nbytes = 0;
  uint64_t checksum = 0;  // written by the write job before `written` resolves
  std::shared_ptr<IoFuture> written = std::make_shared<IoFuture>();
  std::shared_ptr<Extents> extents;

  ~Entry() {
    if (!extents) return;
    try {
      std::lock_guard<std::mutex> lock(extents->mu);
      extents->allocator.free(offset, extent);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "asteria: spill store lost an extent of key '%s': %s\n", key.c_str(),
                   e.what());
    }
  }
};

SpillStore::SpillStore(const SpillOptions& options) {
  if (options.io_threads < 1 || options.io_threads > kMaxIoThreads) {
    throw std::invalid_argument("io_threads must be in [1, " + std::to_string(kMaxIoThreads) +
                                "], got " + std::to_string(options.io_threads));
  }
  file_ = SpillFile::create(options.dir, options.capacity_bytes, options.mode);
  extents_ = std::make_shared<Extents>(file_->capacity());
  if (file_->direct()) {
    for (int i = 0; i < options.io_threads; ++i) {
      bounce_.push_back(memory::HostBlock::allocate(kBounceBytes, memory::HostPinning::kPageable));
    }
  }
  pool_ = std::make_unique<IoPool>(options.io_threads);
}

SpillStore::~SpillStore() { close(); }

void SpillStore::check_open_locked(const char* what) const {
  if (closed_) {
    throw StoreClosed(std::string("SpillStore.") + what + ": the spill store '" + file_->path() +
                      "' is closed");
  }
}

std::shared_ptr<SpillStore::Entry> SpillStore::lookup_locked(const std::string& key) const {
  const auto it = index_.find(key);
  if (it == index_.end()) {
    throw KeyNotFound("key '" + key +
                      "' is not in the spill store (never written, deleted, or its write failed)");
  }
  return it->second;
}

void SpillStore::forget(const std::shared_ptr<Entry>& entry) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = index_.find(entry->key);
  if (it != index_.end() && it->second == entry) index_.erase(it);
}

std::shared_ptr<IoFuture> SpillStore::write(const std::string& key, const void* src, size_t bytes,
                                            std::shared_ptr<const void> keepalive) {
  if (bytes > 0 && src == nullptr) throw std::invalid_argument("SpillStore.write: null source");
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_open_locked("put");
  }
  auto entry = std::make_shared<Entry>();
  entry->key = key;
  entry->nbytes = bytes;
  {
    std::lock_guard<std::mutex> lock(extents_->mu);
    ExtentAllocator& allocator = extents_->allocator;
    entry->extent = allocator.rounded(bytes);
    const std::optional<uint64_t> offset = allocator.allocate(bytes);
    if (!offset) {
      throw IoError(ENOSPC, "spill store is full: key '" + key + "' needs " +
                                std::to_string(entry->extent) +
                                " bytes but the largest free extent has " +
                                std::to_string(allocator.largest_free()) + " (" +
                                std::to_string(allocator.used()) + " of " +
                                std::to_string(allocator.capacity()) +
                                " bytes in use); raise capacity_bytes or delete keys");
    }
    entry->offset = *offset;
  }
  entry->extents = extents_;  // from here on, the entry gives its extent back when it goes
  std::shared_ptr<IoFuture> future = entry->written;
  // Jobs drop their reference to the entry before resolving the future, so that a failed or
  // replaced entry's extent is back in the allocator by the time a waiter wakes up.
  IoJob job;
  job.run = [this, entry, src, bytes, keepalive = std::move(keepalive)](int worker) mutable {
    std::shared_ptr<Entry> held = std::move(entry);
    std::shared_ptr<IoFuture> written = held->written;
    written->mark_started();
    std::exception_ptr error;
    try {
      run_write(worker, *held, static_cast<const char*>(src), bytes);
    } catch (const IoError& e) {
      error = std::make_exception_ptr(IoError(
          e.error_code(), "spill store: writing key '" + held->key + "' failed: " + e.what()));
    } catch (...) {
      error = std::current_exception();
    }
    keepalive.reset();
    if (error) {
      ++write_failures_;
      forget(held);
    }
    held.reset();
    if (error) {
      written->fail(error);
    } else {
      written->succeed();
    }
  };
  job.cancel = [this, weak = std::weak_ptr<Entry>(entry)](const std::string& reason) {
    std::shared_ptr<Entry> held = weak.lock();
    if (!held) return;
    std::shared_ptr<IoFuture> written = held->written;
    forget(held);
    held.reset();
    written->fail(std::make_exception_ptr(StoreClosed(reason)));
  };
  std::lock_guard<std::mutex> lock(mu_);
  check_open_locked("put");
  // Index and queue change together, so a read that finds this entry is queued behind its write.
  index_[key] = entry;
  pool_->submit(std::move(job));
  return future;
}

std::shared_ptr<IoFuture> SpillStore::read(const std::string& key, void* dst, size_t capacity,
                                           std::shared_ptr<const void> keepalive) {
  auto future = std::make_shared<IoFuture>();
  std::lock_guard<std::mutex> lock(mu_);
  check_open_locked("get");
  std::shared_ptr<Entry> entry = lookup_locked(key);
  if (dst != nullptr && capacity < entry->nbytes) {
    throw std::invalid_argument("SpillStore.get: key '" + key + "' holds " +
                                std::to_string(entry->nbytes) + " bytes; the output buffer has " +
                                std::to_string(capacity));
  }
  IoJob job;
  job.run = [this, entry, dst, capacity, future,
             keepalive = std::move(keepalive)](int worker) mutable {
    run_read(worker, std::move(entry), static_cast<char*>(dst), capacity, std::move(keepalive),
             *future);
  };
  job.cancel = [future](const std::string& reason) {
    future->fail(std::make_exception_ptr(StoreClosed(reason)));
  };
  pool_->submit(std::move(job));
  return future;
}

void SpillStore::run_write(int worker, Entry& entry, const char* src, size_t bytes) {
  entry.checksum = write_payload(worker, entry.offset, src, bytes);
  bytes_written_ += static_cast<int64_t>(bytes);
  ++writes_;
}

void SpillStore::run_read(int worker, std::shared_ptr<Entry> entry, char* dst, size_t capacity,
                          std::shared_ptr<const void> keepalive, IoFuture& future) {
  future.mark_started();
  entry->written->wait();  // running or done: Note [FIFO start order]
  std::shared_ptr<memory::HostBlock> block;
  std::exception_ptr error;
  const size_t nbytes = entry->nbytes;
  if (entry->written->failed()) {
    try {
      entry->written->rethrow_if_failed();
    } catch (const IoError& e) {
      error = std::make_exception_ptr(
          IoError(e.error_code(), "spill store: key '" + entry->key +
                                      "' cannot be read because its write failed: " + e.what()));
    } catch (...) {
      error = std::current_exception();
    }
  } else {
    try {
      if (dst == nullptr) {
        block = memory::HostBlock::allocate(nbytes, memory::HostPinning::kPageable);
        dst = block->data();
        capacity = block->size();
      }
      const uint64_t checksum = read_payload(worker, entry->offset, dst, nbytes, capacity);
      if (checksum != entry->checksum) {
        ++checksum_failures_;
        error = std::make_exception_ptr(ChecksumError(
            entry->key, "spill store: checksum mismatch reading key '" + entry->key + "' (" +
                            std::to_string(nbytes) + " bytes in the slot at offset " +
                            std::to_string(entry->offset) + " of '" + file_->path() +
                            "'): written with xxh64 " + hex(entry->checksum) + ", read back " +
                            hex(checksum) +
                            "; the spilled copy is corrupt: recompute the value or write it "
                            "again"));
      } else {
        bytes_read_ += static_cast<int64_t>(nbytes);
        ++reads_;
      }
    } catch (const IoError& e) {
      ++read_failures_;
      error = std::make_exception_ptr(IoError(
          e.error_code(), "spill store: reading key '" + entry->key + "' failed: " + e.what()));
    } catch (...) {
      ++read_failures_;
      error = std::current_exception();
    }
  }
  entry.reset();  // a removed or replaced entry gives its extent back now
  keepalive.reset();
  if (error) {
    future.fail(error);
  } else {
    future.succeed(std::move(block), nbytes);
  }
}

uint64_t SpillStore::write_payload(int worker, uint64_t offset, const char* src, size_t bytes) {
  Xxh64 hash;
  size_t pos = 0;
  if (!file_->direct() || aligned(src)) {
    // Straight from the caller's buffer: all of it when buffered, whole blocks when direct.
    const size_t end = file_->direct() ? bytes / kIoAlignment * kIoAlignment : bytes;
    for (; pos < end; pos += std::min(kIoChunk, end - pos)) {
      const size_t len = std::min(kIoChunk, end - pos);
      hash.update(src + pos, len);
      file_->write(offset + pos, src + pos, len);
    }
  }
  if (pos < bytes) {
    // Through the bounce buffer, padded with zeros to whole blocks (the extent has room).
    char* bounce = bounce_[worker]->data();
    const size_t room = bounce_[worker]->size();
    for (; pos < bytes; pos += std::min(room, bytes - pos)) {
      const size_t len = std::min(room, bytes - pos);
      std::memcpy(bounce, src + pos, len);
      hash.update(bounce, len);
      const size_t padded = round_io(len);
      std::memset(bounce + len, 0, padded - len);
      file_->write(offset + pos, bounce, padded);
    }
  }
  return hash.digest();
}

uint64_t SpillStore::read_payload(int worker, uint64_t offset, char* dst, size_t bytes,
                                  size_t capacity) {
  Xxh64 hash;
  size_t pos = 0;
  if (!file_->direct() || aligned(dst)) {
    // Straight into the caller's buffer: all of it when buffered; when direct, whole blocks, and
    // the last partial block too if the buffer has room for its padding.
    size_t end = bytes;
    if (file_->direct())
      end = capacity >= round_io(bytes) ? round_io(bytes) : bytes / kIoAlignment * kIoAlignment;
    for (; pos < end; pos += std::min(kIoChunk, end - pos)) {
      const size_t len = std::min(kIoChunk, end - pos);
      file_->read(offset + pos, dst + pos, len);
      hash.update(dst + pos, std::min(len, bytes - pos));
    }
  }
  if (pos < bytes) {
    char* bounce = bounce_[worker]->data();
    const size_t room = bounce_[worker]->size();
    for (; pos < bytes; pos += std::min(room, bytes - pos)) {
      const size_t len = std::min(room, bytes - pos);
      file_->read(offset + pos, bounce, round_io(len));
      std::memcpy(dst + pos, bounce, len);
      hash.update(dst + pos, len);
    }
  }
  return hash.digest();
}

bool SpillStore::remove(const std::string& key) {
  std::shared_ptr<Entry> dropped;  // released after the lock: it may give its extent back
  std::lock_guard<std::mutex> lock(mu_);
  check_open_locked("delete");
  const auto it = index_.find(key);
  if (it == index_.end()) return false;
  dropped = std::move(it->second);
  index_.erase(it);
  return true;
}

bool SpillStore::contains(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.count(key) > 0;
}

std::optional<size_t> SpillStore::nbytes(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  return it->second->nbytes;
}

std::optional<std::pair<uint64_t, uint64_t>> SpillStore::extent(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  return std::make_pair(it->second->offset, it->second->extent);
}

std::vector<std::string> SpillStore::keys() const {
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.reserve(index_.size());
    for (const auto& [key, entry] : index_) out.push_back(key);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void SpillStore::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  pool_->shutdown("the spill store was closed before this operation ran");
  std::unordered_map<std::string, std::shared_ptr<Entry>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(index_);
  }
  dropped.clear();
  file_->close();
}

bool SpillStore::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

SpillStats SpillStore::stats() const {
  SpillStats s;
  s.bytes_written = bytes_written_.load();
  s.bytes_read = bytes_read_.load();
  s.writes = writes_.load();
  s.reads = reads_.load();
  s.write_failures = write_failures_.load();
  s.read_failures = read_failures_.load();
  s.checksum_failures = checksum_failures_.load();
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.keys = static_cast<int64_t>(index_.size());
  }
  {
    std::lock_guard<std::mutex> lock(extents_->mu);
    s.used_bytes = static_cast<int64_t>(extents_->allocator.used());
    s.capacity_bytes = static_cast<int64_t>(extents_->allocator.capacity());
  }
  s.queued = static_cast<int64_t>(pool_->queued());
  return s;
}

}  // namespace asteria::io
