// I/O threads for the spill store: a FIFO queue served by a few std::threads, and the futures
// that callers wait on.
//
// Contract
// --------
// * Own threads: nothing is shared with the refresh worker pool (core/worker_pool.h), so a refresh
//   never queues behind a disk and a slow disk never holds a refresh worker.
// * Note [FIFO start order]: jobs start in submission order; a job starts only after every job
//   submitted before it has started. A job may therefore wait for an earlier job to finish (a read
//   for the write of the same key) without deadlock: the earlier job is already running.
// * A job is run(worker) plus cancel(reason); exactly one of the two is called, once. `worker` is
//   the index (0 .. threads-1) of the thread that runs it, for per-thread buffers. run must not
//   throw (the store's jobs put every error into their future); an escaping exception is reported
//   on stderr and dropped.
// * shutdown(reason): stops accepting jobs (submit then throws std::runtime_error), cancels the
//   queued ones, waits for the running ones and joins the threads. Idempotent; the destructor
//   calls it.
// * IoFuture: the outcome of one operation, shared by the job and every waiter. Thread-safe. The
//   producer calls mark_started, then succeed or fail, once; waiters see everything the producer
//   wrote before resolving.
//
// Torch-free: built by setup.py and by CMakeLists.txt (tests/cpp/test_spill.cpp).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "memory/host_block.h"

namespace asteria::io {

class IoFuture {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  bool done() const;
  void wait() const;
  bool wait_for(std::chrono::nanoseconds timeout) const;  // returns done()
  bool failed() const;
  void rethrow_if_failed() const;  // does not wait

  // A read's result: the block the store read into when the caller gave no buffer (else null),
  // and the payload size.
  std::shared_ptr<memory::HostBlock> block() const;
  size_t nbytes() const;
  std::optional<TimePoint> started_at() const;
  std::optional<TimePoint> finished_at() const;

  void mark_started();
  void succeed(std::shared_ptr<memory::HostBlock> block = nullptr, size_t nbytes = 0);
  void fail(std::exception_ptr error);

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::shared_ptr<memory::HostBlock> block_;
  size_t nbytes_ = 0;
  std::optional<TimePoint> started_at_;
  std::optional<TimePoint> finished_at_;
};

struct IoJob {
  std::function<void(int worker)> run;
  std::function<void(const std::string& reason)> cancel;
};

class IoPool {
 public:
  explicit IoPool(int threads);
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  void submit(IoJob job);
  void shutdown(const std::string& reason = "the I/O pool was shut down");
  int threads() const { return static_cast<int>(threads_.size()); }
  size_t queued() const;

 private:
  void worker_main(int index);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoJob> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  std::mutex join_mu_;
};

}  // namespace asteria::io
