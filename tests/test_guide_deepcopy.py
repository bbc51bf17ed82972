"""``copy.deepcopy`` and ``torch.save`` of a guide set up by a plain Pyro call.

Set up by ``guide(x, y)`` or ``svi.step`` (gradients on), a model with trainable deterministic
parameters (BatchNorm, weight norm) used to leave its output, with its autograd history, in
the guide's prototype trace, and ``deepcopy`` refused the guide ("Only Tensors created
explicitly by the user (graph leaves) support the deepcopy protocol").  The copy must work,
predict as the original does and train without touching the original.
"""

import copy
import io

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

import pyro_bnn as pb

GUIDES = ["MeanField", "Symmetrized", "Laplace", "Hypernet"]


def _data():
    torch.manual_seed(0)
    return torch.randn(32, 6), torch.randint(0, 3, (32,))


def _model(name, kind):
    """A BatchNorm (deterministic, trainable affine parameters) on the inputs, before a
    permutable hidden layer (for Symmetrized); the Hypernet's model has weight norm."""
    torch.manual_seed(1)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    if kind == "batchnorm":
        layers.insert(0, torch.nn.BatchNorm1d(6))
    return pb.BNN(torch.nn.Sequential(*layers), likelihood="categorical", weight_norm=name == "Hypernet")


CASES = [(name, "batchnorm") for name in GUIDES] + [("Hypernet", "plain")]


def _make(name, kind):
    model = _model(name, kind)
    return model, getattr(pb.guides, name)(model)


def _svi(model, guide):
    return SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())


def _values(*modules):
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}


def _has_graph(trace) -> bool:
    return any(isinstance(site.get("value"), torch.Tensor) and site["value"].grad_fn is not None
               for site in trace.nodes.values())


@pytest.mark.parametrize("name, kind", CASES)
def test_deepcopy_after_plain_call(name, kind):
    x, y = _data()
    model, guide = _make(name, kind)
    guide(x, y)   # set up by a plain call, with gradients on
    # the set-up keeps no graph (it held the call's forward graph, which deepcopy refused)
    assert not _has_graph(guide.prototype_trace)
    assert all(p.requires_grad for p in guide.parameters())
    copied = copy.deepcopy(guide)
    torch.save(guide, io.BytesIO())
    assert list(copied.prototype_trace.nodes) == list(guide.prototype_trace.nodes)
    for site, node in guide.prototype_trace.nodes.items():
        if isinstance(node.get("value"), torch.Tensor):
            torch.testing.assert_close(copied.prototype_trace.nodes[site]["value"], node["value"])


def _predict(model, guide, x):
    pyro.set_rng_seed(7)
    return pb.predict(model, guide, x, num_samples=4)


@pytest.mark.parametrize("name, kind", CASES)
def test_copy_after_svi_step_predicts_alike_and_trains_alone(name, kind):
    x, y = _data()
    model, guide = _make(name, kind)
    _svi(model, guide).step(x, y)
    model2, guide2 = copy.deepcopy((model, guide))
    model3, guide3 = copy.deepcopy((model, guide))
    assert guide2.approximated_model() is model2

    before = _values(model, guide)
    svi = _svi(model3, guide3)
    for _ in range(3):
        svi.step(x, y)
    after = _values(model, guide)
    assert before.keys() == after.keys()
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=f"the original's {key} moved")
    trained = _values(model3, guide3)
    assert any(not torch.equal(trained[key], before[key]) for key in before)  # the copy did train

    if name == "Laplace":   # its predictive (GLM) needs the curvature, on both alike
        guide.fit_curvature((x, y))
        guide2.fit_curvature((x, y))
    torch.testing.assert_close(_predict(model2, guide2, x), _predict(model, guide, x), rtol=0, atol=0)
