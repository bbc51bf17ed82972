"""Habits at the scale of the full Fashion-MNIST training set (thirty-eighth session), held on
small data: what went wrong only with many observations, many draws or large activations is
reproduced here by scaling the quantity that grew (docs/results/input_checks.md,
"Thirty-eighth session: real-scale habits")."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.posterior.arviz import correction_ess, loo_approximate


@pytest.fixture(scope="module")
def digits_tree():
    """A MeanField fit on 300 digits and its DataTree on them (40 draws)."""
    d = pb.datasets.digits()
    x, y = d.x_train[:300], d.y_train[:300]
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=5, seed=0, progress=False)
    return pb.to_arviz(model, guide, x, y, num_samples=40, seed=0)


def _spread(dt, factor: float):
    """``dt`` with ``log p`` and ``log q`` multiplied by ``factor``: their difference spans
    ``factor`` times as many nats, as it does when ``log p`` sums over 60,000 observations and
    both densities over 200,000 weights."""
    out = dt.copy(deep=True)
    stats = out["sample_stats"].to_dataset()
    out["sample_stats"] = stats.assign(lp=stats["lp"] * factor, log_q=stats["log_q"] * factor)
    return out


def test_loo_approximate_names_weights_that_collapsed_on_one_draw(digits_tree):
    """Fashion-MNIST MLP, 60,000 images, 200 draws: ``log p − log q`` spanned > 10,000 nats,
    ArviZ's ``loo_approximate_posterior`` returned NaN for every Pareto k̂, ``warning=False`` and
    no warning, and an ELPD that was one draw's log-likelihood (−29,720 against PSIS-LOO's
    −46,539): a silent wrong answer that ``pb.compare`` reported with 0 % bad k̂.  Now the
    undefined k̂ count as very bad, ``warning`` is set and a warning names the effective sample
    size; where the weights did not collapse the result is ArviZ's own."""
    import arviz_stats

    ess, span = correction_ess(digits_tree["sample_stats"]["lp"].values,
                               digits_tree["sample_stats"]["log_q"].values)
    factor = 20_000.0 / span
    wide = _spread(digits_tree, factor)
    assert correction_ess(wide["sample_stats"]["lp"].values, wide["sample_stats"]["log_q"].values)[0] < 1.01
    with pytest.warns(UserWarning, match=r"could not be fitted .* effective sample size of 1\.00.* psis_loo"):
        res = loo_approximate(wide, pointwise=True)
    assert res.warning
    k = res.pareto_k.values
    assert not np.isnan(k).any() and (k > res.good_k).sum() >= np.isinf(k).sum() > 0
    with pytest.warns(UserWarning, match="could not be fitted"):
        short = loo_approximate(wide, pointwise=False)
    assert short.pareto_k is None and short.elpd_i is None and short.warning
    assert short.elpd == pytest.approx(res.elpd)

    # the weights of the fit itself: nothing added to ArviZ's answer
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto")  # ArviZ's own
        ours = loo_approximate(digits_tree, pointwise=True)
        theirs = arviz_stats.loo_approximate_posterior(
            digits_tree, log_p=digits_tree["sample_stats"]["lp"], log_q=digits_tree["sample_stats"]["log_q"],
            pointwise=True)
    assert ours.elpd == theirs.elpd and ours.warning == theirs.warning
    np.testing.assert_array_equal(ours.pareto_k.values, theirs.pareto_k.values)


def test_correction_ess_by_hand():
    """``(Σ w)² / Σ w²`` for weights ``exp(log p − log q)`` and their span in nats."""
    lp, lq = np.array([0.0, 0.0, math.log(2.0)]), np.zeros(3)
    ess, span = correction_ess(lp, lq)
    assert ess == pytest.approx(16 / 6) and span == pytest.approx(math.log(2.0))
    assert correction_ess(torch.tensor([1e4, 0.0]).numpy(), np.zeros(2))[0] == pytest.approx(1.0)


def _digits_cnn_laplace():
    """A Laplace guide (KFAC, all layers) on a small CNN fitted to 200 8×8 digit images."""
    d = pb.datasets.digits(image=True)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten(),
                        nn.Linear(64, 10))
    model = pb.BNN(net, "categorical")
    guide = pb.guides.Laplace(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (d.x_train[:200], d.y_train[:200]), epochs=2, seed=0, progress=False)
    return model, guide, d.x_test[:60], d.y_test[:60]


