// The CUDA build of cuda/device.h: the build facts and the count_nonfinite kernel. Compiled by
// nvcc only when setup.py builds with CUDA; device_cpu.cpp is the stand-in otherwise.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cuda/device.h"

namespace asteria::cuda {

bool cuda_enabled() { return true; }

std::string cuda_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

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
