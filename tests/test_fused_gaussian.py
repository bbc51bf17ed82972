"""The fused mean-field nodes against plain autograd and finite differences."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal, kl_divergence

from pyro_bnn.guides import _fused_gaussian as fused
from pyro_bnn.guides._fused_gaussian import can_fuse, can_fuse_kl, normal_kl_node, sample_and_kl


def _reference(loc, rho, eps, prior_loc, prior_scale, positive):
    sigma = rho.exp() if positive == "exp" else F.softplus(rho)
    kl = kl_divergence(Normal(loc, sigma), Normal(prior_loc.expand(loc.shape), prior_scale.expand(loc.shape)))
    return loc + sigma * eps, kl.sum()


PRIORS = {
    "scalar": lambda shape: (torch.tensor(0.0), torch.tensor(0.7)),
    "scalar_nonzero_loc": lambda shape: (torch.tensor(0.3), torch.tensor(1.5)),
    "per_row": lambda shape: (torch.zeros(shape[0], 1), torch.rand(shape[0], 1) + 0.5),
    "per_weight": lambda shape: (torch.randn(shape), torch.rand(shape) + 0.5),
}


@pytest.mark.parametrize("tensor_constants", [False, True], ids=["cpu_floats", "tensor_path"])
@pytest.mark.parametrize("positive", ["exp", "softplus"])
@pytest.mark.parametrize("prior", sorted(PRIORS))
def test_matches_autograd_value_and_gradient(prior, positive, tensor_constants, float64, monkeypatch):
    if tensor_constants:  # the path a CUDA prior takes (no host read of its value)
        monkeypatch.setattr(fused, "_cpu_floats", lambda prior_loc, prior_scale: None)
    torch.manual_seed(0)
    shape = (5, 4)
    loc = torch.randn(shape, requires_grad=True)
    rho = (torch.randn(shape) - 2).requires_grad_()
    eps = torch.randn(shape)
    prior_loc, prior_scale = PRIORS[prior](shape)
    gw = torch.randn(shape)
    w, kl = sample_and_kl(loc, rho, eps, prior_loc, prior_scale, positive)
    w_ref, kl_ref = _reference(loc, rho, eps, prior_loc, prior_scale, positive)
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((w * gw).sum() + 1.7 * kl, (loc, rho))
    want = torch.autograd.grad((w_ref * gw).sum() + 1.7 * kl_ref, (loc, rho))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("positive", ["exp", "softplus"])
def test_gradcheck_finite_differences(positive, float64):
    torch.manual_seed(1)
    loc = torch.randn(3, 2, requires_grad=True)
    rho = torch.randn(3, 2, requires_grad=True)
    eps = torch.randn(3, 2)
    assert torch.autograd.gradcheck(
        lambda m, r: sample_and_kl(m, r, eps, torch.tensor(0.2), torch.tensor(0.9), positive), (loc, rho))


def test_kl_only_gradient(float64):
    """When the sample is unused (grad_w is None) the KL gradient alone comes back."""
    loc = torch.tensor([0.5, -1.0], requires_grad=True)
    rho = torch.tensor([-1.0, 0.3], requires_grad=True)
    _, kl = sample_and_kl(loc, rho, torch.zeros(2), torch.tensor(0.0), torch.tensor(1.0), "softplus")
    kl.backward()
    sigma = F.softplus(rho.detach())
    torch.testing.assert_close(loc.grad, loc.detach())                      # (μ − 0)/1
    torch.testing.assert_close(rho.grad, (sigma - 1 / sigma) * torch.sigmoid(rho.detach()))


def test_can_fuse():
    loc = torch.zeros(3, 4)
    assert can_fuse(loc, torch.tensor(0.0), torch.tensor(1.0))
    assert can_fuse(loc, torch.zeros(3, 1), torch.ones(4))
    assert not can_fuse(loc, torch.zeros(5), torch.tensor(1.0))            # does not broadcast
    assert not can_fuse(loc, torch.zeros(2, 3, 4), torch.tensor(1.0))      # would grow the site
    assert not can_fuse(loc, torch.tensor(0.0), torch.tensor(1.0, requires_grad=True))


# ------------------------------------------------ the closed-form KL node (local reparameterisation)
KL_PRIORS = {
    "standard": (0.0, 1.0),        # both exact identities (μ − 0, × 1) left out
    "scaled": (0.0, 0.37),         # × s⁻² kept
    "shifted": (0.25, 1.0),        # μ − m kept
    "negative_zero_mean": (-0.0, 1.0),  # −0 is not left out (μ − (−0) turns −0 into +0)
    "both": (-0.3, 2.5),
}


def _kl_graph(kl_fn, dtype, prior, kl_weight):
    """A step's graph around the KL of one site: σ = exp(ρ) used three times (the KL's square
    and log terms and the local reparameterisation's σ²), μ twice (the KL and the layer)."""
    gen = torch.Generator().manual_seed(3)
    loc = (0.1 * torch.randn(7, 5, generator=gen, dtype=dtype)).requires_grad_()
    rho = (torch.randn(7, 5, generator=gen, dtype=dtype) - 3.0).requires_grad_()
    x = torch.randn(4, 5, generator=gen, dtype=dtype)
    m, s = (torch.tensor(v, dtype=dtype) for v in prior)
    scale = rho.exp()
    kl = kl_fn(loc, scale, m, s)
    var = F.linear(x ** 2, scale ** 2)
    f = F.linear(x, loc) + var.clamp_min(1e-30).sqrt() * torch.randn(4, 7, generator=gen, dtype=dtype)
    loss = (f.log_softmax(-1)[:, 0].sum() * -3.0) / 1 + kl_weight * kl
    return loss, torch.autograd.grad(loss, (loc, rho))


