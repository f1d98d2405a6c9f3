// Tests of the torch-free worker pool (csrc/core). Run by ctest, also under
// ThreadSanitizer and AddressSanitizer (CMakeLists.txt option ASTERIA_SANITIZE).
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "core/worker_pool.h"
#include "harness.h"

using asteria::core::JobCancelled;
using asteria::core::JobFailed;
using asteria::core::JobHandle;
using asteria::core::JobSpec;
using asteria::core::JobStatus;
using asteria::core::PoolOptions;
using asteria::core::WorkerPool;
using namespace std::chrono_literals;

namespace {

// A gate a job can wait on, so that later submissions stay queued until the test opens it.
class Gate {
 public:
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return open_; });
  }
  void wait_entered() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return entered_; });
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool open_ = false;
};

PoolOptions options(int workers, size_t capacity = 1024) {
  PoolOptions o;
  o.workers = workers;
  o.queue_capacity = capacity;
  return o;
}

// Occupies the pool's only worker until the gate opens.
std::shared_ptr<JobHandle> block_worker(WorkerPool& pool, Gate& gate) {
  auto h = pool.submit({"gate", 0, -1}, [&gate] { gate.wait(); });
  gate.wait_entered();
  return h;
}

}  // namespace

TEST(deadline_order) {
  Gate gate;  // declared first: outlives the pool's workers
  WorkerPool pool(options(1));
  block_worker(pool, gate);
  std::mutex mu;
  std::vector<std::string> order;
  const std::vector<std::pair<std::string, int64_t>> jobs = {
      {"a", 5}, {"b", 1}, {"c", 3}, {"d", 1}, {"e", 2}};
  std::vector<std::shared_ptr<JobHandle>> handles;
  for (const auto& [block, deadline] : jobs) {
    handles.push_back(pool.submit({block, 1, deadline}, [&mu, &order, block = block] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(block);
    }));
  }
  gate.open();
  for (auto& h : handles) h->wait();
  const std::vector<std::string> expected = {"b", "d", "e", "c", "a"};  // ties: submission order
  CHECK(order == expected);
}

TEST(supersede_cancels_queued_job) {
  Gate gate;  // declared first: outlives the pool's workers
  WorkerPool pool(options(1));
  block_worker(pool, gate);
  std::atomic<int> ran_version{0};
  auto v1 = pool.submit({"L0", 1, 10}, [&] { ran_version = 1; });
  auto v2 = pool.submit({"L0", 2, 12}, [&] { ran_version = 2; });
  CHECK(v1->status() == JobStatus::kCancelled);
  CHECK(v1->done());
  CHECK(!v1->started_at().has_value());
  try {
    v1->rethrow_if_unsuccessful();
    CHECK(false);
  } catch (const JobCancelled& e) {
    CHECK(std::string(e.what()).find("block 'L0' (version 1)") != std::string::npos);
    CHECK(std::string(e.what()).find("superseded by version 2") != std::string::npos);
  }
  CHECK_THROWS(pool.submit({"L0", 1, 1}, [] {}), std::invalid_argument);  // older than queued
  gate.open();
  v2->wait();
  CHECK_EQ(ran_version.load(), 2);
  CHECK_EQ(pool.stats().cancelled, int64_t{1});
}

