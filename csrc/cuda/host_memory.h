// What Asteria's host memory needs from the CUDA driver: page-locking (registration) of host
// ranges, their device addresses, and events recorded on a stream. Torch-free.
//
// Two implementations share this header (setup.py picks one; see Note [One source list]):
//   host_memory.cu       the CUDA build: the CUDA runtime API;
//   host_memory_cpu.cpp  the CPU build (and CMakeLists.txt's torch-free core): no registration,
//                        stand-in fences, and device addresses refused with a clear error.
//
// Contract
// --------
// * host_registration_available(): this is a CUDA build and the CUDA runtime sees a device.
// * host_register(ptr, bytes, device): cudaHostRegister(Mapped | Portable) of one range, with
//   `device` current; throws std::runtime_error naming the CUDA error (the error is cleared, so it
//   cannot resurface in an unrelated later call). Callers keep ranges small (memory/host_block.h
//   registers in chunks of at most 256 MiB).
// * host_unregister(ptr, bytes, device): cudaHostUnregister with `device` current. Never throws; a
//   failure is reported on stderr. Safe from any thread (the current device is restored).
// * host_device_pointer(ptr, device): the device address of registered host memory on `device`
//   (cudaHostGetDevicePointer). Throws in the CPU build, without a GPU, or for unregistered memory.
// * record_stream_fence(stream, device): a fence that completes when the work queued on the raw
//   CUDA stream handle `stream` of `device` before the call has (a cudaEvent). device < 0 gives the
//   CPU stand-in (memory::stand_in_fence()); a device >= 0 throws in the CPU build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "memory/fence.h"

namespace asteria::cuda {

bool host_registration_available();

// The current CUDA device, or -1 when there is none (and always in the CPU build).
int host_current_device();

void host_register(void* ptr, size_t bytes, int device);

void host_unregister(void* ptr, size_t bytes, int device) noexcept;

void* host_device_pointer(void* ptr, int device);

std::shared_ptr<memory::Fence> record_stream_fence(std::uintptr_t stream, int device);

}  // namespace asteria::cuda
