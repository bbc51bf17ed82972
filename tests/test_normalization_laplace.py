"""Laplace over normalisation layers' affine parameters (γ, β): unit-wise curvature blocks and
``Laplace(..., subset="unnormalized")``.

References: the GGN ``Σ_n J_nᵀ Λ_n J_n`` with ``J`` from ``torch.func.jacrev`` over the flat
``W̃`` vector (full, diagonal, and the per-channel blocks of the unit-wise structure), dense
linear algebra for :class:`UnitBlock`, the dense ``J P⁻¹ Jᵀ`` and ``J Δθ`` for the GLM, and
the dense Gaussian density for the guide's joint draws.  Float64; tolerances are round-off.
"""

import math

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature import (
    UnitBlock,
    accumulate_curvature,
    batch_kfac_factors,
    find_layers,
    functional_covariance,
    network_output,
)
from pyro_bnn.curvature.glm import jacobian_factors, linearized_offsets
from pyro_bnn.model.batchnorm import layers_feeding_normalization

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("float64")]

NORMALIZED = (nn.Linear, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.InstanceNorm2d, nn.GroupNorm, nn.LayerNorm)


def _with_norm_affine(name, module, param):
    return isinstance(module, NORMALIZED)


def _net(kind):
    """A small net with a normalisation layer of ``kind``, in eval mode, with running
    statistics and affine parameters away from their initial 0/1."""
    torch.manual_seed(0)
    if kind == "batchnorm":
        net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                            nn.Linear(3 * 4 * 4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))
    elif kind.startswith("instancenorm"):      # with running statistics (used in eval mode) or without
        net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1),
                            nn.InstanceNorm2d(3, affine=True, track_running_stats=kind == "instancenorm_running"),
                            nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3))
    elif kind == "groupnorm":
        net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                            nn.Linear(4 * 4 * 4, 3))
    else:
        net = nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(20, 1, 4, 4) * 2 + 0.5)          # running statistics ≠ (0, 1)
        for m in net.modules():
            if isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)) and m.weight is not None:
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    net.eval()
    return net


def _setup(kind):
    model = pb.BNN(_net(kind), "categorical", stochastic=_with_norm_affine).double().eval()
    values = {k: v.clone().requires_grad_() for k, v in model.initial_values().items()}
    shapes = {k: v.shape for k, v in values.items()}
    return model, values, shapes, find_layers(model, shapes)


def _jacobian(model, layers, values, shapes, x):
    """``J`` (N, C, P) by torch.func over the flat ``W̃`` of all layers, and ``f``."""
    theta = torch.cat([layer.flatten(values).reshape(-1) for layer in layers]).detach()

    def f(th):
        vals = {}
        for layer, part in zip(layers, th.split([layer.numel for layer in layers])):
            vals.update(layer.unflatten_flat(part, shapes))
        return network_output(model, vals, x)
    return torch.func.jacrev(f)(theta), f(theta)