TEST(run_ahead_of_runs_the_queue_up_to_a_job_on_the_caller) {
  Gate gate;  // declared first: outlives the pool's workers
  WorkerPool pool(options(1));
  auto busy = block_worker(pool, gate);
  std::mutex mu;
  std::vector<std::pair<std::string, std::thread::id>> ran;
  auto job = [&mu, &ran](std::string name) {
    return [&mu, &ran, name] {
      std::lock_guard<std::mutex> lock(mu);
      ran.emplace_back(name, std::this_thread::get_id());
    };
  };
  auto a = pool.submit({"a", 1, 2}, job("a"));
  auto mine = pool.submit({"mine", 1, 3}, job("mine"));
  auto later = pool.submit({"later", 1, 4}, job("later"));
  CHECK(!pool.run_ahead_of(*busy));  // running: nothing to help with
  int helped = 0;
  while (pool.run_ahead_of(*mine)) ++helped;
  CHECK_EQ(helped, 2);  // "a", then "mine" itself; never "later", queued behind it
  CHECK(a->status() == JobStatus::kSucceeded && mine->status() == JobStatus::kSucceeded);
  CHECK(later->status() == JobStatus::kQueued);
  CHECK(!pool.run_ahead_of(*mine));  // done
  {
    std::lock_guard<std::mutex> lock(mu);
    CHECK(ran.size() == 2u && ran[0].first == "a" && ran[1].first == "mine");
    CHECK(ran[0].second == std::this_thread::get_id());  // on the caller, not the worker
  }
  CHECK_EQ(pool.stats().completed, int64_t{2});
  CHECK_EQ(pool.stats().running, int64_t{1});  // the gate's job
  gate.open();
  later->wait();
  CHECK(later->status() == JobStatus::kSucceeded);
}

TEST(shutdown_waits_for_a_helping_thread) {
  Gate gate;  // declared first: outlives the pool's workers
  Gate helped;
  WorkerPool pool(options(1));
  block_worker(pool, gate);
  auto mine = pool.submit({"mine", 1, 1}, [&helped] { helped.wait(); });
  std::thread helper([&] { pool.run_ahead_of(*mine); });
  helped.wait_entered();
  std::atomic<bool> shut{false};
  std::thread stopper([&] {
    pool.shutdown(true);
    shut = true;
  });
  gate.open();  // the worker's job ends; the helper's has not
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!shut.load());
  helped.open();
  stopper.join();
  helper.join();
  CHECK(shut.load());
  CHECK(mine->status() == JobStatus::kSucceeded);
}

TEST(running_job_is_not_superseded) {
  Gate gate;  // declared first: outlives the pool's workers
  WorkerPool pool(options(1));
  auto running = pool.submit({"L0", 1, 0}, [&gate] { gate.wait(); });
  gate.wait_entered();
  auto next = pool.submit({"L0", 2, 0}, [] {});
  CHECK(running->status() == JobStatus::kRunning);
  gate.open();
  running->wait();
  next->wait();
  CHECK(running->status() == JobStatus::kSucceeded);
  CHECK(next->status() == JobStatus::kSucceeded);
  CHECK(running->started_at().has_value() && running->finished_at().has_value());
  CHECK(*running->started_at() <= *running->finished_at());
  CHECK(*running->finished_at() <= *next->started_at());  // one worker: strictly one after another
}

TEST(error_propagates_with_block_name) {
  WorkerPool pool(options(2));
  auto h = pool.submit({"model.layer3.weight/L", 7, 0},
                       [] { throw std::runtime_error("eigh: factor has non-finite entries"); });
  h->wait();
  CHECK(h->status() == JobStatus::kFailed);
  try {
    h->rethrow_if_unsuccessful();
    CHECK(false);
  } catch (const JobFailed& e) {
    CHECK_EQ(e.block(), std::string("model.layer3.weight/L"));
    CHECK_EQ(e.version(), int64_t{7});
    CHECK_EQ(e.original_message(), std::string("eigh: factor has non-finite entries"));
    CHECK_EQ(std::string(e.what()), std::string("block 'model.layer3.weight/L' (version 7): "
                                                "eigh: factor has non-finite entries"));
    CHECK_THROWS(std::rethrow_exception(e.original()), std::runtime_error);
  }
  auto odd = pool.submit({"x", 1, 0}, [] { throw 42; });
  odd->wait();
  CHECK_THROWS(odd->rethrow_if_unsuccessful(), JobFailed);
  CHECK_EQ(pool.stats().failed, int64_t{2});
}

