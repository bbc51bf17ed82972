"""Laplace guide: exact on Bayesian linear regression, evidence gradients, hyperparameter
learning, predictives, Pyro-guide behaviour."""

import math

import pyro
import pytest
import torch
from helpers import HandWritten
from pyro.infer import Predictive
from torch import nn

import pyro_bnn as pb
from pyro_bnn.guides.laplace import LaplaceMAPObjective

pytestmark = pytest.mark.filterwarnings("ignore")
DELTA, SIGMA = 2.0, 0.5


def _blr(structure="kron", n=40, d=3, seed=0):
    """BLR model with the exact MAP put into the guide; float64 throughout."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:d, None] + 0.3 + \
        SIGMA * torch.randn(n, 1, generator=g, dtype=torch.float64)
    model = pb.BNN(nn.Linear(d, 1).double(), "gaussian", prior=pb.priors.IIDNormal(DELTA ** -0.5),
                   noise=SIGMA).double()
    guide = pb.guides.Laplace(model, structure=structure)
    sigma = model.likelihood.noise.detach()
    xt = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)
    P = xt.T @ xt / sigma ** 2 + DELTA * torch.eye(d + 1, dtype=x.dtype)
    w = torch.linalg.solve(P, xt.T @ y[:, 0] / sigma ** 2)
    guide.fit_curvature((x, y))                                # sets the guide up
    with torch.no_grad():
        guide.theta["net__weight"].copy_(w[:d].reshape(1, d))
        guide.theta["net__bias"].copy_(w[d:])
    guide.fit_curvature((x, y), batch_size=16)
    return model, guide, x, y, xt, P, sigma


def _closed_form_evidence(xt, y, sigma):
    cov = sigma ** 2 * torch.eye(len(y), dtype=y.dtype) + xt @ xt.T / DELTA
    return torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=y.dtype), cov).log_prob(y[:, 0])


@pytest.mark.parametrize("structure", ["kron", "full"])
def test_blr_evidence_and_posterior_are_exact(structure):
    model, guide, x, y, xt, P, sigma = _blr(structure)
    assert torch.allclose(guide.prior_precision.double(), torch.tensor(DELTA, dtype=torch.float64))
    ev = guide.log_evidence()
    exact = _closed_form_evidence(xt, y, sigma)
    assert abs(float(ev) - float(exact)) <= 1e-6 * abs(float(exact))
    block = guide.posterior.blocks[0]
    cov = block.covariance(guide.layer_prior_precisions()[0].double(), sigma ** -2)
    torch.testing.assert_close(cov, torch.linalg.inv(P), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("structure", ["kron", "full"])
def test_blr_evidence_terms_are_the_dense_ones(structure):
    """evidence_terms on Bayesian linear regression against dense computations: the fit
    Σ log N(y | Xθ*, σ²), the Occam factor log det P − (d+1) log δ and the scatter δ‖θ*‖²;
    they combine to log_evidence (the closed form, tested above)."""
    model, guide, x, y, xt, P, sigma = _blr(structure)
    terms = guide.evidence_terms()
    theta = torch.cat([guide.theta["net__weight"].reshape(-1), guide.theta["net__bias"]]).detach()
    fit = torch.distributions.Normal(xt @ theta, sigma).log_prob(y[:, 0]).sum()
    assert float(terms["log_likelihood"]) == pytest.approx(float(fit), rel=1e-10)
    ratio = torch.logdet(P) - len(theta) * math.log(DELTA)
    assert float(terms["log_det_ratio"]) == pytest.approx(float(ratio), rel=1e-9)
    assert float(terms["scatter"]) == pytest.approx(DELTA * float(theta @ theta), rel=1e-9)
    combined = terms["log_likelihood"] - 0.5 * (terms["log_det_ratio"] + terms["scatter"])
    assert float(combined) == pytest.approx(float(_closed_form_evidence(xt, y, sigma)), rel=1e-9)


def test_map_objective_is_stationary_at_exact_map():
    model, guide, x, y, *_ = _blr("kron")
    loss, _ = LaplaceMAPObjective()(model, guide, x, y, num_data=len(x))
    grads = torch.autograd.grad(loss, list(guide.theta.values()))
    # δ = 1/σ_prior² carries float32 rounding of the prior's σ buffer (~1e-7 relative)
    assert max(float(g.abs().max()) for g in grads) < 1e-5


def test_guide_draws_have_posterior_covariance():
    model, guide, x, y, xt, P, sigma = _blr("kron")
    torch.manual_seed(0)
    draws = torch.stack([torch.cat([v.reshape(-1) for v in pb.posterior.prediction.sample_latents(model, guide, x[:2]).values()])
                         for _ in range(2000)])
    emp = torch.cov(draws.T)
    exact = torch.linalg.inv(P)
    # 2000 draws: relative standard error of a variance ≈ sqrt(2/2000) ≈ 3.2 %
    assert torch.allclose(torch.diagonal(emp), torch.diagonal(exact), rtol=0.1)
    assert torch.allclose(draws.mean(0), torch.cat([guide.theta["net__weight"].reshape(-1),
                                                    guide.theta["net__bias"]]).detach(),
                          atol=4 * float(torch.diagonal(exact).max().sqrt()) / math.sqrt(2000) * 3)


@pytest.mark.parametrize("structure,prior_structure,kron_bias,subset", [
    ("kron", "scalar", "joint", "all"), ("kron", "layerwise", "joint", "all"),
    ("kron", "sitewise", "separate", "all"), ("kron", "sitewise", "separate", "last_layer"),
    ("kron", "sitewise", "joint", "all"),
    ("kron", "layerwise", "joint", "last_layer"), ("diag", "diagonal", "joint", "all"),
    ("diag", "sitewise", "joint", "all"), ("full", "layerwise", "joint", "all"),
    ("full", "sitewise", "joint", "all")])
def test_evidence_gradient_matches_finite_differences(structure, prior_structure, kron_bias, subset):
    """d log p(D | δ) / d log δ by autograd against central differences (1e-5 relative), for
    every prior structure: one δ, per layer, per site (weight and bias apart), per weight."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 3, (40,))
    model = pb.BNN(net, "categorical").double()
    guide = pb.guides.Laplace(model, structure=structure, prior_structure=prior_structure,
                              prior_precision=0.5, kron_bias=kron_bias, subset=subset).fit_curvature((x, y))
    log_d = guide.log_prior_precision.detach().double().clone()
    log_d = log_d + 0.1 * torch.randn(log_d.shape, dtype=log_d.dtype)
    log_d.requires_grad_()
    ev = guide.log_evidence(log_d.exp())
    (grad,) = torch.autograd.grad(ev, log_d)
    eps = 1e-6
    flat = log_d.detach().reshape(-1)
    idx = range(flat.numel()) if flat.numel() < 5 else [0, 7, flat.numel() - 1]
    for i in idx:
        e = torch.zeros_like(flat)
        e[i] = eps
        fd = (guide.log_evidence((flat + e).reshape(log_d.shape).exp())
              - guide.log_evidence((flat - e).reshape(log_d.shape).exp())) / (2 * eps)
        assert abs(float(fd) - float(grad.reshape(-1)[i])) < 1e-5 * max(1.0, abs(float(fd)))


