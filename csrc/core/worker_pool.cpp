#include "core/worker_pool.h"

#include <set>
#include <sstream>

#include <algorithm>
#include <cerrno>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace asteria::core {
namespace {

std::string describe(const JobSpec& spec) {
  std::ostringstream out;
  out << "block '" << spec.block << "' (version " << spec.version << ")";
  return out.str();
}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception (not derived from std::exception)";
  }
}

// Note [Pool registry]: every live pool is listed here so that shutdown_all_pools() can stop
// them before interpreter exit. A pool leaves the list before its destructor shuts it down.
std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

std::set<WorkerPool*>& registry() {
  static std::set<WorkerPool*> pools;
  return pools;
}

// Note [Worker priority]: the workers compute in the background of a training loop. Where the
// machine has no idle core for them (a CPU-only run whose training thread, statistics lane and
// workers share two cores), the kernel's fair scheduler splits a core evenly between a worker and
// the training thread, and the step after a refresh is descheduled for tens of milliseconds
// (measured on bench/step_time.py: 50-120 ms of that step's forward off CPU at nice 0, 2-35 ms
// with the workers at nice +10). So a worker thread raises its own nice value by `nice` (on
// Linux, setpriority on the thread id changes that thread only). Raising needs no privilege;
// the result is capped at 19. Elsewhere a no-op. Only where a core is left to the workers and
// the lane (the runtime's default): a lowered worker that competes with every training thread
// gets almost no CPU, misses its deadlines, and the steps wait at the barrier (`make demo` at
// two training threads on two cores: 5.4 s of waiting, where it had none at nice 0).
void lower_current_thread_priority(int nice) {
  if (nice < 0 || nice > 19) {
    throw std::invalid_argument("WorkerPool: nice must be in [0, 19], got " + std::to_string(nice));
  }
#if defined(__linux__)
  const auto tid = static_cast<id_t>(syscall(SYS_gettid));
  errno = 0;
  const int current = getpriority(PRIO_PROCESS, tid);
  if (current == -1 && errno != 0) return;  // unknown: leave the priority as it is
  const int target = std::min(19, current + nice);
  if (setpriority(PRIO_PROCESS, tid, target) != 0) {
    throw std::invalid_argument("WorkerPool: cannot set a worker's nice value to " +
                                std::to_string(target) + " (errno " + std::to_string(errno) + ")");
  }
#else
  (void)nice;
#endif
}

// Pins the calling thread to one CPU. Linux only; a no-op elsewhere.
void pin_current_thread(int cpu) {
#if defined(__linux__)
  if (cpu < 0 || cpu >= CPU_SETSIZE) {
    throw std::invalid_argument("WorkerPool: CPU id " + std::to_string(cpu) + " out of range");
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    throw std::invalid_argument("WorkerPool: cannot pin a worker to CPU " + std::to_string(cpu) +
                                " (pthread_setaffinity_np error " + std::to_string(rc) + ")");
  }
#else
  (void)cpu;
#endif
}

JobSpec spec_of(const JobHandle& handle) {
  return JobSpec{handle.block(), handle.version(), handle.deadline()};
}

}  // namespace

const char* to_string(JobStatus status) {
  switch (status) {
    case JobStatus::kQueued:
      return "queued";
    case JobStatus::kRunning:
      return "running";
    case JobStatus::kSucceeded:
      return "succeeded";
    case JobStatus::kFailed:
      return "failed";
    case JobStatus::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

JobFailed::JobFailed(const JobSpec& spec, std::string original_message, std::exception_ptr original)
    : std::runtime_error(describe(spec) + ": " + original_message),
      block_(spec.block),
      version_(spec.version),
      original_message_(std::move(original_message)),
      original_(std::move(original)) {}

// ---- JobHandle ----------------------------------------------------------------------------

JobStatus JobHandle::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

bool JobHandle::done() const {
  const JobStatus s = status();
  return s != JobStatus::kQueued && s != JobStatus::kRunning;
}

void JobHandle::wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock,
           [this] { return status_ != JobStatus::kQueued && status_ != JobStatus::kRunning; });
}

bool JobHandle::wait_for(std::chrono::nanoseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [this] {
    return status_ != JobStatus::kQueued && status_ != JobStatus::kRunning;
  });
}

