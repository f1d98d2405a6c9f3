// Worker pool: std::thread workers that run type-erased jobs in deadline order.
//
// Contract
// --------
// * Thread safety: every public member of WorkerPool and JobHandle may be called from any thread,
//   concurrently. A job's function runs on exactly one worker thread and must not block on
//   another job of the same pool (with every worker blocked that would deadlock).
// * Ownership: the pool owns queued jobs and their functions; a JobHandle is shared by the pool
//   and every waiter (std::shared_ptr), so a waiter may outlive the pool. A job function must own
//   (capture by value) everything it reads and writes; the pool never copies data.
// * Order: queued jobs start in (deadline, submission order): the smallest deadline first, ties
//   first come first served. The deadline is the step by which the result must be installed.
// * Supersede: each job names a block. Submitting a job for a block that still has a queued (not
//   started) job cancels that older job: its handle resolves as cancelled. A running job is never
//   interrupted; its successor queues behind it as usual. A submission whose version is older
//   than the queued job's is a caller mistake (std::invalid_argument), not a supersede.
// * Errors: an exception thrown by a job function is caught on the worker and carried to the
//   handle; JobHandle::rethrow_if_unsuccessful throws JobFailed naming the block, the version and
//   the original message, with the original exception kept in JobFailed::original().
// * Bounded queue: at most `queue_capacity` jobs wait; submit blocks until there is room (a
//   superseding submit never needs room). submit after shutdown throws std::runtime_error.
// * Shutdown: queued jobs are cancelled, running jobs finish, then (wait=true) every thread is
//   joined and every job a helping thread runs has finished. The destructor does
//   shutdown(true). shutdown_all_pools() shuts every live pool down (for interpreter exit: no
//   worker may still run when static destructors start).
// * Helping: run_ahead_of(handle) runs, on the calling thread, the first queued job (the
//   handle's own or one queued before it) while the handle's job is still queued: a thread that
//   is about to wait for a job shortens its wait (Note [Helping waiters]). The job runs as on a
//   worker (status, stats, errors), without the worker's init hook: the caller sets up its thread.
// * Workers: `workers` threads; worker i is pinned to affinity[i % affinity.size()] when an
//   affinity list is given (Linux; ignored elsewhere), lowers its CPU priority by `nice` (Note
//   [Worker priority]), then runs the init hook (e.g. one LAPACK thread per worker). The
//   constructor waits for every worker's setup and rethrows the first failure, so a bad CPU index
//   or a throwing hook fails construction, not a later job.
//
// Torch-free on purpose: this file and worker_pool.cpp build with the plain C++17 toolchain of
// CMakeLists.txt and are tested by tests/cpp (also under ThreadSanitizer).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace asteria::core {

enum class JobStatus { kQueued, kRunning, kSucceeded, kFailed, kCancelled };

const char* to_string(JobStatus status);

// What the scheduler needs to know about a job.
struct JobSpec {
  std::string block;     // the preconditioner block the result belongs to
  int64_t version = 0;   // the step the job's input was taken at
  int64_t deadline = 0;  // the step by which the result must be installed
};

// Thrown by JobHandle::rethrow_if_unsuccessful when the job function threw.
class JobFailed : public std::runtime_error {
 public:
  JobFailed(const JobSpec& spec, std::string original_message, std::exception_ptr original);
  const std::string& block() const { return block_; }
  int64_t version() const { return version_; }
  const std::string& original_message() const { return original_message_; }
  std::exception_ptr original() const { return original_; }

 private:
  std::string block_;
  int64_t version_;
  std::string original_message_;
  std::exception_ptr original_;
};

// Thrown by JobHandle::rethrow_if_unsuccessful when the job was cancelled before it started.
class JobCancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The shared state of one job: its status, and its error once it failed.
class JobHandle {
 public:
  explicit JobHandle(JobSpec spec) : spec_(std::move(spec)) {}

  const std::string& block() const { return spec_.block; }
  int64_t version() const { return spec_.version; }
  int64_t deadline() const { return spec_.deadline; }
  JobStatus status() const;
  bool done() const;  // succeeded, failed or cancelled

