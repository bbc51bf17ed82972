"""``pb.predictive_samples`` and the ``pb.analysis`` tools on a ``DataLoader`` of test inputs.

As for ``pb.evaluate`` (``tests/test_loader_evaluate.py``): the loader is read once
(:func:`pyro_bnn.data.prediction_data.read_loader`), each batch checked, and the tool runs on
the gathered tensors, so the same seed gives the same numbers bit for bit.  The attacks that
return the perturbed inputs (``fgsm``) and the active-learning pool (indexed per round) take
tensors only and say so.
"""

import warnings

import pyro
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyro_bnn as pb
from pyro_bnn.analysis import active, adversarial, corruption, ood, pruning


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))


@pytest.fixture(scope="module")
def digits():
    d = pb.datasets.digits()
    return d.x_train[:300], d.y_train[:300], d.x_test[:120], d.y_test[:120]


@pytest.fixture(scope="module")
def trained(digits):
    x, y, _, _ = digits
    model = pb.BNN(_net(), "categorical")
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        pb.fit(model, guide, (x, y), epochs=3, progress=False, seed=0)
    return model, guide


def _pairs(xt, yt, batch_size=37, **kw):
    return DataLoader(TensorDataset(xt, yt), batch_size=batch_size, **kw)


def _tools(model, guide):
    """Every tool that scores a labelled test set, as ``call(x, y)``: ``y=None`` with a loader."""
    return {
        "pruning_curve": lambda x, y=None: pruning.pruning_curve(model, guide, x, y, fractions=[0.0, 0.5],
                                                                 num_samples=3, seed=1),
        "fgsm_curve": lambda x, y=None: adversarial.fgsm_curve(model, guide, x, y, epsilons=[0.0, 0.1],
                                                               eval_num_samples=3, seed=1),
        "rotation_curve": lambda x, y=None: corruption.rotation_curve(model, guide, x, y, angles=[0, 45],
                                                                      num_samples=3, seed=1),
        "noise_curve": lambda x, y=None: corruption.noise_curve(model, guide, x, y, stds=[0.0, 0.3],
                                                                num_samples=3, seed=1),
        "corruption_curve": lambda x, y=None: corruption.corruption_curve(
            model, guide, x, y, transform=corruption.rotate, levels=[0, 90], num_samples=3, seed=1),
    }


TOOLS = ["pruning_curve", "fgsm_curve", "rotation_curve", "noise_curve", "corruption_curve"]


@pytest.mark.parametrize("tool", TOOLS)
def test_a_loader_gives_the_tensors_curve(trained, digits, tool):
    model, guide = trained
    _, _, xt, yt = digits
    call = _tools(model, guide)[tool]
    ref = call(xt, yt)
    got = call(_pairs(xt, yt))
    assert got == ref
    assert "accuracy" in ref and max(ref["accuracy"]) > 0.5    # a trained model's curve, scored on labels


@pytest.mark.parametrize("tool", ["pruning_curve", "fgsm_curve", "rotation_curve"])
def test_a_shuffled_loader_gives_the_same_curve_up_to_rounding(trained, digits, tool):
    model, guide = trained
    _, _, xt, yt = digits
    call = _tools(model, guide)[tool]
    ref = call(xt, yt)
    shuffled = _pairs(xt, yt, shuffle=True, generator=torch.Generator().manual_seed(3))
    got = call(shuffled)
    assert set(got) == set(ref)
    for key, values in ref.items():
        assert got[key] == (values if isinstance(values, str) else pytest.approx(values, abs=1e-5)), key


