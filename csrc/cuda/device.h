// What the extension knows of CUDA: whether it was built with it, and the one kernel it has.
//
// Two implementations share this header (setup.py picks one; see Note [One source list]):
//   device.cu       the CUDA build (ASTERIA_WITH_CUDA);
//   device_cpu.cpp  the CPU build.
// Asteria's copies between host and device memory run on one low-priority stream, owned by
// Python (asteria/memory/copies.py): torch's streams and events, no C++ stream of its own.
//
// Contract
// --------
// * cuda_enabled(): whether the extension was compiled with CUDA; cuda_version(): the CUDA
//   runtime version compiled against ("13.0"), or "" in the CPU build.
// * count_nonfinite(t): the number of NaN/Inf entries of a floating tensor as a 0-dim int64
//   tensor on t's device, computed on the current stream without a host sync (a CUDA kernel in
//   the CUDA build). Non-floating tensors have none.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace asteria::cuda {

bool cuda_enabled();

std::string cuda_version();

at::Tensor count_nonfinite(const at::Tensor& t);

}  // namespace asteria::cuda