def test_evidence_gradient_in_noise_matches_finite_differences():
    model, guide, *_ = _blr("kron")
    log_s = torch.tensor(math.log(0.7), dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(guide.log_evidence(noise=log_s.exp()), log_s)
    eps = 1e-6
    fd = (guide.log_evidence(noise=torch.tensor(math.exp(math.log(0.7) + eps), dtype=torch.float64))
          - guide.log_evidence(noise=torch.tensor(math.exp(math.log(0.7) - eps), dtype=torch.float64))) / (2 * eps)
    assert abs(float(fd) - float(grad)) < 1e-6 * max(1.0, abs(float(fd)))


def test_optimize_prior_precision_finds_the_evidence_maximum(digits_small):
    x, y, *_ = digits_small
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron")
    pb.fit(model, guide, (x, y), epochs=5, lr=1e-2, progress=False, seed=0)
    best = guide.optimize_prior_precision(steps=200, lr=0.1)
    grid = torch.logspace(-3, 3, 41)
    values = torch.stack([guide.log_evidence(d) for d in grid]).detach()
    assert best >= float(values.max()) - 1e-3 * abs(float(values.max()))
    assert torch.isclose(guide.log_evidence().detach(), torch.tensor(best), rtol=1e-5)


def test_fit_predict_glm_and_sample(digits_small):
    x, y, xt, yt = digits_small
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron")
    pb.fit(model, guide, (x, y), epochs=3, lr=1e-2, progress=False, seed=0)
    assert guide.posterior is not None and guide.posterior.num_data == len(x)
    p1 = pb.predict(model, guide, xt, predictive="glm_probit", batch_size=7)
    p2 = pb.predict(model, guide, xt, predictive="glm_probit", batch_size=1000)
    assert p1.shape == (1, len(xt), 10)
    torch.testing.assert_close(p1, p2)
    torch.testing.assert_close(p1.sum(-1), torch.ones(1, len(xt)))
    ps = pb.predict(model, guide, xt, num_samples=5)
    assert ps.shape == (5, len(xt), 10)
    assert not torch.allclose(ps[0], ps[1])                      # joint posterior draws differ
    pmc = guide.predict(model, xt, predictive="glm", link_approx="mc", num_samples=4)
    assert pmc.shape == (4, len(xt), 10)
    pred = Predictive(model, guide=guide, num_samples=3, return_sites=["obs"])(xt[:5])
    assert pred["obs"].shape == (3, 5)


def test_glm_probit_matches_brute_force_dense_laplace(digits_small):
    """End to end: GGN summed over N with the softmax Λ = diag(p) − ppᵀ at θ*,
    Σ_f = J (H + δI)⁻¹ Jᵀ and probit κ = (1 + π/8 diag Σ_f)^{-1/2}, all from torch.func."""
    x, y, xt, _ = digits_small
    x, xt = x[:60].double(), xt[:15].double()
    y = y[:60]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    model = pb.BNN(net, "categorical").double()
    guide = pb.guides.Laplace(model, "full", prior_precision=0.7)
    guide.fit_curvature((x, y))                                 # post hoc, at the net's weights
    mods = [m for m in net if isinstance(m, nn.Linear)]
    names = [f"{i}.{p}" for i, m in enumerate(net) if isinstance(m, nn.Linear) for p in ("weight", "bias")]
    shapes = [p.shape for m in mods for p in (m.weight, m.bias)]
    theta = torch.cat([p.detach().reshape(-1) for m in mods for p in (m.weight, m.bias)])

    def f(th, inp):
        parts = th.split([s.numel() for s in shapes])
        return torch.func.functional_call(net, {n: t.reshape(s) for n, t, s in zip(names, parts, shapes)}, (inp,))

    J = torch.func.jacrev(f)(theta, x)                          # (N, C, P)
    p = torch.softmax(f(theta, x), -1)
    Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    P = torch.einsum("ncp,ncd,ndq->pq", J, Lam, J) + 0.7 * torch.eye(len(theta), dtype=theta.dtype)
    Jt = torch.func.jacrev(f)(theta, xt)
    var = torch.einsum("ncp,pq,ncq->nc", Jt, torch.linalg.inv(P), Jt)
    expected = torch.softmax(f(theta, xt) / torch.sqrt(1 + math.pi / 8 * var), -1)
    got = pb.predict(model, guide, xt, predictive="glm_probit")[0]
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_last_layer_laplace_matches_dense_softmax_regression(digits_small, structure):
    """``subset="last_layer"`` is a Laplace of a softmax regression on the frozen body's
    features φ̃ = [tanh(W₀x + b₀), 1]: evidence, posterior draws and GLM probit against
    a dense torch.func reference (GGN Σ_n Jᵀ Λ_n J; for "kron" the KFAC approximation
    (Σ_n Λ_n)/N ⊗ Σ_n φ̃ φ̃ᵀ).  The same Laplace via ``pb.BNN(..., stochastic=...)``."""
    x, y, xt, _ = digits_small
    x, xt, y = x[:60].double(), xt[:15].double(), y[:60]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    model = pb.BNN(net, "categorical").double()
    delta = 0.7
    guide = pb.guides.Laplace(model, structure, prior_precision=delta, subset="last_layer")
    guide.fit_curvature((x, y))
    assert guide.laplace_sites == ["net.2.weight", "net.2.bias"]
    assert guide.fixed_sites == ["net.0.weight", "net.0.bias"]
    W, b = net[2].weight.detach(), net[2].bias.detach()
    theta = torch.cat([W, b[:, None]], 1).reshape(-1)            # W̃ = [W, b], row-major

    def features(inp):
        with torch.no_grad():
            h = net[1](net[0](inp))
        return torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1)

    def f(th, phi):
        return phi @ th.reshape(10, 7).T

    phi, phit = features(x), features(xt)
    J = torch.func.jacrev(f)(theta, phi)                         # (N, C, 70)
    p = torch.softmax(f(theta, phi), -1)
    Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    if structure == "full":
        H = torch.einsum("ncp,ncd,ndq->pq", J, Lam, J)
    else:
        H = torch.kron(Lam.sum(0) / len(x), phi.T @ phi)
    P = H + delta * torch.eye(70, dtype=H.dtype)
    loglik = torch.distributions.Categorical(logits=f(theta, phi)).log_prob(y).sum()
    log_prior = 0.5 * (70 * math.log(delta) - delta * (theta ** 2).sum()) - 35 * math.log(2 * math.pi)
    expected = loglik + log_prior + 35 * math.log(2 * math.pi) - 0.5 * torch.logdet(P)
    torch.testing.assert_close(guide.log_evidence(), expected, rtol=1e-10, atol=0.0)

    Jt = torch.func.jacrev(f)(theta, phit)
    var = torch.einsum("ncp,pq,ncq->nc", Jt, torch.linalg.inv(P), Jt)
    probs = torch.softmax(f(theta, phit) / torch.sqrt(1 + math.pi / 8 * var), -1)
    torch.testing.assert_close(pb.predict(model, guide, xt, predictive="glm_probit")[0], probs, rtol=1e-8, atol=1e-10)

    draws = [guide() for _ in range(4)]                          # body fixed at θ*, last layer random
    assert all(torch.equal(d["net.0.weight"], net[0].weight) for d in draws)
    assert not torch.equal(draws[0]["net.2.weight"], draws[1]["net.2.weight"])

    ll = pb.BNN(net, "categorical", stochastic=["net.2.weight", "net.2.bias"]).double()
    other = pb.guides.Laplace(ll, structure, prior_precision=delta).fit_curvature((x, y))
    torch.testing.assert_close(other.log_evidence(), expected, rtol=1e-10, atol=0.0)


