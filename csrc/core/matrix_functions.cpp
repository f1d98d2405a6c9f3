#include "core/matrix_functions.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/lapack_backend.h"

namespace asteria {
namespace {

using Outputs = std::vector<at::Tensor>;

const char* dtype_name(at::ScalarType dtype) {
  return dtype == at::kDouble ? "torch.float64" : "torch.float32";
}

void check_square(const char* name, const at::Tensor& a) {
  TORCH_CHECK_VALUE(a.dim() == 2 && a.size(0) == a.size(1), name,
                    " must be a square matrix, got shape ", a.sizes());
  TORCH_CHECK_VALUE(a.device().is_cpu(), name, " must be a CPU tensor, got ", a.device());
}

void check_dtype(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble,
                    "dtype must be torch.float32 or torch.float64, got ", dtype);
}

// Note [Canonical layout]: BLAS results depend on the operands' memory layout (a column-major
// basis from LAPACK multiplies differently from a row-major copy), so every function computes on
// row-major operands, like matrix_functions.py; the pool's copies and the optimizer's own tensors
// then give the same bits.
at::Tensor canonical(const at::Tensor& a, at::ScalarType dtype) { return a.to(dtype).contiguous(); }

// Exact, usually in one pass: a finite sum means every entry is finite; only a non-finite sum,
// which may be an overflow, needs the full test (as _finite_one in matrix_functions.py).
bool all_finite(const at::Tensor& t) {
  if (!at::isFloatingType(t.scalar_type())) return true;
  if (std::isfinite(t.sum().item<double>())) return true;
  return at::isfinite(t).all().item<bool>();
}

bool all_finite(const Outputs& outputs) {
  for (const at::Tensor& t : outputs) {
    if (!all_finite(t)) return false;
  }
  return true;
}

// The validity gate of outputs whose first tensor is orthonormal (entries bounded by 1): its sum
// cannot overflow and any NaN/Inf makes it non-finite, so one reduction replaces isfinite + all.
// Mirrors _finite_orthonormal in matrix_functions.py.
bool finite_orthonormal(const Outputs& outputs) {
  if (!std::isfinite(outputs.at(0).sum().item<double>())) return false;
  for (size_t i = 1; i < outputs.size(); ++i) {
    if (!all_finite(outputs[i])) return false;
  }
  return true;
}

using ValidFn = bool (*)(const Outputs&);

// Whether factor + kEighShift * I equals factor bit for bit: adding s to a float x returns x when
// |s| < ulp(x) / 2, and ulp(x) >= |x| eps / 2, so every diagonal entry above 4 s / eps in
// magnitude (margin 2) absorbs the shift (as _shift_is_exact_noop in matrix_functions.py).
bool shift_is_exact_noop(const at::Tensor& a) {
  const double eps = a.scalar_type() == at::kFloat ? std::numeric_limits<float>::epsilon()
                                                   : std::numeric_limits<double>::epsilon();
  return a.size(0) > 0 && a.diagonal().abs().min().item<double>() * eps > 8 * kEighShift;
}

// One attempt in `dtype`: the outputs when LAPACK succeeded and they pass `valid`, else nullopt
// with the reason in *error.
template <typename Fn>
std::optional<Outputs> attempt(const Fn& fn, at::ScalarType dtype, ValidFn valid,
                               std::string* error) {
  try {
    Outputs out = fn(dtype);
    if (valid(out)) return out;
    *error = "non-finite result";
  } catch (const c10::LinAlgError& e) {
    *error = e.msg();
  }
  return std::nullopt;
}

// Note [fp64 retry]: run fn(dtype); on a LAPACK error or a non-finite result run fn(float64) once
// and convert its floating outputs back to dtype. Mirrors _with_fp64_retry in matrix_functions.py.
template <typename Fn>
Outputs with_fp64_retry(const Fn& fn, at::ScalarType dtype, const char* what,
                        ValidFn valid = all_finite) {
  std::string first_error;
  if (auto out = attempt(fn, dtype, valid, &first_error)) return std::move(*out);
  std::string retry_error = first_error;
  if (dtype != at::kDouble) {
    if (auto out = attempt(fn, at::kDouble, valid, &retry_error)) {
      for (at::Tensor& t : *out) {
        if (at::isFloatingType(t.scalar_type())) t = t.to(dtype);
      }
      return std::move(*out);
    }
  }
  throw MatrixFunctionError(std::string(what) + " failed in " + dtype_name(dtype) + " (" +
                            first_error + ") and in float64 (" + retry_error + ")");
}

// Note [Refreshes ignore autocast]: a refresh computes in its own dtype on whatever thread runs
// it. A pool job can run on the training thread (Note [Helping waiters]) inside the caller's
// autocast region (a module's forward pre-hook installs what is ready), where at::mm would come
// back in bfloat16 and LAPACK refuse it; every entry point turns autocast off for its thread.
using NoAutocast = c10::impl::ExcludeDispatchKeyGuard;

}  // namespace

