"""Target shapes and batched draws in ``pb.BNN``'s Pyro model, as a Pyro user meets them.

1. Targets whose shape torch would broadcast against the output (a regression target ``(M,)``
   for an output ``(M, 1)`` makes an ``(M, M)`` log-likelihood that Pyro's plate check does not
   see) are refused by the model itself, so plain ``SVI`` cannot train on them silently.
2. ``Predictive(parallel=True)`` and vectorised particles on networks beyond the MLP of the
   guide contract tests: a CNN, weight norm with random directions, an invariant model,
   Gaussian regression and dropout.
3. A ``DataLoader`` over an ``IterableDataset`` (no length) needs ``num_data``.
4. ``pb.fit(..., optimizer=pyro.optim.Adam({"lr": 1e-2}))``: a Pyro optimiser is the factory of
   its torch optimiser; an optimiser instance or a Pyro scheduler is named.
"""

import pyro
import pytest
import torch
from helpers import mlp
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.training.optimizer import apply_rate_factors

pytestmark = pytest.mark.filterwarnings("ignore::pyro_bnn.training.convergence.ConvergenceWarning")


def _svi_step(model, x, y):
    pyro.clear_param_store()
    guide = AutoNormal(model)
    return SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO()).step(x, y)


@pytest.mark.parametrize("likelihood, target, match", [
    ("gaussian", lambda y: y[:, 0], r"shape \(50, 1\).*got \(50,\) \(one output: pass y.unsqueeze"),
    ("bernoulli", lambda y: (y[:, 0] > 0).float(), r"shape \(50, 1\).*got \(50,\)"),
    ("categorical", lambda y: nn.functional.one_hot((y[:, 0] > 0).long(), 2).float(),
     r"shape \(50,\).*got \(50, 2\) \(one-hot targets: pass y.argmax"),
])
def test_plain_svi_refuses_targets_that_would_broadcast(likelihood, target, match):
    torch.manual_seed(0)
    x, y = torch.randn(50, 3), torch.randn(50, 1)
    model = pb.BNN(mlp(3, 8, 2 if likelihood == "categorical" else 1), likelihood,
                   **({"noise": 1.0} if likelihood == "gaussian" else {}))
    with pytest.raises(ValueError, match=match):
        _svi_step(model, x, target(y))
    assert isinstance(_svi_step(model, x, (y > 0).float() if likelihood == "bernoulli" else
                                y if likelihood == "gaussian" else torch.zeros(50, dtype=torch.long)), float)


def test_categorical_labels_in_a_column_are_named():
    model = pb.BNN(mlp(3, 8, 4), "categorical")
    with pytest.raises(ValueError, match=r"got \(20, 1\) \(labels in a column: pass y.squeeze"):
        _svi_step(model, torch.randn(20, 3), torch.zeros(20, 1, dtype=torch.long))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Dropout(0.2), nn.Linear(4 * 4 * 4, 10))


@pytest.mark.parametrize("case", ["cnn", "weight_norm_directions", "invariant", "regression"])
def test_parallel_predictive_matches_one_pass_per_draw(case):
    """Each parallel draw's output is the network's under that draw's weights."""
    torch.manual_seed(0)
    if case == "cnn":
        model, x = pb.BNN(_cnn(), "categorical"), torch.randn(6, 1, 8, 8)
    elif case == "weight_norm_directions":
        model, x = pb.BNN(mlp(5, 8, 3), "categorical", weight_norm=True, random_directions=True), torch.randn(6, 5)
    elif case == "invariant":
        aug = pb.invariance.AffineAugmentation(num_samples=3)
        model, x = pb.BNN(_cnn(), "categorical", augmentation=aug), torch.randn(6, 1, 8, 8)
    else:
        model, x = pb.BNN(mlp(5, 8, 2), "gaussian", noise=0.3), torch.randn(6, 5)
    y = torch.randn(6, 2) if case == "regression" else torch.randint(0, 3, (6,))
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=1, progress=False)
    model.eval()  # dropout off: a draw's output is a function of its weights
    shapes = {s: v.shape for s, v in model.initial_values().items()}
    out = Predictive(model, guide=guide, num_samples=5, parallel=True,
                     return_sites=[*model.site_names, "obs", "_RETURN"])(x)
    num_out = {"regression": 2, "weight_norm_directions": 3}.get(case, 10)
    assert out["_RETURN"].shape == (5, 6, num_out)
    assert out["obs"].shape == ((5, 6, 2) if case == "regression" else (5, 6))
    for i in range(5):
        draw = {s: out[s][i].reshape(shapes[s]) for s in model.site_names}
        torch.testing.assert_close(out["_RETURN"][i], model.run_with(draw, x))
    # the Gaussian observations scatter around their own draw's output
    if case == "regression":
        assert (out["obs"] - out["_RETURN"]).std() == pytest.approx(0.3, rel=0.5)