def test_subset_map_objective_keeps_the_prior_of_point_estimates(digits_small):
    """The MAP objective of a subset Laplace is the same log joint as the all-layer one
    (fixed sites keep their model prior), so both train the same MAP network."""
    x, y, *_ = digits_small
    net = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
    model = pb.BNN(net, "categorical", prior=pb.priors.IIDNormal(0.5))
    full = pb.guides.Laplace(model, "kron")
    last = pb.guides.Laplace(model, "kron", subset=["net.2.weight", "net.2.bias"])
    obj = LaplaceMAPObjective()
    torch.testing.assert_close(obj(model, full, x, y)[0], obj(model, last, x, y)[0])
    pb.fit(model, last, (x, y), epochs=2, progress=False, marglik=pb.MarglikOptions(every=1, burnin=0, steps=5, lr=0.1))
    assert last.prior_precision.dim() == 0 and torch.isfinite(last.log_evidence())
    assert pb.predict(model, last, x[:5], predictive="glm_probit").shape == (1, 5, 10)


def test_online_marglik_keeps_best_state(digits_small):
    x, y, *_ = digits_small
    # an N(0, 1) model: one δ (the default fan-in prior resolves to layer-wise δ)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), "categorical",
                   prior=pb.priors.IIDNormal(1.0))
    guide = pb.guides.Laplace(model, "kron", prior_precision=1.0)
    res = pb.fit(model, guide, (x, y), epochs=4, lr=1e-2, progress=False, seed=0,
                 marglik=pb.MarglikOptions(every=1, burnin=1, steps=20, lr=0.1))
    ev = res.history["log_evidence"]
    assert len(ev) == 4 and math.isnan(ev[0]) and all(math.isfinite(v) for v in ev[1:])
    best = res.history["best_log_evidence"][0]
    assert best == max(ev[1:])
    assert float(guide.prior_precision) != 1.0
    assert abs(float(guide.log_evidence()) - best) < 1e-4 * abs(best)   # best state restored
    # the evidence's terms are recorded at every update and combine to its value there
    terms = [res.history[f"evidence_{k}"] for k in ("log_likelihood", "log_det_ratio", "scatter")]
    assert all(len(t) == 3 for t in terms)
    combined = [ll - 0.5 * (ldr + sc) for ll, ldr, sc in zip(*terms)]
    assert combined == pytest.approx(ev[1:], rel=1e-3)
    assert all(ldr > 0 and sc > 0 for ldr, sc in zip(*terms[1:]))


