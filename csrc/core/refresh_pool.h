// Refresh pool: the matrix functions of core/matrix_functions.h as jobs on the worker pool, and
// the futures Python waits on (asteria._C.WorkerPool / asteria._C.Future).
//
// Contract
// --------
// * Ownership: submit_* copy their tensor arguments (detached, on the CPU) before returning, so
//   the caller may mutate or free its tensors at once (copy=false hands a CPU tensor over
//   instead: the job reads it in place and the caller must not write it before the future
//   resolves); a CUDA tensor is copied synchronously here
//   (the asynchronous path is the runtime's staged snapshots, asteria/runtime/snapshots.py). A
//   job's result is owned by its future alone: it is freed once the future and every tensor
//   handed out by result() are gone.
// * Threads: every member may be called from any thread. Jobs run on the pool's workers with
//   autograd off and `lapack_threads` LAPACK/OpenMP threads each (a per-thread setting; torch's
//   process-wide thread count is untouched). Nothing here takes the GIL: the bindings release it
//   around every call that can block (submit when the queue is full, result, shutdown).
// * Scheduling: as core::WorkerPool (deadline order, a newer submission for a block cancels its
//   queued predecessor, bounded queue). A thread about to wait for a future may run the jobs
//   queued up to it itself (RefreshFuture::run_ahead).
// * Results: a successful job writes its result, then resolves its future. The future and every
//   result() call share the same result tensors: treat them as read-only (clone before writing
//   in place). Errors resolve the
//   future; result() rethrows them with the block name and version prepended and the original kind
//   kept: MatrixFunctionError stays MatrixFunctionError, invalid arguments become
//   std::invalid_argument (ValueError in Python), anything else std::runtime_error. Cancellation
//   throws core::JobCancelled; a timeout, FutureTimeout.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "core/worker_pool.h"

namespace asteria {

// What a refresh returns: inverse_root -> Tensor; eigh -> (evals, evecs); qr_refresh ->
// (Q, perm or None).
using RefreshValue = std::variant<at::Tensor, std::tuple<at::Tensor, at::Tensor>,
                                  std::tuple<at::Tensor, std::optional<at::Tensor>>>;

// Thrown by RefreshFuture::result when the timeout passes first (TimeoutError in Python).
class FutureTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RefreshFuture {
 public:
  RefreshFuture(std::shared_ptr<core::JobHandle> handle, std::shared_ptr<const RefreshValue> out,
                std::weak_ptr<core::WorkerPool> pool = {}, int lapack_threads = 1);

  bool done() const { return handle_->done(); }
  bool cancelled() const { return handle_->status() == core::JobStatus::kCancelled; }
  std::string status() const { return core::to_string(handle_->status()); }
  const std::string& block() const { return handle_->block(); }
  int64_t version() const { return handle_->version(); }
  int64_t deadline() const { return handle_->deadline(); }
  // time.monotonic() seconds when a worker started / finished the job; nullopt until then.
  std::optional<double> started_at() const;
  std::optional<double> finished_at() const;

  // Waits (forever when timeout_s is nullopt) and returns the result or throws (see contract).
  RefreshValue result(std::optional<double> timeout_s = std::nullopt) const;

  // While this job is still queued, runs the pool's first queued job (this one or one queued
  // before it) on the calling thread, with the pool's LAPACK thread count; returns whether one
  // ran (Note [Helping waiters] in worker_pool.cpp). Call it again until it returns false.
  bool run_ahead() const;

 private:
  std::shared_ptr<core::JobHandle> handle_;
  std::shared_ptr<const RefreshValue> out_;  // written by the job before the handle resolves
  std::weak_ptr<core::WorkerPool> pool_;     // gone: the pool was destroyed, nothing to help
  int lapack_threads_;
};

struct RefreshPoolOptions {
  int workers = core::default_worker_count();
  int lapack_threads = 1;
  std::vector<int> affinity;
  int64_t queue_capacity = 1024;
  int nice = 0;  // added to each worker's nice value (Note [Worker priority], worker_pool.cpp)
  // Return freed heap memory to the system when a worker goes idle after jobs that moved at
  // least this many bytes (0: never); Note [Returning freed memory] in refresh_pool.cpp.
  int64_t trim_bytes = int64_t{64} << 20;
};

class RefreshPool {
 public:
  explicit RefreshPool(const RefreshPoolOptions& options);
  ~RefreshPool();

  RefreshFuture submit_eigh(const std::string& block, int64_t version, int64_t deadline,
                            const at::Tensor& factor, at::ScalarType dtype, bool copy = true);
  RefreshFuture submit_qr_refresh(const std::string& block, int64_t version, int64_t deadline,
                                  const at::Tensor& factor, const at::Tensor& basis, bool sort,
                                  at::ScalarType dtype, bool copy = true);
  RefreshFuture submit_inverse_root(const std::string& block, int64_t version, int64_t deadline,
                                    const at::Tensor& factor, double root, double epsilon,
                                    at::ScalarType dtype, bool copy = true);

  void shutdown(bool wait = true) { pool_->shutdown(wait); }
  bool is_shutdown() const { return pool_->is_shutdown(); }
  // submitted, completed, cancelled, failed, queued, running, trims (Note [Returning freed
  // memory]).
  std::map<std::string, int64_t> stats() const;
  int workers() const { return pool_->workers(); }
  int lapack_threads() const { return lapack_threads_; }
  int64_t trims() const { return trims_.load(); }

 private:
  using Compute = std::function<RefreshValue()>;
  RefreshFuture submit(core::JobSpec spec, Compute compute);

  void on_idle();

  const int lapack_threads_;
  const int64_t trim_bytes_;
  std::atomic<int64_t> churn_bytes_{0};  // bytes moved by jobs since the last trim
  std::atomic<int64_t> trims_{0};
  std::shared_ptr<core::WorkerPool> pool_;  // futures hold it weakly (run_ahead)
};

}  // namespace asteria