def _oracle_ggn(model, layers, values, shapes, x):
    J, out = _jacobian(model, layers, values, shapes, x)
    p = torch.softmax(out, -1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("ncp,ncd,ndq->pq", J, lam, J)


@pytest.mark.parametrize("kind", ["batchnorm", "groupnorm", "layernorm", "instancenorm", "instancenorm_running"])
def test_affine_curvature_matches_torch_func(kind):
    """Full and diagonal GGN over all sites equal the oracle; the unit-wise blocks are its
    per-channel (γ_c, β_c) sub-blocks.  Batches of 4 and 3 (the sums run over batches)."""
    model, values, shapes, layers = _setup(kind)
    assert any(layer.unitwise for layer in layers)
    x, y = torch.randn(7, 1, 4, 4), torch.randint(0, 3, (7,))
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    run = lambda xb: network_output(model, values, xb)  # noqa: E731
    H = _oracle_ggn(model, layers, values, shapes, x)
    full = accumulate_curvature(layers, batches, run, "categorical", "full")
    torch.testing.assert_close(full.blocks[0].H, H, rtol=1e-9, atol=1e-12)
    diag = accumulate_curvature(layers, batches, run, "categorical", "diag")
    torch.testing.assert_close(torch.cat([b.h.reshape(-1) for b in diag.blocks]), torch.diagonal(H),
                               rtol=1e-9, atol=1e-12)
    kron = accumulate_curvature(layers, batches, run, "categorical", "kron")
    start = 0
    for layer, block in zip(layers, kron.blocks):
        if layer.unitwise:
            assert isinstance(block, UnitBlock) and block.U.shape == (layer.out_features, 2, 2)
            sub = H[start:start + layer.numel, start:start + layer.numel]
            units = torch.block_diag(*[sub[2 * c:2 * c + 2, 2 * c:2 * c + 2] for c in range(layer.out_features)])
            torch.testing.assert_close(block.to_dense(), units, rtol=1e-9, atol=1e-12)
            assert float((sub - units).abs().max()) > 1e-6      # the cross-channel terms it drops exist
        start += layer.numel


@pytest.mark.parametrize("in_dim, vector_delta", [(2, False), (2, True), (1, True)])
def test_unit_block_linear_algebra_matches_dense(in_dim, vector_delta):
    torch.manual_seed(1)
    B = torch.randn(5, in_dim, in_dim)
    block = UnitBlock(B @ B.mT)
    n = 5 * in_dim
    delta = torch.rand(n) + 0.1 if vector_delta else torch.tensor(0.7)
    scale = 2.5
    P = block.to_dense(scale) + torch.diag(delta.expand(n))
    torch.testing.assert_close(block.logdet(delta, scale), torch.logdet(P))
    torch.testing.assert_close(block.covariance(delta, scale), torch.linalg.inv(P))
    S = block.sample(torch.eye(n), delta, scale)               # rows: P^{-1/2} e_i
    torch.testing.assert_close(S.T @ S, torch.linalg.inv(P))
    v = torch.randn(n)
    torch.testing.assert_close(block.matvec(v, scale), block.to_dense(scale) @ v)
    torch.testing.assert_close(block.solve(v, delta, scale), torch.linalg.solve(P, v))
    J = torch.randn(3, 4, 5, in_dim)                           # (C_out, M, units, in')
    Jf = J.flatten(2)
    torch.testing.assert_close(block.functional_variance_rows(J, delta, scale),
                               torch.einsum("cmp,pq,dmq->mcd", Jf, torch.linalg.inv(P), Jf))


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_glm_covariance_and_offsets_with_affine_sites_match_dense(structure):
    """``Σ_f = J P⁻¹ Jᵀ`` and ``J Δθ`` of the streamed GLM against the dense Jacobian."""
    model, values, shapes, layers = _setup("batchnorm")
    x, y = torch.randn(12, 1, 4, 4), torch.randint(0, 3, (12,))
    run = lambda xb: network_output(model, values, xb)  # noqa: E731
    fit = accumulate_curvature(layers, [(x, y)], run, "categorical", structure)
    deltas = [torch.tensor(0.9)] * len(fit.blocks)
    cov = torch.block_diag(*[b.covariance(d) for b, d in zip(fit.blocks, deltas)])
    xs = torch.randn(5, 1, 4, 4)
    J, f_star = _jacobian(model, layers, values, shapes, xs)
    f, Sf = functional_covariance(layers, fit.blocks, deltas, 1.0, run, xs, batch_size=3)
    torch.testing.assert_close(Sf, torch.einsum("ncp,pq,ndq->ncd", J, cov, J))
    torch.testing.assert_close(f, f_star)
    offsets = [torch.randn(2, *layer.shape) for layer in layers]
    (factors,) = list(jacobian_factors(layers, run, xs, batch_size=5))
    flat = torch.cat([o.flatten(1) for o in offsets], 1)                  # (S, P)
    torch.testing.assert_close(linearized_offsets(layers, factors, offsets), torch.einsum("ncp,sp->snc", J, flat))


def _digits_bn_model():
    net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    return pb.BNN(net, "categorical", stochastic=_with_norm_affine).double()


def test_unnormalized_subset_selects_affine_and_unnormalized_layers():
    model = _digits_bn_model()
    guide = pb.guides.Laplace(model, "kron", subset="unnormalized")
    d = pb.datasets.digits()
    guide.fit_curvature((d.x_train[:50].double(), d.y_train[:50]))
    assert guide.laplace_sites == ["net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"]
    assert guide.fixed_sites == ["net.0.weight", "net.0.bias"]
    assert [layer.unitwise for layer in guide.layers] == [True, False]


def test_unnormalized_subset_errors_name_the_mistake():
    d = pb.datasets.digits()
    data = (d.x_train[:20].double(), d.y_train[:20])
    plain = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)), "categorical")
    with pytest.raises(ValueError, match="no Linear/Conv layer of the network feeds a normalisation layer"):
        pb.guides.Laplace(plain, "kron", subset="unnormalized").fit_curvature(data)
    default = pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 10)), "categorical")
    with pytest.raises(ValueError, match=r"affine parameters \(γ, β\), but none of them is a random site"):
        pb.guides.Laplace(default, "kron", subset="unnormalized").fit_curvature(data)
    with pytest.raises(ValueError, match="subset must be one of"):
        pb.guides.Laplace(default, "kron", subset="normalized")


