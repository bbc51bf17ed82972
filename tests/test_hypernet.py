"""Bayesian hypernetwork guide, flows and weight-norm models (issue 5)."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from pyro.nn import PyroModule, PyroSample
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.local_params import local_params
from pyro_bnn.guides.hypernet_flows import HypernetFlow
from pyro_bnn.guides.hypernet_objective import HypernetELBO, clipped_log_likelihood, log_weights
from pyro_bnn.guides.made import MADE
from pyro_bnn.guides.meanfield import MeanFieldELBO
from pyro_bnn.model.weight_norm import WeightNormConv2d, WeightNormLinear, to_weight_norm
from pyro_bnn.training.guide_setup import setup_guide


def _flow_fn(flow):
    def h(eps):
        x = eps
        for t in flow.transforms():
            x = t(x)
        return x
    return h


# ----------------------------------------------------------------------------- flows
@pytest.mark.parametrize("kind", ["iaf", "realnvp"])
@pytest.mark.parametrize("affine_last, flow_index", [(False, None), (True, None), (True, [4, 0, 2])],
                         ids=["affine_first", "affine_last", "blocks_on_3_of_5"])
def test_flow_log_density_is_change_of_variables(kind, affine_last, flow_index):
    """Against the dense Jacobian of ε → z; with ``flow_index`` the blocks act on three of the
    five coordinates (a weight-norm model with random directions: the flow over the scales)."""
    torch.manual_seed(0)
    dim = 5
    index = None if flow_index is None else torch.tensor(flow_index)
    flow = HypernetFlow(dim, kind, num_flows=3, hidden=7, init_loc=torch.randn(dim),
                        init_scale=0.5, init_gain=1.0, affine_last=affine_last, flow_index=index)
    eps = torch.randn(4, dim)
    z, log_q = flow.rsample_with_log_prob(eps=eps)
    for i in range(len(eps)):
        jac = torch.autograd.functional.jacobian(_flow_fn(flow), eps[i])
        ref = (dist.Normal(0.0, 1.0).log_prob(eps[i]).sum() - torch.linalg.slogdet(jac)[1])
        assert torch.allclose(log_q[i], ref, atol=1e-4), (log_q[i], ref)
    # Pyro's TransformedDistribution agrees, also without the inverse cache (fresh inverse)
    assert torch.allclose(flow.distribution().log_prob(z.clone()), log_q, atol=1e-4)
    if index is not None:   # the other coordinates: the affine layer alone
        rest = [i for i in range(dim) if i not in flow_index]
        a = flow.affine
        torch.testing.assert_close(z[:, rest], a.loc[rest] + a.scale[rest] * eps[:, rest])


def test_flow_index_is_checked():
    with pytest.raises(ValueError, match="distinct coordinates in \\[0, 5\\)"):
        HypernetFlow(5, num_flows=1, hidden=4, flow_index=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="distinct"):
        HypernetFlow(5, num_flows=1, hidden=4, flow_index=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="affine_last=True"):
        HypernetFlow(5, num_flows=1, hidden=4, flow_index=torch.tensor([0, 1]), affine_last=False)
    with pytest.raises(ValueError, match="at least 2"):
        HypernetFlow(5, num_flows=1, hidden=4, flow_index=torch.tensor([3]))
    # all coordinates in order is no subset: the plain flow, same state dict
    assert HypernetFlow(5, num_flows=1, hidden=4, flow_index=torch.arange(5)).flow_index is None


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_made_is_autoregressive_for_narrow_hidden_layer(groups):
    torch.manual_seed(0)
    dim, perm = 6, torch.tensor([3, 0, 5, 1, 4, 2])
    made = MADE(dim, hidden=4, permutation=perm, groups=groups)  # hidden < D: Pyro's ARN refuses this
    with torch.no_grad():
        for p in made.parameters():
            p.normal_()
        made.apply_masks_()
        made.b_in.fill_(10.0)  # all ReLUs active
    rank = torch.empty(dim, dtype=torch.long)
    rank[perm] = torch.arange(dim)
    jac = torch.autograd.functional.jacobian(lambda x: torch.cat(made(x)), torch.randn(dim))
    allowed = (rank[:, None] > rank[None, :]).float().repeat(2, 1)
    assert torch.all(jac.abs() * (1 - allowed) == 0)
    assert (jac.abs() * allowed).sum() > 0


@pytest.mark.parametrize("dim,hidden,groups", [(10, 6, 1), (9, 4, 3), (7, 12, 4), (30, 16, 4)])
def test_made_block_storage_equals_dense_masked_layers(dim, hidden, groups):
    """The staircase-block MADE is the dense masked MADE: same function, same gradients on
    the allowed weights, zero gradient (so zero after Adam steps) outside the mask."""
    torch.manual_seed(0)
    made = MADE(dim, hidden, torch.randperm(dim), groups=groups)
    rank = torch.empty(dim, dtype=torch.long)
    rank[made.permutation] = torch.arange(1, dim + 1)
    deg = 1 + (torch.arange(hidden) * (dim - 1)) // hidden
    m_in = (deg[:, None] >= rank[None, :]).float()
    m_out = (rank[:, None] > deg[None, :]).float().repeat(2, 1)
    w_in, b_in, w_out, b_out = made.dense_weights()
    assert torch.all(w_in * (1 - m_in) == 0) and torch.all(w_out * (1 - m_out) == 0)
    dense = [t.clone().requires_grad_() for t in (w_in, b_in, w_out, b_out)]
    x = torch.randn(3, dim)
    h = torch.relu(x @ (dense[0] * m_in).T + dense[1])
    ref = h @ (dense[2] * m_out).T + dense[3]
    out = torch.cat(made(x), -1)
    assert torch.allclose(out, ref, atol=1e-6)
    probe = torch.randn_like(ref)
    (ref * probe).sum().backward()
    (out * probe).sum().backward()
    grads = MADE(dim, hidden, made.permutation, groups=groups)  # pack the grads like weights
    with torch.no_grad():
        for p, q in zip(grads.parameters(), made.parameters()):
            p.copy_(q.grad)
    g_in, gb_in, g_out, gb_out = grads.dense_weights()
    assert torch.allclose(g_in, dense[0].grad * m_in, atol=1e-5)
    assert torch.allclose(g_out, dense[2].grad * m_out, atol=1e-5)
    assert torch.allclose(gb_in, dense[1].grad, atol=1e-5)
    assert torch.allclose(gb_out, dense[3].grad, atol=1e-5)
    opt = torch.optim.Adam(made.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (torch.cat(made(torch.randn(2, dim)), -1) ** 2).sum().backward()
        opt.step()
    w_in, _, w_out, _ = made.dense_weights()
    assert torch.all(w_in * (1 - m_in) == 0) and torch.all(w_out * (1 - m_out) == 0)


@pytest.mark.parametrize("scaled", [False, True])
def test_made_one_block_autograd_equals_the_block_function_bit_for_bit(scaled):
    """With one block per layer the MADE runs plain autograd through ``W ⊙ M``; the custom
    Function that more blocks use gives the same outputs and gradients, bit for bit."""
    torch.manual_seed(0)
    made = MADE(12, 7, torch.randperm(12), groups=1, fan_in_scaled=scaled, log_scale_bound=2.0)
    assert made.one_block
    with torch.no_grad():
        for p in made.parameters():
            p.normal_()
        made.apply_masks_()
    x, probe = torch.randn(3, 12, requires_grad=True), torch.randn(3, 24)
    results = []
    for one_block in (True, False):
        made.one_block = one_block
        made.zero_grad(set_to_none=True)
        x.grad = None
        out = torch.cat(made(x), -1)
        (out * probe).sum().backward()
        results.append([out.detach(), x.grad] + [p.grad for p in made.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_made_one_block_supports_torch_func():
    """Plain autograd (one block) also runs under ``torch.func`` transforms: ``jacrev`` gives
    autograd's Jacobian."""
    torch.manual_seed(0)
    made = MADE(6, 4, torch.randperm(6), log_scale_bound=2.0, fan_in_scaled=True)
    x = torch.randn(6)
    jac = torch.func.jacrev(lambda v: torch.cat(made(v)))(x)
    assert torch.allclose(jac, torch.autograd.functional.jacobian(lambda v: torch.cat(made(v)), x))


