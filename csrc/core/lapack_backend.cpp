#include "core/lapack_backend.h"

#include "core/aligned.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <limits>
#include <vector>

namespace asteria::lapack {
namespace {

// Symbols torch's own libraries export (libtorch_cpu and what it links: MKL, libgomp). Looked up
// at run time so the extension links nothing beyond torch and builds against any LAPACK torch has.
// Note the exact-case MKL_Set_Num_Threads_Local: the lowercase mkl_set_num_threads_local exported
// beside it is the Fortran variant that takes an int* (calling it with an int crashes).
using SetThreadsFn = int (*)(int);
using OmpSetThreadsFn = void (*)(int);
template <typename T>
using SyevdFn = void (*)(const char* jobz, const char* uplo, const int* n, T* a, const int* lda,
                         T* w, T* work, const int* lwork, int* iwork, const int* liwork, int* info);

struct TorchSymbols {
  SetThreadsFn mkl_set_num_threads_local = nullptr;
  OmpSetThreadsFn omp_set_num_threads = nullptr;
  SyevdFn<float> ssyevd = nullptr;
  SyevdFn<double> dsyevd = nullptr;
};

TorchSymbols load_torch_symbols() {
  TorchSymbols s;
  Dl_info info{};
  // Any function defined in libtorch_cpu locates the library; dlsym on its handle searches it and
  // the libraries it depends on (torch's libgomp).
  if (dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info) == 0 || !info.dli_fname) {
    return s;
  }
  void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!handle) return s;
  s.mkl_set_num_threads_local =
      reinterpret_cast<SetThreadsFn>(dlsym(handle, "MKL_Set_Num_Threads_Local"));
  s.omp_set_num_threads = reinterpret_cast<OmpSetThreadsFn>(dlsym(handle, "omp_set_num_threads"));
  s.ssyevd = reinterpret_cast<SyevdFn<float>>(dlsym(handle, "ssyevd_"));
  s.dsyevd = reinterpret_cast<SyevdFn<double>>(dlsym(handle, "dsyevd_"));
  dlclose(handle);  // torch stays loaded: RTLD_NOLOAD only took another reference
  return s;
}

const TorchSymbols& torch_symbols() {
  static const TorchSymbols symbols = load_torch_symbols();
  return symbols;
}

bool has_mkl_direct() {
  const TorchSymbols& s = torch_symbols();
  return s.ssyevd && s.dsyevd && s.mkl_set_num_threads_local;
}

std::atomic<int> injected_failures{0};
std::atomic<bool> inject_float64{false};

std::atomic<bool>& use_mkl_direct() {
  static std::atomic<bool> flag{[] {
    const char* env = std::getenv("ASTERIA_EIGH_PATH");
    return env != nullptr && std::string(env) == "mkl_direct" && has_mkl_direct();
  }()};
  return flag;
}

void check_matrix(const char* what, const at::Tensor& a) {
  TORCH_CHECK(a.device().is_cpu(), what, ": expected a CPU tensor, got ", a.device());
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble, what,
              ": expected float32 or float64, got ", a.scalar_type());
  TORCH_CHECK(a.dim() == 2 && a.size(0) == a.size(1), what, ": expected a square matrix, got ",
              a.sizes());
}

void maybe_inject_failure(const char* what, const at::Tensor& a) {
  if (a.scalar_type() == at::kDouble && !inject_float64.load()) return;
  int left = injected_failures.load();
  while (left > 0) {
    if (injected_failures.compare_exchange_weak(left, left - 1)) {
      TORCH_CHECK_LINALG(false, what, ": failure injected by asteria's test hook");
    }
  }
}

// Note [Direct MKL eigh]: ?syevd_ from the MKL inside libtorch_cpu, called with workspaces kept
// per thread. A row-major symmetric matrix is its own column-major transpose, so the buffer is
// passed as is with uplo 'U' (LAPACK's upper triangle of A^T is ATen's lower triangle of A, the
// triangle "L" reads); eigenvectors come back as columns of a column-major matrix, i.e. rows of the
// row-major buffer, hence the transpose. Workspaces up to kCachedWorkspaceBytes are kept per
// thread (no allocation per call); larger ones are allocated per call so that a worker does not
// hold gigabytes after one huge factor. Selected by ASTERIA_EIGH_PATH=mkl_direct or
// set_eigh_path("mkl_direct"); ATen's at::linalg_eigh is the default.
constexpr size_t kCachedWorkspaceBytes = size_t{64} << 20;

template <typename T>
struct Workspace {
  std::vector<T> work;
  std::vector<int> iwork;
};