def test_online_marglik_learns_gaussian_noise():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 80)[:, None]
    y = torch.sin(2 * x) + 0.2 * torch.randn_like(x)
    model = pb.BNN(nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)), "gaussian", noise="learned")
    guide = pb.guides.Laplace(model, "kron")
    pb.fit(model, guide, (x, y), epochs=150, lr=1e-2, batch_size=80, progress=False, seed=0,
           marglik=pb.MarglikOptions(every=10, burnin=50, steps=50, lr=0.1))
    assert model.likelihood.log_noise.requires_grad          # unfrozen after fit
    assert 0.1 < float(model.likelihood.noise) < 0.4         # true σ = 0.2, init 1.0
    out = pb.predict(model, guide, x, predictive="glm", num_samples=7)
    assert out.shape == (7, 80, 1)


def test_post_hoc_laplace_of_pretrained_net_and_handwritten_model(digits_small):
    x, y, *_ = digits_small
    torch.manual_seed(0)
    hw = HandWritten(64, 8, 10)
    # the same weights as a BNN: evidence must agree
    net = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
    model = pb.BNN(net, "categorical")
    g_bnn = pb.guides.Laplace(model, "kron", prior_precision=2.0).fit_curvature((x, y))
    g_hw = pb.guides.Laplace(hw, "kron", prior_precision=2.0, init_loc_fn=pyro.infer.autoguide.init_to_value(
        values={"fc1.weight": net[0].weight.detach(), "fc1.bias": net[0].bias.detach(),
                "fc2.weight": net[2].weight.detach(), "fc2.bias": net[2].bias.detach()}))
    g_hw.fit_curvature((x, y))
    torch.testing.assert_close(g_bnn.map_values()["net.0.weight"], net[0].weight)   # no training
    torch.testing.assert_close(g_hw.log_evidence(), g_bnn.log_evidence(), rtol=1e-5, atol=1e-3)
    p = pb.predict(hw, g_hw, x[:5], predictive="glm_probit")
    assert p.shape == (1, 5, 10)


def test_curvature_survives_state_dict_round_trip(digits_small):
    x, y, xt, _ = digits_small
    model = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron", kron_bias="separate").fit_curvature((x, y))
    guide2 = pb.guides.Laplace(model, "kron", kron_bias="separate")
    guide2._ensure_setup(x[:2], y[:2])
    assert guide2.posterior is None
    guide2.load_state_dict(guide.state_dict())
    torch.testing.assert_close(guide2.log_evidence(), guide.log_evidence())
    torch.testing.assert_close(pb.predict(model, guide2, xt, predictive="glm_probit"), pb.predict(model, guide, xt, predictive="glm_probit"))


def test_user_errors():
    model = pb.BNN(nn.Linear(3, 2), "categorical")
    with pytest.raises(ValueError, match="structure"):
        pb.guides.Laplace(model, structure="kfac")
    with pytest.raises(ValueError, match="kron"):
        pb.guides.Laplace(model, structure="kron", prior_structure="diagonal")
    with pytest.raises(ValueError, match="kron_bias"):
        pb.guides.Laplace(model, kron_bias="split")
    with pytest.raises(ValueError, match="prior_precision"):
        pb.guides.Laplace(model, prior_precision=-1.0)
    with pytest.raises(ValueError, match="subset"):
        pb.guides.Laplace(model, subset="first_layer")
    with pytest.raises(ValueError, match="lacks"):
        pb.guides.Laplace(model, subset=["net.9.weight"]).fit_curvature((torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))
    with pytest.raises(ValueError, match="fit_curvature"):
        pb.guides.Laplace(model).log_evidence()
    with pytest.raises(TypeError, match=r"marglik must be a pyro_bnn.MarglikOptions or None, got dict"):
        pb.fit(model, pb.guides.Laplace(model), (torch.randn(4, 3), torch.tensor([0, 1, 0, 1])),
               epochs=1, progress=False, marglik=dict(every=0))
    assert "laplace" in pb.guides.registered_guides()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda(digits_small):
    x, y, xt, _ = digits_small
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron")
    pb.fit(model, guide, (x, y), epochs=2, device="cuda", progress=False,
           marglik=pb.MarglikOptions(every=1, burnin=0, steps=5, lr=0.1))
    assert guide.log_evidence().device.type == "cuda"
    p = pb.predict(model, guide, xt.cuda(), predictive="glm_probit")
    assert p.device.type == "cuda" and p.shape == (1, len(xt), 10)
    assert pb.predict(model, guide, xt.cuda(), num_samples=2).device.type == "cuda"