def test_parallel_draws_get_their_own_dropout_masks():
    """In train mode every parallel draw runs its own pass, as sequential ``Predictive`` does:
    one weight value (a point-mass guide), five different dropout masks."""
    torch.manual_seed(0)
    model, x = pb.BNN(_cnn(), "categorical"), torch.randn(6, 1, 8, 8)
    guide = pyro.infer.autoguide.AutoDelta(model)
    pb.fit(model, guide, (x, torch.randint(0, 10, (6,))), epochs=1, progress=False)
    model.train()
    out = Predictive(model, guide=guide, num_samples=5, parallel=True, return_sites=["_RETURN"])(x)
    assert all((out["_RETURN"][0] - out["_RETURN"][i]).abs().max() > 1e-4 for i in range(1, 5))
    model.eval()
    out = Predictive(model, guide=guide, num_samples=5, parallel=True, return_sites=["_RETURN"])(x)
    torch.testing.assert_close(out["_RETURN"][0], out["_RETURN"][4])


def test_a_dataloader_without_length_needs_num_data():
    x, y = torch.randn(60, 3), torch.randint(0, 2, (60,))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from zip(x, y)

    loader = torch.utils.data.DataLoader(Stream(), batch_size=20)
    model = pb.BNN(mlp(3, 8, 2), "categorical")
    guide = pb.guides.MeanField(model)
    with pytest.raises(TypeError, match=r"Stream has no len\(\).*pass num_data=N"):
        pb.fit(model, guide, loader, epochs=1, progress=False)
    result = pb.fit(model, guide, loader, epochs=2, num_data=60, progress=False)
    assert len(result.history["loss"]) == 2


def test_a_user_likelihood_without_batch_dims_is_named_under_parallel_draws():
    class Laplacian(pb.model.likelihoods.Likelihood):
        name = "laplacian"

        def distribution(self, f):
            return pyro.distributions.Laplace(f, 0.5).to_event(f.dim() - 1)

    torch.manual_seed(0)
    model = pb.BNN(mlp(3, 8, 1), Laplacian())
    x = torch.randn(5, 3)
    guide = AutoNormal(model)
    pb.fit(model, guide, (x, torch.randn(5, 1)), epochs=1, progress=False)
    assert Predictive(model, guide=guide, num_samples=4)(x)["obs"].shape == (4, 5, 1)
    with pytest.raises(TypeError, match=r"Laplacian.distribution\(f\) takes no batch_dims.*parallel=False"):
        Predictive(model, guide=guide, num_samples=4, parallel=True)(x)


def _fit_digits(optimizer, digits_small):
    x, y, _, _ = digits_small
    torch.manual_seed(0)
    model = pb.BNN(mlp(), "categorical")
    guide = pb.guides.MeanField(model)
    result = pb.fit(model, guide, (x, y), epochs=3, optimizer=optimizer, seed=1, progress=False)
    return result.history["loss"], {k: v.detach().clone() for k, v in guide.state_dict().items()}


def test_a_pyro_optimiser_is_its_torch_optimiser(digits_small):
    losses, state = _fit_digits(pyro.optim.Adam({"lr": 1e-2, "betas": (0.8, 0.99)}), digits_small)
    ref_losses, ref_state = _fit_digits(lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99)), digits_small)
    assert losses == ref_losses
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=0, atol=0)
    clipped, _ = _fit_digits(pyro.optim.ClippedAdam({"lr": 1e-2, "clip_norm": 5.0}), digits_small)
    assert clipped[-1] < clipped[0]