@pytest.mark.parametrize("groups", [1, 3])
def test_made_fan_in_scaling_keeps_the_function_and_divides_the_steps(groups):
    """``fan_in_scaled``: same function, stored weights × fan-in, so gradients w.r.t. the stored
    weights are the plain ones / fan-in (Adam's steps on the pre-activations shrink by the
    fan-in); state dicts load across the two conventions; the log-scale bound is
    ``B tanh(s/B)`` of the unbounded output."""
    torch.manual_seed(0)
    dim, hidden = 9, 6
    plain = MADE(dim, hidden, torch.randperm(dim), groups=groups)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_()
        plain.apply_masks_()
    scaled = MADE(dim, hidden, plain.permutation, groups=groups, fan_in_scaled=True)
    scaled.load_state_dict(plain.state_dict())
    for a, b in zip(plain.dense_weights(), scaled.dense_weights()):
        assert torch.allclose(a, b, atol=1e-6)
    x = torch.randn(4, dim)
    probe = torch.randn(4, 2 * dim)
    for m in (plain, scaled):
        assert torch.allclose(torch.cat(m(x), -1), torch.cat(plain(x), -1), atol=1e-5)
        (torch.cat(m(x), -1) * probe).sum().backward()
    for wp, ws, stair, fan_in in ((plain.w_in, scaled.w_in, scaled._in, scaled.fan_in_in),
                                  (plain.w_out, scaled.w_out, scaled._out, scaled.fan_in_out)):
        for i, rows in enumerate(stair.rows):
            assert torch.allclose(ws[i].grad, wp[i].grad / fan_in[rows][:, None], atol=1e-6)
            assert torch.allclose(ws[i], wp[i] * fan_in[rows][:, None], atol=1e-5)
    back = MADE(dim, hidden, plain.permutation, groups=groups)
    back.load_state_dict(scaled.state_dict())
    assert torch.allclose(torch.cat(back(x), -1), torch.cat(plain(x), -1), atol=1e-5)
    bounded = MADE(dim, hidden, plain.permutation, groups=groups, log_scale_bound=0.5)
    bounded.load_state_dict(plain.state_dict())
    mean, log_scale = bounded(x)
    assert torch.allclose(mean, plain(x)[0])
    assert torch.allclose(log_scale, 0.5 * torch.tanh(plain(x)[1] / 0.5))
    assert log_scale.abs().max() <= 0.5


