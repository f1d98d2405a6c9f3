// SOAP's per-step block math in one call per chunk of blocks (Note [SOAP step in C++] in
// soap_step.cpp): the update (steps 3-4 of SOAP, the authors' soap.py) and the factor
// statistics (step 1).
//
// Contract
// --------
// * Blocks: 2-D, with an optional left basis (the dim-0 eigenbasis) and an optional right one
//   (dim 1), or of any order with no basis at all. Other blocks (order 3 and more with bases,
//   1-D with a basis) stay with asteria/optim/soap.py's tensordot path.
// * Every tensor on one device, in one floating dtype; moments, weights and factors are written
//   in place, everything else is read. Shapes are checked (c10::ValueError, a ValueError in
//   Python) before anything is written.
// * The ops are those of the Python formulation, in the same order per block, so the results are
//   bitwise the same on the same device.
// * Runs under a no-grad guard; reentrant (the statistics lane calls soap_accumulate from its own
//   thread).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace asteria {

// For every block i: g_rot = Q_L^T G Q_R; m = b1 m + (1-b1) g_rot; v = b2 v + (1-b2) g_rot^2;
// u = Q_L (m / (sqrt(v) + eps)) Q_R^T, rescaled to unit RMS when `normalize`; W -= step_i u.
void soap_update_blocks(
    const std::vector<at::Tensor>& grads, const std::vector<std::optional<at::Tensor>>& lefts,
    const std::vector<std::optional<at::Tensor>>& rights, const std::vector<at::Tensor>& exp_avgs,
    const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& weights,
    const std::vector<double>& step_sizes, double beta1, double beta2, double eps, bool normalize);

// The factor EMAs of one 2-D block: L <- beta L + (1-beta) G G^T, R <- beta R + (1-beta) G^T G
// (either factor may be absent).
void soap_accumulate(const std::vector<std::optional<at::Tensor>>& factors, const at::Tensor& grad,
                     double beta);

}  // namespace asteria