TEST(shutdown_with_running_jobs) {
  auto pool = std::make_unique<WorkerPool>(options(2));
  std::atomic<int> finished{0};
  std::vector<std::shared_ptr<JobHandle>> handles;
  for (int i = 0; i < 10; ++i) {
    handles.push_back(pool->submit({"b" + std::to_string(i), 1, i}, [&finished] {
      std::this_thread::sleep_for(50ms);
      ++finished;
    }));
  }
  while (pool->stats().running < 2) std::this_thread::sleep_for(1ms);
  const auto start = std::chrono::steady_clock::now();
  pool->shutdown(true);
  CHECK(std::chrono::steady_clock::now() - start < 2s);
  int succeeded = 0;
  int cancelled = 0;
  for (auto& h : handles) {
    CHECK(h->done());
    succeeded += h->status() == JobStatus::kSucceeded;
    cancelled += h->status() == JobStatus::kCancelled;
  }
  CHECK_EQ(succeeded, finished.load());
  CHECK_EQ(succeeded + cancelled, 10);
  CHECK(succeeded >= 2);
  CHECK_THROWS(pool->submit({"late", 1, 0}, [] {}), std::runtime_error);
  pool->shutdown(true);  // idempotent
  pool.reset();
}

TEST(shutdown_without_wait_then_destroy) {
  auto pool = std::make_unique<WorkerPool>(options(1));
  Gate gate;
  auto running = block_worker(*pool, gate);
  auto queued = pool->submit({"q", 1, 0}, [] {});
  pool->shutdown(false);
  CHECK(queued->status() == JobStatus::kCancelled);
  CHECK(pool->is_shutdown());
  gate.open();
  pool.reset();  // joins
  CHECK(running->status() == JobStatus::kSucceeded);
}

TEST(many_concurrent_submitters) {
  WorkerPool pool(options(4, 64));
  constexpr int kThreads = 8;
  constexpr int kPerThread = 300;
  std::atomic<int64_t> work{0};
  std::vector<std::vector<std::shared_ptr<JobHandle>>> handles(kThreads);
  std::vector<std::thread> submitters;
  for (int t = 0; t < kThreads; ++t) {
    submitters.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        // Half the jobs share a block per thread (supersede races), half are distinct.
        const std::string block =
            i % 2 ? "t" + std::to_string(t) : "t" + std::to_string(t) + "/" + std::to_string(i);
        handles[t].push_back(pool.submit({block, i, i % 7}, [&work] { work += 1; }));
      }
    });
  }
  for (auto& s : submitters) s.join();
  int64_t succeeded = 0;
  int64_t cancelled = 0;
  for (auto& per_thread : handles) {
    for (auto& h : per_thread) {
      h->wait();
      succeeded += h->status() == JobStatus::kSucceeded;
      cancelled += h->status() == JobStatus::kCancelled;
    }
  }
  const auto stats = pool.stats();
  CHECK_EQ(succeeded + cancelled, int64_t{kThreads * kPerThread});
  CHECK_EQ(work.load(), succeeded);
  CHECK_EQ(stats.submitted, int64_t{kThreads * kPerThread});
  CHECK_EQ(stats.completed, succeeded);
  CHECK_EQ(stats.cancelled, cancelled);
  CHECK_EQ(stats.queued, int64_t{0});
  CHECK_EQ(stats.running, int64_t{0});
}

TEST(bounded_queue_blocks_submitter) {
  Gate gate;  // declared first: outlives the pool's workers
  WorkerPool pool(options(1, 2));
  block_worker(pool, gate);
  pool.submit({"a", 1, 0}, [] {});
  pool.submit({"b", 1, 0}, [] {});
  std::atomic<bool> submitted{false};
  std::thread late([&] {
    pool.submit({"c", 1, 0}, [] {})->wait();
    submitted = true;
  });
  std::this_thread::sleep_for(50ms);
  CHECK(!submitted.load());
  pool.submit({"a", 2, 0}, [] {});  // superseding needs no room
  CHECK_EQ(pool.stats().queued, int64_t{2});
  gate.open();
  late.join();
  CHECK(submitted.load());
}