template <typename T>
Workspace<T>& workspace_for(size_t lwork, size_t liwork, Workspace<T>& local) {
  thread_local Workspace<T> cached;
  const bool cache = lwork * sizeof(T) + liwork * sizeof(int) <= kCachedWorkspaceBytes;
  Workspace<T>& ws = cache ? cached : local;
  if (ws.work.size() < lwork) ws.work.resize(lwork);
  if (ws.iwork.size() < liwork) ws.iwork.resize(liwork);
  return ws;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> eigh_mkl_direct(const at::Tensor& a, SyevdFn<T> syevd) {
  const int64_t n64 = a.size(0);
  const int64_t lwork64 = 1 + 6 * n64 + 2 * n64 * n64;
  TORCH_CHECK(lwork64 <= std::numeric_limits<int>::max(), "eigh (mkl_direct): n = ", n64,
              " is too large for 32-bit LAPACK workspaces; use the 'aten' eigh path");
  const int n = static_cast<int>(n64);
  const int lwork = static_cast<int>(lwork64);
  const int liwork = 3 + 5 * n;
  at::Tensor vecs = a.clone(at::MemoryFormat::Contiguous);
  at::Tensor vals = at::empty({n64}, a.options());
  Workspace<T> local;
  Workspace<T>& ws =
      workspace_for<T>(static_cast<size_t>(lwork), static_cast<size_t>(liwork), local);
  int info = 0;
  const char jobz = 'V';
  const char uplo = 'U';
  syevd(&jobz, &uplo, &n, vecs.data_ptr<T>(), &n, vals.data_ptr<T>(), ws.work.data(), &lwork,
        ws.iwork.data(), &liwork, &info);
  TORCH_CHECK(info >= 0, "eigh: argument ", -info, " of syevd had an illegal value");
  TORCH_CHECK_LINALG(info == 0, "eigh: the algorithm failed to converge; ", info,
                     " off-diagonal elements of an intermediate tridiagonal form did not "
                     "converge to zero.");
  return {vals, vecs.t()};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> eigh(const at::Tensor& a) {
  check_matrix("eigh", a);
  maybe_inject_failure("eigh", a);
  if (use_mkl_direct().load() && a.size(0) > 0) {
    if (a.scalar_type() == at::kFloat) return eigh_mkl_direct<float>(a, torch_symbols().ssyevd);
    return eigh_mkl_direct<double>(a, torch_symbols().dsyevd);
  }
  return at::linalg_eigh(a, "L");
}

at::Tensor qr_q(const at::Tensor& a) {
  check_matrix("qr", a);
  maybe_inject_failure("qr", a);
  // geqrf + orgqr: the LAPACK calls of at::linalg_qr(a, "reduced"), bit for bit, without forming
  // and copying out R (as _qr_q in matrix_functions.py).
  auto [h, tau] = at::geqrf(a);
  return at::linalg_householder_product(h, tau);
}

// Note [Aligned operands] in aligned.cpp: the product's bits do not depend on where a and b sit.
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) { return asteria::aligned_mm(a, b); }

void set_thread_lapack_threads(int n) {
  TORCH_CHECK_VALUE(n >= 1, "lapack_threads must be >= 1, got ", n);
  // ATen initializes each thread's OpenMP/MKL counts lazily, on the thread's first parallel call
  // (at::internal::lazy_init_num_threads). Trigger that now so it cannot later undo what follows.
  (void)at::get_num_threads();
  const TorchSymbols& s = torch_symbols();
  if (s.omp_set_num_threads) s.omp_set_num_threads(n);
  if (s.mkl_set_num_threads_local) s.mkl_set_num_threads_local(n);
}

ScopedThreadLapackThreads::ScopedThreadLapackThreads(int n)
    : openmp_(at::get_num_threads()), mkl_(0) {
  TORCH_CHECK_VALUE(n >= 1, "lapack_threads must be >= 1, got ", n);
  const TorchSymbols& s = torch_symbols();
  if (s.omp_set_num_threads) s.omp_set_num_threads(n);
  if (s.mkl_set_num_threads_local) mkl_ = s.mkl_set_num_threads_local(n);
}

ScopedThreadLapackThreads::~ScopedThreadLapackThreads() {
  const TorchSymbols& s = torch_symbols();
  if (s.omp_set_num_threads) s.omp_set_num_threads(openmp_);
  if (s.mkl_set_num_threads_local) s.mkl_set_num_threads_local(mkl_);
}

int thread_lapack_threads() { return at::get_num_threads(); }

bool has_thread_local_mkl() { return torch_symbols().mkl_set_num_threads_local != nullptr; }

bool has_thread_local_openmp() { return torch_symbols().omp_set_num_threads != nullptr; }

std::string backend_name() {
  const std::string config = at::show_config();
  const std::string key = "LAPACK_INFO=";
  const size_t start = config.find(key);
  if (start == std::string::npos) {
    return at::globalContext().hasLAPACK() ? "unknown" : "none";
  }
  const size_t end = config.find_first_of(", \n", start + key.size());
  return config.substr(start + key.size(), end - start - key.size());
}

std::string eigh_path() { return use_mkl_direct().load() ? "mkl_direct" : "aten"; }

void set_eigh_path(const std::string& path) {
  if (path == "aten") {
    use_mkl_direct().store(false);
    return;
  }
  TORCH_CHECK_VALUE(path == "mkl_direct", "eigh path must be 'aten' or 'mkl_direct', got '", path,
                    "'");
  TORCH_CHECK(has_mkl_direct(),
              "eigh path 'mkl_direct' needs MKL's ssyevd_/dsyevd_/MKL_Set_Num_Threads_Local "
              "exported by torch's libraries; this torch (LAPACK: ",
              backend_name(), ") does not export them");
  use_mkl_direct().store(true);
}

void testing_fail_next(int n, bool include_float64) {
  TORCH_CHECK_VALUE(n >= 0, "testing_fail_next: n must be >= 0, got ", n);
  inject_float64.store(include_float64);
  injected_failures.store(n);
}

}  // namespace asteria::lapack
