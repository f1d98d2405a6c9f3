#include "core/soap_step.h"

#include "core/aligned.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cstddef>

// Note [SOAP step in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~
// SOAP's step is some twenty small ops per block. On small blocks the cost is the dispatch, not
// the arithmetic: from Python each op pays the interpreter and the binding, about as much again
// as the op's own dispatcher call. These functions issue the same ATen ops, in the same order per
// block, from C++: one Python call per chunk of blocks. The arithmetic, hence every bit of the
// result, is that of the Python formulation (tests/unit/test_fused_steps.py checks it against
// the per-block ops of the authors' code). Written to mirror it line by line:
//   g_rot = Q_L^T @ G, then @ Q_R                 (kron.mode_products, transpose=True)
//   m.mul_(b1).add_(g_rot, alpha=1-b1)
//   v.mul_(b2).add_(g_rot.pow(2), alpha=1-b2)     (Tensor.square is pow(2))
//   ratio = m / v.sqrt().add_(eps)
//   u = Q_L @ ratio, then @ Q_R^T                 (mode_products, transpose=False)
//   u = u / (1e-30 + mean(u^2)^0.5)               (normalize_grads)
//   W.add_(u, alpha=-step)
// The GIL is released by the binding, so the statistics lane and the pool's workers run while
// the main thread is in here.

