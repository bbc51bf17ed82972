"""The scales' prior of a weight-norm Hypernet learned from the Laplace evidence (issue 26).

Reference: ``pb.guides.Laplace(..., prior_structure="layerwise")`` on a plain BNN whose weights
are the Hypernet's mean network ``E_q[g]·v/‖v‖`` (and its biases), with ``δ`` optimised by the
same number of Adam steps from the same start.
"""

import math
import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature.marglik import marglik_due
from pyro_bnn.guides.hypernet_objective import log_weights

SITES = ["net.0.weight_g", "net.2.weight_g"]



def _data(n=120):
    d = pb.datasets.digits()
    return d.x_train[:n].to(torch.get_default_dtype()), d.y_train[:n]


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 10))


def _model(prior=None, seed=0):
    return pb.BNN(_net(seed), "categorical", weight_norm=True, prior=prior)


def _guide(model, **options):
    return pb.guides.Hypernet(model, **{"num_flows": 2, "hidden": 16, **options})


def _fit(model, guide, data, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)  # a few epochs: contract tests
        return pb.fit(model, guide, data, **{"batch_size": 40, "seed": 0, "progress": False, **kw})


def _mean_net(model, scales):
    """A plain network with the weight-norm model's mean network g·v/‖v‖ (and biases) as weights."""
    net = _net(seed=5)
    with torch.no_grad():
        for i in (0, 2):
            v = model.net[i].weight_v.detach()
            net[i].weight.copy_(scales[f"net.{i}.weight_g"][:, None] * v / v.norm(dim=1, keepdim=True))
            net[i].bias.copy_(model.net[i].bias.detach())
    return net


def _plain_laplace(model, scales, x, y):
    """A plain BNN with the weight-norm model's mean network as its weights, under Laplace with
    one δ per layer starting at the model's current scale-prior precisions."""
    net = _mean_net(model, scales)
    start = torch.tensor([float(model.site_normal_prior(s)[1]) ** -2 for s in SITES])
    laplace = pb.guides.Laplace(pb.BNN(net, "categorical"), "kron", prior_structure="layerwise",
                                prior_precision=start)
    return laplace.fit_curvature((x, y))


def test_delta_equals_layerwise_laplace_of_the_mean_network(float64):
    """Same δ as Laplace's evidence steps on the plain network (rtol 1e-9, float64), and a
    maximum of Laplace's own evidence: ±1 % on either layer's δ lowers it."""
    x, y = _data()
    model = _model(prior={SITES[0]: pb.priors.IIDNormal(0.5), SITES[1]: pb.priors.IIDNormal(2.0)})
    guide = _guide(model, prior_structure="layerwise")
    _fit(model, guide, (x, y), epochs=3)
    scales = guide.mean_scales()
    laplace = _plain_laplace(model, scales, x, y)
    update = guide.update_prior_precision_((x, y), steps=300, lr=0.1)
    reference = laplace.optimize_prior_precision(steps=300, lr=0.1)
    ours = torch.tensor([update.prior_precision[s] for s in SITES])
    torch.testing.assert_close(ours, laplace.prior_precision.detach(), rtol=1e-9, atol=0)
    assert update.log_evidence == pytest.approx(reference, rel=1e-9)
    assert not torch.allclose(ours, torch.tensor([4.0, 0.25]), rtol=0.05)  # it moved from the start
    with torch.no_grad():
        best = float(laplace.log_evidence(ours))
        for layer in range(2):
            for factor in (0.99, 1.01):
                moved = ours.clone()
                moved[layer] *= factor
                assert float(laplace.log_evidence(moved)) < best, (layer, factor)


def _conv_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def _mlp_1(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 12), nn.Tanh(), nn.Linear(12, 1))