void JobHandle::rethrow_if_unsuccessful() const {
  std::lock_guard<std::mutex> lock(mu_);
  switch (status_) {
    case JobStatus::kSucceeded:
      return;
    case JobStatus::kFailed:
      throw JobFailed(spec_, error_message_, error_);
    case JobStatus::kCancelled:
      throw JobCancelled(describe(spec_) + " was cancelled: " + cancel_reason_);
    default:
      throw std::logic_error(describe(spec_) + " is still " + to_string(status_));
  }
}

std::optional<std::chrono::steady_clock::time_point> JobHandle::started_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_at_;
}

std::optional<std::chrono::steady_clock::time_point> JobHandle::finished_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_at_;
}

bool JobHandle::start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (status_ != JobStatus::kQueued) return false;
  status_ = JobStatus::kRunning;
  started_at_ = std::chrono::steady_clock::now();
  return true;
}

void JobHandle::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_at_ = std::chrono::steady_clock::now();
    if (error) {
      error_message_ = message_of(error);
      error_ = std::move(error);
      status_ = JobStatus::kFailed;
    } else {
      status_ = JobStatus::kSucceeded;
    }
  }
  cv_.notify_all();
}

bool JobHandle::cancel(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_ != JobStatus::kQueued) return false;
    status_ = JobStatus::kCancelled;
    cancel_reason_ = reason;
  }
  cv_.notify_all();
  return true;
}

// ---- WorkerPool ---------------------------------------------------------------------------

WorkerPool::WorkerPool(PoolOptions options) : options_(std::move(options)) {
  if (options_.workers < 1) {
    throw std::invalid_argument("WorkerPool: workers must be >= 1, got " +
                                std::to_string(options_.workers));
  }
  if (options_.queue_capacity < 1) {
    throw std::invalid_argument("WorkerPool: queue_capacity must be >= 1");
  }
  start_workers();
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().insert(this);
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(this);
  }
  shutdown(true);
}

void WorkerPool::start_workers() {
  threads_.reserve(static_cast<size_t>(options_.workers));
  for (int i = 0; i < options_.workers; ++i) {
    threads_.emplace_back([this, i] { worker_main(i); });
  }
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    setup_cv_.wait(lock, [this] { return setup_done_ == options_.workers; });
    error = setup_error_;
  }
  if (error) {
    shutdown(true);
    std::rethrow_exception(error);
  }
}

bool WorkerPool::setup_worker(int index) {
  std::exception_ptr error;
  try {
    if (!options_.affinity.empty()) {
      pin_current_thread(options_.affinity[static_cast<size_t>(index) % options_.affinity.size()]);
    }
    if (options_.nice != 0) lower_current_thread_priority(options_.nice);
    if (options_.init) options_.init(index);
  } catch (...) {
    error = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (error && !setup_error_) setup_error_ = error;
  ++setup_done_;
  setup_cv_.notify_all();
  return !error;
}

void WorkerPool::worker_main(int index) {
  if (!setup_worker(index)) return;
  bool ran_job = false;  // since this worker last went idle
  for (;;) {
    Queued job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (ran_job && options_.on_idle && queue_.empty() && !stopping_) {
        lock.unlock();
        try {
          options_.on_idle(index);
        } catch (...) {  // a housekeeping hook: it must not take the worker down
        }
        lock.lock();
      }
      ran_job = false;
      work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and shutdown cancelled everything queued
      auto it = queue_.begin();
      job = std::move(it->second);
      queued_by_block_.erase(job.handle->block());
      queue_.erase(it);
      --stats_.queued;
      ++stats_.running;
    }
    space_cv_.notify_one();
    run_job(std::move(job));
    ran_job = true;
  }
}

