#include "core/aligned.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "core/matrix_functions.h"

// Note [Aligned operands]
// ~~~~~~~~~~~~~~~~~~~~~~~
// MKL's BLAS and LAPACK results on the CPU can depend on where a matrix starts in memory, not
// only on its values and layout. Measured on an AMD EPYC (torch 2.13.0+cpu, MKL 2024.2; the
// Intel Xeon where the project was written hides it): `sgemm` of a 3 x 33 by 33 x 33 product
// whose operand starts at an offset that is not a multiple of 16 bytes gives other bits than at
// an aligned one, and `syevd`/`geqrf` of a 33 x 33 matrix likewise (in a stack of 16 copies of
// one matrix only those at 16-byte offsets agree); and MKL's batched gemm (what at::bmm calls
// for contiguous stacks) rounds some shapes (5 or 7 x 64 by 64 x 64, float32) otherwise than
// its gemm whatever the alignment. So "the same routine on the same input" needs one more
// rule, kept here and in matrix_functions.py: every matrix Asteria hands to BLAS or LAPACK on
// the CPU is a dense row- or column-major matrix at a 64-byte boundary (aligned_operand: a copy
// where it is not), products are computed one matrix at a time by at::mm (block_mm: never
// at::bmm on the CPU), and eigendecompositions and QR factorizations one matrix at a time on
// LAPACK's own fresh copy (never a batched call). Then a block's product, root or basis is the
// same bits alone, at any place of any batch, in native mode, on the pool and in the C++ step,
// on any CPU; tests/unit/test_aligned_operands.py checks the results and, on any CPU, that no
// BLAS or LAPACK call of a step or a refresh gets a misaligned or batched operand.
//
// Note [One thread per refresh]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// MKL's results also depend on how many threads a call runs on: a 33 x 33 root or QR refresh on
// two threads differs from the same on one. A pool worker runs its jobs on `lapack_threads`
// threads (1 by default). So a native refresh runs on one LAPACK/BLAS thread per matrix too:
// eigh_each and qr_each spread the matrices of a stack over the caller's threads, each on one
// thread; matrix_functions.py runs a refresh's products under OneLapackThread. Then S = 0 under
// the runtime (lapack_threads = 1) and native mode compute every refresh alike on any CPU.

namespace asteria {
namespace {

bool starts_aligned(const at::Tensor& m) {
  return reinterpret_cast<std::uintptr_t>(m.data_ptr()) % kOperandAlign == 0;
}

bool column_major(const at::Tensor& m) { return m.size(0) > 1 && m.stride(0) == 1; }

void check_matrix(const char* what, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, what, ": expected a ", dim, "-D tensor, got ", t.dim(),
                    " dims");
}

at::Tensor cpu_mm(const at::Tensor& a, const at::Tensor& b) {
  return at::mm(aligned_operand(a), aligned_operand(b));
}

at::Tensor aligned_mm_op(const at::Tensor& a, const at::Tensor& b) {
  check_matrix("aligned_mm", a, 2);
  check_matrix("aligned_mm", b, 2);
  return asteria::aligned_mm(a, b);
}

at::Tensor block_mm_op(const at::Tensor& a, const at::Tensor& b) {
  check_matrix("block_mm", a, 3);
  check_matrix("block_mm", b, 3);
  return asteria::block_mm(a, b);
}

}  // namespace

bool is_aligned_operand(const at::Tensor& m) {
  if (m.dim() != 2 || !m.defined()) return false;
  if (m.numel() == 0) return true;
  if (!starts_aligned(m)) return false;
  const int64_t rows = m.size(0), cols = m.size(1);
  const int64_t s0 = m.stride(0), s1 = m.stride(1);
  const bool row_major = (cols == 1 || s1 == 1) && (rows == 1 || s0 == cols);
  const bool col_major = (rows == 1 || s0 == 1) && (cols == 1 || s1 == rows);
  return row_major || col_major;
}

at::Tensor aligned_operand(const at::Tensor& m) {
  if (!m.is_cpu() || is_aligned_operand(m)) return m;
  // a fresh allocation starts at the allocator's alignment (64 bytes on the CPU)
  if (column_major(m)) return m.t().clone(at::MemoryFormat::Contiguous).t();
  return m.clone(at::MemoryFormat::Contiguous);
}

at::Tensor aligned_mm(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_cpu()) return at::mm(a, b);
  return cpu_mm(a, b);
}

at::Tensor block_mm(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_cpu()) return at::bmm(a, b);
  TORCH_CHECK_VALUE(a.size(0) == b.size(0) && a.size(2) == b.size(1), "block_mm: stacks of shapes ",
                    a.sizes(), " and ", b.sizes(), " do not multiply");
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "block_mm: dtypes ", a.scalar_type(),
                    " and ", b.scalar_type(), " differ");
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  for (int64_t i = 0; i < a.size(0); ++i) {
    at::Tensor row = out.select(0, i);
    if (starts_aligned(row) || row.numel() == 0) {
      at::mm_out(row, aligned_operand(a.select(0, i)), aligned_operand(b.select(0, i)));
    } else {
      row.copy_(cpu_mm(a.select(0, i), b.select(0, i)));
    }
  }
  return out;
}