namespace asteria {
namespace {

void check_block(std::size_t i, const at::Tensor& g, const std::optional<at::Tensor>& left,
                 const std::optional<at::Tensor>& right, const at::Tensor& m, const at::Tensor& v,
                 const at::Tensor& w) {
  const bool bases = left.has_value() || right.has_value();
  TORCH_CHECK_VALUE(!bases || g.dim() == 2, "soap_update_blocks: block ", i,
                    " has bases but its gradient has ", g.dim(), " dims (2 expected)");
  TORCH_CHECK_VALUE(m.sizes() == g.sizes() && v.sizes() == g.sizes() && w.sizes() == g.sizes(),
                    "soap_update_blocks: block ", i, ": gradient ", g.sizes(), ", exp_avg ",
                    m.sizes(), ", exp_avg_sq ", v.sizes(), ", weight ", w.sizes(),
                    " must have one shape");
  if (left) {
    TORCH_CHECK_VALUE(left->dim() == 2 && left->size(0) == g.size(0) && left->size(1) == g.size(0),
                      "soap_update_blocks: block ", i, ": left basis ", left->sizes(),
                      " does not match a gradient of shape ", g.sizes());
  }
  if (right) {
    TORCH_CHECK_VALUE(
        right->dim() == 2 && right->size(0) == g.size(1) && right->size(1) == g.size(1),
        "soap_update_blocks: block ", i, ": right basis ", right->sizes(),
        " does not match a gradient of shape ", g.sizes());
  }
}

}  // namespace

void soap_update_blocks(
    const std::vector<at::Tensor>& grads, const std::vector<std::optional<at::Tensor>>& lefts,
    const std::vector<std::optional<at::Tensor>>& rights, const std::vector<at::Tensor>& exp_avgs,
    const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& weights,
    const std::vector<double>& step_sizes, double beta1, double beta2, double eps, bool normalize) {
  const std::size_t n = grads.size();
  TORCH_CHECK_VALUE(lefts.size() == n && rights.size() == n && exp_avgs.size() == n &&
                        exp_avg_sqs.size() == n && weights.size() == n && step_sizes.size() == n,
                    "soap_update_blocks: every list must have one entry per block (", n,
                    " gradients)");
  for (std::size_t i = 0; i < n; ++i) {
    check_block(i, grads[i], lefts[i], rights[i], exp_avgs[i], exp_avg_sqs[i], weights[i]);
  }
  c10::AutoGradMode no_grad(false);
  for (std::size_t i = 0; i < n; ++i) {
    const auto& left = lefts[i];
    const auto& right = rights[i];
    at::Tensor g_rot = grads[i];
    if (left) g_rot = asteria::aligned_mm(left->t(), g_rot);
    if (right) g_rot = asteria::aligned_mm(g_rot, *right);
    at::Tensor m = exp_avgs[i];
    at::Tensor v = exp_avg_sqs[i];
    m.mul_(beta1).add_(g_rot, 1 - beta1);
    v.mul_(beta2).add_(at::pow(g_rot, 2), 1 - beta2);
    at::Tensor update = at::div(m, at::sqrt(v).add_(eps));
    if (left) update = asteria::aligned_mm(*left, update);
    if (right) update = asteria::aligned_mm(update, right->t());
    if (normalize) {
      update = at::div(update, at::add(at::pow(at::mean(at::pow(update, 2)), 0.5), 1e-30));
    }
    at::Tensor w = weights[i];
    w.add_(update, -step_sizes[i]);
  }
}

void soap_accumulate(const std::vector<std::optional<at::Tensor>>& factors, const at::Tensor& grad,
                     double beta) {
  TORCH_CHECK_VALUE(factors.size() == 2 && grad.dim() == 2,
                    "soap_accumulate: a 2-D gradient and two factor slots expected, got ",
                    grad.dim(), " dims and ", factors.size(), " slots");
  c10::AutoGradMode no_grad(false);
  for (std::size_t i = 0; i < 2; ++i) {
    if (!factors[i]) continue;
    at::Tensor f = *factors[i];
    const at::Tensor gram =
        i == 0 ? asteria::aligned_mm(grad, grad.t()) : asteria::aligned_mm(grad.t(), grad);
    TORCH_CHECK_VALUE(f.sizes() == gram.sizes(), "soap_accumulate: factor ", i, " has shape ",
                      f.sizes(), ", the gradient's gram ", gram.sizes());
    f.lerp_(gram, 1 - beta);
  }
}

namespace {

using Mats = std::array<std::optional<at::Tensor>, 2>;

// kron.mode_products of a matrix: Q_L^T X Q_R with `transpose`, Q_L X Q_R^T without.
at::Tensor mode_products(at::Tensor x, const Mats& mats, bool transpose) {
  if (mats[0]) x = asteria::aligned_mm(transpose ? mats[0]->t() : *mats[0], x);
  if (mats[1]) x = asteria::aligned_mm(x, transpose ? *mats[1] : mats[1]->t());
  return x;
}

std::optional<at::Tensor> entry(const c10::List<std::optional<at::Tensor>>& list, std::size_t i) {
  return list.get(i);
}

}  // namespace

// Note [SOAP installs on the CPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// SOAP.install_refresh of 2-D blocks on the CPU, one operator for a step's installs: per block,
// v permuted along each refreshed dim, and m carried into the new bases through the original
// space (Q_old, then Q_new^T) or by R = Q_old^T Q_new, whichever costs fewer flops, with the
// same ops on the same operands as the Python method (so bit for bit its result). Stacking the
// blocks of a shape group first (what a GPU's batched install does) costs copies of m, v and the
// bases and buys nothing on the CPU, where every product runs one matrix at a time (Note
// [Aligned operands]): measured on an AMD EPYC, SOAP's refresh step at bench/optim_step.py's
// model took about 6% longer stacked.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> soap_install_each(
    at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
    const c10::List<std::optional<at::Tensor>>& old_lefts,
    const c10::List<std::optional<at::Tensor>>& old_rights,
    const c10::List<std::optional<at::Tensor>>& new_lefts,
    const c10::List<std::optional<at::Tensor>>& new_rights,
    const c10::List<std::optional<at::Tensor>>& perm_lefts,
    const c10::List<std::optional<at::Tensor>>& perm_rights) {
  const std::size_t n = exp_avgs.size();
  TORCH_CHECK_VALUE(exp_avg_sqs.size() == n && old_lefts.size() == n && old_rights.size() == n &&
                        new_lefts.size() == n && new_rights.size() == n && perm_lefts.size() == n &&
                        perm_rights.size() == n,
                    "soap_install_each: every list must have one entry per block (", n,
                    " exp_avgs)");
  const std::array<const c10::List<std::optional<at::Tensor>>*, 2> olds{&old_lefts, &old_rights};
  const std::array<const c10::List<std::optional<at::Tensor>>*, 2> news{&new_lefts, &new_rights};
  const std::array<const c10::List<std::optional<at::Tensor>>*, 2> perms{&perm_lefts, &perm_rights};
  for (std::size_t i = 0; i < n; ++i) {  // validate every block before computing any
    TORCH_CHECK_VALUE(exp_avgs[i].dim() == 2 && exp_avg_sqs[i].sizes() == exp_avgs[i].sizes(),
                      "soap_install_each: block ", i, ": exp_avg ", exp_avgs[i].sizes(),
                      " and exp_avg_sq ", exp_avg_sqs[i].sizes(), " must be one 2-D shape");
    bool any = false;
    for (int d = 0; d < 2; ++d) {
      const auto q = entry(*news[d], i);
      if (!q) continue;
      any = true;
      const auto old = entry(*olds[d], i);
      const auto perm = entry(*perms[d], i);
      const int64_t size = exp_avgs[i].size(d);
      TORCH_CHECK_VALUE(old && perm && q->dim() == 2 && q->size(0) == size && q->size(1) == size &&
                            old->sizes() == q->sizes() && perm->dim() == 1 && perm->size(0) == size,
                        "soap_install_each: block ", i, " dim ", d,
                        ": a new basis needs its old basis and its permutation, all of order ",
                        size);
    }
    TORCH_CHECK_VALUE(any, "soap_install_each: block ", i, " has no refreshed dim");
  }
  c10::AutoGradMode no_grad(false);
  std::vector<at::Tensor> ms(n), vs(n);
  for (std::size_t i = 0; i < n; ++i) {
    at::Tensor m = exp_avgs[i];
    at::Tensor v = exp_avg_sqs[i];
    Mats back, forth;
    bool backward = false;
    for (int d = 0; d < 2; ++d) {
      const auto q = entry(*news[d], i);
      if (!q) continue;
      v = v.index_select(d, *entry(*perms[d], i));
      const at::Tensor old = *entry(*olds[d], i);
      if (old.size(0) * old.size(0) < m.numel()) {  // d_i < numel / d_i
        forth[d] = asteria::aligned_mm(old.t(), *q);
      } else {
        back[d] = old;
        forth[d] = *q;
        backward = true;
      }
    }
    if (backward) m = mode_products(m, back, /*transpose=*/false);
    ms[i] = mode_products(m, forth, /*transpose=*/true);
    vs[i] = v;
  }
  return {ms, vs};
}

TORCH_LIBRARY_FRAGMENT(asteria, m) {
  m.def(
      "soap_install_each(Tensor[] exp_avgs, Tensor[] exp_avg_sqs, Tensor?[] old_lefts, "
      "Tensor?[] old_rights, Tensor?[] new_lefts, Tensor?[] new_rights, Tensor?[] perm_lefts, "
      "Tensor?[] perm_rights) -> (Tensor[], Tensor[])");
}

TORCH_LIBRARY_IMPL(asteria, CPU, m) { m.impl("soap_install_each", &soap_install_each); }

}  // namespace asteria
