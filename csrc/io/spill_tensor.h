// The spill store (io/spill_store.h) for torch tensors: asteria._C.SpillStore and SpillFuture,
// which asteria/memory/nvme.py wraps.
//
// Contract
// --------
// * write(key, tensor): writes the tensor's bytes under `key`. A contiguous CPU tensor is written
//   in place and held until the write finished: do not modify it before the future resolves. A
//   CUDA or non-contiguous tensor is first copied, synchronously, into contiguous host memory.
// * read(key, out): reads the key's bytes into `out` (a contiguous CPU tensor of exactly the
//   stored size, held until the read finished) or, without `out`, into a new one-dimensional uint8
//   CPU tensor over a 4 KiB aligned host block (memory/host_tensor.h). Shapes and dtypes are not
//   stored here; the caller keeps them.
// * SpillFuture::result(timeout_s) waits (the bindings release the GIL) and returns nothing for a
//   write and the tensor for a read, or throws the operation's error: io::IoError (errno kept),
//   io::ChecksumError, io::StoreClosed; memory::WaitTimeout when the timeout passes first.
// * Thread safety: as the spill store; every member may be called from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "io/spill_store.h"

namespace asteria::io {

class SpillFuture {
 public:
  SpillFuture(std::shared_ptr<IoFuture> future, std::optional<at::Tensor> out, bool is_read)
      : future_(std::move(future)), out_(std::move(out)), is_read_(is_read) {}

  bool done() const { return future_->done(); }
  bool is_read() const { return is_read_; }
  std::optional<at::Tensor> result(std::optional<double> timeout_s) const;
  // time.monotonic() seconds when an I/O thread started / finished the operation, or None.
  std::optional<double> started_at() const;
  std::optional<double> finished_at() const;

 private:
  std::shared_ptr<IoFuture> future_;
  std::optional<at::Tensor> out_;
  bool is_read_;
};

class TensorSpillStore {
 public:
  TensorSpillStore(const std::string& dir, int64_t capacity_bytes, int io_threads,
                   const std::string& mode);

  SpillFuture write(const std::string& key, const at::Tensor& tensor);
  SpillFuture read(const std::string& key, const std::optional<at::Tensor>& out);
  bool remove(const std::string& key) { return store_->remove(key); }
  bool contains(const std::string& key) const { return store_->contains(key); }
  std::optional<int64_t> nbytes(const std::string& key) const;
  std::optional<std::tuple<int64_t, int64_t>> extent(const std::string& key) const;
  std::vector<std::string> keys() const { return store_->keys(); }
  void close() { store_->close(); }
  bool closed() const { return store_->closed(); }

  // bytes_written, bytes_read, writes, reads, write_failures, read_failures, checksum_failures,
  // keys, used_bytes, capacity_bytes, queued, io_threads.
  std::map<std::string, int64_t> stats() const;
  std::string path() const { return store_->path(); }
  std::string mode() const { return store_->direct() ? "direct" : "buffered"; }
  std::string mode_reason() const { return store_->mode_reason(); }
  int io_threads() const { return store_->io_threads(); }

 private:
  std::unique_ptr<SpillStore> store_;
};

// Test hook (io/spill_file.h): the next n operations of kind op ('write', 'read', 'open_direct')
// fail with errno error_code.
void testing_io_fail_next(int n, int error_code, const std::string& op);

}  // namespace asteria::io