TEST(init_hook_and_affinity) {
  std::atomic<int> inits{0};
  PoolOptions o = options(3);
  o.init = [&inits](int) { ++inits; };
  o.affinity = {0};
  {
    WorkerPool pool(o);
    CHECK_EQ(inits.load(), 3);
    CHECK_EQ(pool.workers(), 3);
  }
  PoolOptions throwing = options(2);
  throwing.init = [](int index) {
    if (index == 1) throw std::runtime_error("no LAPACK here");
  };
  CHECK_THROWS(WorkerPool{throwing}, std::runtime_error);
#if defined(__linux__)
  PoolOptions bad_cpu = options(1);
  bad_cpu.affinity = {1 << 20};
  CHECK_THROWS(WorkerPool{bad_cpu}, std::invalid_argument);
#endif
  CHECK_THROWS(WorkerPool{options(0)}, std::invalid_argument);
}

TEST(workers_lower_their_own_priority) {
#if defined(__linux__)
  // Note [Worker priority]: each worker adds `nice` to its own nice value (capped at 19); the
  // submitting thread keeps its own.
  errno = 0;
  const int base = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  CHECK(errno == 0);
  for (int nice : {0, 7, 19}) {
    PoolOptions o = options(2);
    o.nice = nice;
    WorkerPool pool(o);
    std::vector<std::shared_ptr<JobHandle>> handles;
    std::mutex mu;
    std::vector<int> seen;
    for (int i = 0; i < 4; ++i) {
      handles.push_back(pool.submit(JobSpec{"b" + std::to_string(i), 1, 1}, [&] {
        const int p = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
        std::lock_guard<std::mutex> lock(mu);
        seen.push_back(p);
      }));
    }
    for (auto& h : handles) h->wait();
    CHECK_EQ(static_cast<int>(seen.size()), 4);
    for (int p : seen) CHECK_EQ(p, std::min(19, base + nice));
    CHECK_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))), base);
  }
#endif
  PoolOptions negative = options(1);
  negative.nice = -1;
  CHECK_THROWS(WorkerPool{negative}, std::invalid_argument);
}

TEST(on_idle_runs_once_per_burst_after_the_queue_drains) {
  Gate gate;  // declared first: outlives the pool's workers
  std::atomic<int> idle{0};
  std::atomic<int> done{0};
  PoolOptions o = options(1);
  o.on_idle = [&](int) {
    CHECK_EQ(done.load(), 4);  // never while jobs of the burst are still queued
    ++idle;
    throw std::runtime_error("swallowed: the worker goes on");
  };
  WorkerPool pool(o);
  std::this_thread::sleep_for(20ms);
  CHECK_EQ(idle.load(), 0);  // not before any job ran
  auto first = block_worker(pool, gate);
  std::vector<std::shared_ptr<JobHandle>> rest;
  for (int i = 0; i < 3; ++i)
    rest.push_back(pool.submit({"b" + std::to_string(i), 0, i}, [&] { ++done; }));
  ++done;  // the gate job counts as the burst's first
  gate.open();
  for (auto& h : rest) CHECK(h->wait_for(10s));
  for (int i = 0; i < 200 && idle.load() == 0; ++i) std::this_thread::sleep_for(5ms);
  CHECK_EQ(idle.load(), 1);
  auto again = pool.submit({"c", 0, 0}, [] {});  // the worker survived the hook's exception
  CHECK(again->wait_for(10s));
}

TEST(wait_for_times_out) {
  Gate gate;  // declared first: outlives the pool's workers
  WorkerPool pool(options(1));
  auto h = block_worker(pool, gate);
  CHECK(!h->wait_for(10ms));
  CHECK_THROWS(h->rethrow_if_unsuccessful(), std::logic_error);
  gate.open();
  CHECK(h->wait_for(10s));
}

TEST(shutdown_all_pools_stops_live_pools) {
  WorkerPool a(options(1));
  WorkerPool b(options(2));
  asteria::core::shutdown_all_pools();
  CHECK(a.is_shutdown());
  CHECK(b.is_shutdown());
  asteria::core::shutdown_all_pools();
}

int main(int argc, char** argv) { return harness::run_tests(argc, argv); }
