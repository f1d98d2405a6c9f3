// The CPU build's stand-in for device.cu (see the contract in device.h): no CUDA, and the count
// of non-finite entries computed by ATen. setup.py compiles this file only when it does not
// compile device.cu.
#include <ATen/ATen.h>

#include "cuda/device.h"

namespace asteria::cuda {

bool cuda_enabled() { return false; }

std::string cuda_version() { return ""; }

at::Tensor count_nonfinite(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "count_nonfinite: this asteria build has no CUDA, got ",
              t.device());
  if (!at::isFloatingType(t.scalar_type())) return at::zeros({}, t.options().dtype(at::kLong));
  return at::isfinite(t).logical_not().sum();
}

}  // namespace asteria::cuda