@pytest.mark.parametrize("kind", ["iaf", "realnvp"])
def test_stable_flow_starts_as_the_mean_field_gaussian(kind):
    """Default layout: blocks start at the exact identity, so q = N(μ, σ²) at the start
    (RealNVP: up to the fixed permutations between couplings, which leave N(0, I) as it is)."""
    torch.manual_seed(0)
    loc = torch.randn(6)
    flow = HypernetFlow(6, kind, num_flows=3, hidden=5, init_loc=loc, init_scale=0.1)
    eps = torch.randn(50, 6)
    z, log_q = flow.rsample_with_log_prob(eps=eps)
    if kind == "iaf":
        assert torch.allclose(z, loc + 0.1 * eps, atol=1e-6)
    else:
        assert torch.allclose(((z - loc) / 0.1).sort(-1).values, eps.sort(-1).values, atol=1e-5)
    assert torch.allclose(log_q, dist.Normal(loc, 0.1).log_prob(z).sum(-1), atol=1e-4)
    assert torch.allclose(flow.distribution().log_prob(z), log_q, atol=1e-4)


def test_flow_layout_is_checked_when_loading():
    """Parameters of one layout define another distribution in the other: loading refuses;
    a state dict without the layout record is incomplete (the strict load names the key)."""
    stable = HypernetFlow(4, "iaf", num_flows=2, hidden=3)
    paper = HypernetFlow(4, "iaf", num_flows=2, hidden=3, affine_last=False,
                         log_scale_bound=None, fan_in_scaled=False)
    with pytest.raises(ValueError, match="layout"):
        stable.load_state_dict(paper.state_dict())
    without = {k: v for k, v in paper.state_dict().items() if k != "layout"}
    fresh = HypernetFlow(4, "iaf", num_flows=2, hidden=3, affine_last=False, log_scale_bound=None,
                         fan_in_scaled=False, seed=1)
    with pytest.raises(RuntimeError, match='Missing key.*"layout"'):
        fresh.load_state_dict(dict(without))
    fresh.load_state_dict(paper.state_dict())
    eps = torch.randn(3, 4)
    assert torch.equal(fresh.rsample_with_log_prob(eps=eps)[1], paper.rsample_with_log_prob(eps=eps)[1])


def test_zero_flows_is_mean_field_gaussian():
    loc = torch.randn(4)
    flow = HypernetFlow(4, "iaf", num_flows=0, init_loc=loc, init_scale=0.3)
    z, log_q = flow.rsample_with_log_prob(10)
    ref = dist.Normal(loc, torch.full((4,), 0.3)).log_prob(z).sum(-1)
    assert torch.allclose(log_q, ref, atol=1e-5)


# ---------------------------------------------------------------------- weight norm
def test_weight_norm_model_sites_priors_and_function():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    model = pb.BNN(net, "categorical", weight_norm=True, weight_norm_precision=4.0)
    assert model.site_names == ["net.0.weight_g", "net.2.weight_g"]
    init = model.initial_values()
    assert torch.allclose(init["net.0.weight_g"], net[0].weight.norm(dim=1))
    prior = model.site_prior("net.2.weight_g")
    assert prior.event_shape == (3,) and torch.allclose(prior.base_dist.scale, torch.tensor(0.5))
    x = torch.randn(5, 4)

    assert torch.allclose(model.run_with(init, x), net(x), atol=1e-6)
    doubled = {k: 2 * v for k, v in init.items()}
    h = torch.relu(2 * (net[0](x) - net[0].bias) + net[0].bias)  # W = 2 v/|v|·|v|, same b
    assert torch.allclose(model.run_with(doubled, x), 2 * net[2](h) - net[2].bias,
                          atol=1e-5)
    with pytest.raises(ValueError, match="weight_norm_precision"):
        pb.BNN(net, weight_norm_precision=2.0)
    with pytest.raises(ValueError, match="either prior"):
        pb.BNN(net, prior=pb.priors.IIDNormal(1.0), weight_norm=True, weight_norm_precision=2.0)
    with pytest.raises(ValueError, match="weight-norm model"):
        pb.guides.Hypernet(pb.BNN(net))


