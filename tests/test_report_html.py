"""The report's index.html, the ``bound`` columns, the OOD figure and the dataset options of ``pyro-bnn``."""

import html
import json
import math
import re
import warnings

import numpy as np
import pyro
import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.reporting import cli
from pyro_bnn.reporting.comparison import training_bound
from pyro_bnn.reporting.report import entropy_figure, write_report
from pyro_bnn.reporting.staged_folder import MARKER


@pytest.fixture(scope="module")
def split():
    d = pb.datasets.digits()
    return pb.datasets.DataSplit(d.x_train[:150], d.y_train[:150], d.x_test[:60], d.y_test[:60])


def _model():
    return pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)), "categorical")


@pytest.fixture(scope="module")
def comparison(split):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pb.compare(_model, ["meanfield", "symmetrized", "laplace"], split, epochs=2, lr=1e-2,
                          num_samples=8, loo_samples=16, progress=False, details=True)


def test_bound_is_what_each_guide_maximises(comparison, split):
    table = comparison.table
    assert {"bound", "bound_kind"} <= set(table.columns)
    assert table.loc["meanfield", "bound_kind"] == "elbo"
    assert table.loc["meanfield", "bound"] == table.loc["meanfield", "elbo"]
    assert table.loc["laplace", "bound_kind"] == "log_evidence"
    assert table.loc["laplace", "bound"] == table.loc["laplace", "log_evidence"]
    assert table.loc["symmetrized", "bound_kind"] == "symmetrized_elbo"
    # the symmetrised ELBO of the trained guide, not its base q's ELBO
    run = comparison.runs["symmetrized"]
    pyro.set_rng_seed(3)
    got = training_bound(run.model, run.guide, split, elbo=math.nan, log_evidence=math.nan, num_samples=4)
    pyro.set_rng_seed(3)
    want = pb.guides.symmetrized.symmetrized_elbo(run.model, run.guide, split.train, num_samples=4,
                                                  return_terms=True)
    assert got == {"bound": want["symmetrized_elbo"], "bound_kind": "symmetrized_elbo",
                   "bound_se": want["symmetrized_elbo_se"]}
    assert np.isfinite(table.loc["symmetrized", "bound"])
    assert table.loc["symmetrized", "bound"] != table.loc["symmetrized", "elbo"]


def test_bound_se_is_the_monte_carlo_error_of_each_bound(comparison):
    table = comparison.table
    # the ELBO row: sd / sqrt(S) of its DataTree's per-draw log p - log q
    stats = comparison.datatrees["meanfield"]["sample_stats"]
    per_draw = np.asarray(stats["lp"] - stats["log_q"], dtype=np.float64).ravel()
    assert table.loc["meanfield", "bound_se"] == pytest.approx(per_draw.std(ddof=1) / math.sqrt(per_draw.size),
                                                               rel=1e-9)
    assert table.loc["laplace", "bound_se"] != table.loc["laplace", "bound_se"]   # NaN: not Monte Carlo
    assert np.isfinite(table.loc["symmetrized", "bound_se"]) and table.loc["symmetrized", "bound_se"] > 0


def test_symmetrized_elbo_se_predicts_the_spread_of_its_estimates(comparison, split):
    # 30 seeded estimates from 4 draws each: their sd against the mean stated SE (sd of an sd
    # from 30 values ~13 %; with 4 draws each stated SE varies much more: tolerance factor 1.6)
    run = comparison.runs["symmetrized"]
    values, stated = [], []
    for seed in range(30):
        pyro.set_rng_seed(seed)
        terms = pb.guides.symmetrized.symmetrized_elbo(run.model, run.guide, split.train, num_samples=4,
                                                       return_terms=True)
        values.append(terms["symmetrized_elbo"])
        stated.append(terms["symmetrized_elbo_se"])
    ratio = np.std(values, ddof=1) / np.sqrt(np.mean(np.square(stated)))
    assert 1 / 1.6 < ratio < 1.6


def _images(page: str) -> list[str]:
    return re.findall(r"<img src='([^']+)'", page)


