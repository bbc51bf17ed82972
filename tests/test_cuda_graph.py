"""``pb.fit(cuda_graph=True)``: the training step captured in a CUDA graph and replayed.

Without a GPU only the argument checks run; on CUDA every guide of the contract tests trains
through the graph, and the fit is compared with the same eager fit on the same device.
"""

import math
import warnings

import pytest
import torch
from helpers import mlp
from test_guide_contract import ALL_GUIDES, PYRO_GUIDES, _bnn, _make

import pyro_bnn as pb
from pyro_bnn import CudaGraphFallbackWarning
from pyro_bnn.training.cuda_graph import WARMUP_STEPS, _root_cause, check_cuda_graph_fit

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _digits(n=300):
    d = pb.datasets.digits()
    return d.x_train[:n], d.y_train[:n]


# ---------------------------------------------------------------- arguments (any machine)
def test_cuda_graph_on_the_cpu_is_an_error_before_anything_changes():
    """Refused before the guide's fit-start hook (which gives every site its own prior module
    with ``learn_prior_scale``)."""
    model = _bnn()
    guide = pb.guides.MeanField(model, learn_prior_scale=True)
    priors = dict(model.priors)   # the prior modules (the hook would replace them)
    with pytest.raises(ValueError, match=r"cuda_graph=True needs a CUDA fit.*trains on cpu"):
        pb.fit(model, guide, _digits(64), epochs=1, device="cpu", progress=False, cuda_graph=True)
    assert all(model.priors[key] is prior for key, prior in priors.items())


def test_cuda_graph_argument_checks():
    model = _bnn()
    guide = pb.guides.MeanField(model)
    with pytest.raises(TypeError, match="cuda_graph"):
        pb.fit(model, guide, _digits(64), epochs=1, progress=False, cuda_graph="yes")
    with pytest.raises(ValueError, match="cuda_graph=True and compile=True"):
        pb.fit(model, guide, _digits(64), epochs=1, progress=False, cuda_graph=True, compile=True)
    with pytest.raises(NotImplementedError, match="cuda_graph=True is not supported with distributed"):
        pb.fit(model, guide, _digits(64), epochs=1, progress=False, cuda_graph=True, distributed=True)


def test_a_non_fused_optimiser_is_named():
    """The replayed step needs the guard's device-side checks, which need a fused optimiser."""
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"fused kernel.*got SGD with fused=\[False\]"):
        check_cuda_graph_fit(torch.device("cuda"), False, torch.optim.SGD([p], lr=0.1, fused=False))


def test_the_fallback_names_the_first_error_and_where():
    """A capture that fails ends with torch's "capture invalidated" error; the warning names the
    error that caused it and the innermost frame outside torch (here, this test's function)."""
    def step():
        raise RuntimeError("operation not permitted when stream is capturing")
    try:
        try:
            step()
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904 -- as torch chains it
    except RuntimeError as exc:
        reason = _root_cause(exc)
    assert reason.startswith("RuntimeError: operation not permitted when stream is capturing in ")
    assert reason.endswith("(step)") and "test_cuda_graph.py" in reason


def test_without_cuda_graph_no_step_is_replayed():
    model = _bnn()
    res = pb.fit(model, pb.guides.MeanField(model), _digits(64), epochs=1, progress=False)
    assert res.graph_steps == 0