def test_weight_norm_conv2d_and_layers():
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    wn = to_weight_norm(conv)
    assert isinstance(wn, WeightNormConv2d) and isinstance(wn, nn.Conv2d)
    x = torch.randn(2, 2, 5, 5)
    assert torch.allclose(wn(x), conv(x), atol=1e-6)
    with torch.no_grad():
        wn.weight_g.mul_(3.0)
    assert torch.allclose(wn(x) - wn.bias[:, None, None], 3 * (conv(x) - conv.bias[:, None, None]),
                          atol=1e-5)
    lin = WeightNormLinear(4, 2)
    assert sorted(n for n, _ in lin.named_parameters()) == ["bias", "weight_g", "weight_v"]
    assert torch.allclose(lin.weight.norm(dim=1), lin.weight_g)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 10))
    model = pb.BNN(net, "categorical", weight_norm=True)
    assert model.site_names == ["net.0.weight_g", "net.3.weight_g"]
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=16)
    xi, yi = torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,))
    pb.fit(model, guide, (xi, yi), epochs=1, batch_size=4, progress=False)
    assert pb.predict(model, guide, xi, num_samples=3).shape == (3, 8, 10)


def test_handwritten_weight_norm_pyromodule():
    class Net(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc1 = PyroModule[WeightNormLinear](3, 6)
            self.fc1.weight_g = PyroSample(dist.Normal(0.0, 1.0).expand([6]).to_event(1))
            self.fc2 = PyroModule[WeightNormLinear](6, 1)
            self.fc2.weight_g = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

        def forward(self, x, y=None):
            f = self.fc2(torch.tanh(self.fc1(x))).squeeze(-1)
            with pyro.plate("data", len(x)):
                pyro.sample("obs", dist.Normal(f, 0.1), obs=y)
            return f

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(32, 3)
    y = x[:, 0] - x[:, 1]
    guide = pb.guides.Hypernet(model, flow="realnvp", num_flows=2, hidden=16)
    res = pb.fit(model, guide, (x, y), epochs=30, batch_size=32, lr=1e-2, progress=False)
    assert res.history["loss"][-1] < res.history["loss"][0]
    draws = pb.predict(model, guide, x, num_samples=4)
    assert draws.shape == (4, 32)
    assert set(pb.posterior.prediction.sample_latents(model, guide, x)) == {"fc1.weight_g", "fc2.weight_g"}


def test_full_false_rejects_sites_that_are_not_weight_norm_scales(digits_small):
    """``full=False`` is the flow over weight-norm scales; any other latent site is a clear
    error at set-up (it used to train a flow over every weight and end in NaN logits)."""

    class Plain(PyroModule):  # a hand-written model without weight norm
        def __init__(self):
            super().__init__()
            self.fc = PyroModule[nn.Linear](64, 10)
            self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([10, 64]).to_event(2))
            self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([10]).to_event(1))

        def forward(self, x, y=None, num_data=None):
            f = self.fc(x)
            with pyro.plate("data", num_data or len(x), subsample_size=len(x)):
                pyro.sample("obs", dist.Categorical(logits=f), obs=y)
            return f

    xtr, ytr, _, _ = digits_small
    plain = Plain()
    guide = pb.guides.Hypernet(plain, num_flows=2, hidden=8)
    for _ in range(2):  # the failed set-up is not half-kept: a second call checks again
        with pytest.raises(ValueError, match="'fc.weight', 'fc.bias'.*full=True"):
            pb.fit(plain, guide, (xtr, ytr), epochs=1, progress=False)
    # a weight-norm BNN whose biases are random too: the biases are named
    net = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
    wn = pb.BNN(net, "categorical", weight_norm=True,
                stochastic=lambda name, module, param: name.endswith(("weight_g", "bias")))
    with pytest.raises(ValueError, match="2 of the model's 4 latent sites.*'net.0.bias'"):
        pb.fit(wn, pb.guides.Hypernet(wn, num_flows=2, hidden=8), (xtr, ytr), epochs=1,
               progress=False)
    # full=True accepts both
    res = pb.fit(wn, pb.guides.Hypernet(wn, num_flows=2, hidden=8, full=True), (xtr, ytr),
                 epochs=1, progress=False)
    assert math.isfinite(res.final_loss)


# --------------------------------------------------------------------------- guide
def _toy_model(random_directions=False):
    torch.manual_seed(0)
    x = torch.randn(20, 3)
    y = (x[:, :1] * 0.5 - x[:, 1:2]) + 0.1 * torch.randn(20, 1)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    return pb.BNN(net, "gaussian", noise=0.3, weight_norm=True, random_directions=random_directions), x, y


