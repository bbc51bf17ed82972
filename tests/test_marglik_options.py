"""``pb.MarglikOptions``: the checked, frozen options of ``pb.fit(..., marglik=)``."""

import dataclasses

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature.marglik import check_marglik_options, marglik_due


def test_defaults_are_immer_et_al():
    opts = pb.MarglikOptions()
    assert dataclasses.asdict(opts) == {"every": 1, "burnin": 0, "steps": 100, "lr": 0.1}
    assert type(opts.lr) is float and pb.MarglikOptions(lr=1).lr == 1.0 and type(pb.MarglikOptions(lr=1).lr) is float


def test_frozen():
    opts = pb.MarglikOptions(every=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.every = 2
    assert opts == pb.MarglikOptions(every=5) and opts != pb.MarglikOptions(every=4)


@pytest.mark.parametrize("field, value, error, message", [
    ("every", 0, ValueError, r"MarglikOptions.every must be an int >= 1, got 0"),
    ("every", 2.0, TypeError, r"MarglikOptions.every must be an int >= 1, got 2.0 \(float\)"),
    ("burnin", -1, ValueError, r"MarglikOptions.burnin must be an int >= 0, got -1"),
    ("burnin", 1.5, TypeError, r"MarglikOptions.burnin must be an int >= 0, got 1.5 \(float\)"),
    ("steps", True, TypeError, r"MarglikOptions.steps must be an int >= 0, got True \(bool\)"),
    ("steps", "5", TypeError, r"MarglikOptions.steps must be an int >= 0, got '5' \(str\)"),
    ("lr", 0.0, ValueError, r"MarglikOptions.lr must be a finite number > 0, got 0.0"),
    ("lr", float("nan"), ValueError, r"MarglikOptions.lr must be a finite number > 0, got nan"),
    ("lr", "0.1", TypeError, r"MarglikOptions.lr must be a number > 0, got '0.1' \(str\)"),
])
def test_fields_are_checked(field, value, error, message):
    with pytest.raises(error, match=message):
        pb.MarglikOptions(**{field: value})


def test_unknown_field_is_pythons_type_error():
    with pytest.raises(TypeError, match="frequency"):
        pb.MarglikOptions(frequency=5)


@pytest.mark.parametrize("value, shown", [({"every": 2}, r"got dict; write marglik=pb.MarglikOptions\(\*\*\{'every': 2\}\)"),
                                          (True, "got bool$"), (5, "got int$")])
def test_fit_accepts_only_the_options_object(value, shown):
    with pytest.raises(TypeError, match=r"marglik must be a pyro_bnn.MarglikOptions or None, " + shown):
        check_marglik_options(value)
    assert check_marglik_options(None) is None
    opts = pb.MarglikOptions()
    assert check_marglik_options(opts) is opts


def test_schedule():
    opts = pb.MarglikOptions(every=3, burnin=2)
    assert [e for e in range(1, 12) if marglik_due(e, opts)] == [5, 8, 11]
    assert not any(marglik_due(e, None) for e in range(1, 12))


def test_same_fit_as_the_old_dict_options():
    """Same seed, same tiny problem: identical to the figures the dict-options code gave at
    20943dc (``/work/runs/sigs/marglik_ref.py old`` there: δ, evidence history, final loss)."""
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    model = pb.BNN(nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)), "categorical",
                   prior=pb.priors.IIDNormal(1.0)).double()
    guide = pb.guides.Laplace(model, "kron", prior_precision=1.0)
    with pytest.warns(pb.ConvergenceWarning):
        res = pb.fit(model, guide, (x, y), epochs=4, lr=1e-2, batch_size=20, progress=False, seed=0,
                     marglik=pb.MarglikOptions(every=1, burnin=1, steps=5, lr=0.1))
    ev = res.history["log_evidence"]
    assert ev[0] != ev[0]     # NaN: burn-in epoch
    torch.testing.assert_close(torch.tensor(ev[1:], dtype=torch.float64), torch.tensor(
        [-30.59838402393392, -30.15082117275446, -30.095088657097723], dtype=torch.float64), rtol=1e-9, atol=0)
    assert float(guide.prior_precision) == pytest.approx(2.4740473810258576, rel=1e-9)
    assert res.final_loss == pytest.approx(43.87250391993924, rel=1e-9)