def test_index_html_shows_the_table_and_every_figure(comparison, tmp_path):
    out = tmp_path / "rep"
    written = write_report(comparison, out, num_samples=8)
    page = (out / "index.html").read_text()
    assert written["index_html"] == out / "index.html"
    images = _images(page)
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert sorted(images) == pngs and {"reliability.png", "entropy.png", "forest.png"} <= set(pngs)
    assert all((out / i).is_file() and "/" not in i for i in images)  # relative, in the folder
    for guide in comparison.table.index:
        assert f"<th scope='row'>{guide}</th>" in page
    assert page.count("<tr>") == 1 + len(comparison.table)
    for col in ("bound", "bound_kind", "accuracy", "elpd_loo"):
        assert f"<th>{col}</th>" in page
    assert html.escape(comparison.table.loc["meanfield", "configuration"]) in page
    assert not re.search(r"(src|href)=['\"]?(https?:|//)", page)  # no external resources
    marker = json.loads((out / MARKER).read_text())
    assert "index.html" in marker["files"]


def test_ood_sets_given_are_the_ones_scored(comparison, split, tmp_path):
    ood = {"flipped digits": split.x_test.flip(-1), "zeros": torch.zeros(30, 64)}
    write_report(comparison, tmp_path / "rep", num_samples=8, ood=ood)
    payload = json.loads((tmp_path / "rep" / "metrics.json").read_text())
    for guide in ("meanfield", "symmetrized", "laplace"):
        assert list(payload["ood_auroc_entropy"][guide]) == list(ood)
        assert all(0 <= v <= 1 for v in payload["ood_auroc_entropy"][guide].values())


def test_no_ood_set_skips_the_figure_with_a_note(comparison, tmp_path):
    note = "no OOD figure: the MNIST test digits were not found in /nowhere (pass --ood-root)"
    write_report(comparison, tmp_path / "rep", num_samples=8, ood={}, ood_note=note)
    out = tmp_path / "rep"
    assert not (out / "entropy.png").exists()
    page = (out / "index.html").read_text()
    assert html.escape(note) in page and "entropy.png" not in page
    assert json.loads((out / "metrics.json").read_text())["ood_note"] == note


def test_entropy_panels_carry_their_auroc_in_the_title():
    ent = {"a": {"test": np.zeros(5) + 0.1, "ood": np.zeros(5) + 2.0},   # separable: AUROC 1
           "b": {"test": np.full(5, 1.0), "ood": np.full(5, 1.0)}}        # ties: AUROC 0.5
    fig, aurocs = entropy_figure(ent, 10)
    titles = [ax.get_title() for ax in fig.axes]
    assert aurocs == {"a": {"ood": 1.0}, "b": {"ood": 0.5}}
    assert titles == ["a\nAUROC ood: 1.000", "b\nAUROC ood: 0.500"]