# ---------------------------------------------------------------- CUDA
def _fit(name, cuda_graph, epochs=4, model_fn=_bnn, guide_fn=None, data=None, fallback_ok=False, **kw):
    model = model_fn()
    guide = _make(name, model) if guide_fn is None else guide_fn(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        if not fallback_ok:
            warnings.simplefilter("error", CudaGraphFallbackWarning)
        res = pb.fit(model, guide, _digits() if data is None else data, epochs=epochs, lr=1e-2, device="cuda",
                     progress=False, seed=0, cuda_graph=cuda_graph, **kw)
    return res, {**model.state_dict(), **(guide.state_dict() if isinstance(guide, torch.nn.Module) else {})}


def _steps(n=300, batch_size=64, epochs=4):
    """Graph steps of a fit: per epoch all full batches but the first (read at once, except in
    epoch 1) and the warm-up, none of the partial last batch."""
    full = n // batch_size
    return epochs * full - (epochs - 1) - WARMUP_STEPS


def _assert_same_fit(graphed, eager, rtol=1e-5):
    (g, g_state), (e, e_state) = graphed, eager
    torch.testing.assert_close(torch.tensor(g.history["loss"]), torch.tensor(e.history["loss"]), rtol=rtol, atol=0)
    for key, value in e_state.items():
        if value.is_floating_point():
            torch.testing.assert_close(g_state[key], value, rtol=1e-3, atol=1e-4, msg=key)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", sorted(set(ALL_GUIDES) - set(PYRO_GUIDES)))
def test_every_guide_trains_through_the_graph(name):
    """Every pyro_bnn guide's step is captured (no fallback), replayed for the steps it should
    be, and the fit is the eager fit: the same random draws (the graph advances the generator
    as the eager kernels do), the same kernels, so the losses agree to float32 rounding."""
    graphed = _fit(name, True)
    eager = _fit(name, False)
    assert graphed[0].graph_steps == _steps()
    assert eager[0].graph_steps == 0
    _assert_same_fit(graphed, eager)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", sorted(PYRO_GUIDES))
def test_pyro_autoguides_fall_back_under_trace_elbo(name):
    """Pyro's ``Trace_ELBO`` reads every site's log-density into Python (``torch_item``), so a
    Pyro autoguide's step cannot be captured: the fit says so once (without a capture attempt:
    the objective declares it), trains eagerly, and its result is the eager fit's bit for bit."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = _fit(name, True, fallback_ok=True)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, CudaGraphFallbackWarning)]
    assert len(fallbacks) == 1 and "a Pyro ELBO reads" in fallbacks[0], fallbacks
    eager = _fit(name, False)
    assert graphed[0].graph_steps == 0
    assert graphed[0].history["loss"] == eager[0].history["loss"]


@pytest.mark.cuda
@cuda
def test_weight_noise_kl_annealing_and_cosine_schedule():
    """Python settings that change between epochs (a KL-annealing weight) and a learning rate
    that changes at every step (the cosine schedule) reach the replayed step: the graph is
    captured afresh each epoch and the rate is a tensor filled before each replay."""
    def guide_fn(model):
        return pb.guides.MeanField(model, local_reparameterization=False, kl_annealing=3)
    graphed = _fit("MeanField", True, guide_fn=guide_fn, lr_schedule="cosine")
    eager = _fit("MeanField", False, guide_fn=guide_fn, lr_schedule="cosine")
    assert graphed[0].graph_steps == _steps()
    _assert_same_fit(graphed, eager)


def _poisoned_fit(x, y, cuda_graph):
    """A fit whose objective is NaN on the batch holding an input of 1e4, from epoch 2 on (the
    epoch is a Python number the objective reads: frozen in each epoch's capture)."""
    torch.manual_seed(0)
    model = pb.BNN(mlp(64, 16, 10))
    guide = pb.guides.MeanField(model)
    inner = guide.make_objective()
    epoch = {"n": 0}

    def objective(model, guide, xb, yb, num_data=None):
        loss = inner(model, guide, xb, yb, num_data)
        poison = torch.where(xb.abs().amax() > 1e3, math.nan, 1.0) if epoch["n"] >= 2 else 1.0
        return loss * poison

    hook = guide.on_epoch_start

    def on_epoch_start(ctx):
        epoch["n"] = ctx.epoch
        hook(ctx)
    guide.on_epoch_start = on_epoch_start
    with pytest.raises(FloatingPointError, match=r"the loss became nan in epoch 2 \(step 3\).*end of epoch 1"):
        pb.fit(model, guide, (x, y), epochs=3, lr=1e-2, seed=0, objective=objective, progress=False,
               shuffle=False, device="cuda", cuda_graph=cuda_graph)
    return {**model.state_dict(), **guide.state_dict()}


@pytest.mark.cuda
@cuda
def test_a_non_finite_step_in_the_graph_is_caught_and_named():
    """A NaN loss in a replayed step (epoch 2, step 3): the fused step skips its update, the
    error names that step, and the state restored is the end of epoch 1 — as eagerly."""
    x, y = _digits(256)
    x = x.clone()
    x[64 * 2 + 5] = 1e4     # a finite input that the objective below turns into a NaN loss
    outcomes = [_poisoned_fit(x, y, cuda_graph) for cuda_graph in (True, False)]
    for key, value in outcomes[1].items():
        torch.testing.assert_close(outcomes[0][key], value, rtol=1e-3, atol=1e-4)


@pytest.mark.cuda
@cuda
def test_a_step_that_cannot_be_captured_falls_back_and_says_so():
    """An objective that reads a tensor into Python cannot be captured: the fit warns and
    trains eagerly, and its result is the eager fit's."""
    def objective(model, guide, xb, yb, num_data=None):
        loss = guide.make_objective()(model, guide, xb, yb, num_data)
        if float(loss) > 1e30:    # a synchronisation: refused inside a capture
            raise AssertionError
        return loss

    results = []
    for cuda_graph in (True, False):
        model = _bnn()
        guide = pb.guides.MeanField(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = pb.fit(model, guide, _digits(), epochs=2, lr=1e-2, seed=0, objective=objective, progress=False,
                         device="cuda", cuda_graph=cuda_graph)
        fallbacks = [w for w in caught if issubclass(w.category, CudaGraphFallbackWarning)]
        assert len(fallbacks) == (1 if cuda_graph else 0)
        assert res.graph_steps == 0
        results.append(res.history["loss"])
    assert results[0] == results[1]


@pytest.mark.cuda
@cuda
def test_predictive_and_param_store_after_a_graphed_fit():
    """What a Pyro user does after training: ``Predictive`` and the param store see the
    trained values (the graph updated the parameters in place)."""
    import pyro
    from pyro.infer import Predictive

    x, y = _digits()
    accuracy = {}
    for cuda_graph in (False, True):
        model = _bnn()
        guide = pb.guides.MeanField(model)
        res = pb.fit(model, guide, (x, y), epochs=20, lr=1e-2, seed=0, device="cuda", progress=False,
                     cuda_graph=cuda_graph)
        assert (res.graph_steps > 0) == cuda_graph
        accuracy[cuda_graph] = pb.evaluate(model, guide, x[:100], y[:100], num_samples=16)["accuracy"]
    assert accuracy[True] > 0.8 and abs(accuracy[True] - accuracy[False]) <= 0.03, accuracy
    draws = Predictive(model, guide=guide, num_samples=4, return_sites=["_RETURN"])(x[:10].cuda())
    assert draws["_RETURN"].is_cuda
    names = list(pyro.get_param_store().keys())
    assert names, "the trained guide's parameters are in the param store"