@pytest.mark.parametrize("case", ["conv", "gaussian"])
def test_delta_equals_layerwise_laplace_for_conv_layers_and_regression(float64, case):
    """The same reference for a Conv2d layer (categorical) and for a Gaussian likelihood with a
    fixed noise σ = 0.5 (the curvature scaled by 1/σ²); rtol 1e-9 in float64."""
    d = pb.datasets.digits(image=case == "conv")
    x = d.x_train[:100].double()
    if case == "conv":
        make_net, y, kind, options = _conv_net, d.y_train[:100], "categorical", {}
    else:
        make_net, kind, options = _mlp_1, "gaussian", {"noise": 0.5}
        y = (x[:, 20:30].sum(-1, keepdim=True) - 2.0) / 2.0
    model = pb.BNN(make_net(), kind, weight_norm=True, **options)
    guide = _guide(model, prior_structure="layerwise")
    _fit(model, guide, (x, y), epochs=3, batch_size=25)
    scales = guide.mean_scales()
    net = make_net(seed=5)
    with torch.no_grad():
        for site, g in scales.items():
            path = site[len("net."):-len(".weight_g")]
            layer, plain = model.net.get_submodule(path), net.get_submodule(path)
            v = layer.weight_v.detach()
            plain.weight.copy_(g.reshape(-1, *[1] * (v.dim() - 1)) * v / v.flatten(1).norm(dim=1).reshape(
                -1, *[1] * (v.dim() - 1)))
            plain.bias.copy_(layer.bias.detach())
    laplace = pb.guides.Laplace(pb.BNN(net, kind, **options), "kron", prior_structure="layerwise",
                                prior_precision=1.0)
    laplace.fit_curvature((x, y))
    update = guide.update_prior_precision_((x, y), steps=150, lr=0.1)
    reference = laplace.optimize_prior_precision(steps=150, lr=0.1, **({"learn_noise": False} if options else {}))
    ours = torch.tensor(list(update.prior_precision.values()))
    torch.testing.assert_close(ours, laplace.prior_precision.detach(), rtol=1e-9, atol=0)
    assert update.log_evidence == pytest.approx(reference, rel=1e-9)
    assert not torch.allclose(ours, torch.ones(2), rtol=0.05)


def test_scalar_structure_equals_the_scalar_laplace(float64):
    """``prior_structure="scalar"``: one δ for every layer, equal (rtol 1e-9) to Laplace's
    ``prior_structure="scalar"`` evidence steps from the geometric mean of the layers' δ."""
    x, y = _data()
    model = _model(prior={SITES[0]: pb.priors.IIDNormal(0.5), SITES[1]: pb.priors.IIDNormal(2.0)})
    guide = _guide(model)   # the default: one δ
    assert guide.prior_structure == "scalar"
    _fit(model, guide, (x, y), epochs=3)
    net = _mean_net(model, guide.mean_scales())
    laplace = pb.guides.Laplace(pb.BNN(net, "categorical"), "kron", prior_structure="scalar",
                                prior_precision=1.0)   # (4 · 0.25)^(1/2): the geometric mean
    laplace.fit_curvature((x, y))
    update = guide.update_prior_precision_((x, y), steps=200, lr=0.1)
    reference = laplace.optimize_prior_precision(steps=200, lr=0.1)
    deltas = [update.prior_precision[s] for s in SITES]
    assert deltas[0] == deltas[1] == pytest.approx(float(laplace.prior_precision), rel=1e-9)
    assert update.log_evidence == pytest.approx(reference, rel=1e-9)
    assert deltas[0] != pytest.approx(1.0, rel=0.05)
    assert "(scalar)" in guide.settings_description()
    with pytest.raises(ValueError, match="prior_structure"):
        _guide(model, prior_structure="sitewise")


def test_the_prior_of_each_layer_is_set(float64):
    x, y = _data()
    shared = pb.priors.IIDNormal(1.0)
    model = _model(prior=shared)
    guide = _guide(model, prior_structure="layerwise")
    _fit(model, guide, (x, y), epochs=2)
    update = guide.update_prior_precision_((x, y), steps=100)
    deltas = update.prior_precision
    assert sorted(deltas) == SITES and abs(math.log(deltas[SITES[0]] / deltas[SITES[1]])) > 0.01
    trace = pyro.poutine.trace(model).get_trace(x[:5])
    for site in SITES:
        loc, scale = model.site_normal_prior(site)
        assert float(loc) == 0.0 and float(scale) == pytest.approx(deltas[site] ** -0.5, rel=1e-12)
        normal = trace.nodes[site]["fn"].base_dist
        assert float(normal.scale.flatten()[0]) == pytest.approx(deltas[site] ** -0.5, rel=1e-12)
    assert float(shared.scale) == 1.0  # the user's prior object is left as it was
    assert "g prior precision by the Laplace evidence" in guide.settings_description()