def test_noise_curve_of_a_shuffled_loader_puts_the_pattern_on_other_examples(trained, digits):
    """Documented: the fixed noise pattern follows the row, so a shuffled pass is another draw."""
    model, guide = trained
    _, _, xt, yt = digits
    shuffled = _pairs(xt, yt, shuffle=True, generator=torch.Generator().manual_seed(3))
    got = corruption.noise_curve(model, guide, shuffled, stds=[0.0, 0.8], num_samples=3, seed=1)
    shuffled.generator.manual_seed(3)
    xs, ys = (torch.cat(t) for t in zip(*shuffled, strict=True))
    assert got == corruption.noise_curve(model, guide, xs, ys, stds=[0.0, 0.8], num_samples=3, seed=1)
    ref = corruption.noise_curve(model, guide, xt, yt, stds=[0.0, 0.8], num_samples=3, seed=1)
    assert got["entropy"][0] == pytest.approx(ref["entropy"][0], abs=1e-5)   # no noise: order-free
    assert got["entropy"][1] != ref["entropy"][1]                             # noise on other rows


def test_corruption_curves_read_targets_where_the_batches_hold_them(trained, digits):
    model, guide = trained
    _, _, xt, yt = digits
    ref = corruption.rotation_curve(model, guide, xt, angles=[0, 30], num_samples=2)
    for loader in (DataLoader(xt, batch_size=50), DataLoader(TensorDataset(xt), batch_size=50)):
        got = corruption.rotation_curve(model, guide, loader, angles=[0, 30], num_samples=2)
        assert got == ref and "accuracy" not in got

    class _SomeLabelled(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return (xt[i], int(yt[i])) if i < 10 else (xt[i],)
    with pytest.raises(ValueError, match=r"batch 2 of the DataLoader given to pb.analysis.corruption.rotation_curve "
                                         r"holds no targets but batch 1 did"):
        corruption.rotation_curve(model, guide, DataLoader(_SomeLabelled(), batch_size=10), angles=[0])


@pytest.fixture(scope="module")
def laplace(digits):
    """A MAP network (plain torch training) and its Laplace posterior: the tools' GLM path."""
    x, y, _, _ = digits
    net = _net()
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-2)
    for _ in range(100):
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    model = pb.BNN(net, "categorical")
    return model, pb.guides.Laplace(model).fit_curvature((x, y))


def test_the_glm_predictive_of_a_loader_gives_the_tensors_numbers(laplace, digits):
    """The tools' own predictive (``guide.predict``) on the gathered tensors, checked once:
    the same numbers, and one pixel warning for the corruption curve where each level's
    prediction used to check (and warn about) the inputs again."""
    model, guide = laplace
    _, _, xt, yt = digits
    curve = dict(transform=corruption.rotate, levels=[0, 90], num_samples=4, seed=1, predictive="glm")
    assert corruption.corruption_curve(model, guide, _pairs(xt, yt), **curve) == \
        corruption.corruption_curve(model, guide, xt, yt, **curve)
    ref = ood.evaluate(model, guide, xt[:60], xt[60:].flip(-1), num_samples=4, predictive="glm")
    assert ood.evaluate(model, guide, DataLoader(xt[:60], batch_size=16), xt[60:].flip(-1), num_samples=4,
                        predictive="glm") == ref
    with pytest.warns(pb.UnscaledPixelsWarning) as rec:
        corruption.corruption_curve(model, guide, torch.round(xt * 255), yt, **curve)
    assert sum(w.category is pb.UnscaledPixelsWarning for w in rec) == 1


