"""``pb.fit(compile=True)``: the same objective compiled, a fallback that changes nothing."""

import shutil
import warnings

import pytest
import torch

import pyro_bnn as pb


def _fit(data, *, compile, epochs=2, objective=None, device="cpu"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    model = pb.BNN(net, "categorical")
    guide = pb.guides.MeanField(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        res = pb.fit(model, guide, data, epochs=epochs, batch_size=100, seed=0, progress=False,
                     compile=compile, objective=objective, device=device)
    return res, {**model.state_dict(), **guide.state_dict()}


def _check_compiled_matches_eager(data, device):
    eager, eager_state = _fit(data, compile=False, device=device)
    with warnings.catch_warnings():
        # Dynamo's own tracing warnings (raised as errors under this suite's filters) are not
        # the fit's; a fallback is a failure here
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)   # torch's own (torch 2.11: jit.script_method)
        warnings.simplefilter("error", pb.CompileFallbackWarning)
        compiled, compiled_state = _fit(data, compile=True, device=device)
    assert compiled.compiled and not eager.compiled
    torch.testing.assert_close(torch.tensor(compiled.history["loss"]), torch.tensor(eager.history["loss"]),
                               rtol=1e-5, atol=0)
    for name, value in eager_state.items():
        torch.testing.assert_close(compiled_state[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compiled_fit_matches_eager(digits_small):
    """Compiled (Inductor with the eager random streams), the fit draws the same noise and
    its losses and parameters agree with the eager fit's to float32 rounding."""
    _check_compiled_matches_eager(digits_small[:2], "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_fit_matches_eager_cuda(digits_small):
    _check_compiled_matches_eager(digits_small[:2], "cuda")


def _failing_compile(draw_first):
    """A stand-in for ``torch.compile`` whose compiled call fails (after drawing noise, as a
    half-run compiled objective would)."""
    def fake_compile(module, **kwargs):
        def compiled(*args):
            if draw_first:
                torch.randn(1000)
            raise RuntimeError("backend compiler failed: fake")
        return compiled
    return fake_compile


@pytest.mark.parametrize("draw_first", [False, True])
def test_failed_compiled_call_falls_back_bit_identically(digits_small, monkeypatch, draw_first):
    data = digits_small[:2]
    eager, eager_state = _fit(data, compile=False)
    monkeypatch.setattr(torch, "compile", _failing_compile(draw_first))
    with pytest.warns(pb.CompileFallbackWarning, match="compiled objective failed.*fake"):
        fallen, fallen_state = _fit(data, compile=True)
    assert not fallen.compiled
    assert fallen.history["loss"] == eager.history["loss"]   # the random streams were put back
    for name, value in eager_state.items():
        assert torch.equal(fallen_state[name], value), name


def test_unavailable_compile_falls_back(digits_small, monkeypatch):
    def unavailable(module, **kwargs):
        raise RuntimeError("torch.compile is not supported on this Python")
    data = digits_small[:2]
    eager, _ = _fit(data, compile=False, epochs=1)
    monkeypatch.setattr(torch, "compile", unavailable)
    with pytest.warns(pb.CompileFallbackWarning, match="unavailable here.*not supported on this Python"):
        fallen, _ = _fit(data, compile=True, epochs=1)
    assert not fallen.compiled and fallen.history["loss"] == eager.history["loss"]


class _UserBug(Exception):
    pass


def test_an_error_of_the_eager_objective_is_raised_not_absorbed(digits_small, monkeypatch):
    def objective(model, guide, x, y, num_data):
        raise _UserBug("the user's objective is wrong")
    monkeypatch.setattr(torch, "compile", _failing_compile(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", pb.CompileFallbackWarning)   # no fallback is announced
        with pytest.raises(_UserBug, match="objective is wrong"):
            _fit(digits_small[:2], compile=True, objective=objective)


def test_compile_argument_checks(digits_small):
    with pytest.raises(TypeError, match="compile"):
        _fit(digits_small[:2], compile="yes")
    model = pb.BNN(torch.nn.Linear(64, 10), "categorical")
    with pytest.raises(NotImplementedError, match="compile=True is not supported with distributed"):
        pb.fit(model, pb.guides.MeanField(model), digits_small[:2], compile=True, distributed=True)
