// The CPU build's stand-in for shadow_stream.cu (see the contract in shadow_stream.h): there are
// no streams, copies run synchronously on the calling thread and every event is complete.
// setup.py compiles this file only when it does not compile shadow_stream.cu.
#include <ATen/ATen.h>

#include "cuda/shadow_stream.h"

namespace asteria::cuda {

bool cuda_enabled() { return false; }

std::string cuda_version() { return ""; }

struct CopyEvent::Impl {
  at::Tensor src;
  at::Tensor dst;
};

CopyEvent::CopyEvent(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
CopyEvent::~CopyEvent() = default;
CopyEvent::CopyEvent(CopyEvent&&) noexcept = default;
CopyEvent& CopyEvent::operator=(CopyEvent&&) noexcept = default;

bool CopyEvent::query() const { return true; }

void CopyEvent::synchronize() const {}

const at::Tensor& CopyEvent::host() const { return impl_->dst; }

struct ShadowStream::Impl {};

ShadowStream::ShadowStream(int device) : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(device == -1, "ShadowStream: this asteria build has no CUDA (device ", device,
              " requested); rebuild against a CUDA torch with nvcc available");
}

ShadowStream::~ShadowStream() = default;
ShadowStream::ShadowStream(ShadowStream&&) noexcept = default;
ShadowStream& ShadowStream::operator=(ShadowStream&&) noexcept = default;

CopyEvent ShadowStream::copy_to_host(const at::Tensor& src, const at::Tensor& dst) {
  detail::check_copy_args(src, dst);
  TORCH_CHECK(src.device().is_cpu(), "copy_to_host: this asteria build has no CUDA, src is on ",
              src.device());
  dst.copy_(src);
  return CopyEvent(std::make_shared<CopyEvent::Impl>(CopyEvent::Impl{src, dst}));
}

at::Tensor ShadowStream::host_buffer_like(const at::Tensor& src) const {
  return at::empty(src.sizes(), src.options().device(at::kCPU));
}

void ShadowStream::synchronize() const {}

bool ShadowStream::is_cuda() const { return false; }

int ShadowStream::device() const { return -1; }

int ShadowStream::priority() const { return 0; }

at::Tensor count_nonfinite(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "count_nonfinite: this asteria build has no CUDA, got ",
              t.device());
  if (!at::isFloatingType(t.scalar_type())) return at::zeros({}, t.options().dtype(at::kLong));
  return at::isfinite(t).logical_not().sum();
}

}  // namespace asteria::cuda