def test_online_marglik_restores_the_whole_best_state(monkeypatch):
    """At the end of fit(..., marglik=) the guide *and* the model's own parameters (here the
    deterministic body of a model whose last layer alone is stochastic) come back from the
    best-evidence step."""
    d = pb.datasets.digits()
    x, y = d.x_train[:200], d.y_train[:200]
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)),
                   stochastic=["net.2.weight", "net.2.bias"])
    guide = pb.guides.Laplace(model, structure="kron")
    body, guide_states = [], []
    original = type(guide).evidence_steps

    def hyper_steps(self, *args, **kwargs):
        # the real steps, then a penalty growing with every evidence step: the first is "best"
        value = original(self, *args, **kwargs)
        body.append(model.net[0].weight.detach().clone())
        guide_states.append({k: v.detach().clone() for k, v in self.state_dict().items()})
        return value - 1e4 * len(body)

    monkeypatch.setattr(type(guide), "evidence_steps", hyper_steps)
    res = pb.fit(model, guide, (x, y), epochs=4, batch_size=50, lr=1e-2, progress=False,
                 marglik=pb.MarglikOptions(every=1, burnin=1, steps=5, lr=0.1))
    assert len(body) == 3 and not torch.equal(body[0], body[-1])   # the body did train
    assert res.history["best_log_evidence"] == [res.history["log_evidence"][1]]
    assert torch.equal(model.net[0].weight, body[0])
    for k, v in guide.state_dict().items():
        assert torch.equal(v, guide_states[0][k]), k


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_sitewise_prior_precision_is_the_per_weight_vector_it_spreads(structure):
    """One δ per site equals the per-weight ("diagonal") δ that repeats it over the site's
    entries: evidence and GLM predictive agree (float64)."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(30, 3, dtype=torch.float64), torch.randint(0, 3, (30,))
    model = pb.BNN(net, "categorical").double()
    per_site = torch.tensor([0.3, 2.0, 0.7, 5.0], dtype=torch.float64)   # W0, b0, W2, b2
    site = pb.guides.Laplace(model, structure, prior_structure="sitewise", prior_precision=per_site)
    site.fit_curvature((x, y))
    assert site.prior_precision_groups == [("net.0.weight",), ("net.0.bias",), ("net.2.weight",), ("net.2.bias",)]
    full = lambda shape, v: torch.full(shape, v, dtype=torch.float64)  # noqa: E731
    vec = torch.cat([torch.cat([full((4, 3), 0.3), full((4, 1), 2.0)], 1).reshape(-1),
                     torch.cat([full((3, 4), 0.7), full((3, 1), 5.0)], 1).reshape(-1)])
    diag = pb.guides.Laplace(model, structure, prior_structure="diagonal", prior_precision=vec)
    diag.fit_curvature((x, y))
    torch.testing.assert_close(site.log_evidence(), diag.log_evidence(), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(pb.predict(model, site, x[:7], predictive="glm_probit"),
                               pb.predict(model, diag, x[:7], predictive="glm_probit"), rtol=1e-10, atol=1e-12)


def _blr_gridsearch_problem():
    """BLR with 3 training points for 4 weights: the data leave a direction to the prior, so
    the validation NLL of the (post-hoc) predictive has an interior minimum in δ."""
    g = torch.Generator().manual_seed(0)
    w_true = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:, None]

    def draw(m):
        x = torch.randn(m, 3, generator=g, dtype=torch.float64)
        return x, x @ w_true + 0.3 + 0.6 * torch.randn(m, 1, generator=g, dtype=torch.float64)

    (x, y), (xv, yv) = draw(3), draw(200)
    model = pb.BNN(nn.Linear(3, 1).double(), "gaussian", noise=0.3).double()
    sigma = model.likelihood.noise.detach()
    guide = pb.guides.Laplace(model, "full").fit_curvature((x, y))
    xt = torch.cat([x, torch.ones(3, 1, dtype=x.dtype)], 1)
    xvt = torch.cat([xv, torch.ones(200, 1, dtype=x.dtype)], 1)
    theta = torch.cat([guide.theta["net__weight"].reshape(-1), guide.theta["net__bias"]]).detach()

    def closed_form_nll(delta):
        cov = torch.linalg.inv(xt.T @ xt / sigma ** 2 + delta * torch.eye(4, dtype=x.dtype))
        var = (xvt @ cov * xvt).sum(1) + sigma ** 2
        return float(-torch.distributions.Normal(xvt @ theta, var.sqrt()).log_prob(yv[:, 0]).mean())

    return guide, (xv, yv), closed_form_nll


def test_gridsearch_picks_the_lowest_validation_nll_closed_form():
    """Regression, where the GLM predictive is exact: N(y | x̃ᵀθ*, x̃ᵀ(XᵀX/σ² + δI)⁻¹x̃ + σ²).
    The grid's losses equal the closed form (rtol 1e-9); the chosen δ is its argmin, which
    lies inside the grid."""
    guide, val, closed_form_nll = _blr_gridsearch_problem()
    grid = torch.logspace(-2, 3, 21, dtype=torch.float64)
    exact = torch.tensor([closed_form_nll(d) for d in grid], dtype=torch.float64)
    best = int(torch.argmin(exact))
    assert 0 < best < len(grid) - 1                   # a known interior minimum
    value = guide.optimize_prior_precision(method="gridsearch", val=val, grid=grid)
    torch.testing.assert_close(guide.gridsearch_losses[1], exact, rtol=1e-9, atol=0.0)
    torch.testing.assert_close(guide.prior_precision, grid[best])
    assert value == pytest.approx(float(exact[best]), rel=1e-9)


def test_gridsearch_classification_agrees_with_evaluate(digits_small):
    """Classification: each grid value's loss is pb.evaluate(predictive="glm_probit")'s NLL at that δ,
    and grid search keeps the smallest (validation split taken from the training data)."""
    x, y, _, _ = digits_small
    x_tr, y_tr, x_val, y_val = x[:200], y[:200], x[200:], y[200:]
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron", subset="last_layer")
    pb.fit(model, guide, (x_tr, y_tr), epochs=30, lr=1e-2, progress=False, seed=0)
    grid = [0.01, 0.1, 1.0, 10.0, 100.0, 1e3, 1e4]
    guide.optimize_prior_precision(method="gridsearch", val=(x_val, y_val), grid=grid, link_approx="probit")
    chosen = float(guide.prior_precision)
    evaluated = []
    for d in grid:
        with torch.no_grad():
            guide.log_prior_precision.fill_(math.log(d))
        evaluated.append(pb.evaluate(model, guide, x_val, y_val, predictive="glm_probit")["nll"])
    torch.testing.assert_close(guide.gridsearch_losses[1], torch.tensor(evaluated, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert chosen == pytest.approx(grid[min(range(len(grid)), key=evaluated.__getitem__)], rel=1e-5)


def test_optimize_prior_precision_errors(digits_small):
    x, y, *_ = digits_small
    model = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)), "categorical")
    guide = pb.guides.Laplace(model, "kron")
    with pytest.raises(ValueError, match="fit_curvature"):
        guide.optimize_prior_precision()
    guide.fit_curvature((x, y))
    with pytest.raises(ValueError, match="method"):
        guide.optimize_prior_precision(method="cv")
    with pytest.raises(ValueError, match="val="):
        guide.optimize_prior_precision(method="gridsearch")
    with pytest.raises(ValueError, match="gridsearch"):
        guide.optimize_prior_precision(val=(x, y))
    with pytest.raises(TypeError, match="pair"):
        guide.optimize_prior_precision(method="gridsearch", val=x)
    with pytest.raises(ValueError, match="> 0"):
        guide.optimize_prior_precision(method="gridsearch", val=(x, y), grid=[1.0, -1.0])
    # issue 24: a per-site δ in a joint [W, b] Kronecker block is exact now (no longer refused)
    assert pb.guides.Laplace(model, "kron", prior_structure="sitewise").fit_curvature((x, y)).prior_structure \
        == "sitewise"
    with pytest.raises(ValueError, match="tune_prior_precision"):
        pb.guides.Laplace(model, tune_prior_precision="gridsearch")


def test_registry_laplace_is_last_layer_with_evidence_tuned_prior(digits_small):
    """Registry "laplace": last-layer KFAC whose δ is set by the evidence at the end of fit
    (the gradient of the evidence in log δ vanishes there); "laplace_all" covers all layers."""
    x, y, *_ = digits_small
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.registered_guides()["laplace"](model)
    res = pb.fit(model, guide, (x, y), epochs=5, lr=1e-2, progress=False, seed=0)
    assert guide.laplace_sites == ["net.2.weight", "net.2.bias"] and guide.default_predictive == "glm"
    assert "subset=last_layer" in guide.extra_repr() and "δ by marglik" in guide.extra_repr()
    log_d = guide.log_prior_precision.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(guide.log_evidence(log_d.exp()), log_d)
    assert abs(float(grad)) < 1e-2
    assert res.history["posthoc_log_evidence"][0] == pytest.approx(float(guide.log_evidence()), rel=1e-6)
    other = pb.guides.registered_guides()["laplace_all"](model)
    assert other.subset == "all" and other.tune_prior_precision == "marglik"


def test_online_marglik_selects_by_a_deterministic_evidence_pass():
    """A random augmentation makes every curvature pass a Monte Carlo estimate.  The evidence
    that selects the best state comes from a pass under a fixed seed, so after fit the state
    restored reproduces the recorded best evidence exactly (a fresh-seed pass would not);
    the estimate's noise (two seeds) is recorded and positive; a plain model's pass is exact.
    (The augmentation is fixed here: a learned η moves after the evidence is recorded.)"""
    from pyro_bnn.invariance import AffineAugmentation

    d = pb.datasets.digits()
    x, y = d.x_train[:120], d.y_train[:120]
    torch.manual_seed(0)
    aug = AffineAugmentation(num_samples=3, init_extent=0.3, learnable=False)   # random transformations
    model = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)), "categorical",
                   augmentation=aug)
    guide = pb.guides.Laplace(model, "kron")
    res = pb.fit(model, guide, (x, y), epochs=3, batch_size=40, lr=1e-2, progress=False, seed=0,
                 marglik=pb.MarglikOptions(every=1, burnin=0, steps=5, lr=0.1))
    noise = res.history["log_evidence_noise"]
    assert len(noise) == 3 and all(v > 0 for v in noise)
    best = res.history["best_log_evidence"][0]
    assert float(guide.log_evidence()) == pytest.approx(best, rel=1e-6)
    guide.fit_curvature((x, y))                                  # a pass with other draws
    assert float(guide.log_evidence()) != pytest.approx(best, rel=1e-6)

    plain = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)), "categorical")
    res = pb.fit(plain, pb.guides.Laplace(plain, "kron"), (x, y), epochs=2, batch_size=40, lr=1e-2,
                 progress=False, seed=0, marglik=pb.MarglikOptions(every=1, burnin=0, steps=5, lr=0.1))
    assert res.history["log_evidence_noise"] == [0.0, 0.0]


def test_sitewise_prior_in_the_map_objective_and_online(digits_small):
    """With one δ per site the MAP objective's prior is Σ_sites log N(θ_s | 0, δ_s⁻¹), and
    online marglik learns the weight's and the bias's δ apart (last layer, split-bias KFAC)."""
    x, y, *_ = digits_small
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)), "categorical",
                   prior=pb.priors.IIDNormal(1.0))  # the N(0, 1) of the fixed sites below
    guide = pb.guides.Laplace(model, "kron", subset="last_layer", prior_structure="sitewise",
                              kron_bias="separate", prior_precision=torch.tensor([0.5, 4.0]))
    _, extras = LaplaceMAPObjective()(model, guide, x, y)
    values = guide.map_values()
    expected = sum(torch.distributions.Normal(0.0, d ** -0.5).log_prob(values[s]).sum()
                   for s, d in (("net.2.weight", 0.5), ("net.2.bias", 4.0)))
    expected = expected + sum(torch.distributions.Normal(0.0, 1.0).log_prob(values[s]).sum()
                              for s in ("net.0.weight", "net.0.bias"))
    torch.testing.assert_close(extras["log_prior"], expected.detach(), rtol=1e-5, atol=1e-3)
    res = pb.fit(model, guide, (x, y), epochs=3, lr=1e-2, progress=False, seed=0,
                 marglik=pb.MarglikOptions(every=1, burnin=0, steps=20, lr=0.1))
    assert guide.prior_precision.shape == (2,)
    assert not torch.allclose(guide.prior_precision, torch.tensor([0.5, 4.0]))
    assert float(guide.log_evidence()) == pytest.approx(res.history["best_log_evidence"][0], rel=1e-6)


class _NoiseRegression(pyro.nn.PyroModule):
    """Issue 13's layout: PyroSample Linear weights, a learned noise ``sigma ~ HalfNormal``,
    1-D ``obs`` of shape (N,) in ``pyro.plate("data", N, subsample_size=len(x))``."""

    def __init__(self, num_data, hidden=16, learned_sigma=True):
        super().__init__()
        self.num_data, self.learned_sigma = num_data, learned_sigma
        Normal, PyroSample = pyro.distributions.Normal, pyro.nn.PyroSample
        self.fc1 = pyro.nn.PyroModule[nn.Linear](1, hidden)
        self.fc1.weight = PyroSample(Normal(0.0, 1.0).expand([hidden, 1]).to_event(2))
        self.fc1.bias = PyroSample(Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.fc2 = pyro.nn.PyroModule[nn.Linear](hidden, 1)
        self.fc2.weight = PyroSample(Normal(0.0, 1.0).expand([1, hidden]).to_event(2))
        self.fc2.bias = PyroSample(Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", pyro.distributions.HalfNormal(1.0)) if self.learned_sigma else 0.1
        mean = self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)
        with pyro.plate("data", self.num_data, subsample_size=len(x)):
            pyro.sample("obs", pyro.distributions.Normal(mean, sigma), obs=y)
        return mean


def _sine(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(-2, 2, n).unsqueeze(-1)
    return x, torch.sin(2 * x).squeeze(-1) + 0.1 * torch.randn(n, generator=g)


def test_handwritten_regression_with_constrained_noise_point_estimate():
    """Issue 13: last-layer Laplace of a hand-written regression with 1-D obs and a learned
    ``sigma ~ HalfNormal(1)``.  sigma is a point estimate (MAP of its prior in its support,
    stored unconstrained); it stays positive and lands near the true 0.1; the MAP objective
    is the model's own log joint there; evidence and GLM predictive equal those of the same
    network as a ``pb.BNN`` with the noise fixed at the point estimate."""
    x, y = _sine()
    torch.manual_seed(0)
    model = _NoiseRegression(len(x))
    guide = pb.guides.Laplace(model, "kron", subset="last_layer")
    pb.fit(model, guide, (x, y), epochs=400, batch_size=200, lr=1e-2, progress=False, seed=0)
    assert guide.laplace_sites == ["fc2.weight", "fc2.bias"] and guide.fixed_sites[0] == "sigma"
    values = guide.median()
    sigma = values["sigma"]
    assert 0.07 < float(sigma) < 0.14, float(sigma)          # noise 0.1, 200 points

    # the MAP objective is -log p(y, θ) with the model's HalfNormal prior on sigma (no Jacobian)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for i in (0, 2):
            net[i].weight.copy_(values[f"fc{i // 2 + 1}.weight"])
            net[i].bias.copy_(values[f"fc{i // 2 + 1}.bias"])
        f = net(x).squeeze(-1)
        joint = (pyro.distributions.Normal(f, sigma).log_prob(y).sum()
                 + pyro.distributions.HalfNormal(1.0).log_prob(sigma)
                 + sum(pyro.distributions.Normal(0.0, 1.0).log_prob(v).sum() for k, v in values.items()
                       if k != "sigma"))
        loss, _ = LaplaceMAPObjective()(model, guide, x, y)
    torch.testing.assert_close(loss, -joint, rtol=1e-5, atol=1e-3)

    bnn = pb.BNN(net, "gaussian", noise=float(sigma))
    ref = pb.guides.Laplace(bnn, "kron", subset="last_layer",
                            prior_precision=float(guide.prior_precision)).fit_curvature((x, y[:, None]))
    torch.testing.assert_close(guide.log_evidence(), ref.log_evidence(), rtol=1e-5, atol=1e-3)
    xt = torch.linspace(-2, 2, 51).unsqueeze(-1)
    f_ours, cov_ours = guide.functional_covariance(xt)
    f_ref, cov_ref = ref.functional_covariance(xt)
    assert f_ours.shape == (51, 1) and cov_ours.shape == (51, 1, 1)
    torch.testing.assert_close(f_ours, f_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cov_ours, cov_ref, rtol=1e-4, atol=1e-7)
    draws = pb.predict(model, guide, xt, predictive="glm", num_samples=8)
    assert draws.shape == (8, 51, 1)
    # pb.evaluate with the GLM predictive: regression metrics with the point-estimate sigma,
    # equal to those of the pb.BNN twin (was a crash: the kind came from model.likelihood only)
    yt = torch.sin(2 * xt).squeeze(-1)
    ours = pb.evaluate(model, guide, xt, yt, predictive="glm", num_samples=64)
    theirs = pb.evaluate(bnn, ref, xt, yt[:, None], predictive="glm", num_samples=64)
    assert set(ours) >= {"rmse", "nll", "coverage_95"} and ours["rmse"] < 0.2, ours
    assert ours["nll"] == pytest.approx(theirs["nll"], rel=0.05), (ours, theirs)
    rmse = float(((f_ours.squeeze(-1) - torch.sin(2 * xt).squeeze(-1)) ** 2).mean().sqrt())
    assert rmse < 0.2, rmse
    sample = guide()                                             # a Pyro guide draw: sigma stays positive
    assert torch.equal(sample["sigma"], sigma) and sample["fc2.weight"].shape == (1, 16)
    lin = guide.linearized_samples(xt, num_samples=3)            # one output: (out, in') = (1, 17)
    assert lin.values["fc2.weight"].shape == (3, 1, 16) and lin.values["sigma"].shape == (3,)


def test_laplace_rejects_constrained_site_it_would_cover():
    """A constrained latent inside the Laplace's subset gets a clear error at set-up that
    names the site, its support and the alternatives, not a crash inside the curvature."""
    x, y = _sine(40)
    model = _NoiseRegression(len(x))
    for subset in ("all", ["sigma", "fc2.weight", "fc2.bias"]):
        guide = pb.guides.Laplace(model, "kron", subset=subset)
        with pytest.raises(ValueError, match=r"site 'sigma' has support GreaterThanEq.*subset=.*MeanField"):
            pb.fit(model, guide, (x, y), epochs=1, progress=False)


def test_handwritten_1d_outputs_without_latent_noise():
    """1-D ``obs`` (N,) with a fixed noise (regression) and 1-D Bernoulli logits: the
    curvature treats the output as (N, 1) and matches the same net as a ``pb.BNN``."""
    x, y = _sine(60)
    torch.manual_seed(1)
    model = _NoiseRegression(len(x), learned_sigma=False)
    guide = pb.guides.Laplace(model, "kron", prior_precision=2.0).fit_curvature((x, y))
    theta = guide.median()
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for i in (0, 2):
            net[i].weight.copy_(theta[f"fc{i // 2 + 1}.weight"])
            net[i].bias.copy_(theta[f"fc{i // 2 + 1}.bias"])
    ref = pb.guides.Laplace(pb.BNN(net, "gaussian", noise=0.1), "kron",
                            prior_precision=2.0).fit_curvature((x, y[:, None]))
    torch.testing.assert_close(guide.log_evidence(), ref.log_evidence(), rtol=1e-5, atol=1e-3)

    class Binary(pyro.nn.PyroModule):
        def __init__(self):
            super().__init__()
            self.fc = pyro.nn.PyroModule[nn.Linear](1, 1)
            self.fc.weight = pyro.nn.PyroSample(pyro.distributions.Normal(0.0, 1.0).expand([1, 1]).to_event(2))
            self.fc.bias = pyro.nn.PyroSample(pyro.distributions.Normal(0.0, 1.0).expand([1]).to_event(1))

        def forward(self, x, y=None):
            logits = self.fc(x).squeeze(-1)                       # weights sampled outside the plate
            with pyro.plate("data", len(x)):
                pyro.sample("obs", pyro.distributions.Bernoulli(logits=logits), obs=y)

    labels = (x.squeeze(-1) > 0).float()
    binary = pb.guides.Laplace(Binary(), "full", prior_precision=1.0).fit_curvature((x, labels))
    w, b = binary.median()["fc.weight"], binary.median()["fc.bias"]
    p = torch.sigmoid(x @ w.T + b).squeeze(-1)
    X = torch.cat([x, torch.ones_like(x)], 1)
    H = (X * (p * (1 - p))[:, None]).T @ X + torch.eye(2)      # exact GGN + δ I of logistic regression
    log_lik = pyro.distributions.Bernoulli(probs=p).log_prob(labels).sum()
    theta_vec = torch.cat([w.reshape(-1), b])
    expected = log_lik - 0.5 * (torch.logdet(H) + theta_vec @ theta_vec)
    torch.testing.assert_close(binary.log_evidence(), expected, rtol=1e-5, atol=1e-4)
