"""The uncertainty tools' shared rules: seeding leaves the caller's random streams alone,
one ``predictive=`` keyword, inputs follow the model's device."""

import random

import numpy as np
import pyro
import pytest
import torch
from uncertainty_helpers import digits, mlp, trained

import pyro_bnn as pb
from pyro_bnn.analysis import active, adversarial, corruption, ood, pruning
from pyro_bnn.analysis.tool_support import seeded, to_model_device
from pyro_bnn.model.devices import module_device


def _streams():
    """The caller's random streams, as values that compare with ==."""
    state = pyro.util.get_rng_state()
    np_state = state["numpy"]
    return (state["torch"].tolist(), state["random"], (np_state[0], np_state[1].tolist(), *np_state[2:]))


def test_seeded_is_reproducible_and_restores_every_stream():
    pyro.set_rng_seed(123)
    before = _streams()
    with seeded(7):
        a = (torch.randn(3), random.random(), np.random.rand())
    assert _streams() == before
    with seeded(7):
        b = (torch.randn(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    # the caller's stream continues as if the block had not run
    expected = torch.randn(4)
    pyro.set_rng_seed(123)
    with seeded(7):
        torch.randn(100)
    torch.testing.assert_close(torch.randn(4), expected, rtol=0, atol=0)
    # restored even if the block raises
    with pytest.raises(RuntimeError), seeded(1):
        torch.randn(5)
        raise RuntimeError
    pyro.set_rng_seed(123)
    torch.testing.assert_close(torch.randn(4), expected, rtol=0, atol=0)


def test_seeded_none_uses_the_callers_stream_and_bad_seeds():
    pyro.set_rng_seed(3)
    with seeded(None):
        a = torch.randn(2)
    pyro.set_rng_seed(3)
    torch.testing.assert_close(a, torch.randn(2), rtol=0, atol=0)
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="seed must be a non-negative int"), seeded(bad):
            pass


def _tool_calls():
    """name -> call(seed) of every seeded tool on small trained digits models."""
    d = digits()
    x, y = d.x_test[:60], d.y_test[:60]
    model, guide = trained("meanfield")
    hyper = trained("hypernet")          # sample-based moments: the scores draw too

    def tiny_active(seed):
        return active.run(lambda: pb.BNN(mlp(), "categorical"), pb.guides.MeanField,
                          (d.x_train[:120], d.y_train[:120]), (x, y), initial=10, per_round=5, rounds=1,
                          epochs=1, num_samples=2, eval_num_samples=2, seed=seed).accuracy

    return {
        "pruning_curve": lambda s: pruning.pruning_curve(model, guide, x, y, fractions=[0.0, 0.5], num_samples=3,
                                                         seed=s)["accuracy"],
        "pruning_scores_sampled": lambda s: pruning.scores(hyper[1], kind="snr", model=hyper[0], num_samples=5, seed=s),
        "export_pruned_sampled": lambda s: list(pruning.export_pruned(*hyper, num_samples=5,
                                                                      seed=s).parameters()),
        "ood_evaluate": lambda s: ood.evaluate(model, guide, x[:30], x[30:], num_samples=3, seed=s),
        "fgsm": lambda s: adversarial.fgsm(model, guide, x, y, epsilon=0.1, num_samples=2, seed=s),
        "fgsm_curve": lambda s: adversarial.fgsm_curve(model, guide, x, y, epsilons=[0.0, 0.1], eval_num_samples=2,
                                                       seed=s),
        "rotation_curve": lambda s: corruption.rotation_curve(model, guide, x, y, angles=[0, 45], num_samples=2,
                                                              seed=s),
        "noise_curve": lambda s: corruption.noise_curve(model, guide, x, y, stds=[0.0, 0.5], num_samples=2,
                                                        seed=s),
        "active_run": tiny_active,
    }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


TOOLS = ["pruning_curve", "pruning_scores_sampled", "export_pruned_sampled", "ood_evaluate", "fgsm",
         "fgsm_curve", "rotation_curve", "noise_curve", "active_run"]


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_with_seed_leave_the_callers_streams_unchanged(tool):
    calls = _tool_calls()
    assert sorted(calls) == sorted(TOOLS)
    call = calls[tool]
    pyro.set_rng_seed(2024)
    before = _streams()
    first = call(5)
    assert _streams() == before, f"{tool}(seed=5) changed the caller's random streams"
    second = call(5)
    assert _same(first, second), f"{tool}(seed=5) is not reproducible"


def test_pruning_curve_predictive_keyword():
    model, guide = trained("meanfield")
    d = digits()
    x, y = d.x_test[:80], d.y_test[:80]
    curve = pruning.pruning_curve(model, guide, x, y, fractions=[0.0, 0.9], predictive="mean")
    assert curve["fraction"] == [0.0, 0.9] and len(curve["accuracy"]) == 2
    with pytest.raises(TypeError, match="method"):                  # the old name is gone
        pruning.pruning_curve(model, guide, x, y, fractions=[0.0], method="mean")
    with pytest.raises(ValueError, match="masks one set of posterior draws at every fraction"):
        pruning.pruning_curve(model, guide, x, y, fractions=[0.0], predictive="glm")


def test_model_device_and_moves():
    model, guide = trained("meanfield")
    assert module_device(model, guide) == torch.device("cpu")
    assert module_device(object()) == torch.device("cpu")                # no parameters: the default
    x = torch.zeros(2, 64)
    assert to_model_device(model, guide, x) is x                        # already there: no copy
    a, b = to_model_device(model, guide, x, None)
    assert a is x and b is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tools_move_cpu_inputs_to_a_cuda_model():
    d = digits()
    x, y = d.x_train[:200], d.y_train[:200]
    model = pb.BNN(mlp(), "categorical").to("cuda")
    guide = pb.guides.MeanField(model)
    pb.fit(model, guide, (x, y), epochs=2, device="cuda", progress=False, seed=0)
    xt, yt = d.x_test[:50], d.y_test[:50]                                 # CPU tensors
    assert len(pruning.pruning_curve(model, guide, xt, yt, fractions=[0.0, 0.5], num_samples=2)["accuracy"]) == 2
    assert pruning.pruning_curve(model, guide, xt, yt, fractions=[0.5], predictive="mean")["accuracy"][0] >= 0
    assert ood.evaluate(model, guide, xt[:25], xt[25:], num_samples=2)["entropy"]["auroc"] >= 0
    assert adversarial.fgsm(model, guide, xt, yt, epsilon=0.1).device.type == "cuda"
    assert len(adversarial.fgsm_curve(model, guide, xt, yt, epsilons=[0.0, 0.1], eval_num_samples=2)["accuracy"]) == 2
    assert len(corruption.rotation_curve(model, guide, xt, yt, angles=[0, 90], num_samples=2)["entropy"]) == 2
    assert len(corruption.noise_curve(model, guide, xt, yt, stds=[0.0, 0.3], num_samples=2)["entropy"]) == 2
