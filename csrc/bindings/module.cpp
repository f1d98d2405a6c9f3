// The asteria._C pybind11 module: registration only, no logic. Every call that can block or
// compute for long releases the GIL (py::call_guard<py::gil_scoped_release>). The stub that
// documents this surface for type checkers is asteria/_C.pyi; keep both in step.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "core/build_info.h"
#include "core/lapack_backend.h"
#include "core/matrix_functions.h"
#include "core/refresh_pool.h"
#include "core/worker_pool.h"
#include "cuda/shadow_stream.h"

namespace py = pybind11;

namespace {

using ReleaseGil = py::call_guard<py::gil_scoped_release>;

void register_errors(py::module_& m) {
  py::register_local_exception<asteria::MatrixFunctionError>(m, "MatrixFunctionError",
                                                             PyExc_RuntimeError);
  py::register_local_exception<asteria::core::JobCancelled>(m, "CancelledError",
                                                            PyExc_RuntimeError);
  py::register_local_exception<asteria::FutureTimeout>(m, "FutureTimeoutError", PyExc_TimeoutError);
}

void register_matrix_functions(py::module_& m) {
  m.def("eigh_descending", &asteria::eigh_descending, py::arg("factor"),
        py::arg("dtype") = at::kFloat, ReleaseGil(),
        "Eigenvalues and eigenvectors of a symmetric factor, descending (fp64 retry).");
  m.def("qr_refresh", &asteria::qr_refresh, py::arg("factor"), py::arg("basis"),
        py::arg("sort") = true, py::arg("dtype") = at::kFloat, ReleaseGil(),
        "One warm-started power iteration plus QR; returns (Q, perm or None).");
  m.def("inverse_root", &asteria::inverse_root, py::arg("factor"), py::arg("root"),
        py::arg("epsilon") = 1e-12, py::arg("dtype") = at::kFloat, ReleaseGil(),
        "factor^(-1/root) of a symmetric PSD factor by eigendecomposition (fp64 retry).");
  m.def("eigh_path", &asteria::lapack::eigh_path, "The eigh path: 'aten' or 'mkl_direct'.");
  m.def("set_eigh_path", &asteria::lapack::set_eigh_path, py::arg("path"),
        "Select the eigh path: 'aten' (default) or 'mkl_direct'.");
  m.def("_testing_fail_next", &asteria::lapack::testing_fail_next, py::arg("n"),
        py::arg("include_float64") = false,
        "Test hook: the next n eigh/QR LAPACK calls (non-float64 ones unless include_float64) "
        "raise LinAlgError.");
}

void register_pool(py::module_& m) {
  py::class_<asteria::RefreshFuture>(m, "Future")
      .def("done", &asteria::RefreshFuture::done)
      .def("cancelled", &asteria::RefreshFuture::cancelled)
      .def("status", &asteria::RefreshFuture::status)
      .def("result", &asteria::RefreshFuture::result, py::arg("timeout_s") = py::none(),
           ReleaseGil())
      .def_property_readonly("block", &asteria::RefreshFuture::block)
      .def_property_readonly("version", &asteria::RefreshFuture::version)
      .def_property_readonly("deadline", &asteria::RefreshFuture::deadline)
      .def_property_readonly("started_at", &asteria::RefreshFuture::started_at)
      .def_property_readonly("finished_at", &asteria::RefreshFuture::finished_at);

  py::class_<asteria::RefreshPool>(m, "WorkerPool")
      .def(py::init([](int workers, int lapack_threads, std::optional<std::vector<int>> affinity,
                       int64_t queue_capacity) {
             return std::make_unique<asteria::RefreshPool>(asteria::RefreshPoolOptions{
                 workers, lapack_threads, affinity.value_or(std::vector<int>{}), queue_capacity});
           }),
           py::arg("workers"), py::arg("lapack_threads") = 1, py::arg("affinity") = py::none(),
           py::arg("queue_capacity") = 1024, ReleaseGil())
      .def("submit_eigh", &asteria::RefreshPool::submit_eigh, py::arg("block"), py::arg("version"),
           py::arg("deadline"), py::arg("factor"), py::arg("dtype") = at::kFloat, ReleaseGil())
      .def("submit_qr_refresh", &asteria::RefreshPool::submit_qr_refresh, py::arg("block"),
           py::arg("version"), py::arg("deadline"), py::arg("factor"), py::arg("basis"),
           py::arg("sort") = true, py::arg("dtype") = at::kFloat, ReleaseGil())
      .def("submit_inverse_root", &asteria::RefreshPool::submit_inverse_root, py::arg("block"),
           py::arg("version"), py::arg("deadline"), py::arg("factor"), py::arg("root"),
           py::arg("epsilon") = 1e-12, py::arg("dtype") = at::kFloat, ReleaseGil())
      .def("shutdown", &asteria::RefreshPool::shutdown, py::arg("wait") = true, ReleaseGil())
      .def("is_shutdown", &asteria::RefreshPool::is_shutdown)
      .def("stats", &asteria::RefreshPool::stats)
      .def("latest", &asteria::RefreshPool::latest, py::arg("block"))
      .def("published_version", &asteria::RefreshPool::published_version, py::arg("block"))
      .def_property_readonly("workers", &asteria::RefreshPool::workers)
      .def_property_readonly("lapack_threads", &asteria::RefreshPool::lapack_threads);

  // Note [Pool registry]: stop every pool's workers before the interpreter tears down.
  py::module_::import("atexit").attr("register")(
      py::cpp_function(&asteria::core::shutdown_all_pools, ReleaseGil()));
}

void register_cuda(py::module_& m) {
  m.def("cuda_enabled", &asteria::cuda::cuda_enabled, "Whether _C was compiled with CUDA.");
  m.def("count_nonfinite", &asteria::cuda::count_nonfinite, py::arg("tensor"),
        "Number of NaN/Inf entries as a 0-dim int64 tensor on the tensor's device (no sync).");

  py::class_<asteria::cuda::CopyEvent>(m, "CopyEvent")
      .def("query", &asteria::cuda::CopyEvent::query)
      .def("synchronize", &asteria::cuda::CopyEvent::synchronize, ReleaseGil())
      .def_property_readonly("host", &asteria::cuda::CopyEvent::host);

  py::class_<asteria::cuda::ShadowStream>(m, "ShadowStream")
      .def(py::init<int>(), py::arg("device") = -1)
      .def("copy_to_host", &asteria::cuda::ShadowStream::copy_to_host, py::arg("src"),
           py::arg("dst"), ReleaseGil())
      .def("host_buffer_like", &asteria::cuda::ShadowStream::host_buffer_like, py::arg("src"))
      .def("synchronize", &asteria::cuda::ShadowStream::synchronize, ReleaseGil())
      .def_property_readonly("is_cuda", &asteria::cuda::ShadowStream::is_cuda)
      .def_property_readonly("device", &asteria::cuda::ShadowStream::device)
      .def_property_readonly("priority", &asteria::cuda::ShadowStream::priority);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Asteria's C++ core: matrix functions, the refresh worker pool, the shadow stream.";
  m.def("build_info", &asteria::build_info, "How this extension was built (a dict).");
  register_errors(m);
  register_matrix_functions(m);
  register_pool(m);
  register_cuda(m);
}