def test_ood_on_loaders_gives_the_tensors_scores(trained, digits):
    model, guide = trained
    _, _, xt, _ = digits
    in_x, out_x = xt[:60], xt[60:].flip(-1)
    ref = ood.evaluate(model, guide, in_x, out_x, num_samples=8, seed=2)
    assert ref["entropy"]["auroc"] > 0.5
    for a, b in [(DataLoader(in_x, batch_size=25), DataLoader(TensorDataset(out_x), batch_size=7)),
                 (in_x, DataLoader(out_x, batch_size=16)), (DataLoader(in_x, batch_size=60), out_x)]:
        assert ood.evaluate(model, guide, a, b, num_samples=8, seed=2) == ref
    shuffled = DataLoader(out_x, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    got = ood.evaluate(model, guide, in_x, shuffled, num_samples=8, seed=2)
    pair = 1 / (60 * 60)      # the AUROC moves by this when two scores equal up to rounding swap their order
    for score, values in ref.items():              # the scores are per input: their order does not enter
        assert got[score]["mean_in"] == pytest.approx(values["mean_in"], abs=1e-6), score
        assert got[score]["mean_out"] == pytest.approx(values["mean_out"], abs=1e-6), score
        assert got[score]["auroc"] == pytest.approx(values["auroc"], abs=2 * pair), score


def test_predictive_samples_of_a_loader_are_the_tensors_in_the_loaders_order(trained, digits):
    model, guide = trained
    _, _, xt, yt = digits

    def seeded(x):
        pyro.set_rng_seed(4)
        return pb.predictive_samples(model, guide, x, num_samples=4, batch_size=50)
    ref = seeded(xt)
    for loader in (DataLoader(xt, batch_size=37), _pairs(xt, yt)):
        got = seeded(loader)
        assert got.kind == ref.kind == "categorical" and torch.equal(got.probs, ref.probs)
    shuffled = DataLoader(xt, batch_size=37, shuffle=True, generator=torch.Generator().manual_seed(5))
    got = seeded(shuffled)
    shuffled.generator.manual_seed(5)
    order = torch.cat(list(shuffled))
    assert not torch.equal(order, xt) and torch.equal(got.probs, seeded(order).probs)


def test_active_learning_scores_a_test_loader_as_its_tensors(digits):
    x, y, xt, yt = digits
    options = dict(initial=10, per_round=5, rounds=1, epochs=2, num_samples=2, eval_num_samples=2, seed=0)

    def run(test):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pb.ConvergenceWarning)
            return active.run(lambda: pb.BNN(_net(), "categorical"), pb.guides.MeanField, (x[:60], y[:60]),
                              test, **options)
    ref, got = run((xt, yt)), run(_pairs(xt, yt))
    assert got.accuracy == ref.accuracy and got.nll == ref.nll and got.acquired == ref.acquired
    assert len(ref.accuracy) == 2


def test_an_empty_loader_is_refused_by_every_tool(trained, digits):
    model, guide = trained
    _, _, xt, yt = digits
    empty = _pairs(xt[:0], yt[:0])
    for name, call in _tools(model, guide).items():
        with pytest.raises(ValueError, match=rf"the DataLoader given to pb.analysis.\w+.{name} is empty: it "
                                             r"yielded no batch \(0 examples, batch_size=37"):
            call(empty)
    with pytest.raises(ValueError, match=r"the DataLoader given to pb.analysis.ood.evaluate \(out_x\) is empty"):
        ood.evaluate(model, guide, xt, DataLoader(xt[:0], batch_size=4))
    with pytest.raises(ValueError, match=r"the DataLoader given to pb.predictive_samples is empty"):
        pb.predictive_samples(model, guide, DataLoader(xt[:0], batch_size=4))
    with pytest.raises(ValueError, match=r"the DataLoader given to pb.analysis.active.run \(test\) is empty"):
        active.run(lambda: pb.BNN(_net(), "categorical"), pb.guides.MeanField, (xt, yt), empty,
                   initial=10, rounds=0, epochs=1)