// Note [Helping waiters]: a thread that must wait for a job that no worker has started yet
// (the training step at a barrier, or the urgent refreshes of a step, refresh_pool.h) would sit
// idle while the workers work through the jobs queued before it. run_ahead_of lets it take the
// first of them instead, one at a time, for as long as its own job is still queued: it only ever
// runs a job the workers would have run before its own, so its wait ends no later than without
// help (the job it ran finishes while a worker takes the next one), and with one worker two jobs
// run at once instead of one. A job once started, by a worker or a helper, runs to its end there.
bool WorkerPool::run_ahead_of(const JobHandle& handle) {
  Queued job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || queue_.empty()) return false;
    auto by_block = queued_by_block_.find(handle.block());
    if (by_block == queued_by_block_.end()) return false;
    auto mine = queue_.find(by_block->second);
    if (mine == queue_.end() || mine->second.handle.get() != &handle) return false;
    auto it = queue_.begin();  // (deadline, sequence) order: at or before `mine`
    job = std::move(it->second);
    queued_by_block_.erase(job.handle->block());
    queue_.erase(it);
    --stats_.queued;
    ++stats_.running;
    ++helping_;
  }
  space_cv_.notify_one();
  run_job(std::move(job));
  {
    std::lock_guard<std::mutex> lock(mu_);
    --helping_;
  }
  helped_cv_.notify_all();
  return true;
}

void WorkerPool::run_job(Queued job) {
  std::exception_ptr error;
  if (job.handle->start()) {
    try {
      job.fn();
    } catch (...) {
      error = std::current_exception();
    }
    job.fn = nullptr;  // release captured inputs before waking waiters
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    --stats_.running;
    if (error) {
      ++stats_.failed;
    } else {
      ++stats_.completed;
    }
  }
  job.handle->finish(std::move(error));
}

void WorkerPool::cancel_queued_locked(std::map<QueueKey, Queued>::iterator it,
                                      const std::string& reason) {
  std::shared_ptr<JobHandle> handle = std::move(it->second.handle);
  queued_by_block_.erase(handle->block());
  queue_.erase(it);
  --stats_.queued;
  ++stats_.cancelled;
  handle->cancel(reason);
}

std::shared_ptr<JobHandle> WorkerPool::submit(JobSpec spec, JobFn fn) {
  if (!fn) throw std::invalid_argument("WorkerPool::submit: empty job function");
  auto handle = std::make_shared<JobHandle>(std::move(spec));
  {
    std::unique_lock<std::mutex> lock(mu_);
    space_cv_.wait(lock, [&] {
      return stopping_ || queue_.size() < options_.queue_capacity ||
             queued_by_block_.count(handle->block()) > 0;
    });
    if (stopping_) {
      throw std::runtime_error("WorkerPool: submit for " + describe(spec_of(*handle)) +
                               " after shutdown");
    }
    auto previous = queued_by_block_.find(handle->block());
    if (previous != queued_by_block_.end()) {
      auto it = queue_.find(previous->second);
      const int64_t queued_version = it->second.handle->version();
      if (handle->version() < queued_version) {
        throw std::invalid_argument("WorkerPool: submit for " + describe(spec_of(*handle)) +
                                    " is older than its queued version " +
                                    std::to_string(queued_version));
      }
      cancel_queued_locked(it, "superseded by version " + std::to_string(handle->version()));
    }
    const QueueKey key{handle->deadline(), next_sequence_++};
    queue_.emplace(key, Queued{handle, std::move(fn)});
    queued_by_block_.emplace(handle->block(), key);
    ++stats_.submitted;
    ++stats_.queued;
  }
  work_cv_.notify_one();
  return handle;
}

void WorkerPool::shutdown(bool wait) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      stopping_ = true;
      while (!queue_.empty()) cancel_queued_locked(queue_.begin(), "the pool was shut down");
    }
  }
  work_cv_.notify_all();
  space_cv_.notify_all();
  if (!wait) return;
  std::lock_guard<std::mutex> join_lock(join_mu_);
  for (std::thread& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) {
      throw std::logic_error("WorkerPool::shutdown(wait=true) called from one of its own jobs");
    }
    if (t.joinable()) t.join();
  }
  std::unique_lock<std::mutex> lock(mu_);  // and the jobs that helping threads still run
  helped_cv_.wait(lock, [this] { return helping_ == 0; });
}

bool WorkerPool::is_shutdown() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stopping_;
}

PoolStats WorkerPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void shutdown_all_pools() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (WorkerPool* pool : registry()) pool->shutdown(true);
}

int default_worker_count() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace asteria::core
