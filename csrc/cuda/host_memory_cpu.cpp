// The CPU build's stand-in for host_memory.cu (contract in host_memory.h): nothing is registered,
// fences are the stand-in's, and device addresses are refused. Torch-free; setup.py compiles this
// file only when it does not compile host_memory.cu.
#include <stdexcept>
#include <string>

#include "cuda/host_memory.h"

namespace asteria::cuda {
namespace {

constexpr const char* kNoCuda =
    "this asteria build has no CUDA; rebuild against a CUDA torch with nvcc available";

}  // namespace

bool host_registration_available() { return false; }

int host_current_device() { return -1; }

void host_register(void*, size_t, int) {
  throw std::runtime_error(std::string("cannot pin host memory: ") + kNoCuda);
}

void host_unregister(void*, size_t, int) noexcept {}

void* host_device_pointer(void*, int) {
  throw std::runtime_error(std::string("device views of host memory need CUDA: ") + kNoCuda);
}

std::shared_ptr<memory::Fence> record_stream_fence(std::uintptr_t, int device) {
  if (device >= 0) {
    throw std::runtime_error("cannot record an event on CUDA device " + std::to_string(device) +
                             ": " + kNoCuda);
  }
  return memory::stand_in_fence();
}

}  // namespace asteria::cuda
