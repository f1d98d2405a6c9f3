#include "io/spill_tensor.h"

#include <c10/util/Exception.h>

#include <chrono>

#include "memory/fence.h"
#include "memory/host_tensor.h"

namespace asteria::io {
namespace {

std::optional<double> monotonic_seconds(const std::optional<IoFuture::TimePoint>& t) {
  if (!t) return std::nullopt;
  return std::chrono::duration<double>(t->time_since_epoch()).count();
}

}  // namespace

// ---- SpillFuture ----------------------------------------------------------------------------

std::optional<at::Tensor> SpillFuture::result(std::optional<double> timeout_s) const {
  if (timeout_s) {
    const auto timeout = memory::to_timeout("SpillFuture.result", timeout_s);
    if (!future_->wait_for(*timeout)) {
      throw memory::WaitTimeout("SpillFuture.result: the " +
                                std::string(is_read_ ? "read" : "write") +
                                " did not finish within " + std::to_string(*timeout_s) + " s");
    }
  } else {
    future_->wait();
  }
  future_->rethrow_if_failed();
  if (!is_read_) return std::nullopt;
  if (out_) return out_;
  const int64_t nbytes = static_cast<int64_t>(future_->nbytes());
  return memory::tensor_over_block(future_->block(), 0, {nbytes}, at::kByte);
}

std::optional<double> SpillFuture::started_at() const {
  return monotonic_seconds(future_->started_at());
}

std::optional<double> SpillFuture::finished_at() const {
  return monotonic_seconds(future_->finished_at());
}

// ---- TensorSpillStore -----------------------------------------------------------------------

TensorSpillStore::TensorSpillStore(const std::string& dir, int64_t capacity_bytes, int io_threads,
                                   const std::string& mode) {
  TORCH_CHECK_VALUE(capacity_bytes > 0, "capacity_bytes must be > 0, got ", capacity_bytes);
  SpillOptions options;
  options.dir = dir;
  options.capacity_bytes = static_cast<uint64_t>(capacity_bytes);
  options.io_threads = io_threads;
  options.mode = parse_io_mode(mode);
  store_ = std::make_unique<SpillStore>(options);
}

SpillFuture TensorSpillStore::write(const std::string& key, const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.layout() == at::kStrided, "SpillStore.put: key '", key,
                    "': only strided (dense) tensors can be spilled, got ", tensor.layout());
  at::Tensor src = tensor.detach();
  if (!src.device().is_cpu()) src = src.to(at::kCPU);
  src = src.resolve_conj().resolve_neg().contiguous();
  auto keep = std::make_shared<const at::Tensor>(src);
  return SpillFuture(store_->write(key, src.data_ptr(), src.nbytes(), std::move(keep)),
                     std::nullopt, false);
}

SpillFuture TensorSpillStore::read(const std::string& key, const std::optional<at::Tensor>& out) {
  if (!out) return SpillFuture(store_->read(key, nullptr, 0, nullptr), std::nullopt, true);
  TORCH_CHECK_VALUE(out->device().is_cpu(), "SpillStore.get: out must be a CPU tensor, got ",
                    out->device());
  TORCH_CHECK_VALUE(out->is_contiguous(), "SpillStore.get: out must be contiguous");
  const std::optional<size_t> stored = store_->nbytes(key);
  TORCH_CHECK_VALUE(!stored || *stored == out->nbytes(), "SpillStore.get: key '", key, "' holds ",
                    stored.value_or(0), " bytes, but out has ", out->nbytes());
  auto keep = std::make_shared<const at::Tensor>(*out);
  return SpillFuture(store_->read(key, out->data_ptr(), out->nbytes(), std::move(keep)), *out,
                     true);
}

std::optional<int64_t> TensorSpillStore::nbytes(const std::string& key) const {
  const std::optional<size_t> n = store_->nbytes(key);
  if (!n) return std::nullopt;
  return static_cast<int64_t>(*n);
}

std::optional<std::tuple<int64_t, int64_t>> TensorSpillStore::extent(const std::string& key) const {
  const auto e = store_->extent(key);
  if (!e) return std::nullopt;
  return std::make_tuple(static_cast<int64_t>(e->first), static_cast<int64_t>(e->second));
}

void testing_io_fail_next(int n, int error_code, const std::string& op) {
  IoOp kind = IoOp::kWrite;
  if (op == "write") {
    kind = IoOp::kWrite;
  } else if (op == "read") {
    kind = IoOp::kRead;
  } else if (op == "open_direct") {
    kind = IoOp::kOpenDirect;
  } else {
    TORCH_CHECK_VALUE(false,
                      "_testing_io_fail_next: op must be 'write', 'read' or 'open_direct', got '",
                      op, "'");
  }
  testing_fail_next(n, error_code, kind);
}

std::map<std::string, int64_t> TensorSpillStore::stats() const {
  const SpillStats s = store_->stats();
  return {{"bytes_written", s.bytes_written},
          {"bytes_read", s.bytes_read},
          {"writes", s.writes},
          {"reads", s.reads},
          {"write_failures", s.write_failures},
          {"read_failures", s.read_failures},
          {"checksum_failures", s.checksum_failures},
          {"keys", s.keys},
          {"used_bytes", s.used_bytes},
          {"capacity_bytes", s.capacity_bytes},
          {"queued", s.queued},
          {"io_threads", store_->io_threads()}};
}

}  // namespace asteria::io