@pytest.mark.parametrize("random_directions", [False, True], ids=["scales", "scales_and_directions"])
@pytest.mark.parametrize("kind", ["iaf", "realnvp"])
def test_guide_samples_have_the_flow_density(kind, random_directions):
    model, x, y = _toy_model(random_directions)
    guide = pb.guides.Hypernet(model, flow=kind, num_flows=2, hidden=8, init_scale=0.3,
                               init_gain=1.0)
    setup_guide(model, guide, x, y, 20)
    with local_params(model, guide):
        tr = poutine.trace(guide).get_trace(x, y, num_data=20)
        tr.compute_log_prob()
        aux = [n for n, s in tr.nodes.items() if s["type"] == "sample" and s["infer"].get("is_auxiliary")]
        assert len(aux) == 1
        z = tr.nodes[aux[0]]["value"]
        # the real-named sites are the packed vector split up
        assert torch.equal(torch.cat([tr.nodes[n]["value"].reshape(-1) for n in guide.site_names()]), z)
        assert sorted(guide.site_names()) == sorted(model.site_names)
        # the aux site's density is the change-of-variables density of the same draw
        eps = z.detach().clone()
        for t in reversed(guide.flow.transforms()):
            eps = t.inv(eps)
        _, log_q = guide.flow.rsample_with_log_prob(eps=eps.unsqueeze(0))
        assert torch.allclose(tr.nodes[aux[0]]["log_prob"], log_q[0], atol=1e-4)
        # statistical: q is normalised where its samples fall, E_{p0}[q/p0] = 1, and the
        # importance-weighted mean under a wide Gaussian p0 equals the guide samples' mean
        draws = torch.stack([pb.posterior.prediction.sample_latents(model, guide, x)["net.0.weight_g"]
                             for _ in range(400)])
        with torch.no_grad():
            zs, _ = guide.flow.rsample_with_log_prob(2000)
            mu, sd = zs.mean(0), 3 * zs.std(0)
            if random_directions:   # q factorises: the flow on the scales, N(μ, σ²) on the directions;
                # p0 takes that exact factor, so the check stays 5-dimensional (a wide p0 in all 21
                # dimensions makes the importance weights degenerate)
                index = guide.flow.flow_index
                rest = torch.ones(len(mu), dtype=torch.bool)
                rest[index] = False
                assert index.tolist() == [0, 1, 2, 3, 16]   # g of 3-4 (4 units), then of 4-1 after its 12 v
                mu[rest], sd[rest] = guide.flow.affine.loc[rest], guide.flow.affine.scale[rest]
            p0 = dist.Normal(mu, sd).to_event(1)
            u = p0.sample((200000,))
            w = (guide.flow.distribution().log_prob(u) - p0.log_prob(u)).exp()
    # the weights' standard error is 0.017 here (20,000 draws gave 0.054, as wide as the bound)
    assert abs(w.mean().item() - 1.0) < 0.06
    iw_mean = (w[:, None] * u).mean(0)[:4]
    assert torch.allclose(iw_mean, draws.mean(0), atol=0.3 * draws.std(0).max().item())


@pytest.mark.parametrize("random_directions", [False, True], ids=["scales", "scales_and_directions"])
def test_fast_objective_equals_pyro_trace_elbo(random_directions):
    model, x, y = _toy_model(random_directions)
    guide = pb.guides.Hypernet(model, flow="iaf", num_flows=2, hidden=8, init_scale=0.2,
                               init_gain=1.0)
    setup_guide(model, guide, x[:8], y[:8], 20)
    with local_params(model, guide):
        torch.manual_seed(3)
        ours, extras = HypernetELBO()(model, guide, x[:8], y[:8], num_data=20)
        torch.manual_seed(3)
        ref = Trace_ELBO().differentiable_loss(model, guide, x[:8], y[:8], num_data=20)
        torch.manual_seed(3)
        renyi, _ = HypernetELBO(alpha=0.0)(model, guide, x[:8], y[:8], num_data=20)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-3), (ours, ref)
    assert torch.allclose(renyi, ours)  # one particle: every Rényi bound is the ELBO
    assert torch.allclose(ours, extras["nll"] + extras["kl"], atol=1e-3)