def test_lenet_has_the_stated_layers():
    net = cli.lenet()
    convs = [m for m in net if isinstance(m, nn.Conv2d)]
    fcs = [m for m in net if isinstance(m, nn.Linear)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [(1, 6, (5, 5)), (6, 16, (5, 5))]
    assert [(f.in_features, f.out_features) for f in fcs] == [(256, 120), (120, 84), (84, 10)]
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_fashion_mnist_mlp_is_784_200_200_10(split):
    args = cli.build_parser().parse_args(["--dataset", "fashion-mnist"])
    fake = pb.datasets.DataSplit(torch.zeros(4, 784), torch.zeros(4).long(), torch.zeros(2, 784),
                                 torch.zeros(2).long())
    net = cli._model_fn(args, fake)("meanfield")
    sizes = [(m.in_features, m.out_features) for m in net.modules() if isinstance(m, nn.Linear)]
    assert sizes == [(784, 200), (200, 200), (200, 10)]


def test_dataset_defaults_override_guide_defaults():
    for name, cfg in cli.DATASET_DEFAULTS["fashion-mnist"].items():
        merged = cli.guide_defaults("fashion-mnist", name)
        assert merged == {**cli.GUIDE_DEFAULTS[name], **cfg}
    assert cli.guide_defaults("digits", "meanfield") == cli.GUIDE_DEFAULTS["meanfield"]


def test_cnn_on_fashion_mnist_trains_meanfield_at_its_measured_lr():
    # ARCH_DEFAULTS goes over the dataset's defaults for that architecture only
    cnn = cli.guide_defaults("fashion-mnist", "meanfield", arch="cnn")
    mlp = cli.guide_defaults("fashion-mnist", "meanfield", arch="mlp")
    assert cnn == {**mlp, "lr": 1e-2} and "lr" not in mlp
    args = cli.build_parser().parse_args(["--dataset", "fashion-mnist", "--arch", "cnn"])
    epochs, lr, *_ = cli._settings(args, ["meanfield", "laplace_all"])
    assert lr["meanfield"] == 1e-2 and epochs["meanfield"] == mlp["epochs"]
    assert lr["laplace_all"] == cli.guide_defaults("fashion-mnist", "laplace_all")["lr"]
    args = cli.build_parser().parse_args(["--dataset", "fashion-mnist"])
    assert cli._settings(args, ["meanfield"])[1]["meanfield"] is None   # the MLP: the guide's own lr


def test_cnn_on_fashion_mnist_trains_symmetrized_at_the_library_rate_for_240_epochs():
    # the converged setting of the forty-first session: no pinned lr (the guide's own rate for
    # this net, a quarter of MeanField's rule for unnormalised convolutions), 240 epochs
    assert cli.guide_defaults("fashion-mnist", "symmetrized", arch="cnn") == {"epochs": 240}
    args = cli.build_parser().parse_args(["--dataset", "fashion-mnist", "--arch", "cnn"])
    epochs, lr, *_ = cli._settings(args, ["symmetrized"])
    assert epochs["symmetrized"] == 240 and lr["symmetrized"] is None
    model = pb.BNN(cli.lenet(), "categorical")
    assert pb.guides.Symmetrized(model).learning_rate(60_000) == pytest.approx(0.0051, abs=1e-4)


def test_fashion_mnist_laplace_all_is_online_marglik_with_layerwise_delta():
    # the "guide" key of a dataset's defaults reaches the guide's constructor (compare's
    # guide_options), the "fit" key pb.fit (marglik= for Immer et al.'s online schedule)
    args = cli.build_parser().parse_args(["--dataset", "fashion-mnist"])
    epochs, lr, fit_kw, predict, guide_kw = cli._settings(args, ["laplace_all", "meanfield"])
    assert guide_kw == {"laplace_all": {"prior_structure": "layerwise"}, "meanfield": {}}
    assert isinstance(fit_kw["laplace_all"]["marglik"], pb.MarglikOptions)
    assert lr["laplace_all"] == 1e-3 and lr["meanfield"] is None
    model = pb.BNN(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), "categorical")
    guide = pb.guides.registered_guides()["laplace_all"](model, **guide_kw["laplace_all"])
    assert guide.prior_structure == "layerwise" and guide.subset == "all"
    digits = cli.build_parser().parse_args([])
    assert cli._settings(digits, ["laplace_all"])[4] == {"laplace_all": {}}


def _no_training(*args, **kwargs):
    raise AssertionError("compare must not be called")


@pytest.mark.parametrize("make, words", [(False, "is not a folder"), (True, "not found")])
def test_missing_fashion_mnist_is_exit_2_before_training(make, words, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "compare", _no_training)
    root = tmp_path / "data"
    if make:
        root.mkdir()
    rc = cli.main(["--dataset", "fashion-mnist", "--data-root", str(root), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: Fashion-MNIST") and words in err
    assert not (tmp_path / "rep").exists() or not any((tmp_path / "rep").iterdir())


def test_cnn_on_digits_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "compare", _no_training)
    rc = cli.main(["--arch", "cnn", "--out", str(tmp_path / "rep")])
    assert rc == 2 and "--arch cnn needs 28x28 images" in capsys.readouterr().err


def test_a_training_bound_of_the_wrong_shape_is_named(comparison, split):
    run = comparison.runs["symmetrized"]

    class OldShape(type(run.guide)):
        def training_bound(self, model, data, *, num_samples=32):
            return -1.0, "symmetrized_elbo"                     # (value, kind): no standard error

    run.guide.__class__ = OldShape
    try:
        with pytest.raises(TypeError, match=r"OldShape.training_bound must return \(value, kind, standard_error\)"):
            training_bound(run.model, run.guide, split, elbo=math.nan, log_evidence=math.nan, num_samples=2)
    finally:
        run.guide.__class__ = OldShape.__mro__[1]
