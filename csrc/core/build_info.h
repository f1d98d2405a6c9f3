// How this extension was built and what it found at run time, for asteria._C.build_info() and
// `python -m asteria.info`.
//
// Contract: build_info() is cheap, thread-safe and never throws for a working torch. Keys:
//   torch_version (str, the TORCH_VERSION this file was compiled against, without local tag),
//   cuda (bool), cuda_version (str, "" without CUDA), lapack_backend (str, torch's LAPACK_INFO),
//   eigh_path (str, "aten" or "mkl_direct"), thread_local_mkl / thread_local_openmp (bool: whether
//   per-worker LAPACK thread control works), default_workers (int, hardware threads),
//   cplusplus (int, __cplusplus), compiler (str).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>

namespace asteria {

using BuildValue = std::variant<bool, int64_t, std::string>;

std::map<std::string, BuildValue> build_info();

}  // namespace asteria
