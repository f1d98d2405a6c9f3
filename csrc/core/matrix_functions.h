// Matrix functions of the preconditioner refreshes: the C++ twins of
// asteria/optim/matrix_functions.py, with the same semantics, messages aside from naming the C++
// function.
//
// Contract
// --------
// * Inputs: CPU tensors (any floating dtype, any strides); they are read, never written.
//   `dtype` is the compute and output dtype: float32 or float64.
// * Precision policy (Note [fp64 retry]): compute in `dtype`; when LAPACK fails (c10::LinAlgError)
//   or the result is not finite, recompute once in float64 and convert back to `dtype`. When the
//   retry fails too, throw MatrixFunctionError("<function> failed in <dtype> (...) and in float64
//   (...)"). A float64 `dtype` gets no second try.
// * Non-finite input throws MatrixFunctionError("<function>: ... non-finite entries") at once.
// * Caller mistakes (not square, mismatched shapes, root/epsilon <= 0, bad dtype) throw
//   c10::ValueError (ValueError in Python), as the pure-torch versions raise ValueError.
// * Thread safety: reentrant; called concurrently from pool workers. All LAPACK/BLAS goes through
//   core/lapack_backend.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

namespace asteria {

// A refresh failed in its dtype and again in float64, or its input was not finite.
// Exposed to Python as asteria._C.MatrixFunctionError (a RuntimeError).
class MatrixFunctionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The shift SOAP's authors add before eigh ("L + 1e-30 I"); kept so results match theirs.
constexpr double kEighShift = 1e-30;

// Eigenvalues and eigenvectors of the symmetric `factor`, in descending eigenvalue order.
std::tuple<at::Tensor, at::Tensor> eigh_descending(const at::Tensor& factor,
                                                   at::ScalarType dtype = at::kFloat);

// One warm-started power iteration plus QR: Q = qr(factor @ basis[:, perm]).Q. With `sort` the
// columns of `basis` are first ordered by diag(basis^T factor basis), descending, and the
// permutation (int64) is returned; without it the permutation is nullopt.
std::tuple<at::Tensor, std::optional<at::Tensor>> qr_refresh(const at::Tensor& factor,
                                                             const at::Tensor& basis,
                                                             bool sort = true,
                                                             at::ScalarType dtype = at::kFloat);

// factor^{-1/root} = Q diag(lambda^{-1/root}) Q^T of a symmetric PSD factor, lambda the eigenvalues
// of factor + epsilon I raised to the eigensolver's accuracy n eps max|lambda| (Note [Round-off
// floor] in asteria/optim/matrix_functions.py), then shifted to min(lambda) = epsilon where below
// it (Meta's perturbation).
at::Tensor inverse_root(const at::Tensor& factor, double root, double epsilon = 1e-12,
                        at::ScalarType dtype = at::kFloat);

}  // namespace asteria
