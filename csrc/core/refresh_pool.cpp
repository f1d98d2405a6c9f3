#include "core/refresh_pool.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <chrono>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <variant>

#include "core/lapack_backend.h"
#include "core/matrix_functions.h"

namespace asteria {
namespace {

// A copy the job owns: detached, on the CPU, never aliasing the caller's storage.
at::Tensor own(const at::Tensor& t) {
  return t.detach().to(at::kCPU, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

// The job's input: a copy (the default), or, when the caller hands the tensor over (copy=false:
// it will not write it before the future resolves), the CPU tensor itself.
at::Tensor input(const at::Tensor& t, bool copy) {
  return copy || !t.device().is_cpu() ? own(t) : t.detach();
}

void check_dtype(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble,
                    "dtype must be torch.float32 or torch.float64, got ", dtype);
}

// Bytes of a result's tensors (a refresh's inputs and workspaces are of the same order).
int64_t value_bytes(const RefreshValue& value) {
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.nbytes()) : int64_t{0};
  };
  return std::visit(
      [&](const auto& v) -> int64_t {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, at::Tensor>) {
          return bytes(v);
        } else if constexpr (std::is_same_v<V, std::tuple<at::Tensor, at::Tensor>>) {
          return bytes(std::get<0>(v)) + bytes(std::get<1>(v));
        } else {
          const auto& second = std::get<1>(v);
          return bytes(std::get<0>(v)) + (second ? bytes(*second) : int64_t{0});
        }
      },
      value);
}

// Runs a refresh on a worker, turning torch's exception types into the three kinds the future
// rethrows (see the contract in the header). c10 messages are taken without their C++ backtrace.
RefreshValue run_refresh(const std::function<RefreshValue()>& compute) {
  c10::NoGradGuard no_grad;
  try {
    return compute();
  } catch (const c10::ValueError& e) {
    throw std::invalid_argument(e.what_without_backtrace());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

// Rethrows a failed job's error with the block and version prepended, keeping its kind.
[[noreturn]] void rethrow_with_block(const core::JobFailed& failed) {
  try {
    std::rethrow_exception(failed.original());
  } catch (const MatrixFunctionError&) {
    throw MatrixFunctionError(failed.what());
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(failed.what());
  } catch (...) {
    throw std::runtime_error(failed.what());
  }
}

std::optional<double> monotonic_seconds(
    const std::optional<std::chrono::steady_clock::time_point>& t) {
  if (!t) return std::nullopt;
  return std::chrono::duration<double>(t->time_since_epoch()).count();
}

std::string describe(const core::JobHandle& handle) {
  std::ostringstream out;
  out << "block '" << handle.block() << "' (version " << handle.version() << ")";
  return out.str();
}

}  // namespace

// ---- RefreshFuture ------------------------------------------------------------------------

RefreshFuture::RefreshFuture(std::shared_ptr<core::JobHandle> handle,
                             std::shared_ptr<const RefreshValue> out,
                             std::weak_ptr<core::WorkerPool> pool, int lapack_threads)
    : handle_(std::move(handle)),
      out_(std::move(out)),
      pool_(std::move(pool)),
      lapack_threads_(lapack_threads) {}

bool RefreshFuture::run_ahead() const {
  if (handle_->status() != core::JobStatus::kQueued) return false;
  const std::shared_ptr<core::WorkerPool> pool = pool_.lock();
  if (!pool) return false;
  lapack::ScopedThreadLapackThreads threads(lapack_threads_);  // as on a worker
  return pool->run_ahead_of(*handle_);
}

std::optional<double> RefreshFuture::started_at() const {
  return monotonic_seconds(handle_->started_at());
}

std::optional<double> RefreshFuture::finished_at() const {
  return monotonic_seconds(handle_->finished_at());
}

RefreshValue RefreshFuture::result(std::optional<double> timeout_s) const {
  if (timeout_s.has_value()) {
    TORCH_CHECK_VALUE(*timeout_s >= 0, "timeout_s must be >= 0 or None, got ", *timeout_s);
    // Durations beyond a year are "forever" (and would overflow nanoseconds).
    constexpr double kForever = 365.0 * 24 * 3600;
    if (*timeout_s < kForever) {
      const auto timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::duration<double>(*timeout_s));
      if (!handle_->wait_for(timeout)) {
        std::ostringstream msg;
        msg << describe(*handle_) << ": no result after " << *timeout_s << " s (job is "
            << core::to_string(handle_->status()) << ")";
        throw FutureTimeout(msg.str());
      }
    }
  }
  handle_->wait();
  try {
    handle_->rethrow_if_unsuccessful();
  } catch (const core::JobFailed& failed) {
    rethrow_with_block(failed);
  }
  return *out_;
}

// ---- RefreshPool --------------------------------------------------------------------------