def test_affine_sites_are_refused_by_differentiable_kfac():
    model, values, shapes, layers = _setup("batchnorm")
    x = torch.randn(4, 1, 4, 4)
    with pytest.raises(ValueError, match="BatchNorm affine parameters"):
        batch_kfac_factors(layers, lambda: network_output(model, values, x), "categorical", create_graph=True)


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_a_pyro_user_fits_a_laplace_over_batchnorm_affine_sites(structure):
    """Plain SVI on the guide's MAP objective (BatchNorm in train mode), fit_curvature (eval
    mode), the evidence tuned, state_dict round trip (same evidence, same joint draws'
    density), the joint draw's log density equal to the dense Gaussian's, and Predictive."""
    import pyro
    from pyro.infer import SVI, Predictive

    torch.manual_seed(2)
    pyro.set_rng_seed(2)
    d = pb.datasets.digits()
    x, y = d.x_train[:300].double(), d.y_train[:300]
    model = _digits_bn_model()
    guide = pb.guides.Laplace(model, structure, subset="unnormalized")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=guide.make_objective())
    model.train()
    for _ in range(30):
        svi.step(x, y)
    model.eval()
    guide.fit_curvature((x, y))
    before = float(guide.log_evidence())
    guide.optimize_prior_precision(steps=100, lr=0.1)
    after = float(guide.log_evidence())
    assert math.isfinite(after) and after >= before - 1e-9
    fresh = pb.guides.Laplace(model, structure, subset="unnormalized")
    fresh.fit_curvature((x[:10], y[:10]))                         # set-up; every buffer is overwritten
    fresh.load_state_dict(guide.state_dict())
    assert float(fresh.log_evidence()) == pytest.approx(after, rel=1e-12)
    # the joint draw's density is the dense Gaussian N(θ*, P⁻¹) over the Laplace sites
    theta, deltas = guide._block_inputs()
    _, _, scale = guide._kind_and_scale()
    cov = torch.block_diag(*[b.covariance(dl, scale) for b, dl in zip(guide.posterior.blocks, deltas)])
    star = guide.map_values()
    loc = torch.cat([layer.flatten(star).reshape(-1) for layer in guide.layers])
    draw = loc + 0.01 * torch.randn_like(loc)
    values, start = {}, 0
    for layer in guide.layers:
        values.update(layer.unflatten_flat(draw[start:start + layer.numel], guide.site_shapes))
        start += layer.numel
    exact = torch.distributions.MultivariateNormal(loc.detach(), cov).log_prob(draw.detach())
    assert float(guide.log_density(values)) == pytest.approx(float(exact), rel=1e-9)
    assert float(fresh.log_density(values)) == pytest.approx(float(exact), rel=1e-9)
    draws = Predictive(model, guide=guide, num_samples=3, return_sites=["net.1.weight", "net.0.weight"])(x[:5])
    assert not torch.allclose(draws["net.1.weight"][0], draws["net.1.weight"][1])    # γ is random
    torch.testing.assert_close(draws["net.0.weight"][0], draws["net.0.weight"][1])   # a point estimate
    probs = pb.predict(model, guide, d.x_test[:50].double(), predictive="glm", num_samples=20)
    assert torch.isfinite(probs).all() and torch.allclose(probs.mean(0).sum(-1), torch.ones(50, dtype=probs.dtype))


