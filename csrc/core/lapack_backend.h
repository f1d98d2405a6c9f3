// The one place Asteria calls LAPACK/BLAS: every other C++ file goes through these functions.
//
// Contract
// --------
// * Inputs are CPU float32/float64 matrices; outputs are new tensors (inputs are never written).
// * Thread safety: all functions may be called concurrently from any thread. They use ATen's CPU
//   linear algebra (the LAPACK torch ships: MKL on x86 wheels) unless the direct-MKL eigh path is
//   selected (see Note [Direct MKL eigh]).
// * Threads: set_thread_lapack_threads(n) changes only the calling thread's OpenMP and MKL thread
//   counts, never torch's process-wide setting (at::set_num_threads would change the global
//   default that every thread created later starts from). Pool workers call it once at start.
// * Errors: a LAPACK failure throws c10::LinAlgError (torch.linalg.LinAlgError in Python), as ATen
//   does; callers decide whether to retry.
// * Test hook: testing_fail_next(n) makes the next n eigh/qr calls in a dtype other than float64
//   throw c10::LinAlgError, so the float64 retry path can be tested deterministically;
//   testing_fail_next(n, true) fails float64 calls too (the retry-also-fails path).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>

namespace asteria::lapack {

// Eigenvalues (ascending) and eigenvectors (columns) of a symmetric matrix, lower triangle read.
std::tuple<at::Tensor, at::Tensor> eigh(const at::Tensor& a);

// Reduced QR: a = q r with q having orthonormal columns.
at::Tensor qr_q(const at::Tensor& a);

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b);

// Sets the calling thread's LAPACK/BLAS and OpenMP thread count (n >= 1).
void set_thread_lapack_threads(int n);

// set_thread_lapack_threads(n) for the object's lifetime, then the calling thread's counts as
// they were (a training thread that runs a pool's job while it waits, Note [Helping waiters]).
class ScopedThreadLapackThreads {
 public:
  explicit ScopedThreadLapackThreads(int n);
  ~ScopedThreadLapackThreads();
  ScopedThreadLapackThreads(const ScopedThreadLapackThreads&) = delete;
  ScopedThreadLapackThreads& operator=(const ScopedThreadLapackThreads&) = delete;

 private:
  int openmp_;  // the thread's OpenMP count before
  int mkl_;     // its MKL thread-local count before (0: none, MKL's global count)
};

// The calling thread's OpenMP thread count as ATen sees it (at::get_num_threads()).
int thread_lapack_threads();

// Whether set_thread_lapack_threads can reach MKL's and OpenMP's per-thread setters.
bool has_thread_local_mkl();
bool has_thread_local_openmp();

// The LAPACK torch was built with, from torch's build config (for example "mkl").
std::string backend_name();

// How eigh is computed: "aten" (at::linalg_eigh) or "mkl_direct" (see Note [Direct MKL eigh]).
std::string eigh_path();

// Selects the eigh path: "aten", or "mkl_direct" (TORCH_CHECKs that the symbols are present).
void set_eigh_path(const std::string& path);

// Test hook: the next n eigh/qr_q calls on non-float64 input (any input with include_float64)
// throw c10::LinAlgError. n = 0 disarms it.
void testing_fail_next(int n, bool include_float64 = false);

}  // namespace asteria::lapack