// Note [Returning freed memory]: a refresh allocates its inputs' copies, LAPACK workspaces and
// results, several times the factor's size, on a worker thread, and frees most of it on another
// thread or later. glibc keeps freed memory in its arenas for reuse, and after freeing a large
// mmap-ed block it raises its mmap threshold, so later blocks of that size come from the arenas
// too: the process's resident memory then stays at its high-water mark (measured: 40 fp64 eigh
// jobs of 500x500 left ~420 MiB resident after everything was freed, and malloc_trim returned
// it). So when a worker finds the queue empty after jobs that moved at least `trim_bytes`, it
// calls malloc_trim(0): off the training thread, at most once per burst of jobs; it costs
// ~15-25 ms when there is memory to return (it holds each arena's lock meanwhile) and ~0.2 ms
// when there is none. Other C libraries: nothing to do here.
RefreshPool::RefreshPool(const RefreshPoolOptions& options)
    : lapack_threads_(options.lapack_threads), trim_bytes_(options.trim_bytes) {
  TORCH_CHECK_VALUE(options.workers >= 1, "workers must be >= 1, got ", options.workers);
  TORCH_CHECK_VALUE(options.lapack_threads >= 1, "lapack_threads must be >= 1, got ",
                    options.lapack_threads);
  TORCH_CHECK_VALUE(options.queue_capacity >= 1, "queue_capacity must be >= 1, got ",
                    options.queue_capacity);
  core::PoolOptions pool_options;
  pool_options.workers = options.workers;
  pool_options.queue_capacity = static_cast<size_t>(options.queue_capacity);
  pool_options.affinity = options.affinity;
  TORCH_CHECK_VALUE(options.nice >= 0 && options.nice <= 19, "nice must be in [0, 19], got ",
                    options.nice);
  pool_options.nice = options.nice;
  const int threads = options.lapack_threads;
  pool_options.init = [threads](int) { lapack::set_thread_lapack_threads(threads); };
  TORCH_CHECK_VALUE(options.trim_bytes >= 0, "trim_bytes must be >= 0, got ", options.trim_bytes);
  if (options.trim_bytes > 0) pool_options.on_idle = [this](int) { on_idle(); };
  try {
    pool_ = std::make_shared<core::WorkerPool>(std::move(pool_options));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

RefreshPool::~RefreshPool() { pool_->shutdown(true); }

void RefreshPool::on_idle() {
  if (churn_bytes_.load() < trim_bytes_) return;
  churn_bytes_.store(0);
#if defined(__GLIBC__)
  malloc_trim(0);
  trims_.fetch_add(1);
#endif
}

RefreshFuture RefreshPool::submit(core::JobSpec spec, Compute compute) {
  auto out = std::make_shared<RefreshValue>();
  auto job = [this, out, compute = std::move(compute)] {
    *out = run_refresh(compute);
    churn_bytes_.fetch_add(value_bytes(*out));
  };
  try {
    return RefreshFuture(pool_->submit(std::move(spec), std::move(job)), out, pool_,
                         lapack_threads_);
  } catch (const std::invalid_argument& e) {  // a version older than the queued one
    TORCH_CHECK_VALUE(false, e.what());
  }
}

RefreshFuture RefreshPool::submit_eigh(const std::string& block, int64_t version, int64_t deadline,
                                       const at::Tensor& factor, at::ScalarType dtype, bool copy) {
  check_dtype(dtype);
  return submit({block, version, deadline}, [f = input(factor, copy), dtype] {
    return RefreshValue(eigh_descending(f, dtype));
  });
}

RefreshFuture RefreshPool::submit_qr_refresh(const std::string& block, int64_t version,
                                             int64_t deadline, const at::Tensor& factor,
                                             const at::Tensor& basis, bool sort,
                                             at::ScalarType dtype, bool copy) {
  check_dtype(dtype);
  return submit({block, version, deadline},
                [f = input(factor, copy), q = input(basis, copy), sort, dtype] {
                  return RefreshValue(qr_refresh(f, q, sort, dtype));
                });
}

RefreshFuture RefreshPool::submit_inverse_root(const std::string& block, int64_t version,
                                               int64_t deadline, const at::Tensor& factor,
                                               double root, double epsilon, at::ScalarType dtype,
                                               bool copy) {
  check_dtype(dtype);
  TORCH_CHECK_VALUE(root > 0, "root must be > 0, got ", root);
  TORCH_CHECK_VALUE(epsilon > 0, "epsilon must be > 0, got ", epsilon);
  return submit({block, version, deadline}, [f = input(factor, copy), root, epsilon, dtype] {
    return RefreshValue(inverse_root(f, root, epsilon, dtype));
  });
}

std::map<std::string, int64_t> RefreshPool::stats() const {
  const core::PoolStats s = pool_->stats();
  return {{"submitted", s.submitted}, {"completed", s.completed}, {"cancelled", s.cancelled},
          {"failed", s.failed},       {"queued", s.queued},       {"running", s.running},
          {"trims", trims_.load()}};
}

}  // namespace asteria
