"""The divergence guard with its step checks on the device (``deferred``; CUDA with a fused
Adam in real fits), forced on the CPU here: the same fits bit for bit, the same failures with
the same messages and restored states, and no flag left on the optimiser.

The divergence-guard tests of ``test_training_reliability.py`` run again in this module with
the deferral forced (imported below)."""

import warnings

import pytest
import torch
from helpers import mlp
from test_training_reliability import (  # noqa: F401 -- fixtures and tests run again, deferred
    _meanfield,
    _no_convergence_warnings,
    _objective_with,
    data,
    test_gradient_whose_square_overflows_is_caught,
    test_hypernet_lr100_stops_finite,
    test_meanfield_lr100_restores_a_state_whose_loss_is_finite,
    test_nan_gradient_at_last_step_is_caught,
    test_non_finite_parameter_from_an_epoch_hook,
)

import pyro_bnn as pb
from pyro_bnn.training import divergence, loop
from pyro_bnn.training.optimizer import default_optimizer


def _fusable(optimizer, device, distributed=None):
    """``can_defer_checks`` without its CUDA condition."""
    return (distributed is None and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in optimizer.param_groups))


#: the tests here that exercise the guard or the predicate directly, without a fit
_WITHOUT_FIT = {"test_can_defer_only_on_cuda_with_a_fused_optimiser", "test_the_optimiser_skips_while_the_flag_is_set"}


@pytest.fixture(autouse=True)
def _deferred(monkeypatch, request):
    used = []
    monkeypatch.setattr(loop, "defer_step_checks", lambda *a: used.append(_fusable(*a)) or used[-1])
    yield used
    if request.node.originalname not in _WITHOUT_FIT:
        assert any(used), "no fit in this test deferred its checks"


def test_can_defer_only_on_cuda_with_a_fused_optimiser():
    p = torch.nn.Parameter(torch.zeros(3))
    fused = torch.optim.Adam([p], fused=True)
    assert not divergence.can_defer_checks(fused, torch.device("cpu"))
    assert divergence.can_defer_checks(fused, torch.device("cuda"))
    assert not divergence.can_defer_checks(fused, torch.device("cuda"), distributed=object())
    assert not divergence.can_defer_checks(torch.optim.Adam([p]), torch.device("cuda"))
    assert not divergence.can_defer_checks(torch.optim.SGD([p], lr=0.1), torch.device("cuda"))


def _fit_states(monkeypatch, deferred, tmp_path, device="cpu", **kw):
    if not deferred:
        monkeypatch.setattr(loop, "defer_step_checks", lambda *a: False)
    model, guide = _meanfield(seed=3)
    d = pb.datasets.digits()
    optimizers = []

    def optimizer(params):
        optimizers.append(default_optimizer(params, 1e-2))
        return optimizers[-1]
    res = pb.fit(model, guide, (d.x_train[:300], d.y_train[:300]), epochs=4, batch_size=64, seed=0,
                 optimizer=optimizer, progress=False, checkpoint=tmp_path / f"{deferred}.pt", device=device, **kw)
    assert not hasattr(optimizers[0], "found_inf") and not hasattr(optimizers[0], "grad_scale")
    return res, {**model.state_dict(), **guide.state_dict()}


def test_deferred_checks_change_nothing(monkeypatch, tmp_path):
    """The losses (summed in the same order in float64), the parameters and the checkpoint."""
    deferred, deferred_state = _fit_states(monkeypatch, True, tmp_path)
    sync, sync_state = _fit_states(monkeypatch, False, tmp_path)
    assert deferred.history["loss"] == sync.history["loss"]
    assert all(torch.equal(deferred_state[k], v) for k, v in sync_state.items())
    a = torch.load(tmp_path / "True.pt", weights_only=True)
    b = torch.load(tmp_path / "False.pt", weights_only=True)
    assert all(torch.equal(a["guide"][k], v) for k, v in b["guide"].items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deferred_checks_change_nothing_cuda(monkeypatch, tmp_path):
    """On CUDA the deferral is the default (``can_defer_checks``); the same fit read at once."""
    deferred, deferred_state = _fit_states(monkeypatch, True, tmp_path, device="cuda")
    sync, sync_state = _fit_states(monkeypatch, False, tmp_path, device="cuda")
    assert deferred.history["loss"] == sync.history["loss"]
    assert all(torch.equal(deferred_state[k], v) for k, v in sync_state.items())


def test_a_deferred_failure_restores_what_the_immediate_check_restores(monkeypatch, data):  # noqa: F811
    """NaN loss at epoch 2, step 3 (a deferred step): the steps after it in that epoch do not
    move anything, the error names the step, and the state restored is the end of epoch 1."""
    x, y = data
    outcomes = []
    for deferred in (True, False):
        if not deferred:
            monkeypatch.setattr(loop, "defer_step_checks", lambda *a: False)
        model, guide = _meanfield()
        objective = _objective_with(guide, 4 + 3, lambda loss: loss * float("nan"))
        with pytest.raises(FloatingPointError, match=r"the loss became nan in epoch 2 \(step 3\).*end of epoch 1"):
            pb.fit(model, guide, (x, y), epochs=3, lr=1e-2, seed=0, objective=objective, progress=False)
        outcomes.append({**model.state_dict(), **guide.state_dict()})
    assert all(torch.equal(outcomes[0][k], v) for k, v in outcomes[1].items())


def test_the_optimiser_skips_while_the_flag_is_set():
    """The mechanism itself: a fused Adam step with ``found_inf`` set changes no parameter and
    no moment (torch's GradScaler protocol), and the guard takes the flag off afterwards."""
    torch.manual_seed(0)
    net = mlp(4, 3, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1, fused=True)
    guard = divergence.DivergenceGuard(net, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0),
                                       list(net.parameters()), deferred=True)
    guard.start()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    guard.begin_epoch()
    for step in (1, 2):
        opt.zero_grad()
        loss = net(torch.randn(5, 4)).sum() * (float("inf") if step == 1 else 1.0)
        loss.backward()
        guard.check(loss, 1, step)
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    with warnings.catch_warnings(), pytest.raises(FloatingPointError, match=r"loss became inf in epoch 1 \(step 1\)"):
        guard.end_epoch(1)
    assert not hasattr(opt, "found_inf")
