// The CUDA build of the shadow stream (see the contract in shadow_stream.h) and the
// count_nonfinite kernel that gates snapshots. Compiled by nvcc only when setup.py builds with
// CUDA; shadow_stream_cpu.cpp is the stand-in otherwise.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <optional>

#include "cuda/shadow_stream.h"

namespace asteria::cuda {

bool cuda_enabled() { return true; }

std::string cuda_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

// ---- CopyEvent ----------------------------------------------------------------------------

struct CopyEvent::Impl {
  at::Tensor src;
  at::Tensor dst;
  std::optional<at::cuda::CUDAEvent> done;  // nullopt: the copy was synchronous

  ~Impl() {
    // Never release src/dst under an in-flight copy (the caching allocators could hand the memory
    // to someone else while the DMA engine still reads or writes it).
    if (done) done->synchronize();
  }
};

CopyEvent::CopyEvent(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
CopyEvent::~CopyEvent() = default;
CopyEvent::CopyEvent(CopyEvent&&) noexcept = default;
CopyEvent& CopyEvent::operator=(CopyEvent&&) noexcept = default;

bool CopyEvent::query() const { return !impl_->done || impl_->done->query(); }

void CopyEvent::synchronize() const {
  if (impl_->done) impl_->done->synchronize();
}

const at::Tensor& CopyEvent::host() const { return impl_->dst; }

// ---- ShadowStream -------------------------------------------------------------------------

struct ShadowStream::Impl {
  std::optional<c10::cuda::CUDAStream> stream;  // nullopt: no usable GPU, synchronous stand-in
  int device = -1;
};

ShadowStream::ShadowStream(int device) : impl_(std::make_unique<Impl>()) {
  if (!at::cuda::is_available()) {
    TORCH_CHECK(device == -1, "ShadowStream: CUDA device ", device, " requested, but no GPU");
    return;
  }
  const int count = static_cast<int>(c10::cuda::device_count());
  const int index = device < 0 ? static_cast<int>(c10::cuda::current_device()) : device;
  TORCH_CHECK(index < count, "ShadowStream: device ", index, " out of range (", count, " GPUs)");
  impl_->device = index;
  // Priority 0 is the lowest CUDA stream priority (the default stream has it too); pool streams
  // are owned by torch and never destroyed, so the handle stays valid for the process.
  impl_->stream =
      c10::cuda::getStreamFromPool(/*priority=*/0, static_cast<c10::DeviceIndex>(index));
}

ShadowStream::~ShadowStream() = default;
ShadowStream::ShadowStream(ShadowStream&&) noexcept = default;
ShadowStream& ShadowStream::operator=(ShadowStream&&) noexcept = default;

CopyEvent ShadowStream::copy_to_host(const at::Tensor& src, const at::Tensor& dst) {
  detail::check_copy_args(src, dst);
  auto impl = std::make_shared<CopyEvent::Impl>();
  impl->src = src;
  impl->dst = dst;
  if (!impl_->stream || !src.is_cuda()) {
    dst.copy_(src);
    return CopyEvent(std::move(impl));
  }
  TORCH_CHECK(src.device().index() == impl_->device, "copy_to_host: src is on ", src.device(),
              " but the shadow stream is on cuda:", impl_->device);
  c10::cuda::CUDAGuard device_guard(src.device());
  // The copy must see every write the current stream issued before this call.
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(src.device().index()));
  ready.block(*impl_->stream);
  {
    c10::cuda::CUDAStreamGuard stream_guard(*impl_->stream);
    dst.copy_(src, /*non_blocking=*/true);
  }
  impl->done.emplace();
  impl->done->record(*impl_->stream);
  return CopyEvent(std::move(impl));
}

at::Tensor ShadowStream::host_buffer_like(const at::Tensor& src) const {
  return at::empty(src.sizes(),
                   src.options().device(at::kCPU).pinned_memory(impl_->stream.has_value()));
}

void ShadowStream::synchronize() const {
  if (impl_->stream) impl_->stream->synchronize();
}

bool ShadowStream::is_cuda() const { return impl_->stream.has_value(); }

int ShadowStream::device() const { return impl_->device; }

int ShadowStream::priority() const { return impl_->stream ? impl_->stream->priority() : 0; }

// ---- count_nonfinite ----------------------------------------------------------------------

namespace {

constexpr int kThreads = 256;

// Grid-stride count of non-finite entries; one atomic per warp that found any.
template <typename scalar_t>
__global__ void count_nonfinite_kernel(const scalar_t* __restrict__ data, int64_t n,
                                       unsigned long long* __restrict__ count) {
  using acc_t = at::opmath_type<scalar_t>;
  unsigned long long local = 0;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    local += isfinite(static_cast<acc_t>(data[i])) ? 0 : 1;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    local += __shfl_down_sync(0xffffffffu, local, offset);
  }
  if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(count, local);
}

}  // namespace

at::Tensor count_nonfinite(const at::Tensor& t) {
  if (!at::isFloatingType(t.scalar_type())) return at::zeros({}, t.options().dtype(at::kLong));
  if (!t.is_cuda()) return at::isfinite(t).logical_not().sum();
  c10::cuda::CUDAGuard device_guard(t.device());
  const at::Tensor data = t.contiguous();
  at::Tensor count = at::zeros({}, t.options().dtype(at::kLong));
  const int64_t n = data.numel();
  if (n == 0) return count;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, sms * 8);
  static_assert(sizeof(int64_t) == sizeof(unsigned long long), "atomicAdd on the int64 counter");
  auto* out = reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(t.device().index());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, data.scalar_type(), "count_nonfinite", [&] {
        count_nonfinite_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
            data.data_ptr<scalar_t>(), n, out);
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return count;
}

}  // namespace asteria::cuda
