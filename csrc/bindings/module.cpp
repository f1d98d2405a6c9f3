// The asteria._C pybind11 module: registration only, no logic. Every call that can block or
// compute for long releases the GIL (py::call_guard<py::gil_scoped_release>). The stub that
// documents this surface for type checkers is asteria/_C.pyi; keep both in step.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "core/aligned.h"
#include "core/build_info.h"
#include "core/lapack_backend.h"
#include "core/matrix_functions.h"
#include "core/refresh_pool.h"
#include "core/soap_step.h"
#include "core/worker_pool.h"
#include "cuda/device.h"
#include "io/spill_tensor.h"
#include "memory/fence.h"
#include "memory/host_tensor.h"
#include "memory/staging_ring.h"

namespace py = pybind11;

namespace {

using ReleaseGil = py::call_guard<py::gil_scoped_release>;

// Note [GIL-free pool teardown]: deleting a pool joins its workers, and a worker finishing a job
// may drop the last reference to a result tensor that reached Python, which takes the GIL. The
// garbage collector deletes the pool with the GIL held, so the join releases it first (unless
// the interpreter is finalizing, when the atexit hook has already stopped every pool).
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

struct PoolDeleter {
  void operator()(asteria::RefreshPool* pool) const {
    if (Py_IsInitialized() && !interpreter_finalizing() && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete pool;
    } else {
      delete pool;
    }
  }
};
using PoolHolder = std::unique_ptr<asteria::RefreshPool, PoolDeleter>;

void register_errors(py::module_& m) {
  py::register_local_exception<asteria::MatrixFunctionError>(m, "MatrixFunctionError",
                                                             PyExc_RuntimeError);
  py::register_local_exception<asteria::core::JobCancelled>(m, "CancelledError",
                                                            PyExc_RuntimeError);
  py::register_local_exception<asteria::FutureTimeout>(m, "FutureTimeoutError", PyExc_TimeoutError);
}

void register_memory_errors(py::module_& m) {
  py::register_local_exception<asteria::memory::WaitTimeout>(m, "WaitTimeoutError",
                                                             PyExc_TimeoutError);
  py::register_local_exception<asteria::io::ChecksumError>(m, "SpillChecksumError",
                                                           PyExc_RuntimeError);
  py::register_local_exception<asteria::io::KeyNotFound>(m, "SpillKeyError", PyExc_KeyError);
  py::register_local_exception<asteria::io::StoreClosed>(m, "SpillClosedError", PyExc_RuntimeError);
  // An OSError subclass that carries the errno: `except OSError as e: e.errno == errno.ENOSPC`.
  static PyObject* const io_error = PyErr_NewExceptionWithDoc(
      "asteria._C.SpillIOError", "A spill-store read or write failed; errno says why.",
      PyExc_OSError, nullptr);
  m.attr("SpillIOError") = py::handle(io_error);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const asteria::io::IoError& e) {
      PyErr_SetObject(io_error, py::make_tuple(e.error_code(), e.what()).ptr());
    }
  });
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
  m.def("soap_update_blocks", &asteria::soap_update_blocks, py::arg("grads"), py::arg("lefts"),
        py::arg("rights"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("weights"),
        py::arg("step_sizes"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("normalize"), ReleaseGil(),
        "SOAP's update of a chunk of 2-D (or basis-free) blocks, in place (soap_step.h).");
  m.def("soap_accumulate", &asteria::soap_accumulate, py::arg("factors"), py::arg("grad"),
        py::arg("beta"), ReleaseGil(), "SOAP's factor EMAs of one 2-D block, in place.");
  m.def("eigh_path", &asteria::lapack::eigh_path, "The eigh path: 'aten' or 'mkl_direct'.");
  m.def("set_eigh_path", &asteria::lapack::set_eigh_path, py::arg("path"),
        "Select the eigh path: 'aten' (default) or 'mkl_direct'.");
  m.def("_testing_fail_next", &asteria::lapack::testing_fail_next, py::arg("n"),
        py::arg("include_float64") = false,
        "Test hook: the next n eigh/QR LAPACK calls (non-float64 ones unless include_float64) "
        "raise LinAlgError.");
}

void register_pool(py::module_& m) {
  // Note [One thread per refresh] in csrc/core/aligned.cpp: `with _C.OneLapackThread():` runs a
  // refresh's products and factorizations on one LAPACK/BLAS thread, as a pool worker does.
  py::class_<asteria::OneLapackThread>(m, "OneLapackThread")
      .def(py::init<>(),
           "The calling thread's LAPACK/BLAS threads set to 1 for a with-block, then restored.")
      .def("__enter__", [](asteria::OneLapackThread& self) { self.enter(); })
      .def("__exit__", [](asteria::OneLapackThread& self, py::args) {
        self.exit();
        return false;
      });

  py::class_<asteria::RefreshFuture>(m, "Future")
      .def("done", &asteria::RefreshFuture::done)
      .def("cancelled", &asteria::RefreshFuture::cancelled)
      .def("run_ahead", &asteria::RefreshFuture::run_ahead, ReleaseGil(),
           "While this job is queued, run the pool's first queued job here; whether one ran.")
      .def("status", &asteria::RefreshFuture::status)
      .def("result", &asteria::RefreshFuture::result, py::arg("timeout_s") = py::none(),
           ReleaseGil())
      .def_property_readonly("block", &asteria::RefreshFuture::block)
      .def_property_readonly("version", &asteria::RefreshFuture::version)
      .def_property_readonly("deadline", &asteria::RefreshFuture::deadline)
      .def_property_readonly("started_at", &asteria::RefreshFuture::started_at)
      .def_property_readonly("finished_at", &asteria::RefreshFuture::finished_at);

  py::class_<asteria::RefreshPool, PoolHolder>(m, "WorkerPool")
      .def(py::init([](int workers, int lapack_threads, std::optional<std::vector<int>> affinity,
                       int64_t queue_capacity, int64_t trim_bytes, int nice) {
             asteria::RefreshPoolOptions options;
             options.workers = workers;
             options.lapack_threads = lapack_threads;
             options.affinity = affinity.value_or(std::vector<int>{});
             options.queue_capacity = queue_capacity;
             options.trim_bytes = trim_bytes;
             options.nice = nice;
             return PoolHolder(new asteria::RefreshPool(options));
           }),
           py::arg("workers"), py::arg("lapack_threads") = 1, py::arg("affinity") = py::none(),
           py::arg("queue_capacity") = 1024, py::arg("trim_bytes") = int64_t{64} << 20,
           py::arg("nice") = 0, ReleaseGil())
      .def_property_readonly("trims", &asteria::RefreshPool::trims)
      .def("submit_eigh", &asteria::RefreshPool::submit_eigh, py::arg("block"), py::arg("version"),
           py::arg("deadline"), py::arg("factor"), py::arg("dtype") = at::kFloat,
           py::arg("copy") = true, ReleaseGil())
      .def("submit_qr_refresh", &asteria::RefreshPool::submit_qr_refresh, py::arg("block"),
           py::arg("version"), py::arg("deadline"), py::arg("factor"), py::arg("basis"),
           py::arg("sort") = true, py::arg("dtype") = at::kFloat, py::arg("copy") = true,
           ReleaseGil())
      .def("submit_inverse_root", &asteria::RefreshPool::submit_inverse_root, py::arg("block"),
           py::arg("version"), py::arg("deadline"), py::arg("factor"), py::arg("root"),
           py::arg("epsilon") = 1e-12, py::arg("dtype") = at::kFloat, py::arg("copy") = true,
           ReleaseGil())
      .def("shutdown", &asteria::RefreshPool::shutdown, py::arg("wait") = true, ReleaseGil())
      .def("is_shutdown", &asteria::RefreshPool::is_shutdown)
      .def("stats", &asteria::RefreshPool::stats, ReleaseGil())
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
}

void register_host_memory(py::module_& m) {
  namespace mem = asteria::memory;
  m.def("host_empty", &mem::host_empty, py::arg("sizes"), py::arg("dtype"),
        py::arg("pinned") = py::none(), py::arg("reuse") = false, ReleaseGil(),
        "An uninitialized contiguous CPU tensor over a 4 KiB-aligned host block (fresh, or with "
        "reuse=True one from the cache of reused blocks).");
  m.def("release_host_cache", &mem::release_host_cache, ReleaseGil(),
        "Free every block in the cache of reused host blocks; the bytes freed.");
  m.def("host_memory_stats", &mem::host_memory_stats_dict,
        "live_blocks, live_bytes, registered_blocks, registered_bytes, peak_bytes, "
        "allocated_blocks, cached_blocks, cached_bytes, reused_blocks.");
  m.def("device_view", &mem::device_view, py::arg("host"), py::arg("device") = -1,
        "A CUDA tensor aliasing pinned host memory (zero-copy); keeps the memory alive.");
  m.def("host_tensor_info", &mem::host_tensor_info, py::arg("tensor"),
        "Where an asteria.memory tensor's memory lives, or None for any other tensor.");
  m.def("_testing_hold_fences", &mem::testing_hold_fences,
        "Test hook: CPU stand-in fences recorded from now on stay pending.");
  m.def("_testing_release_fences", &mem::testing_release_fences,
        "Test hook: complete the held stand-in fences and stop holding.");

  py::class_<mem::HostTensorInfo>(m, "HostTensorInfo")
      .def_readonly("block_bytes", &mem::HostTensorInfo::block_bytes)
      .def_readonly("offset", &mem::HostTensorInfo::offset)
      .def_readonly("pinned", &mem::HostTensorInfo::pinned)
      .def_readonly("device_view", &mem::HostTensorInfo::device_view)
      .def_readonly("staging_slot", &mem::HostTensorInfo::staging_slot);

  py::class_<mem::RingStats>(m, "RingStats")
      .def_readonly("slots", &mem::RingStats::slots)
      .def_readonly("slot_bytes", &mem::RingStats::slot_bytes)
      .def_readonly("leased", &mem::RingStats::leased)
      .def_readonly("held_by_views", &mem::RingStats::held_by_views)
      .def_readonly("pending_copies", &mem::RingStats::pending_copies)
      .def_readonly("acquires", &mem::RingStats::acquires)
      .def_readonly("waited", &mem::RingStats::waited)
      .def_readonly("pinned", &mem::RingStats::pinned);

  py::class_<mem::SlotLease>(m, "StagingSlot")
      .def_property_readonly("index", &mem::SlotLease::index)
      .def_property_readonly("nbytes", &mem::SlotLease::bytes)
      .def_property_readonly("released", &mem::SlotLease::released)
      .def("view", &mem::slot_view, py::arg("sizes"), py::arg("dtype"))
      .def("record", &mem::slot_record, py::arg("stream"), py::arg("device"))
      .def("query", &mem::SlotLease::query)
      .def("wait", &mem::wait_slot, py::arg("timeout_s") = py::none(), ReleaseGil())
      .def("release", &mem::SlotLease::release);

  py::class_<mem::StagingRing>(m, "StagingRing")
      .def(py::init(&mem::make_staging_ring), py::arg("slots"), py::arg("slot_bytes"),
           py::arg("pinned") = py::none(), ReleaseGil())
      .def("acquire", &mem::acquire_slot, py::arg("timeout_s") = py::none(), ReleaseGil())
      .def("stats", &mem::StagingRing::stats)
      .def_property_readonly("slots", &mem::StagingRing::slots)
      .def_property_readonly("slot_bytes", &mem::StagingRing::slot_bytes);
}

void register_spill(py::module_& m) {
  namespace io = asteria::io;
  py::class_<io::SpillFuture>(m, "SpillFuture")
      .def("done", &io::SpillFuture::done)
      .def("result", &io::SpillFuture::result, py::arg("timeout_s") = py::none(), ReleaseGil())
      .def_property_readonly("is_read", &io::SpillFuture::is_read)
      .def_property_readonly("started_at", &io::SpillFuture::started_at)
      .def_property_readonly("finished_at", &io::SpillFuture::finished_at);

  py::class_<io::TensorSpillStore>(m, "SpillStore")
      .def(py::init<const std::string&, int64_t, int, const std::string&>(), py::arg("path_dir"),
           py::arg("capacity_bytes"), py::arg("io_threads") = 2, py::arg("mode") = "auto",
           ReleaseGil())
      .def("write", &io::TensorSpillStore::write, py::arg("key"), py::arg("tensor"), ReleaseGil())
      .def("read", &io::TensorSpillStore::read, py::arg("key"), py::arg("out") = py::none(),
           ReleaseGil())
      .def("remove", &io::TensorSpillStore::remove, py::arg("key"), ReleaseGil())
      .def("contains", &io::TensorSpillStore::contains, py::arg("key"))
      .def("nbytes", &io::TensorSpillStore::nbytes, py::arg("key"))
      .def("extent", &io::TensorSpillStore::extent, py::arg("key"))
      .def("keys", &io::TensorSpillStore::keys)
      .def("close", &io::TensorSpillStore::close, ReleaseGil())
      .def("closed", &io::TensorSpillStore::closed)
      .def("stats", &io::TensorSpillStore::stats)
      .def_property_readonly("path", &io::TensorSpillStore::path)
      .def_property_readonly("mode", &io::TensorSpillStore::mode)
      .def_property_readonly("mode_reason", &io::TensorSpillStore::mode_reason)
      .def_property_readonly("io_threads", &io::TensorSpillStore::io_threads);

  m.def("_testing_io_fail_next", &io::testing_io_fail_next, py::arg("n"), py::arg("errno"),
        py::arg("op") = "write",
        "Test hook: the next n spill-file operations of kind op ('write', 'read', "
        "'open_direct') fail with this errno.");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "Asteria's C++ core: matrix functions, the refresh worker pool, host memory and the "
      "staging ring, the NVMe spill store.";
  m.def("build_info", &asteria::build_info, "How this extension was built (a dict).");
  register_errors(m);
  register_memory_errors(m);
  register_matrix_functions(m);
  register_pool(m);
  register_cuda(m);
  register_host_memory(m);
  register_spill(m);
}
