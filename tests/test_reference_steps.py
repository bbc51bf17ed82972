"""The plain-PyTorch reference steps of ``benchmarks/bench_reference.py`` compute the guides' own
losses and gradients (issue 27: otherwise the speed ratios against them mean nothing)."""

from __future__ import annotations

import importlib
import pathlib
import statistics

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("bench_reference")


def _data(n=48, inputs=20, classes=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, inputs, generator=gen), torch.randint(0, classes, (n,), generator=gen)


@pytest.mark.parametrize("num_flows", [0, 3])
def test_hypernet_reference_equals_guide_loss(bench, num_flows):
    from pyro_bnn.training.guide_setup import setup_guide
    x, y = _data()
    model, guide = bench.make_hypernet(num_flows, flow_hidden=8, sizes=[20, 16, 12, 4])
    setup_guide(model, guide, x[:2], y[:2], 480)
    if num_flows:
        bench._perturb_flow(guide, scale=0.2)
    res = bench.check_hypernet(model, guide, x, y, 480)
    assert res["rel_loss"] < 1e-5 and res["rel_kl"] < 1e-5, res
    assert res["max_rel_grad"] < 1e-4, res
    # the check is not vacuous: another noise draw gives another loss
    other = bench.check_hypernet(model, guide, x, y, 480, seed=7)
    assert abs(other["loss_lib"] - res["loss_lib"]) > 1e-3 * abs(res["loss_lib"])


def test_hypernet_reference_sees_the_flow(bench):
    """With the blocks moved off the identity the KL differs from the 0-block guide's."""
    from pyro_bnn.training.guide_setup import setup_guide
    x, y = _data()
    model, guide = bench.make_hypernet(2, flow_hidden=8, sizes=[20, 16, 12, 4])
    setup_guide(model, guide, x[:2], y[:2], 480)
    before = bench.check_hypernet(model, guide, x, y, 480)
    bench._perturb_flow(guide, scale=0.5)
    after = bench.check_hypernet(model, guide, x, y, 480)
    assert after["rel_loss"] < 1e-5 and after["max_rel_grad"] < 1e-4, after
    assert abs(after["kl_ref"] - before["kl_ref"]) > 1e-2


def test_symmetrized_reference_equals_guide_loss(bench):
    from pyro_bnn.training.guide_setup import setup_guide
    x, y = _data()
    model, guide = bench.make_symmetrized(sizes=[20, 16, 12, 4])
    setup_guide(model, guide, x[:2], y[:2], 480)
    with torch.no_grad():   # spread the scales, so that the assignment is not trivially the identity
        for name in guide.site_names():
            guide.loc_and_raw_scale(name)[1].fill_(-0.5)
    res = bench.check_symmetrized(model, guide, x, y, 480)
    assert res["rel_loss"] < 1e-5 and res["rel_entropy_gap"] < 1e-5, res
    assert res["max_rel_grad"] < 1e-4, res
    # the gap is not just log|G|: log ρ(e | ω) is part of it
    log_order = sum(torch.lgamma(torch.tensor(d + 1.0)).item() for d in (16, 12))
    assert res["entropy_gap_ref"] < log_order - 0.1


def test_local_reparameterization_references_equal_the_guides(bench, monkeypatch):
    """``bench_fmnist_speed.py``'s references of the local-reparameterisation paths: MeanField's
    and Symmetrized's default (MeanField's data term, the gap on a weight draw of its own)."""
    import pyro_bnn as pb
    from pyro_bnn.training.guide_setup import setup_guide
    speed = importlib.import_module("bench_fmnist_speed")
    x, y = _data()
    torch.manual_seed(0)
    model = pb.BNN(bench._mlp([20, 16, 12, 4]), "categorical", prior=pb.priors.IIDNormal(1.0))
    guide = pb.guides.Symmetrized(model)
    assert guide.local_reparameterization
    setup_guide(model, guide, x[:2], y[:2], 480)
    with torch.no_grad():
        for name in guide.site_names():
            guide.loc_and_raw_scale(name)[1].fill_(-0.5)
    res = speed.check_symmetrized_local(model, guide, x, y, 480)
    assert res["rel_loss"] < 1e-5 and res["rel_entropy_gap"] < 1e-5 and res["max_rel_grad"] < 1e-4, res
    other = speed.check_symmetrized_local(model, guide, x, y, 480, seed=7)
    assert abs(other["loss_lib"] - res["loss_lib"]) > 1e-3 * abs(res["loss_lib"])
    torch.manual_seed(0)
    model = pb.BNN(bench._mlp([20, 16, 12, 4]), "categorical")
    guide = pb.guides.MeanField(model, init_scale=0.3)
    setup_guide(model, guide, x[:2], y[:2], 480)
    res = speed.check_meanfield(model, guide, x, y, 480)
    assert res["rel_loss"] < 1e-5 and res["max_rel_grad"] < 1e-4, res


@pytest.mark.parametrize("num_flows", [0, 2])
def test_hypernet_reference_on_a_convolutional_net(bench, num_flows):
    """The convolutional path of the Hypernet reference (``bench_fmnist_speed.py --arch cnn``):
    weight-norm Conv2d and Linear layers with pooling and Flatten between them."""
    from torch import nn

    import pyro_bnn as pb
    from pyro_bnn.training.guide_setup import setup_guide
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(4 * 3 * 3, 5), nn.ReLU(), nn.Linear(5, 4))
    model = pb.BNN(net, "categorical", weight_norm=True)
    guide = pb.guides.Hypernet(model, flow="iaf", num_flows=num_flows, hidden=8)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 1, 8, 8, generator=gen), torch.randint(0, 4, (24,), generator=gen)
    setup_guide(model, guide, x[:2], y[:2], 240)
    if num_flows:
        bench._perturb_flow(guide, scale=0.2)
    res = bench.check_hypernet(model, guide, x, y, 240)
    assert "steps" in bench.hypernet_reference_params(model, guide)   # the convolutional path ran
    assert res["rel_loss"] < 1e-5 and res["rel_kl"] < 1e-5, res
    assert res["max_rel_grad"] < 1e-4, res
    other = bench.check_hypernet(model, guide, x, y, 240, seed=7)
    assert abs(other["loss_lib"] - res["loss_lib"]) > 1e-3 * abs(res["loss_lib"])


def test_paired_ratios_pair_the_measurements_of_one_repeat(bench):
    """``bench_fmnist_speed.paired_ratios``: the median of per-repeat ratios, which a load change
    between repeats (both measurements of a repeat slowed alike) leaves at the true ratio while
    the ratio of the medians moves."""
    speed = importlib.import_module("bench_fmnist_speed")
    load = [1.0, 2.0, 2.0, 1.0, 1.0]   # repeats 2 and 3 ran at twice the load
    ref = [1.0 * f for f in load]
    loop = [1.1 * f for f in load[:3]] + [2.2, 2.2]   # the loop's last two caught the load instead
    res = {"x:ref": {"cpu": ref}, "x:loop": {"cpu": loop}, "map": {"cpu": [0.5] * 5}, "x:fit2": {"cpu": ref}}
    paired = speed.paired_ratios(res)
    assert set(paired) == {"x:loop"}   # no reference for map, the reference itself and the 2-epoch calls left out
    assert paired["x:loop"] == pytest.approx(1.1)
    assert statistics.median(loop) / statistics.median(ref) == pytest.approx(2.2)   # what the medians' ratio says