def test_linearized_draws_of_a_cnn_take_bounded_memory(monkeypatch):
    """``pb.to_arviz`` of an all-layer Laplace LeNet (``predictive="glm"``, 200 draws, 2,000
    Fashion-MNIST test images) peaked 5.8 GB above its start: ``J Δθ`` formed each
    convolution's ``(S, M, T, out)`` block for all ``S`` draws of a batch of ``M`` = 1,024
    inputs at once.  The draws now go in turns of at most ``max_values`` floats per block
    (+0.6 GB there, and faster); the draws are those of one turn to rounding."""
    from pyro_bnn.curvature import glm
    from pyro_bnn.curvature.layers import Layer

    model, guide, x, y = _digits_cnn_laplace()
    whole = guide.linearized_samples(x, num_samples=24, batch_size=30, generator=torch.Generator().manual_seed(1))
    blocks = []
    output_offsets = Layer.output_offsets

    def spy(layer, a, dw):
        out = output_offsets(layer, a, dw)
        blocks.append(out.numel() if dw.shape[0] > 1 else 0)     # one draw is always allowed
        return out

    monkeypatch.setattr(Layer, "output_offsets", spy)
    monkeypatch.setitem(glm.linearized_offsets.__kwdefaults__, "max_values", 2_000)
    turns = guide.linearized_samples(x, num_samples=24, batch_size=30, generator=torch.Generator().manual_seed(1))
    assert blocks and max(blocks) <= 2_000
    assert len(blocks) > 2 * len(guide.layers)              # the convolutions went in several turns
    torch.testing.assert_close(turns.f, whole.f)
    torch.testing.assert_close(turns.log_q, whole.log_q)
    with pytest.raises(ValueError, match="max_values must be >= 1, got 0"):
        glm.linearized_offsets(guide.layers, None, [], max_values=0)


@pytest.mark.parametrize("resume, overwrite", [(False, True), (False, False), (True, False)])
def test_a_checkpoint_path_that_is_a_folder_is_refused_before_training(tmp_path, resume, overwrite):
    """``pb.fit(..., checkpoint=<a folder>, overwrite=True)`` trained its first epoch (a minute
    on Fashion-MNIST's 60,000 images) and then failed with ``IsADirectoryError`` from renaming
    its temporary file over the folder.  Now a ValueError before any training names the folder
    and a file path in it; the folder and its files are untouched.  So is a path under a file."""
    d = pb.datasets.digits()
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    model = pb.BNN(nn.Linear(64, 10), "categorical")
    guide = pb.guides.MeanField(model)
    calls = []
    objective = lambda *args: calls.append(1)  # noqa: E731  (never reached)
    with pytest.raises(ValueError, match=r"checkpoint must be the path of a file, got the folder .*runs'; "
                                         r"name a file in it, e\.g\. checkpoint=.*fit\.pt"):
        pb.fit(model, guide, d.train, epochs=1, checkpoint=folder, resume=resume, overwrite=overwrite,
               objective=objective, progress=False)
    with pytest.raises(ValueError, match=r"lies under .*notes\.txt', which is a file, not a folder"):
        pb.fit(model, guide, d.train, epochs=1, checkpoint=folder / "notes.txt" / "new" / "fit.pt",
               objective=objective, progress=False)
    assert not calls and [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]       # no lock file left behind


def test_fit_curvature_with_x_and_y_as_two_arguments_names_the_tuple():
    """``laplace.fit_curvature(x_train, y_train)`` (the data written out as for an SVI step)
    stopped at ``batch_size or default`` with "Boolean value of Tensor with more than one value
    is ambiguous".  Now a TypeError names ``fit_curvature((x, y))``; ``batch_size`` is an int
    >= 1, and the tuple with a batch size gives the curvature of the default one."""
    d = pb.datasets.digits()
    x, y = d.x_train[:200], d.y_train[:200]
    model = pb.BNN(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)), "categorical")
    guide = pb.guides.Laplace(model, subset="last_layer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=2, seed=0, progress=False)
    with pytest.raises(TypeError, match=r"takes the data as its first argument: \(x, y\) tensors as one tuple, "
                                        r"fit_curvature\(\(x, y\)\).* got a Tensor of shape \(200,\)"):
        guide.fit_curvature(x, y)
    with pytest.raises(ValueError, match="batch_size must be"):
        guide.fit_curvature((x, y), 0)
    reference = float(guide.fit_curvature((x, y)).log_evidence())
    assert float(guide.fit_curvature((x, y), 64).log_evidence()) == pytest.approx(reference, rel=1e-5)