namespace {

// A stack of column-major matrices (what LAPACK returns, batched or not): (B, rows, cols) with
// strides (rows * cols, 1, rows).
at::Tensor column_major_stack(int64_t batch, int64_t rows, int64_t cols,
                              const at::TensorOptions& options) {
  return at::empty({batch, cols, rows}, options).transpose(1, 2);
}

void check_stack(const char* what, const at::Tensor& a) {
  TORCH_CHECK_VALUE(a.dim() == 3, what, ": expected a stack of matrices (3-D), got ", a.dim(),
                    " dims");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> eigh_each(const at::Tensor& a) {
  check_stack("eigh_each", a);
  if (!a.is_cpu()) return at::linalg_eigh(a, "L");
  const int64_t batch = a.size(0), n = a.size(1);
  at::Tensor values = at::empty({batch, n}, a.options());
  at::Tensor vectors = column_major_stack(batch, n, n, a.options());
  // the matrices over the caller's threads, each on one LAPACK thread (Note [One thread per
  // refresh]); at::linalg_eigh works on its own fresh (aligned) copy of the matrix
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    const lapack::ScopedThreadLapackThreads one(1);
    for (int64_t i = begin; i < end; ++i) {
      auto [w, v] = at::linalg_eigh(a.select(0, i), "L");
      values.select(0, i).copy_(w);
      vectors.select(0, i).copy_(v);
    }
  });
  return {values, vectors};
}

at::Tensor qr_each(const at::Tensor& a) {
  check_stack("qr_each", a);
  if (!a.is_cpu()) {
    auto [h, tau] = at::geqrf(a);
    return at::linalg_householder_product(h, tau);
  }
  const int64_t batch = a.size(0), rows = a.size(1), cols = a.size(2);
  at::Tensor q = column_major_stack(batch, rows, std::min(rows, cols), a.options());
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    const lapack::ScopedThreadLapackThreads one(1);
    for (int64_t i = begin; i < end; ++i) {
      auto [h, tau] = at::geqrf(a.select(0, i));  // on geqrf's own fresh copy
      q.select(0, i).copy_(at::linalg_householder_product(h, tau));
    }
  });
  return q;
}

// Note [Refreshes one by one on the CPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Native mode refreshes the due blocks of a shape group in one call (Note [Batched refreshes] in
// asteria/optim/refresher.py). On a GPU that call stacks them and runs batched kernels; on the CPU
// stacking buys nothing (every product and factorization runs one matrix at a time anyway, Note
// [Aligned operands]) and costs a copy of every factor and basis, a stacked sort and gather, and
// a copy back: on an AMD EPYC (torch 2.13.0+cpu) SOAP's refresh step at bench/optim_step.py's
// model took 20% longer stacked than block by block. So on the CPU the group is one operator,
// qr_refresh_each, that runs the pool's own qr_refresh (core/matrix_functions.cpp) on each
// factor: one dispatched op for the group, as the stacked path's were few, no copies, and each
// basis bit for bit what a pool worker computes for the block (the same routine on the same
// input, on one LAPACK thread). A block whose refresh fails (non-finite in float32 and float64)
// comes back marked in `ok`, and its caller runs it alone, for its error.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor> qr_refresh_each(
    at::TensorList factors, at::TensorList bases, bool sort, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(factors.size() == bases.size(), "qr_refresh_each: ", factors.size(),
                    " factors but ", bases.size(), " bases");
  const auto n = static_cast<int64_t>(factors.size());
  std::vector<at::Tensor> qs(n), perms(n);
  at::Tensor ok = at::ones({n}, at::TensorOptions().dtype(at::kBool));
  bool* ok_ptr = ok.data_ptr<bool>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const lapack::ScopedThreadLapackThreads one(1);  // Note [One thread per refresh]
    for (int64_t i = begin; i < end; ++i) {
      try {
        auto [q, perm] = qr_refresh(factors[i], bases[i], sort, dtype);
        qs[i] = std::move(q);
        if (perm) perms[i] = std::move(*perm);
      } catch (const MatrixFunctionError&) {
        ok_ptr[i] = false;
      }
    }
  });
  for (int64_t i = 0; i < n; ++i) {  // a list of tensors holds no undefined one
    if (!qs[i].defined()) qs[i] = at::empty({0}, factors[i].options().dtype(dtype));
    if (!perms[i].defined()) perms[i] = at::empty({0}, factors[i].options().dtype(at::kLong));
  }
  return {qs, perms, ok};
}

void OneLapackThread::enter() {
  TORCH_CHECK(!scope_, "OneLapackThread: entered twice");
  scope_.emplace(1);
}

void OneLapackThread::exit() { scope_.reset(); }

TORCH_LIBRARY_FRAGMENT(asteria, m) {
  m.def("aligned_mm(Tensor a, Tensor b) -> Tensor");
  m.def("block_mm(Tensor a, Tensor b) -> Tensor");
  m.def("eigh_each(Tensor a) -> (Tensor, Tensor)");
  m.def("qr_each(Tensor a) -> Tensor");
  m.def(
      "qr_refresh_each(Tensor[] factors, Tensor[] bases, bool sort, ScalarType dtype) -> "
      "(Tensor[], Tensor[], Tensor)");
}

TORCH_LIBRARY_IMPL(asteria, CompositeExplicitAutograd, m) {
  m.impl("aligned_mm", &aligned_mm_op);
  m.impl("block_mm", &block_mm_op);
  m.impl("eigh_each", &eigh_each);
  m.impl("qr_each", &qr_each);
}

TORCH_LIBRARY_IMPL(asteria, CPU, m) { m.impl("qr_refresh_each", &qr_refresh_each); }

}  // namespace asteria