def test_prob_clip_and_state_dict_roundtrip(digits_small):
    xtr, ytr, xte, yte = digits_small
    lik = pb.likelihoods.Categorical()
    f = torch.tensor([[10.0, -10.0, 0.0], [0.0, 0.0, 0.0]])
    y = torch.tensor([1, 2])
    got = clipped_log_likelihood(lik, f, y, (1e-3, 0.999))
    assert torch.allclose(got, torch.tensor([math.log(1e-3), math.log(1 / 3)]))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model = pb.BNN(net, "categorical", weight_norm=True)
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=32, prob_clip=(1e-3, 0.999))
    res = pb.fit(model, guide, (xtr, ytr), epochs=8, batch_size=50, lr=3e-3, lr_schedule="constant", progress=False,
                 clip_norm=10.0)
    assert set(res.history) >= {"loss", "nll", "kl"}
    metrics = pb.evaluate(model, guide, xte, yte, num_samples=8)
    assert metrics["accuracy"] > 0.5
    guide2 = pb.guides.Hypernet(model, num_flows=2, hidden=32)
    setup_guide(model, guide2, xtr[:2], ytr[:2], len(xtr))
    guide2.load_state_dict(guide.state_dict())
    with torch.no_grad():
        eps = torch.randn(3, guide.flow.dim)
        assert torch.allclose(guide.flow.rsample_with_log_prob(eps=eps)[1],
                              guide2.flow.rsample_with_log_prob(eps=eps)[1])
    assert "hypernet" in pb.guides.registered_guides()
    assert guide.scale_parameters() == [guide.flow.affine.rho]
    assert pb.guides.Hypernet(model).scale_parameters() == []  # not set up yet
    with pytest.raises(ValueError, match="prob_clip"):
        pb.guides.Hypernet(model, prob_clip=(0.5, 0.1))
    with pytest.raises(ValueError, match="flow must be"):
        pb.guides.Hypernet(model, flow="maf")


# ----------------------------------------------------------------- statistical toys
def _train(model, guide, objective, x, y, steps, lr, cosine=False, with_model=False):
    """Full-batch Adam on the guide's parameters (and the model's point estimates if asked,
    e.g. weight-norm directions), with cosine decay of lr to 0 if asked."""
    setup_guide(model, guide, x, y, len(x))
    factor = (lambda t: 0.5 * (1 + math.cos(math.pi * t / steps))) if cosine else (lambda t: 1.0)
    with local_params(model, guide):
        params = list(guide.parameters()) + (list(model.parameters()) if with_model else [])
        opt = torch.optim.Adam(params, lr=lr, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        for _ in range(steps):
            out = objective(model, guide, x, y, num_data=len(x))
            loss = out[0] if isinstance(out, tuple) else out
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def _draws_and_log_q(model, guide, num_samples):
    if isinstance(guide, pb.guides.Hypernet):
        return guide.sample_with_log_prob(num_samples)
    values, log_q = {}, 0.0
    for name in model.site_names:
        loc, scale = guide.loc_and_scale(name)
        w = loc + scale * torch.randn((num_samples,) + loc.shape)
        values[name] = w
        log_q = log_q + dist.Normal(loc, scale).log_prob(w).reshape(num_samples, -1).sum(1)
    return values, log_q


@pytest.mark.slow
def test_bimodal_toy_full_weight_flow_is_not_worse_than_mean_field():
    """ŷ = a·b·x on y = x + 0.1 ε (the posterior is a curved ridge ab ≈ 1 in each mode).  The
    full-weight flow (default layout: starts as MeanField's Gaussian; both start at σ = 0.1)
    reaches a higher ELBO than a converged MeanField, mean of 2 seeds, and follows the ridge (negative
    within-mode correlation of a and b, which a mean-field guide cannot have).  MeanField:
    2,000 full-batch steps, lr 0.1, cosine (ELBO flat: 45.40/45.43 at 2,000 vs 45.43/45.45 at
    4,000 steps); flow: IAF 4 × 32, 500 steps, lr 3e-2, cosine (measured 46.7–46.8; ~3 s per
    seed)."""
    torch.manual_seed(0)
    x = torch.randn(64, 1)
    y = x + 0.1 * torch.randn(64, 1)
    net = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        net[0].weight.fill_(0.8)
        net[1].weight.fill_(0.8)
    model = pb.BNN(net, "gaussian", noise=0.1)
    elbos = {"flow": [], "meanfield": []}
    for seed in range(2):
        torch.manual_seed(seed)
        hn = pb.guides.Hypernet(model, flow="iaf", num_flows=4, hidden=32, full=True,
                                init_scale=0.1, seed=seed)
        _train(model, hn, HypernetELBO(), x, y, steps=500, lr=3e-2, cosine=True)
        mf = pb.guides.MeanField(model, init_scale=0.1)
        _train(model, mf, MeanFieldELBO(), x, y, steps=2000, lr=0.1, cosine=True)
        with torch.no_grad():
            for name, guide in (("flow", hn), ("meanfield", mf)):
                values, log_q = _draws_and_log_q(model, guide, 4000)
                elbos[name].append(log_weights(model, values, log_q, x, y)[0].mean().item())
            values, _ = hn.sample_with_log_prob(4000)
            ab = torch.stack([values["net.0.weight"].reshape(-1), values["net.1.weight"].reshape(-1)])
            ab = ab * torch.sign(ab[:1])  # fold the a = b = −1 mode onto the other one
            assert torch.corrcoef(ab)[0, 1] <= -0.5, (seed, torch.corrcoef(ab)[0, 1])
    assert sum(elbos["flow"]) / 2 >= sum(elbos["meanfield"]) / 2, elbos


def test_full_weight_flow_trains_at_mean_field_learning_rates(digits_small):
    """A flow over all 3,760 weights of a 64-50-10 net, trained full batch at lr 5e-2 (a
    mean-field rate): the loss never rises above its start and falls below a third of it in
    60 steps.  The paper's layout (affine layer first, hard-clamped log-scales, plain
    conditioners) spiked to 1e7 and stalled at ~2e4 here (docs/results/hypernet.md)."""
    xtr, ytr, _, _ = digits_small
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 50), nn.ReLU(), nn.Linear(50, 10)), "categorical")
    guide = pb.guides.Hypernet(model, full=True, num_flows=2, hidden=32, init_scale=0.1)
    setup_guide(model, guide, xtr, ytr, len(xtr))
    objective = guide.make_objective(1)
    losses = []
    with local_params(model, guide):
        opt = torch.optim.Adam(list(guide.parameters()), lr=5e-2)
        for _ in range(60):
            loss, _ = objective(model, guide, xtr, ytr, len(xtr))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert max(losses) <= losses[0], (losses[0], max(losses))
    assert sum(losses[-10:]) / 10 < losses[0] / 3, (losses[0], losses[-10:])