std::tuple<at::Tensor, at::Tensor> eigh_descending(const at::Tensor& factor, at::ScalarType dtype) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  check_square("factor", factor);
  check_dtype(dtype);
  if (!all_finite(factor)) {
    throw MatrixFunctionError("eigh_descending: factor has non-finite entries");
  }
  const auto run = [&factor](at::ScalarType dt) -> Outputs {
    // The shifted copy only where the shift changes a bit (as _eigh in matrix_functions.py).
    if (factor.scalar_type() == dt && shift_is_exact_noop(factor)) {
      auto [evals, evecs] = lapack::eigh(factor);
      return {evecs, evals};
    }
    // A copy with the shift added to its diagonal in place: the values of
    // factor + shift * I without building the identity (as _shifted in matrix_functions.py).
    // Column-major, the layout LAPACK works in, so eigh's own working copy is a memcpy.
    at::Tensor a = at::empty({factor.size(1), factor.size(0)}, factor.options().dtype(dt)).t();
    a.copy_(factor);
    a.diagonal().add_(kEighShift);
    auto [evals, evecs] = lapack::eigh(a);
    return {evecs, evals};
  };
  Outputs out = with_fp64_retry(run, dtype, "eigh_descending", finite_orthonormal);
  std::swap(out[0], out[1]);
  return {out[0].flip(0), out[1].flip(1)};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> qr_refresh(const at::Tensor& factor,
                                                             const at::Tensor& basis, bool sort,
                                                             at::ScalarType dtype) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  check_square("factor", factor);
  TORCH_CHECK_VALUE(basis.sizes() == factor.sizes(), "basis shape ", basis.sizes(),
                    " != factor shape ", factor.sizes());
  TORCH_CHECK_VALUE(basis.device().is_cpu(), "basis must be a CPU tensor, got ", basis.device());
  check_dtype(dtype);
  if (!all_finite(factor) || !all_finite(basis)) {
    throw MatrixFunctionError("qr_refresh: factor or basis has non-finite entries");
  }
  // The same operations, in the same order, as qr_refresh in matrix_functions.py, transposed
  // (Note [QR layout] there): one P^T = Q^T F^T serves the eigenvalue estimates diag(Q^T F Q)
  // and the power iteration, and reaches geqrf column-major.
  const auto run = [&factor, &basis, sort](at::ScalarType dt) -> Outputs {
    const at::Tensor f = canonical(factor, dt);
    const at::Tensor qt = canonical(basis.t(), dt);
    const at::Tensor power_t = lapack::matmul(qt, f.t());
    if (!sort) return {lapack::qr_q(power_t.t())};
    const at::Tensor est = (qt * power_t).sum(1);
    const at::Tensor perm = at::argsort(est, /*dim=*/-1, /*descending=*/true);
    return {lapack::qr_q(power_t.index_select(0, perm).t()), perm};
  };
  Outputs out = with_fp64_retry(run, dtype, "qr_refresh", finite_orthonormal);
  if (out.size() == 1) return {out[0], std::nullopt};
  return {out[0], out[1].to(at::kLong)};
}

at::Tensor inverse_root(const at::Tensor& factor, double root, double epsilon,
                        at::ScalarType dtype) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  check_square("factor", factor);
  TORCH_CHECK_VALUE(root > 0, "root must be > 0, got ", root);
  TORCH_CHECK_VALUE(epsilon > 0, "epsilon must be > 0, got ", epsilon);
  check_dtype(dtype);
  if (!all_finite(factor)) {
    throw MatrixFunctionError("inverse_root: factor has non-finite entries");
  }
  // Meta's perturbation, as asteria/optim/matrix_functions.py's twin (Notes [Singular factors]
  // and [Round-off floor] there): eigh(factor + epsilon I), eigenvalues raised to the solver's
  // accuracy n eps max|lam|, then lam - min(lam) + epsilon where min(lam) < epsilon.
  const auto run = [&factor, root, epsilon](at::ScalarType dt) -> Outputs {
    at::Tensor f = canonical(factor, dt).clone();
    f.diagonal().add_(epsilon);
    auto [raw, evecs] = lapack::eigh(f);
    const double eps = dt == at::kFloat ? std::numeric_limits<float>::epsilon()
                                        : std::numeric_limits<double>::epsilon();
    const at::Tensor evals =
        at::maximum(raw, raw.abs().max() * (static_cast<double>(raw.size(0)) * eps));
    const at::Tensor low = evals.min();
    const at::Tensor lam = at::where(low < epsilon, (evals - low) + epsilon, evals);
    const at::Tensor scale = lam.pow(-1.0 / root);
    return {lapack::matmul(evecs * scale, evecs.t())};
  };
  return with_fp64_retry(run, dtype, "inverse_root")[0];
}

}  // namespace asteria
