"""Corruption curves: exact rotations, noise, and entropy rising with rotation for every guide."""

import pytest
import torch
from uncertainty_helpers import GUIDE_NAMES, digits, trained

from pyro_bnn.analysis.corruption import gaussian_noise, noise_curve, rotate, rotation_curve


def test_rotate_exact_cases():
    g = torch.Generator().manual_seed(0)
    flat = torch.rand(3, 64, generator=g)
    img = flat.reshape(3, 1, 8, 8)
    assert torch.equal(rotate(flat, 0), flat)
    torch.testing.assert_close(rotate(flat, 360), flat, atol=1e-5, rtol=0)
    torch.testing.assert_close(rotate(flat, 90).reshape(3, 1, 8, 8), torch.rot90(img, 1, (-2, -1)))
    torch.testing.assert_close(rotate(flat, -90).reshape(3, 1, 8, 8), torch.rot90(img, -1, (-2, -1)))
    mnist_like = torch.rand(2, 1, 28, 28, generator=g)
    torch.testing.assert_close(rotate(mnist_like, 180), torch.rot90(mnist_like, 2, (-2, -1)),
                               atol=1e-5, rtol=0)
    assert rotate(torch.rand(2, 784), 30).shape == (2, 784)


def test_rotate_counter_clockwise_by_hand():
    # a single lit pixel in the top-right corner of a 2×2 image goes to the top-left at +90°
    x = torch.tensor([[0.0, 1.0], [0.0, 0.0]]).reshape(1, 4)
    torch.testing.assert_close(rotate(x, 90), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_rotate_errors():
    with pytest.raises(ValueError, match="square"):
        rotate(torch.rand(2, 10), 30)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        rotate(torch.rand(2, 3, 4), 30)


def test_gaussian_noise():
    x = torch.full((200, 64), 0.5)
    assert torch.equal(gaussian_noise(x, 0.0), x)
    noisy = gaussian_noise(x, 0.1, clamp=None, generator=torch.Generator().manual_seed(0))
    # sd of a 12,800-value std estimate ≈ 0.1/sqrt(25600) ≈ 6e-4
    assert float((noisy - x).std()) == pytest.approx(0.1, abs=0.003)
    assert gaussian_noise(x, 2.0).max() <= 1.0
    with pytest.raises(ValueError, match="std must be"):
        gaussian_noise(x, -1.0)


@pytest.mark.parametrize("name", GUIDE_NAMES)
def test_entropy_rises_with_rotation_every_guide(name):
    model, guide = trained(name)
    d = digits()
    x, y = d.x_test[:200], d.y_test[:200]
    curve = rotation_curve(model, guide, x, y, angles=[0, 45, 90], num_samples=8)
    assert curve["angle"] == [0.0, 45.0, 90.0]
    ent, acc = curve["entropy"], curve["accuracy"]
    # (the 0→90° figure with well-trained models is measured in examples/corruption_digits.py;
    # these 60-step test models can be confidently wrong on some 90° digits)
    assert ent[1] > ent[0] and (ent[1] + ent[2]) / 2 > ent[0], ent
    assert acc[0] > acc[2], acc
    noise = noise_curve(model, guide, x, y, stds=[0.0, 0.5], num_samples=8)
    assert noise["entropy"][1] > noise["entropy"][0], noise["entropy"]


def test_curve_with_guide_predictive_method():
    """``predictive="glm_probit"`` (Laplace's linearised predictive, probit link) goes through ``guide.predict``:
    a deterministic (1, N, C) predictive gives MI 0 and equals pb.predict at every level."""
    import pyro_bnn as pb

    model, guide = trained("laplace")
    d = digits()
    x, y = d.x_test[:100], d.y_test[:100]
    curve = rotation_curve(model, guide, x, y, angles=[0, 45], num_samples=4, predictive="glm_probit")
    assert curve["mutual_information"] == [0.0, 0.0]
    probs = pb.predict(model, guide, rotate(x, 45), predictive="glm_probit").reshape(len(x), -1)
    expected = float(pb.metrics.predictive_entropy(probs.unsqueeze(0)).mean())
    assert curve["entropy"][1] == pytest.approx(expected, rel=1e-5)
    assert curve["accuracy"][0] > 0.5 and curve["entropy"][1] > curve["entropy"][0]


def test_plots_write_pngs(tmp_path):
    """Every uncertainty plot renders a titled figure from the matching tool's output format;
    saved with the scripts' atomic writer, it is a PNG."""
    from pyro_bnn.analysis import uncertainty_plots as up
    from pyro_bnn.analysis.active import ActiveResult
    from pyro_bnn.reporting.output_files import save_figure

    curve = {"level": [0, 45, 90], "entropy": [0.1, 0.5, 0.9], "accuracy": [0.9, 0.5, 0.2]}
    runs = [ActiveResult("bald", [20, 30], [0.5, 0.6]), ActiveResult("bald", [20, 30], [0.55, 0.7])]
    ood = {"max_prob": {"auroc": 0.9}, "entropy": {"auroc": 0.8}}
    figs = {
        "prune.png": up.plot_pruning_curves({"snr": {"fraction": [0, 0.9], "accuracy": [0.9, 0.8]}}, baseline=0.9),
        "fgsm.png": up.plot_fgsm_curve({"mf": {"epsilon": [0, 0.1], "accuracy": [0.9, 0.3],
                                               "entropy": [0.1, 0.8], "mutual_information": [0, 0.1]}}),
        "active.png": up.plot_active_curves({"bald": runs}),
        "rot.png": up.plot_corruption_curves({"mf": curve}, key="entropy"),
        "ood.png": up.plot_ood_scores({"mf": ood}),
    }
    for fname, fig in figs.items():
        save_figure(fig, tmp_path / fname, dpi=120)
        assert (tmp_path / fname).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / fname).stat().st_size > 1000
        assert fig.axes[-1].get_title() and fig.axes[-1].get_xlabel() and fig.axes[-1].get_ylabel()