def _digits_meanfield(digits_small, epochs=5):
    xtr, ytr, _, _ = digits_small
    torch.manual_seed(0)
    model = pb.BNN(nn.Sequential(nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10)), "categorical")
    mf = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, mf, (xtr, ytr), epochs=epochs, progress=False, seed=0)
    return model, mf, xtr, ytr


@pytest.mark.parametrize("kind", ["iaf", "realnvp"])
def test_init_from_meanfield_starts_as_that_posterior(digits_small, kind):
    """The flow built from a trained MeanField has that guide's density: draws have log q =
    Σ log N(w; μ, σ²) of the MeanField (blocks at the identity, affine layer at μ, σ)."""
    model, mf, xtr, ytr = _digits_meanfield(digits_small)
    hn = pb.guides.Hypernet(model, full=True, flow=kind, num_flows=2, hidden=16, init_from=mf)
    setup_guide(model, hn, xtr, ytr, len(xtr))
    with torch.no_grad():
        values, log_q = hn.sample_with_log_prob(64)
        expected = sum(dist.Normal(*mf.loc_and_scale(name)).log_prob(values[name]).reshape(64, -1).sum(1)
                       for name in model.site_names)
        assert torch.allclose(log_q, expected, rtol=1e-5, atol=1e-3)
        for name in model.site_names:  # the draws scatter around the MeanField's means at its scales
            loc, scale = mf.loc_and_scale(name)
            z = ((values[name] - loc) / scale).reshape(-1)
            assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1.0) < 0.05


def test_init_from_checks_what_it_is_given(digits_small):
    model, mf, xtr, ytr = _digits_meanfield(digits_small, epochs=1)
    with pytest.raises(TypeError, match="init_from must be a trained pb.guides.MeanField"):
        pb.guides.Hypernet(model, full=True, init_from=AutoDelta(model))
    with pytest.raises(ValueError, match="not set up"):
        pb.guides.Hypernet(model, full=True, init_from=pb.guides.MeanField(model))
    with pytest.raises(ValueError, match="layout='stable' and init_gain=0"):
        pb.guides.Hypernet(model, full=True, init_from=mf, layout="paper")
    other = pb.BNN(nn.Sequential(nn.Linear(64, 21), nn.ReLU(), nn.Linear(21, 10)), "categorical")
    hn = pb.guides.Hypernet(other, full=True, num_flows=2, hidden=8, init_from=mf)
    with pytest.raises(ValueError, match="init_from's site 'net.0.weight' has shape \\(20, 64\\)"):
        setup_guide(other, hn, xtr, ytr, len(xtr))


@pytest.mark.slow
def test_flow_started_from_meanfield_ends_above_it(digits_small):
    """Refining a trained MeanField with a flow over all its weights (``init_from``, the guide's
    default lr 3e-4, 100 epochs) ends at a higher ELBO than the MeanField, in each of 2 seeds
    (measured +3.5 / +4.1 nats; at lr 1e-2 seed 0 ended 9.0 nats *below*).  ELBOs from 512
    full-data draws each, same random numbers for both guides."""
    xtr, ytr, _, _ = digits_small
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = pb.BNN(nn.Sequential(nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10)), "categorical")
        mf = pb.guides.MeanField(model)
        pb.fit(model, mf, (xtr, ytr), epochs=300, progress=False, seed=seed)
        hn = pb.guides.Hypernet(model, full=True, flow="realnvp", num_flows=2, hidden=32, init_from=mf)
        assert hn.default_lr == 3e-4
        pb.fit(model, hn, (xtr, ytr), epochs=100, progress=False, seed=seed)
        elbos = []
        for guide in (mf, hn):
            objective = pb.guides.guide_contract(guide).make_objective(1)
            torch.manual_seed(0)
            with torch.no_grad(), local_params(model, guide):
                draws = [objective(model, guide, xtr, ytr, num_data=len(xtr)) for _ in range(512)]
            elbos.append(-sum(float(d[0] if isinstance(d, tuple) else d) for d in draws) / len(draws))
        assert elbos[1] >= elbos[0], (seed, elbos)