def test_wrong_types_name_what_was_expected_and_what_was_received(trained, digits):
    model, guide = trained
    _, _, xt, yt = digits
    dataset = TensorDataset(xt, yt)
    for name, call in _tools(model, guide).items():
        batches = "x or \\(x, y\\)" if name.endswith(("corruption_curve", "rotation_curve", "noise_curve")) else "\\(x, y\\)"
        with pytest.raises(TypeError, match=rf"x in pb.analysis.\w+.{name} must be a torch.Tensor or a DataLoader "
                                            rf"of {batches} batches, got TensorDataset \(a Dataset: pass DataLoader"):
            call(dataset)
    with pytest.raises(TypeError, match=r"x in pb.analysis.pruning.pruning_curve must be a torch.Tensor or a "
                                        r"DataLoader of \(x, y\) batches, got list"):
        pruning.pruning_curve(model, guide, list(xt), yt)
    with pytest.raises(TypeError, match=r"x in pb.predictive_samples must be a torch.Tensor or a DataLoader of x "
                                        r"or \(x, y\) batches, got tuple \(pass the inputs and the targets as two"):
        pb.predictive_samples(model, guide, (xt, yt))
    with pytest.raises(TypeError, match=r"out_x in pb.analysis.ood.evaluate must be a tensor of inputs \(N, \.\.\.\) "
                                        r"or a DataLoader of x or \(x, y\) batches, got ndarray"):
        ood.evaluate(model, guide, xt, xt.numpy())
    with pytest.raises(ValueError, match=r"pb.analysis.pruning.pruning_curve got a DataLoader and y= \(Tensor\)"):
        pruning.pruning_curve(model, guide, _pairs(xt, yt), yt)
    with pytest.raises(ValueError, match=r"batch 1 of the DataLoader given to pb.analysis.adversarial.fgsm_curve "
                                         r"holds no targets"):
        adversarial.fgsm_curve(model, guide, DataLoader(xt, batch_size=10))
    with pytest.raises(TypeError, match=r"test in pb.analysis.active.run must be a tuple \(x, y\) of tensors or a "
                                        r"DataLoader of \(x, y\) batches, got TensorDataset"):
        active.run(lambda: pb.BNN(_net(), "categorical"), pb.guides.MeanField, (xt, yt), dataset)
    with pytest.raises(TypeError, match=r"pool in pb.analysis.active.run must be a tuple \(x, y\) of tensors, got "
                                        r"a tuple of 1 \(Tensor\)"):
        active.run(lambda: pb.BNN(_net(), "categorical"), pb.guides.MeanField, (xt,), (xt, yt))


def test_the_attacks_that_return_inputs_refuse_a_loader(trained, digits):
    """``fgsm`` returns ``x_adv`` row by row with ``x``: a loader is refused with the way out."""
    model, guide = trained
    _, _, xt, yt = digits
    with pytest.raises(TypeError, match=r"x in pb.analysis.adversarial.fgsm must be a torch.Tensor, got DataLoader; "
                                        r"the attack returns the perturbed inputs paired row by row with x.*fgsm_curve"):
        adversarial.fgsm(model, guide, _pairs(xt, yt), yt, epsilon=0.1)
    with pytest.raises(TypeError, match=r"y in pb.analysis.adversarial.fgsm_from_latents must be a torch.Tensor, "
                                        r"got list$"):
        adversarial.fgsm_from_latents(model, [], xt, yt.tolist(), epsilon=0.1)
    with pytest.raises(TypeError, match=r"pool in pb.analysis.active.run must be a tuple \(x, y\) of tensors, got "
                                        r"DataLoader; the pool is indexed by the points each round labels"):
        active.run(lambda: pb.BNN(_net(), "categorical"), pb.guides.MeanField, _pairs(xt, yt), (xt, yt))


def test_unscaled_pixels_are_warned_once_per_set(trained, digits):
    """One look per data set given: a curve's loader once (not again as the tool predicts), and
    ood's two sets each once when they are loaders, once together when they are tensors."""
    model, guide = trained
    _, _, xt, yt = digits
    pixels = torch.round(xt * 255)
    calls = [(lambda: pruning.pruning_curve(model, guide, _pairs(pixels, yt), fractions=[0.0], num_samples=2), 1),
             (lambda: corruption.corruption_curve(model, guide, _pairs(pixels, yt), transform=corruption.rotate,
                                                  levels=[0, 90], num_samples=2), 1),
             (lambda: ood.evaluate(model, guide, pixels[:60], pixels[60:], num_samples=2), 1),
             (lambda: ood.evaluate(model, guide, DataLoader(pixels[:60], batch_size=30),
                                   DataLoader(pixels[60:], batch_size=30), num_samples=2), 2),
             (lambda: pb.predictive_samples(model, guide, DataLoader(pixels, batch_size=30), num_samples=2), 1)]
    for call, expected in calls:
        with pytest.warns(pb.UnscaledPixelsWarning) as rec:
            call()
        assert sum(w.category is pb.UnscaledPixelsWarning for w in rec) == expected
