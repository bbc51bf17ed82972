"""The evidence of the linearised model at its own mode (``Laplace(..., evidence="linearized")``,
Antorán et al. 2022) against references: the closed-form evidence of Bayesian linear regression
at any linearisation point and any δ, the MAP evidence at a mode, dense linear algebra, autograd
gradients (also over augmented copies), finite differences in δ, a state_dict round trip.

Float64 throughout; tolerances are round-off (1e-9 relative) unless stated.
"""

import math

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature import (
    KronBlock,
    SplitBiasKronBlock,
    accumulate_curvature,
    find_layers,
    network_output,
)

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("float64")]
SIGMA = 0.5


def _regression(structure, evidence, n=40, d=3, seed=0, delta=2.0):
    """A linear-Gaussian model whose weights are NOT the posterior mode (random θ*)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5])[:d, None] + 0.3 + SIGMA * torch.randn(n, 1, generator=g)
    model = pb.BNN(nn.Linear(d, 1), "gaussian", prior=pb.priors.IIDNormal(delta ** -0.5), noise=SIGMA).double()
    guide = pb.guides.Laplace(model, structure=structure, evidence=evidence)
    guide.fit_curvature((x, y))                                     # set-up
    with torch.no_grad():
        guide.theta["net__weight"].copy_(torch.randn(1, d, generator=g))
        guide.theta["net__bias"].copy_(torch.randn(1, generator=g))
    guide.fit_curvature((x, y), batch_size=16)
    xt = torch.cat([x, torch.ones(n, 1)], 1)
    return guide, xt, y


def _closed_form(xt, y, delta):
    cov = SIGMA ** 2 * torch.eye(len(y)) + xt @ xt.T / delta
    return float(torch.distributions.MultivariateNormal(torch.zeros(len(y)), cov).log_prob(y[:, 0]))


def test_linear_gaussian_evidence_is_the_closed_form_at_any_point_and_delta():
    """For a linear model the linearised model is the model: its evidence is the closed form
    log N(y | 0, σ²I + X̃X̃ᵀ/δ) whatever θ* is.  The MAP evidence at the same random θ* is not
    (it is exact only at the mode), so the comparison can fail."""
    guide, xt, y = _regression("full", "linearized")
    map_guide, _, _ = _regression("full", "map")
    for delta in (0.1, 2.0, 50.0):
        d = torch.tensor(delta)
        ours = float(guide.log_evidence(d))
        exact = _closed_form(xt, y, delta)
        assert ours == pytest.approx(exact, rel=1e-9)
        assert abs(float(map_guide.log_evidence(d)) - exact) > 1.0     # θ* is not the mode
        assert ours >= float(map_guide.log_evidence(d)) - 1e-9


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_approximate_curvature_is_refused_at_construction(structure):
    """KFAC and the diagonal GGN make the Newton step's fit unbounded (measured with KFAC)."""
    with pytest.raises(ValueError, match="needs structure='full'"):
        pb.guides.Laplace(pb.BNN(nn.Linear(3, 1), "gaussian"), structure=structure, evidence="linearized")


@pytest.mark.parametrize("structure", ["full"])
def test_at_a_mode_the_two_evidences_agree(structure):
    """At θ* = the mode of the regularised loss under δ₀ (one exact Newton step on the linear
    model) the terms equal the MAP evidence's; at another δ the linearised one is higher."""
    guide, xt, y = _regression(structure, "linearized")
    delta0 = torch.tensor(2.0)
    fit = guide.posterior
    theta = torch.cat([guide.theta["net__weight"].reshape(-1), guide.theta["net__bias"]]).detach()
    grad = SIGMA ** -2 * torch.cat([g.reshape(-1) for g in fit.gradients])
    H = xt.T @ xt / SIGMA ** 2                      # the exact Hessian (the diagonal GGN is not)
    mode = theta - torch.linalg.solve(H + delta0 * torch.eye(len(theta)), grad + delta0 * theta)
    with torch.no_grad():
        guide.theta["net__weight"].copy_(mode[:-1].reshape(1, -1))
        guide.theta["net__bias"].copy_(mode[-1:])
    guide.fit_curvature((xt[:, :-1], y))
    lin = guide.evidence_terms(delta0)
    guide.evidence = "map"
    at_map = guide.evidence_terms(delta0)
    for key in lin:
        assert float(lin[key]) == pytest.approx(float(at_map[key]), rel=1e-9, abs=1e-9)
    guide.evidence = "linearized"
    for delta in (0.2, 20.0):
        d = torch.tensor(delta)
        higher = float(guide.log_evidence(d))
        guide.evidence = "map"
        assert higher > float(guide.log_evidence(d)) + 1e-6
        guide.evidence = "linearized"


