"""Input gradients through Laplace-sampled BatchNorm γ, β agree with finite differences.

Laplace draws come out of the layer matrix ``[γ, β]`` (``curvature.layers.Layer.unflatten``);
as strided views of it, torch 2.14's CPU ``batch_norm`` in eval mode back-propagated wrong input
gradients through them (autograd 0.038 against the finite difference −0.004 on this net), so
gradient-based tools (adversarial inputs with ``predictive="sample"``) got wrong directions.
"""

from __future__ import annotations

import torch
from test_laplace_pruned_glm import _setup

from pyro_bnn.model.modes import evaluation_mode
from pyro_bnn.posterior.prediction import sample_latents


def test_input_gradient_through_sampled_batchnorm_matches_finite_differences():
    model, guide, _, x = _setup("batchnorm", "kron")
    torch.manual_seed(0)
    with evaluation_mode(model, guide):
        values = sample_latents(model, guide, x[:1])
        xx = x[:4].clone().requires_grad_()
        grad, = torch.autograd.grad(model.run_with(values, xx)[:, 0].sum(), xx)
        step = torch.zeros_like(x[:4])
        step[:, 0] = 1e-6
        with torch.no_grad():
            fd = (model.run_with(values, x[:4] + step)[:, 0] - model.run_with(values, x[:4] - step)[:, 0]) / 2e-6
    torch.testing.assert_close(grad[:, 0], fd, rtol=1e-5, atol=1e-7)
    assert fd.abs().max() > 1e-3  # not a vacuous comparison of zeros