def test_online_marglik_over_affine_sites_runs_without_the_normalisation_warning():
    """``pb.fit``'s online schedule with ``subset="unnormalized"``: the weights before BatchNorm are
    point estimates, so the warning about tuning their prior by the evidence does not fire (it
    does for ``subset="all"`` on the same net: ``tests/test_batchnorm_draws.py``); a δ per
    covered layer is learned and the kept evidence is the one of the restored state."""
    import warnings

    d = pb.datasets.digits()
    torch.manual_seed(0)
    x, y = d.x_train[:300].double(), d.y_train[:300]
    model = _digits_bn_model()
    guide = pb.guides.Laplace(model, "kron", subset="unnormalized", prior_structure="layerwise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = pb.fit(model, guide, (x, y), epochs=4, progress=False,
                     marglik=pb.MarglikOptions(every=2, burnin=0, steps=10))
    assert not [w for w in caught if "feed a normalisation layer" in str(w.message)]
    assert guide.prior_precision.shape == (2,) and not torch.allclose(guide.prior_precision,
                                                                       torch.ones(2, dtype=torch.float64))
    best = res.history["best_log_evidence"][0]
    model.eval()
    guide.fit_curvature((x, y))
    assert float(guide.log_evidence()) == pytest.approx(best, rel=1e-6)


def test_a_hand_written_pyro_module_with_random_batchnorm_affine_parameters():
    """A user's own ``PyroModule`` whose BatchNorm γ, β (and the other layers) are ``PyroSample``
    sites, called from a hand-written forward: ``subset="unnormalized"`` finds the layer that
    feeds BatchNorm from the guide's set-up run of the model (torch.fx cannot read the forward),
    and the same sites can be named; the curvature of γ, β is the
    per-channel block of the dense GGN of the same sites, and the weights before BatchNorm are
    point estimates."""
    import pyro
    import pyro.distributions as dist
    from pyro.nn import PyroModule, PyroSample

    class Net(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc1 = PyroModule[nn.Linear](64, 8)
            self.bn = PyroModule[nn.BatchNorm1d](8)
            self.fc2 = PyroModule[nn.Linear](8, 10)
            for mod in (self.fc1, self.bn, self.fc2):
                for name, p in list(mod.named_parameters()):
                    setattr(mod, name, PyroSample(dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())))

        def forward(self, x, y=None):
            logits = self.fc2(torch.relu(self.bn(self.fc1(x))))
            with pyro.plate("data", len(x)):
                return pyro.sample("obs", dist.Categorical(logits=logits), obs=y)

    torch.manual_seed(3)
    pyro.clear_param_store()
    d = pb.datasets.digits()
    x, y = d.x_train[:200].double(), d.y_train[:200]
    model = Net().double()
    model.eval()
    sites = ["bn.weight", "bn.bias", "fc2.weight", "fc2.bias"]
    # torch.fx cannot read this forward (a plate, pyro.sample); the guide's set-up run of the model can
    assert layers_feeding_normalization(model, whole_layer=True) == []
    found = pb.guides.Laplace(model, "kron", subset="unnormalized")
    found.fit_curvature((x, y))
    assert found.laplace_sites == sites and found.normalization_feeding == ("fc1",)
    guide = pb.guides.Laplace(model, "kron", subset=sites)
    guide.fit_curvature((x, y))
    star = {k: v.detach() for k, v in guide.map_values().items()}
    full = pb.guides.Laplace(model, "full", subset=sites, init_loc_fn=lambda site: star[site["name"]])
    full.fit_curvature((x, y))
    assert guide.laplace_sites == sites and guide.fixed_sites == ["fc1.weight", "fc1.bias"]
    torch.testing.assert_close(guide.map_values()["fc1.weight"], full.map_values()["fc1.weight"])
    unit = guide.posterior.blocks[0].to_dense()
    H = full.posterior.blocks[0].H[:16, :16]
    torch.testing.assert_close(unit, H * torch.block_diag(*[torch.ones(2, 2)] * 8), rtol=1e-9, atol=1e-12)
    assert math.isfinite(float(guide.log_evidence()))