@pytest.mark.parametrize("block_type", ["kron", "split"])
def test_block_solve_with_a_weight_and_a_bias_prior_precision(block_type):
    """``P⁻¹ v`` with one δ for the weight columns and one for the bias column (the whitened
    path of a Kronecker block); every block type's scalar / vector case is in test_curvature."""
    torch.manual_seed(3)
    A, G = torch.randn(4, 4), torch.randn(3, 3)
    block = (KronBlock if block_type == "kron" else SplitBiasKronBlock)(A @ A.T, G @ G.T)
    delta = torch.tensor([0.5, 0.5, 0.5, 3.0]).repeat(3)
    v = torch.randn(12)
    P = block.to_dense(2.5) + torch.diag(delta)
    torch.testing.assert_close(block.solve(v, delta, 2.5), torch.linalg.solve(P, v))


def _mlp_fit(num_augmentations=1, kind="categorical"):
    torch.manual_seed(11)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    model = pb.BNN(net, kind)
    values = {k: v.clone().requires_grad_() for k, v in model.initial_values().items()}
    layers = find_layers(model, {k: v.shape for k, v in values.items()})
    x = torch.randn(14, 1, 6, 6)
    y = torch.randint(0, 3, (14,)) if kind == "categorical" else torch.randn(14, 3)
    S = num_augmentations
    shift = torch.randn(S, 1, 6, 6)

    def run(xb):
        copies = (xb[:, None] + shift[None]).reshape(-1, 1, 6, 6)     # example-major copies
        return network_output(model, values, copies).reshape(len(xb), S, 3).mean(1)
    fit = accumulate_curvature(layers, [(x[:8], y[:8]), (x[8:], y[8:])], run, kind, "kron",
                               num_augmentations=S, gradient=True)
    f = run(x)
    if kind == "categorical":
        nll = nn.functional.cross_entropy(f, y, reduction="sum")
    else:
        nll = 0.5 * ((f - y) ** 2).sum()                             # Λ = I: the σ² is outside
    grads = torch.autograd.grad(nll, list(values.values()))
    expected = [layer.flatten(dict(zip(values, grads))) for layer in layers]
    return fit, expected


@pytest.mark.parametrize("num_augmentations,kind", [(1, "categorical"), (3, "categorical"), (1, "gaussian")])
def test_curvature_pass_gradient_is_the_autograd_gradient(num_augmentations, kind):
    """The gradient summed by the curvature pass equals autograd's gradient of the negative
    log-likelihood, also when the network averages over augmented copies (where KFAC itself
    averages the inputs, the gradient uses every copy's own inputs)."""
    fit, expected = _mlp_fit(num_augmentations, kind)
    for got, want in zip(fit.gradients, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def _regressor(evidence, structure="full", prior_structure="layerwise"):
    """A non-linear regression net after a short fit: θ* is not a mode."""
    torch.manual_seed(2)
    x = torch.randn(60, 4)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] + 0.1 * torch.randn(60, 1)
    model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), "gaussian", noise=0.3).double()
    guide = pb.guides.Laplace(model, structure=structure, evidence=evidence, prior_structure=prior_structure)
    pb.fit(model, guide, (x, y), epochs=3, batch_size=20, progress=False)
    guide.fit_curvature((x, y))
    return model, guide, x, y


@pytest.mark.parametrize("structure,prior_structure", [("full", "scalar"), ("full", "layerwise"),
                                                       ("full", "sitewise")])
def test_evidence_gradient_matches_finite_differences(structure, prior_structure):
    """d/d log δ of the linearised evidence (through the linear model's mode) against central
    differences (step 1e-5; agreement to 1e-6 relative)."""
    _, guide, _, _ = _regressor("linearized", structure, prior_structure)
    log_pp = guide.log_prior_precision.detach().clone().requires_grad_()
    value = guide.log_evidence(log_pp.exp())
    (grad,) = torch.autograd.grad(value, log_pp)
    eps = 1e-5
    for i in range(log_pp.numel()):
        e = torch.zeros_like(log_pp).reshape(-1)
        e[i] = eps
        e = e.reshape(log_pp.shape)
        fd = (float(guide.log_evidence((log_pp + e).exp())) - float(guide.log_evidence((log_pp - e).exp()))) / (2 * eps)
        assert float(grad.reshape(-1)[i]) == pytest.approx(fd, rel=1e-6, abs=1e-6)