def test_mean_scales_is_the_mean_of_q():
    x, y = _data()
    model = _model()
    gaussian = _guide(model, num_flows=0)  # q = N(loc, σ²): the mean is the affine layer's loc
    _fit(model, gaussian, (x, y), epochs=1)
    state = torch.get_rng_state()
    mean = torch.cat([gaussian.mean_scales(4000)[s] for s in SITES])
    assert torch.equal(torch.get_rng_state(), state)  # its own generator: the global stream untouched
    loc, sigma = gaussian.flow.affine.loc.detach(), gaussian.flow.affine.scale.detach()
    assert bool(((mean - loc).abs() < 5 * sigma / math.sqrt(4000)).all())
    assert not torch.equal(gaussian.mean_scales(4000, seed=1)[SITES[0]], mean[:12])  # Monte Carlo
    model = _model()
    flow = _guide(model, init_gain=0.5)  # a flow away from the identity: against its own draws
    _fit(model, flow, (x, y), epochs=1)
    draws, _ = flow.sample_with_log_prob(20000)
    mean = flow.mean_scales(20000)
    for site in SITES:
        se = draws[site].std(0) / math.sqrt(20000)
        assert bool(((mean[site] - draws[site].mean(0)).abs() < 6 * se).all()), site


def test_fit_learns_the_prior_between_epochs():
    """Updates after the due epochs, before the next one trains, none after the last epoch; the
    history records the prior in force during each epoch; the objective uses the learned prior."""
    x, y = _data()
    model = _model()
    guide = _guide(model, prior_structure="layerwise")
    options = pb.MarglikOptions(every=2, burnin=1, steps=50, lr=0.1)
    res = _fit(model, guide, (x, y), epochs=6, marglik=options)
    evidence = res.history["mean_network_log_evidence"]
    precisions = res.history["scale_prior_precision"]
    assert len(evidence) == len(precisions) == 6
    for epoch in range(1, 7):
        assert math.isfinite(evidence[epoch - 1]) == marglik_due(epoch - 1, options), epoch
    assert precisions[0] == [1.0, 1.0] == precisions[2] and precisions[3] != precisions[2]
    assert precisions[4] == precisions[3] and precisions[5] != precisions[4]
    final = [float(model.site_normal_prior(s)[1]) ** -2 for s in SITES]
    assert final == pytest.approx(precisions[-1], rel=1e-6)
    # the training objective is that of the model with the learned prior
    with torch.no_grad():
        values, log_q = guide.sample_with_log_prob(1)
        _, _, kl = log_weights(model, values, log_q, x, y)
        log_p = sum(torch.distributions.Normal(0.0, d ** -0.5).log_prob(values[s]).sum()
                    for s, d in zip(SITES, final))
    assert float(kl) == pytest.approx(float(log_q - log_p), rel=1e-5)


def test_plain_svi_then_update():
    x, y = _data()
    model = _model()
    guide = _guide(model, prior_structure="layerwise")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss=guide.make_objective())
    for _ in range(3):
        svi.step(x, y)
    laplace = _plain_laplace(model, guide.mean_scales(), x, y)   # of the parameters SVI trained
    update = guide.update_prior_precision_((x, y), steps=30)
    laplace.optimize_prior_precision(steps=30, lr=0.1)
    torch.testing.assert_close(torch.tensor([update.prior_precision[s] for s in SITES]),
                               laplace.prior_precision.detach(), rtol=1e-4, atol=0)  # float32
    trace = pyro.poutine.trace(model).get_trace(x[:5])
    for site, delta in update.prior_precision.items():
        assert delta != pytest.approx(1.0, rel=1e-3)
        assert float(trace.nodes[site]["fn"].base_dist.scale.flatten()[0]) == pytest.approx(delta ** -0.5, rel=1e-6)
    assert math.isfinite(svi.step(x, y))
    draws = Predictive(model, guide=guide, num_samples=3)(x[:4])
    assert draws["net.0.weight_g"].shape[0] == 3 and draws["net.0.weight_g"].shape[-1] == 12


