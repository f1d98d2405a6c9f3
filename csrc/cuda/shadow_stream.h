// Shadow stream: a lowest-priority CUDA stream that snapshots device tensors into host memory
// without making the main (current) stream wait.
//
// Two implementations share this header (setup.py picks one; see Note [One source list]):
//   shadow_stream.cu       the CUDA build (ASTERIA_WITH_CUDA): real streams, events, kernels;
//   shadow_stream_cpu.cpp  the CPU build: copies synchronously, events are always complete.
// The CUDA build also runs without a GPU, or with CPU tensors: then it behaves like the stand-in.
//
// Contract
// --------
// * copy_to_host(src, dst): records an event on src's device's *current* stream, makes the shadow
//   stream wait on it (so the copy sees every write the current stream issued before the call),
//   then copies src into dst on the shadow stream and returns an event that completes when the
//   copy has. The current stream never waits. dst must be a contiguous CPU tensor of src's shape
//   and dtype; for an asynchronous copy it should be pinned (host_buffer_like gives one), a
//   pageable dst makes the copy synchronous with respect to the host.
// * Lifetimes: the returned CopyEvent keeps src and dst alive until it is destroyed; destroying an
//   event whose copy is still in flight waits for the copy first (never a use-after-free). The
//   caller must not write src on another stream, or read dst, before query() is true or
//   synchronize() returned.
// * Thread safety: a ShadowStream and a CopyEvent may be used from any thread, but not by two
//   threads at once. Nothing here takes the GIL; the bindings release it in synchronize().
// * count_nonfinite(t): the number of NaN/Inf entries of a floating tensor as a 0-dim int64
//   tensor on t's device, computed on the current stream without a host sync (a CUDA kernel in
//   the CUDA build). Non-floating tensors have none.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>

namespace asteria::cuda {

// True when the extension was compiled with CUDA (ASTERIA_WITH_CUDA).
bool cuda_enabled();

// The CUDA runtime version compiled against ("13.0"), or "" in the CPU build.
std::string cuda_version();

class CopyEvent {
 public:
  struct Impl;
  explicit CopyEvent(std::shared_ptr<Impl> impl);
  ~CopyEvent();
  CopyEvent(CopyEvent&&) noexcept;
  CopyEvent& operator=(CopyEvent&&) noexcept;

  bool query() const;              // true when the copy is complete
  void synchronize() const;        // blocks the calling thread until the copy is complete
  const at::Tensor& host() const;  // the destination tensor

 private:
  std::shared_ptr<Impl> impl_;
};

class ShadowStream {
 public:
  // device: a CUDA device index, or -1 for the current device. In the CPU build, and in the CUDA
  // build without a usable GPU, the stream is the synchronous stand-in (is_cuda() false).
  explicit ShadowStream(int device = -1);
  ~ShadowStream();
  ShadowStream(ShadowStream&&) noexcept;
  ShadowStream& operator=(ShadowStream&&) noexcept;

  CopyEvent copy_to_host(const at::Tensor& src, const at::Tensor& dst);
  // An uninitialized contiguous CPU tensor of src's shape and dtype, pinned when is_cuda().
  at::Tensor host_buffer_like(const at::Tensor& src) const;
  void synchronize() const;  // waits for all work queued on the shadow stream
  bool is_cuda() const;
  int device() const;    // the CUDA device index, -1 for the stand-in
  int priority() const;  // the stream priority (CUDA: larger is lower), 0 for the stand-in

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

at::Tensor count_nonfinite(const at::Tensor& t);

namespace detail {
// The argument checks both implementations of copy_to_host share.
inline void check_copy_args(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(dst.device().is_cpu(), "copy_to_host: dst must be a CPU tensor, got ", dst.device());
  TORCH_CHECK(dst.is_contiguous(), "copy_to_host: dst must be contiguous");
  TORCH_CHECK(dst.sizes() == src.sizes(), "copy_to_host: dst shape ", dst.sizes(), " != src shape ",
              src.sizes());
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "copy_to_host: dst dtype ", dst.scalar_type(),
              " != src dtype ", src.scalar_type());
}
}  // namespace detail

}  // namespace asteria::cuda
