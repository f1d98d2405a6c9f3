#include "core/build_info.h"

#include <torch/version.h>

#include "core/lapack_backend.h"
#include "core/worker_pool.h"
#include "cuda/device.h"

namespace asteria {

std::map<std::string, BuildValue> build_info() {
  return {
      {"torch_version", std::string(TORCH_VERSION)},
      {"cuda", cuda::cuda_enabled()},
      {"cuda_version", cuda::cuda_version()},
      {"lapack_backend", lapack::backend_name()},
      {"eigh_path", lapack::eigh_path()},
      {"thread_local_mkl", lapack::has_thread_local_mkl()},
      {"thread_local_openmp", lapack::has_thread_local_openmp()},
      {"default_workers", static_cast<int64_t>(core::default_worker_count())},
      {"cplusplus", static_cast<int64_t>(__cplusplus)},
      {"compiler", std::string(__VERSION__)},
  };
}

}  // namespace asteria