class _Interrupted(Exception):
    pass


def _objective(guide, stop_at=None):
    """The guide's own loss as a user's ``objective=`` that raises at call ``stop_at``."""
    loss, calls = guide.make_objective(), [0]

    def objective(model, guide_, x, y, num_data):
        calls[0] += 1
        if calls[0] == stop_at:
            raise _Interrupted
        return loss(model, guide_, x, y, num_data)
    return objective


def test_an_interrupted_fit_resumed_ends_where_the_uninterrupted_one_does(tmp_path):
    """Killed at step 2 of epoch 4 (3 steps per epoch, cosine schedule), resumed from its
    checkpoint: the learned precisions, their history, the flow and the model end bit-identical."""
    x, y = _data()
    options = pb.MarglikOptions(every=1, burnin=1, steps=20, lr=0.1)
    path = tmp_path / "fit.pt"
    kw = dict(epochs=6, marglik=options)
    model, guide = _model(), None
    guide = _guide(model)
    with pytest.raises(_Interrupted):
        _fit(model, guide, (x, y), checkpoint=path, objective=_objective(guide, stop_at=11), **kw)
    saved = torch.load(path, weights_only=True)
    assert saved["epoch"] == 3
    assert len(saved["history"]["scale_prior_precision"]) == 3
    stored = [float(saved["model"][f"priors.{s.replace('.', '__')}.scale"]) ** -2 for s in SITES]
    assert stored == pytest.approx(saved["history"]["scale_prior_precision"][-1], rel=1e-6)
    runs = []
    for extra in (dict(checkpoint=path, resume=True), {}):
        model = _model()
        guide = _guide(model)
        res = _fit(model, guide, (x, y), objective=_objective(guide), **kw, **extra)
        runs.append((res, model, guide))
    (resumed, m1, g1), (full, m2, g2) = runs
    assert resumed.resumed_from == 3
    assert resumed.history["scale_prior_precision"] == full.history["scale_prior_precision"]
    assert resumed.history["loss"] == full.history["loss"]
    for a, b in ((m1, m2), (g1, g2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert full.history["scale_prior_precision"][-1] != full.history["scale_prior_precision"][2]


def test_bad_input_is_a_clear_error():
    x, y = _data()
    options = pb.MarglikOptions(every=1, steps=2)
    plain = pb.BNN(_net(), "categorical")
    with pytest.raises(ValueError, match="weight-norm model"):
        _fit(plain, pb.guides.Hypernet(plain, full=True, num_flows=1, hidden=4), (x, y), epochs=1,
             marglik=options)
    model = _model(prior=pb.priors.ScaleMixture())
    with pytest.raises(ValueError, match="i.i.d. Normal"):
        _fit(model, _guide(model), (x, y), epochs=1, marglik=options)
    model = _model(prior=pb.priors.IIDNormal(1.0, loc=0.5))
    with pytest.raises(ValueError, match="zero-mean"):
        _fit(model, _guide(model), (x, y), epochs=1, marglik=options)
    model = _model()
    with pytest.raises(RuntimeError, match="set up first"):
        _guide(model).update_prior_precision_((x, y))
    with pytest.raises(RuntimeError, match="set up first"):
        _guide(model).mean_scales()
    guide = _guide(model)
    _fit(model, guide, (x, y), epochs=1)
    with pytest.raises(ValueError, match="steps"):
        guide.update_prior_precision_((x, y), steps=-1)
    with pytest.raises(TypeError, match="marglik must be a pyro_bnn.MarglikOptions"):
        _fit(model, guide, (x, y), epochs=1, marglik={"every": 1})