def test_nonlinear_net_linearized_evidence_is_never_below_the_map_evidence():
    """θ̂ maximises the quadratic whose value at θ* is the MAP evidence's fit and scatter."""
    _, guide, _, _ = _regressor("linearized")
    for delta in (0.01, 1.0, 100.0):
        d = torch.tensor([delta, delta])
        lin = float(guide.log_evidence(d))
        guide.evidence = "map"
        at_map = float(guide.log_evidence(d))
        guide.evidence = "linearized"
        assert lin >= at_map - 1e-9
        assert math.isfinite(lin)


def test_state_dict_round_trip_keeps_the_gradient_and_the_evidence():
    model, guide, x, y = _regressor("linearized")
    value = float(guide.log_evidence())
    fresh = pb.guides.Laplace(model, "full", evidence="linearized", prior_structure="layerwise")
    fresh.fit_curvature((x[:5], y[:5]))          # set-up; then every buffer is overwritten
    fresh.load_state_dict(guide.state_dict())
    assert float(fresh.log_evidence()) == pytest.approx(value, rel=1e-12)
    assert any(k.startswith("curvature_state.grad") for k in guide.state_dict())


def test_online_marglik_with_the_linearized_evidence_runs_and_records_it():
    """pb.fit's online schedule uses the guide's evidence: the recorded best evidence is the
    linearised one of the restored state."""
    torch.manual_seed(0)
    x = torch.randn(80, 4)
    y = torch.sin(x[:, :1]) + 0.1 * torch.randn(80, 1)
    model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), "gaussian").double()
    guide = pb.guides.Laplace(model, "full", evidence="linearized", prior_structure="layerwise")
    hist = pb.fit(model, guide, (x, y), epochs=6, batch_size=40, progress=False,
                  marglik=pb.MarglikOptions(every=2, steps=20))
    best = hist.history["best_log_evidence"][0]
    assert best == max(v for v in hist.history["log_evidence"] if not math.isnan(v))
    guide.fit_curvature((x, y))
    assert float(guide.log_evidence()) == pytest.approx(best, rel=1e-6)


def test_unknown_evidence_is_an_error_and_a_map_curvature_is_refused():
    model = pb.BNN(nn.Linear(2, 1), "gaussian")
    with pytest.raises(ValueError, match="evidence must be one of"):
        pb.guides.Laplace(model, evidence="exact")
    guide = pb.guides.Laplace(model, "full", evidence="linearized")
    x, y = torch.randn(10, 2), torch.randn(10, 1)
    guide.fit_curvature((x, y))
    values = {k: v.detach().requires_grad_() for k, v in guide.map_values().items()}
    without = accumulate_curvature(guide.layers, [(x, y)], lambda xb: network_output(model, values, xb),
                                   "gaussian", "full")                     # no gradient=True
    with pytest.raises(ValueError, match="log-likelihood gradients"):
        guide.posterior = without


def test_a_classifier_is_refused_before_the_curvature_pass():
    """The quadratic is exact for a Gaussian likelihood only; a classifier is refused by name."""
    model = pb.BNN(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), "categorical")
    guide = pb.guides.Laplace(model, "full", evidence="linearized")
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    with pytest.raises(ValueError, match="needs a Gaussian likelihood, got a categorical"):
        guide.fit_curvature((x, y))


def test_a_pyro_user_trains_with_svi_then_tunes_by_the_linearized_evidence():
    """Plain ``pyro.infer.SVI`` on the guide's own MAP objective, then ``fit_curvature`` and
    ``optimize_prior_precision`` by hand, then ``Predictive``: the evidence tuned is the linearised
    one (it equals the closed form of the linear-Gaussian model at the tuned δ), and Predictive
    draws from the fitted posterior."""
    import pyro
    from pyro.infer import SVI, Predictive

    guide, xt, y = _regression("full", "linearized")
    model = guide.base_model
    x = xt[:, :-1]
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=guide.make_objective())
    for _ in range(5):                                  # a few steps: θ* is still not the mode
        svi.step(x, y)
    guide.fit_curvature((x, y))
    guide.optimize_prior_precision(steps=200, lr=0.1, learn_noise=False)
    delta = float(guide.prior_precision)
    assert float(guide.log_evidence()) == pytest.approx(_closed_form(xt, y, delta), rel=1e-9)
    draws = Predictive(model, guide=guide, num_samples=4, return_sites=["net.weight"])(x)["net.weight"]
    assert draws.shape[0] == 4 and not torch.allclose(draws[0], draws[1])
