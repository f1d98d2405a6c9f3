// The CUDA build of host registration, device addresses and stream fences (contract in
// host_memory.h). Torch-free: the CUDA runtime API only, so nvcc compiles it in seconds;
// host_memory_cpu.cpp is the stand-in otherwise.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "cuda/host_memory.h"

namespace asteria::cuda {
namespace {

std::string describe(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

// Throws for a failed call, clearing the error first: a stale error must not surface in an
// unrelated later call (as a misattributed failure of some kernel launch).
void check(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(what + " failed: " + describe(err));
}

// Makes `device` current while it lives (device < 0: leaves the device alone). Never throws;
// status() says whether the switch worked.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (device < 0) return;
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      status_ = cudaGetLastError();
      return;
    }
    if (previous_ == device) return;
    status_ = cudaSetDevice(device);
    if (status_ != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    switched_ = true;
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  bool switched_ = false;
  cudaError_t status_ = cudaSuccess;
};

void require_device(const char* what) {
  if (!host_registration_available()) {
    throw std::runtime_error(std::string(what) + ": the CUDA runtime sees no GPU on this machine");
  }
}

// A cudaEvent recorded on a stream; complete once the work queued before it has run.
class EventFence : public memory::Fence {
 public:
  EventFence(cudaStream_t stream, int device) : device_(device) {
    DeviceScope scope(device);
    check(scope.status(), "cudaSetDevice(" + std::to_string(device) + ")");
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t err = cudaEventRecord(event_, stream);
    if (err != cudaSuccess) {
      cudaEventDestroy(event_);
      check(err, "cudaEventRecord");
    }
  }

  ~EventFence() override {
    DeviceScope scope(device_);
    if (cudaEventDestroy(event_) != cudaSuccess) cudaGetLastError();
  }

  bool query() override {
    if (done_.load(std::memory_order_acquire)) return true;
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    check(err, "cudaEventQuery");
    done_.store(true, std::memory_order_release);
    return true;
  }

  bool wait_for(memory::Timeout timeout) override {
    if (timeout) return memory::poll_until([this] { return query(); }, timeout);
    check(cudaEventSynchronize(event_), "cudaEventSynchronize");
    done_.store(true, std::memory_order_release);
    return true;
  }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
  std::atomic<bool> done_{false};
};

}  // namespace

bool host_registration_available() {
  static const bool available = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return count > 0;
  }();
  return available;
}

int host_current_device() {
  if (!host_registration_available()) return -1;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

void host_register(void* ptr, size_t bytes, int device) {
  require_device("cannot pin host memory");
  DeviceScope scope(device);
  check(scope.status(), "cudaSetDevice(" + std::to_string(device) + ")");
  check(cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
        "cudaHostRegister of " + std::to_string(bytes) + " bytes");
}

void host_unregister(void* ptr, size_t bytes, int device) noexcept {
  DeviceScope scope(device);
  const cudaError_t err = cudaHostUnregister(ptr);
  if (err == cudaSuccess) return;
  cudaGetLastError();
  // At interpreter exit the runtime may already be gone; the process is ending anyway.
  if (err == cudaErrorCudartUnloading) return;
  std::fprintf(stderr, "asteria: cudaHostUnregister of %zu bytes failed: %s\n", bytes,
               describe(err).c_str());
}

void* host_device_pointer(void* ptr, int device) {
  require_device("device views of host memory");
  DeviceScope scope(device);
  check(scope.status(), "cudaSetDevice(" + std::to_string(device) + ")");
  void* device_ptr = nullptr;
  check(cudaHostGetDevicePointer(&device_ptr, ptr, 0), "cudaHostGetDevicePointer");
  return device_ptr;
}

std::shared_ptr<memory::Fence> record_stream_fence(std::uintptr_t stream, int device) {
  if (device < 0) return memory::stand_in_fence();
  require_device("cannot record an event");
  return std::make_shared<EventFence>(reinterpret_cast<cudaStream_t>(stream), device);
}

}  // namespace asteria::cuda