@pytest.mark.parametrize("flush", [False, True], ids=["denormals", "flush_denormals"])
@pytest.mark.parametrize("kl_weight", [1.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("prior", sorted(KL_PRIORS))
def test_kl_node_is_bit_identical_to_the_autograd_formula(prior, dtype, kl_weight, flush):
    """Values and gradients equal ``normal_kl``'s autograd graph bit for bit (``torch.equal``),
    with σ's three gradient contributions summed in the same order."""
    from pyro_bnn.guides.meanfield import normal_kl
    from pyro_bnn.training.devices import flush_denormals

    with flush_denormals() if flush else contextlib.nullcontext():
        loss_node, grads_node = _kl_graph(normal_kl_node, dtype, KL_PRIORS[prior], kl_weight)
        loss_ref, grads_ref = _kl_graph(normal_kl, dtype, KL_PRIORS[prior], kl_weight)
    assert torch.equal(loss_node, loss_ref)
    for got, want in zip(grads_node, grads_ref):
        assert torch.equal(got, want)
    assert grads_ref[1].abs().sum() > 0            # not vacuous: ρ gets a gradient


def test_kl_node_value_and_double_backward(float64):
    """The KL against torch's closed form; second derivatives by finite differences."""
    torch.manual_seed(4)
    loc = torch.randn(3, 2, requires_grad=True)
    rho = torch.randn(3, 2, requires_grad=True)
    m, s = torch.tensor(0.2), torch.tensor(0.9)
    want = kl_divergence(Normal(loc, rho.exp()), Normal(m.expand(3, 2), s.expand(3, 2))).sum()
    torch.testing.assert_close(normal_kl_node(loc, rho.exp(), m, s), want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradgradcheck(lambda a, r: normal_kl_node(a, r.exp(), m, s), (loc, rho))


def test_can_fuse_kl():
    loc = torch.zeros(3, 4)
    assert can_fuse_kl(loc, loc, torch.tensor(0.0), torch.tensor(1.0))
    assert can_fuse_kl(loc, loc, torch.zeros(1, 1), torch.ones(1))
    assert not can_fuse_kl(loc, loc, torch.zeros(3, 1), torch.tensor(1.0))              # a prior per row
    assert not can_fuse_kl(loc, loc, torch.tensor(0.0), torch.tensor(1.0, requires_grad=True))  # learned
    assert not can_fuse_kl(loc, loc, torch.zeros(1, 1, 1), torch.tensor(1.0))          # would grow the KL


@pytest.mark.parametrize("positive", ["exp", "softplus"])
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_meanfield_objective_with_the_kl_node(arch, positive, monkeypatch):
    """The local-reparameterisation MeanField objective with the KL node against the one with
    the autograd formula: with ``σ = softplus(ρ)`` bit for bit in the loss and every gradient;
    with ``σ = exp(ρ)`` the node reads ``log σ = ρ`` (no ``log(exp(ρ))`` rounding), so the two
    agree to float32 rounding (1e-6 relative) and not necessarily bit for bit."""
    from torch import nn

    import pyro_bnn as pb
    from pyro_bnn.contract.local_params import local_params
    from pyro_bnn.guides import meanfield
    from pyro_bnn.training.guide_setup import setup_guide

    torch.manual_seed(0)
    if arch == "mlp":
        net, x = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), torch.randn(8, 6)
    else:
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
        x = torch.randn(8, 1, 6, 6)
    y = torch.randint(0, 3, (8,))
    model = pb.BNN(net, "categorical", prior=pb.priors.IIDNormal(0.8))
    guide = pb.guides.MeanField(model, init_scale=0.1, scale_parameterization=positive)
    setup_guide(model, guide, x[:2], y[:2], 100)
    # σ = exp(ρ): every site's KL in one node (normal_kl_sites_log_scale); softplus: one per site
    node = "normal_kl_sites_log_scale" if positive == "exp" else "normal_kl_node"
    calls, original = [], getattr(meanfield, node)
    monkeypatch.setattr(meanfield, node, lambda *args: calls.append(1) or original(*args))
    results = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(meanfield, "can_fuse_kl", lambda *args: False)
            monkeypatch.setattr(meanfield, "can_fuse_kl_sites", lambda *args: False)
        with local_params(model, guide):
            params = [p for s in model.site_names for p in guide.loc_and_raw_scale(s)]
            torch.manual_seed(1)
            loss = meanfield.meanfield_loss(model, guide, x, y, 100)
            results.append((loss, torch.autograd.grad(loss, params)))
    # the first run took the node for every site (one call for all of them with σ = exp(ρ))
    assert len(calls) == (1 if positive == "exp" else len(model.site_names))
    (loss_node, grads_node), (loss_ref, grads_ref) = results
    if positive == "softplus":
        assert torch.equal(loss_node, loss_ref)
        assert all(torch.equal(a, b) for a, b in zip(grads_node, grads_ref))
    else:
        torch.testing.assert_close(loss_node, loss_ref, rtol=1e-6, atol=0)
        for a, b in zip(grads_node, grads_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prior", sorted(KL_PRIORS))
def test_log_scale_kl_node_value_and_gradients(prior, float64):
    """The node with ``log σ`` given: the value of torch's closed form and the gradients of the
    autograd formula in float64 (1e-12), finite differences, and a log term read from its
    argument (a perturbed ``log σ`` moves the KL by exactly −Δ)."""
    from pyro_bnn.guides.meanfield import normal_kl

    torch.manual_seed(5)
    loc = (0.1 * torch.randn(4, 3)).requires_grad_()
    rho = (torch.randn(4, 3) - 2.0).requires_grad_()
    m, s = (torch.tensor(v) for v in KL_PRIORS[prior])
    got = fused.normal_kl_node_log_scale(loc, rho.exp(), rho, m, s)
    want = normal_kl(loc, rho.exp(), m, s)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, kl_divergence(Normal(loc, rho.exp()), Normal(m.expand(4, 3), s.expand(4, 3))).sum(),
                               rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (loc, rho)), torch.autograd.grad(want, (loc, rho))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, r: fused.normal_kl_node_log_scale(a, r.exp(), r, m, s), (loc, rho))
    with torch.no_grad():
        shifted = fused.normal_kl_node_log_scale(loc, rho.exp(), rho + 0.25, m, s)
    torch.testing.assert_close(shifted, got.detach() - 0.25 * rho.numel(), rtol=1e-12, atol=1e-9)


# ------------------------------------------------ every site's KL in one node (issue 27)
SITE_SHAPES = [(5, 4), (5,), (3, 5), (3,)]
SITE_PRIOR_SETS = {
    "one_standard_prior": ["standard"] * 4,       # the default: one N(0, 1) for every site
    "one_scaled_prior": ["scaled"] * 4,
    "one_shifted_scaled_prior": ["both"] * 4,     # μ − m and × s⁻² on the shared-prior path
    "mixed": ["standard", "shifted", "negative_zero_mean", "both"],
}


def _sites(dtype, prior_names, seed=6):
    gen = torch.Generator().manual_seed(seed)
    locs = [(0.3 * torch.randn(s, generator=gen, dtype=dtype)).requires_grad_() for s in SITE_SHAPES]
    rhos = [(torch.randn(s, generator=gen, dtype=dtype) - 2.0).requires_grad_() for s in SITE_SHAPES]
    # one tensor pair per distinct prior, shared by its sites, as one pb.priors object shares its buffers
    made = {name: tuple(torch.tensor(v, dtype=dtype) for v in KL_PRIORS[name]) for name in set(prior_names)}
    return locs, rhos, [made[name] for name in prior_names]


def _kl_sites_graph(together: bool, dtype, prior_names, create_graph=False):
    """``3.7 · KL + (a term on σ and μ outside the KL)`` and its gradients, the KL by the sites node
    or as ``0.0 + Σ`` of the per-site nodes (``closed_form_kl``'s order)."""
    locs, rhos, priors = _sites(dtype, prior_names)
    scales = [r.exp() for r in rhos]
    if together:
        kl = fused.normal_kl_sites_log_scale(locs, scales, rhos, [m for m, _ in priors], [s for _, s in priors])
    else:
        kl = 0.0
        for loc, scale, rho, (m, s) in zip(locs, scales, rhos, priors):
            kl = kl + fused.normal_kl_node_log_scale(loc, scale, rho, m, s)
    # σ and μ used once more, as the local reparameterisation's forward uses them
    other = sum((sc.square() * 0.7 + lo.sin()).sum() for sc, lo in zip(scales, locs))
    loss = 3.7 * kl + other
    return loss, torch.autograd.grad(loss, locs + rhos, create_graph=create_graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("priors", sorted(SITE_PRIOR_SETS))
def test_kl_sites_node_is_bit_identical_to_the_per_site_nodes(priors, dtype):
    """The one node over every site gives the per-site nodes' sum and every gradient bit for bit
    (``torch.equal``), whichever prior each site has (exact identities left out per site)."""
    loss_sites, grads_sites = _kl_sites_graph(True, dtype, SITE_PRIOR_SETS[priors])
    loss_ref, grads_ref = _kl_sites_graph(False, dtype, SITE_PRIOR_SETS[priors])
    assert torch.equal(loss_sites, loss_ref)
    for got, want in zip(grads_sites, grads_ref):
        assert torch.equal(got, want)
    assert all(float(g.abs().sum()) > 0 for g in grads_ref)     # not vacuous


def test_kl_sites_node_value_gradients_and_double_backward(float64):
    """Against torch's closed form (value), finite differences (first and second derivatives)
    and the per-site nodes' second derivatives."""
    locs, rhos, priors = _sites(torch.float64, SITE_PRIOR_SETS["mixed"])
    ms, ss = [m for m, _ in priors], [s for _, s in priors]
    got = fused.normal_kl_sites_log_scale(locs, [r.exp() for r in rhos], rhos, ms, ss)
    want = sum(kl_divergence(Normal(lo, r.exp()), Normal(m.expand(lo.shape), s.expand(lo.shape))).sum()
               for lo, r, m, s in zip(locs, rhos, ms, ss))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    def f(*leaves):
        lo, r = leaves[:4], leaves[4:]
        return fused.normal_kl_sites_log_scale(list(lo), [x.exp() for x in r], list(r), ms, ss)

    leaves = tuple(locs + rhos)
    assert torch.autograd.gradcheck(f, leaves)
    assert torch.autograd.gradgradcheck(f, leaves)
    _, grads = _kl_sites_graph(True, torch.float64, SITE_PRIOR_SETS["mixed"], create_graph=True)
    _, grads_ref = _kl_sites_graph(False, torch.float64, SITE_PRIOR_SETS["mixed"], create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), locs + rhos, allow_unused=True)
    second_ref = torch.autograd.grad(sum(g.square().sum() for g in grads_ref), locs + rhos, allow_unused=True)
    for a, b in zip(second, second_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_can_fuse_kl_sites():
    a, b = torch.zeros(3, 2), torch.zeros(4)
    zero, one = torch.tensor(0.0), torch.tensor(1.0)
    assert fused.can_fuse_kl_sites([a, b], [a, b], [zero, zero], [one, one])
    assert not fused.can_fuse_kl_sites([a], [a], [zero], [one])                           # one site
    assert not fused.can_fuse_kl_sites([a, b], [a, b], [zero, torch.zeros(1)], [one, one])  # not 0-dim
    assert not fused.can_fuse_kl_sites([a, b.double()], [a, b.double()], [zero, zero.double()],
                                       [one, one.double()])                               # two dtypes
    learned = torch.tensor(1.0, requires_grad=True)
    assert not fused.can_fuse_kl_sites([a, b], [a, b], [zero, zero], [one, learned])     # learned prior