  void wait() const;
  // Waits at most `timeout`; returns done().
  bool wait_for(std::chrono::nanoseconds timeout) const;
  // Throws JobFailed or JobCancelled unless the job succeeded. Does not wait.
  void rethrow_if_unsuccessful() const;

  // When a worker started / finished the job (steady clock, i.e. CLOCK_MONOTONIC on Linux, the
  // clock of Python's time.monotonic()); nullopt until it happens. A cancelled job never starts.
  std::optional<std::chrono::steady_clock::time_point> started_at() const;
  std::optional<std::chrono::steady_clock::time_point> finished_at() const;

 private:
  friend class WorkerPool;
  bool start();  // queued -> running; false when already cancelled
  void finish(std::exception_ptr error);
  bool cancel(const std::string& reason);  // false when no longer queued

  const JobSpec spec_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  JobStatus status_ = JobStatus::kQueued;
  std::exception_ptr error_;
  std::string error_message_;
  std::string cancel_reason_;
  std::optional<std::chrono::steady_clock::time_point> started_at_;
  std::optional<std::chrono::steady_clock::time_point> finished_at_;
};

using JobFn = std::function<void()>;
using WorkerInit = std::function<void(int worker_index)>;

struct PoolOptions {
  int workers = 1;
  size_t queue_capacity = 1024;
  std::vector<int> affinity;  // CPU ids; empty: no pinning
  int nice = 0;               // added to each worker thread's nice value, 0..19 (Linux)
  WorkerInit init;            // runs once on each worker thread before any job
  // Runs on a worker, outside the pool's lock, when it finds the queue empty after running a
  // job (before it sleeps); exceptions are swallowed. RefreshPool returns freed memory to the
  // system here (Note [Returning freed memory] in refresh_pool.cpp).
  std::function<void(int worker_index)> on_idle;
};

struct PoolStats {
  int64_t submitted = 0;
  int64_t completed = 0;  // succeeded
  int64_t cancelled = 0;
  int64_t failed = 0;
  int64_t queued = 0;
  int64_t running = 0;
};

class WorkerPool {
 public:
  explicit WorkerPool(PoolOptions options);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  std::shared_ptr<JobHandle> submit(JobSpec spec, JobFn fn);
  // Runs the first queued job on the calling thread if `handle`'s job is still queued; returns
  // whether a job ran (false: it started, finished or was cancelled, or the pool is stopping).
  bool run_ahead_of(const JobHandle& handle);
  void shutdown(bool wait = true);
  PoolStats stats() const;
  int workers() const { return static_cast<int>(threads_.size()); }
  bool is_shutdown() const;

 private:
  using QueueKey = std::pair<int64_t, uint64_t>;  // (deadline, submission sequence)
  struct Queued {
    std::shared_ptr<JobHandle> handle;
    JobFn fn;
  };

  void start_workers();
  void worker_main(int index);
  bool setup_worker(int index);
  void run_job(Queued job);
  void cancel_queued_locked(std::map<QueueKey, Queued>::iterator it, const std::string& reason);

  const PoolOptions options_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;    // workers: a job was queued, or shutdown
  std::condition_variable space_cv_;   // submitters: room in the queue, or shutdown
  std::condition_variable setup_cv_;   // constructor: a worker finished its setup
  std::condition_variable helped_cv_;  // shutdown(wait): a helping thread finished its job
  std::map<QueueKey, Queued> queue_;
  std::unordered_map<std::string, QueueKey> queued_by_block_;
  uint64_t next_sequence_ = 0;
  bool stopping_ = false;
  int helping_ = 0;  // jobs running on helping threads (run_ahead_of)
  int setup_done_ = 0;
  std::exception_ptr setup_error_;
  PoolStats stats_;
  std::vector<std::thread> threads_;
  std::mutex join_mu_;  // serializes joins between concurrent shutdown(true) calls
};

// Shuts down every live WorkerPool (wait=true). Safe to call more than once.
void shutdown_all_pools();

// Number of hardware threads, at least 1.
int default_worker_count();

}  // namespace asteria::core
