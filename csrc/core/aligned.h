// Matrix products whose bits do not depend on where the operands sit in memory.
//
// Contract
// --------
// * aligned_operand(m): a 2-D tensor with m's values that is a dense row-major or column-major
//   matrix starting at a kOperandAlign-byte boundary: m itself where it already is one, else a
//   copy in m's orientation (column-major where m's dim 0 has stride 1, row-major otherwise).
//   Never writes m. Applied to every operand Asteria hands to BLAS or LAPACK on the CPU
//   (Note [Aligned operands] in aligned.cpp).
// * aligned_mm(a, b): at::mm of aligned_operand(a) and aligned_operand(b) on the CPU (at::mm
// elsewhere):
//   its result depends only on the operands' values, shapes and orientations.
// * Two operators, torch.ops.asteria.aligned_mm(a, b) (2-D) and torch.ops.asteria.block_mm(a, b)
//   (stacks (B, m, k) and (B, k, n)): on the CPU, mm of each pair of matrices, one at a time,
//   into a new contiguous result (so a block's product is the same bits alone or at any place of
//   any batch); on other devices at::mm / at::bmm (cuBLAS: equal to the single products to
//   rounding). Registered when the extension loads; each is one operator to the dispatcher.
// * Thread safety: reentrant (the statistics lane and the pool's workers call them).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "core/lapack_backend.h"

namespace asteria {

// Where an operand must start: the CPU allocator's alignment (c10's gAlignment), a multiple of
// the 16 bytes MKL's kernels were seen to depend on.
constexpr std::int64_t kOperandAlign = 64;

// Whether a 2-D tensor is a dense row- or column-major matrix starting at kOperandAlign bytes.
bool is_aligned_operand(const at::Tensor& m);

at::Tensor aligned_operand(const at::Tensor& m);

at::Tensor aligned_mm(const at::Tensor& a, const at::Tensor& b);

at::Tensor block_mm(const at::Tensor& a, const at::Tensor& b);

// torch.ops.asteria.eigh_each(a) and qr_each(a): at::linalg_eigh(a, "L") and the Q of a reduced
// QR (geqrf + orgqr) of a stack, the results column-major per matrix as LAPACK returns them. On
// the CPU one matrix at a time, each on LAPACK's own fresh copy (never one batched call, which
// would hand LAPACK the matrices where they sit in the stack); elsewhere one batched call.
std::tuple<at::Tensor, at::Tensor> eigh_each(const at::Tensor& a);

at::Tensor qr_each(const at::Tensor& a);

// Note [Refreshes one by one on the CPU] (aligned.cpp): qr_refresh (core/matrix_functions.h) of
// each factor with its basis, CPU tensors only: the bases, the permutations (empty where `sort`
// is false) and whether each succeeded (a failed one's entries are empty tensors).
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor> qr_refresh_each(
    at::TensorList factors, at::TensorList bases, bool sort, at::ScalarType dtype);

// Note [One thread per refresh]: the calling thread's LAPACK/BLAS threads set to 1 between
// enter() and exit() (exit restores them; a second enter() without exit() is refused), what a
// native refresh runs under so that it computes as a pool worker with lapack_threads = 1 does.
class OneLapackThread {
 public:
  void enter();
  void exit();

 private:
  std::optional<lapack::ScopedThreadLapackThreads> scope_;
};

}  // namespace asteria