def _toy_regression_std_ratio(seed):
    torch.manual_seed(seed)
    x, y = pb.datasets.toy_regression(64, seed=0)
    net = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    model = pb.BNN(net, "gaussian", noise=0.02, weight_norm=True)
    guide = pb.guides.Hypernet(model, flow="iaf", num_flows=4, hidden=50)
    _train(model, guide, HypernetELBO(), x, y, steps=1000, lr=1e-2, cosine=True, with_model=True)
    grid = torch.linspace(0.0, 1.0, 101).unsqueeze(-1)
    f = pb.predict(model, guide, grid, num_samples=200)[..., 0]
    std = f.std(0)
    inside, outside = std[grid[:, 0] <= 0.5].mean(), std[grid[:, 0] >= 0.8].mean()
    rmse = (pb.predict(model, guide, x, num_samples=50).mean(0) - y).pow(2).mean().sqrt()
    assert rmse < 0.15, rmse  # it fits the data (std of y is ≈ 0.3)
    return (outside / inside).item()


@pytest.mark.slow
def test_toy_regression_uncertainty_grows_away_from_data():
    """Weight-norm MLP 1-64-64-1, IAF 4 × 50 over the scales, 1,000 full-batch steps at
    lr 1e-2 with cosine decay (training ELBO within a few % over its last 10 %; the example
    ``examples/toy_regression_hypernet.py`` prints it): the predictive std on [0.8, 1] is
    ≥ 3× the std inside the data [0, 0.5] (median of 3 seeds)."""
    ratios = sorted(_toy_regression_std_ratio(seed) for seed in range(3))
    assert ratios[1] >= 3, ratios


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hypernet_on_cuda():
    model, x, y = _toy_model()
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=8)
    pb.fit(model, guide, (x, y), epochs=2, batch_size=10, device="cuda", progress=False)
    assert guide.flow.affine.loc.is_cuda and guide.flow.blocks[0].arn.permutation.is_cuda
    draws = pb.predict(model, guide, x.cuda(), num_samples=3)
    assert draws.is_cuda and draws.shape == (3, 20, 1)


def _cuda_variant(name):
    """(model, guide, x, y, fit options) for one Hypernet variant added after the last GPU run."""
    torch.manual_seed(0)
    if name == "full_blocks":   # a full-weight flow over 20·40 + 40 + 41 = 881 weights: MADE groups > 1
        x, y = torch.randn(40, 20), torch.randint(0, 2, (40,))
        model = pb.BNN(nn.Sequential(nn.Linear(20, 40), nn.ReLU(), nn.Linear(40, 1)), "bernoulli")
        return model, pb.guides.Hypernet(model, full=True, num_flows=1), x, y.float()[:, None], {}
    d = pb.datasets.digits()
    x, y = d.x_train[:80], d.y_train[:80]
    net = nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10))
    if name == "random_directions":
        model = pb.BNN(net, "categorical", weight_norm=True, random_directions=True)
        return model, pb.guides.Hypernet(model, num_flows=2, hidden=16), x, y, {}
    model = pb.BNN(net, "categorical", weight_norm=True)   # the scale prior learned by the evidence
    guide = pb.guides.Hypernet(model, num_flows=2, hidden=16, prior_structure="layerwise",
                               directions="sphere")
    return model, guide, x, y, {"marglik": pb.MarglikOptions(every=1, burnin=0, steps=5, lr=0.1)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["full_blocks", "random_directions", "evidence_prior"])
def test_hypernet_variants_on_cuda(name):
    """The full-weight flow with a several-block MADE, random directions and the evidence-learned
    scale prior train and predict on CUDA, every parameter and buffer on the device."""
    model, guide, x, y, options = _cuda_variant(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)   # two epochs: a device test
        res = pb.fit(model, guide, (x, y), epochs=2, batch_size=40, device="cuda", progress=False, **options)
    if name == "full_blocks":   # (the flow exists once the guide is set up, by the fit)
        assert not guide.flow.blocks[0].arn.one_block   # the custom-backward path
    assert all(math.isfinite(v) for v in res.history["loss"])
    assert all(t.is_cuda for t in list(guide.parameters()) + list(guide.buffers()))
    draws = pb.predict(model, guide, x.cuda(), num_samples=3)
    assert draws.is_cuda and draws.shape[:2] == (3, len(x)) and bool(torch.isfinite(draws).all())
