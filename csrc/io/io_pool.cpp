#include "io/io_pool.h"

#include <cstdio>
#include <stdexcept>
#include <utility>

namespace asteria::io {

// ---- IoFuture -------------------------------------------------------------------------------

bool IoFuture::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void IoFuture::wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
}

bool IoFuture::wait_for(std::chrono::nanoseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [this] { return done_; });
}

bool IoFuture::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_ != nullptr;
}

void IoFuture::rethrow_if_failed() const {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

std::shared_ptr<memory::HostBlock> IoFuture::block() const {
  std::lock_guard<std::mutex> lock(mu_);
  return block_;
}

size_t IoFuture::nbytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return nbytes_;
}

std::optional<IoFuture::TimePoint> IoFuture::started_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_at_;
}

std::optional<IoFuture::TimePoint> IoFuture::finished_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_at_;
}

void IoFuture::mark_started() {
  std::lock_guard<std::mutex> lock(mu_);
  started_at_ = std::chrono::steady_clock::now();
}

void IoFuture::succeed(std::shared_ptr<memory::HostBlock> block, size_t nbytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    block_ = std::move(block);
    nbytes_ = nbytes;
    finished_at_ = std::chrono::steady_clock::now();
    done_ = true;
  }
  cv_.notify_all();
}

void IoFuture::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    finished_at_ = std::chrono::steady_clock::now();
    done_ = true;
  }
  cv_.notify_all();
}

// ---- IoPool ---------------------------------------------------------------------------------

IoPool::IoPool(int threads) {
  if (threads < 1) {
    throw std::invalid_argument("io_threads must be >= 1, got " + std::to_string(threads));
  }
  threads_.reserve(threads);
  try {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { worker_main(i); });
  } catch (...) {
    shutdown();
    throw;
  }
}

IoPool::~IoPool() { shutdown(); }

void IoPool::submit(IoJob job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw std::runtime_error("submit after the I/O pool was shut down");
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

size_t IoPool::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void IoPool::shutdown(const std::string& reason) {
  std::deque<IoJob> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cancelled.swap(queue_);
  }
  cv_.notify_all();
  for (IoJob& job : cancelled) {
    if (job.cancel) job.cancel(reason);
  }
  std::lock_guard<std::mutex> join_lock(join_mu_);
  for (std::thread& t : threads_) {
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
  }
}

void IoPool::worker_main(int index) {
  while (true) {
    IoJob job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      job.run(index);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "asteria: an I/O job threw: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "asteria: an I/O job threw a non-standard exception\n");
    }
  }
}

}  // namespace asteria::io