def _fit_wide(digits_small, **fit_kw):
    """MeanField on a net with a wide layer (fan-in 128 > 100: its means get the factor √(100/128))."""
    x, y, _, _ = digits_small
    torch.manual_seed(0)
    model = pb.BNN(mlp(64, 128, 10), "categorical")
    guide = pb.guides.MeanField(model)
    result = pb.fit(model, guide, (x, y), epochs=3, seed=1, progress=False, **fit_kw)
    return guide, result.history["loss"], {k: v.detach().clone() for k, v in guide.state_dict().items()}


def test_a_custom_optimiser_gets_the_guides_rate_factors(digits_small):
    built = []

    def factory(params):
        built.append(torch.optim.Adam(params, lr=1e-2, betas=(0.8, 0.99), fused=True))
        return built[-1]

    guide, losses, _ = _fit_wide(digits_small, optimizer=factory)
    factors = guide.learning_rate_factors()  # the wide layer's weight and bias means
    assert len(factors) == 2 and losses[-1] < losses[0]
    for wide_loc, factor in factors:
        assert factor == pytest.approx((100 / 128) ** 0.5)
        group, = [g for g in built[0].param_groups if any(p is wide_loc for p in g["params"])]
        assert group["initial_lr"] == pytest.approx(1e-2 * factor)  # the rate the schedule starts from
        assert group["betas"] == (0.8, 0.99)  # the user's other settings kept
    assert sum(len(g["params"]) for g in built[0].param_groups) == len({id(p) for g in built[0].param_groups
                                                                        for p in g["params"]})
    # the user's fused Adam at the default's rate trains exactly as the default optimiser does
    _, default_losses, default_state = _fit_wide(digits_small, lr=1e-2)
    _, same_losses, same_state = _fit_wide(digits_small, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2, fused=True))
    assert same_losses == default_losses
    for key in default_state:
        torch.testing.assert_close(same_state[key], default_state[key], rtol=0, atol=0)


def test_an_optimiser_with_its_own_groups_is_left_as_it_is():
    """A factory that already sets per-parameter rates (several groups, e.g. the default optimiser
    with the guide's factors) gets no factor twice."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    grouped = torch.optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.05}], lr=0.1)
    apply_rate_factors(grouped, [(b, 0.5)])
    assert [g["lr"] for g in grouped.param_groups] == [0.1, 0.05]
    single = torch.optim.Adam([a, b], lr=0.1)
    apply_rate_factors(single, [(b, 0.5)])
    assert [(g["lr"], len(g["params"])) for g in single.param_groups] == [(0.1, 1), (0.05, 1)]


def test_rate_factors_on_a_stepped_optimiser_are_refused():
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    with pytest.raises(ValueError, match="already taken a step"):
        apply_rate_factors(opt, [(w, 0.5)])
    fresh = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    apply_rate_factors(fresh, [(w, 0.5)])
    assert [(g["lr"], g["momentum"]) for g in fresh.param_groups] == [(0.05, 0.9)]


@pytest.mark.parametrize("optimizer, match", [
    (lambda: torch.optim.Adam(nn.Linear(2, 2).parameters()), r"takes a factory, got an optimiser instance \(Adam\)"),
    (lambda: pyro.optim.ExponentialLR({"optimizer": torch.optim.Adam, "optim_args": {"lr": 1e-2}, "gamma": 0.9}),
     r"learning-rate scheduler.*lr_schedule="),
    (lambda: pyro.optim.Adam(lambda name, param: {"lr": 1e-2}), r"per-parameter arguments"),
])
def test_optimisers_fit_cannot_use_are_named(optimizer, match, digits_small):
    with pytest.raises(TypeError, match=match):
        _fit_digits(optimizer(), digits_small)


def test_weight_decay_outside_the_objective_is_warned(digits_small):
    with pytest.warns(UserWarning, match=r"weight_decay=0.01 \(AdamW\).*outside the ELBO") as record:
        _fit_digits(lambda p: torch.optim.AdamW(p, lr=1e-2), digits_small)
    assert any(w.filename == __file__ for w in record)  # points at the caller of pb.fit
    with pytest.warns(UserWarning, match=r"weight_decay=0.1 \(Adam\)"):
        _fit_digits(pyro.optim.Adam({"lr": 1e-2, "weight_decay": 0.1}), digits_small)
    _fit_digits(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0), digits_small)  # silent
