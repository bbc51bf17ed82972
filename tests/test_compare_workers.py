"""``pb.compare(workers=N)`` and ``pyro-bnn --workers N``: guides trained in forked processes give
the figures of one process, come back whole, and fail, die or get interrupted by name."""

import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
import warnings

import pandas as pd
import pyro
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bnn as pb
from pyro_bnn.reporting import cli
from pyro_bnn.reporting.comparison import ComparisonInterrupted
from pyro_bnn.reporting.workers import check_workers, run_jobs
from pyro_bnn.training.seeding import seeded

TIMING = ("train_seconds", "predict_seconds")

# Python 3.12+ warns when a multi-threaded process forks; a test process can hold torch's
# intra-op pool (or other tests' threads), and the workers set their own thread count first.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")


@pytest.fixture(scope="module")
def split(digits_small):
    return pb.datasets.DataSplit(*digits_small)


def _model():
    return pb.BNN(nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)), "categorical")


def _compare(split, guides, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pb.compare(_model, guides, split, epochs=3, lr=1e-2, num_samples=10, loo_samples=30,
                          progress=False, details=True, **kw)


def _no_workers_left():
    return not [p for p in mp.active_children() if p.name.startswith("pyro-bnn")]


def test_two_workers_give_the_one_process_table_and_whole_guides(split):
    guides = {"meanfield": "meanfield", "laplace": "laplace", "symmetrized": "symmetrized",
              "hypernet": "hypernet", "autonormal": AutoNormal}
    one = _compare(split, guides)
    two = _compare(split, guides, workers=2)
    assert list(two.table.index) == list(guides)        # the caller's order, not completion order
    assert "error" not in two.table.columns, two.table.get("error")
    # every guide is seeded alike: the same figures to the last bit, timings aside
    pd.testing.assert_frame_equal(one.table.drop(columns=list(TIMING)), two.table.drop(columns=list(TIMING)),
                                  check_exact=True)
    x = split.x_test[:20]
    for name in guides:   # the trained guide came back whole: its predictive is the same
        with seeded(1):
            p1 = one.runs[name].predictive(x, 5).probs
        with seeded(1):
            p2 = two.runs[name].predictive(x, 5).probs
        torch.testing.assert_close(p2, p1, rtol=0, atol=0)
        assert two.runs[name].datatree is not None and two.runs[name].fit.history
    assert _no_workers_left()


def test_a_stale_param_store_of_the_caller_does_not_reach_the_returned_guide(split):
    """The caller's Pyro param store holds other values under the autoguide's names (an earlier
    fit); the guide that comes back from a worker predicts with its own trained values."""
    guides = {"autonormal": AutoNormal}
    x = split.x_test[:20]
    _compare(split, guides, seed=5)                         # fills the store: seed-5 values
    stale = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    two = _compare(split, guides, workers=2)
    assert {k: v for k, v in pyro.get_param_store().items()}.keys() == stale.keys()
    with seeded(1):
        p2 = two.runs["autonormal"].predictive(x, 5).probs
    one = _compare(split, guides)                            # seed 0 in this process
    with seeded(1):
        p1 = one.runs["autonormal"].predictive(x, 5).probs
    torch.testing.assert_close(p2, p1, rtol=0, atol=0)


def _broken(model, **kw):
    raise ValueError("this guide is broken on purpose")


def test_a_failing_guide_in_a_worker_is_recorded_or_raised(split):
    with pytest.warns(RuntimeWarning, match="guide 'broken' failed: ValueError: this guide is broken"):
        out = pb.compare(_model, {"meanfield": "meanfield", "broken": _broken}, split, epochs=1,
                         num_samples=5, loo_samples=0, progress=False, details=True, workers=2)
    assert "broken on purpose" in out.table.loc["broken", "error"]
    assert out.table.loc["broken", "converged"] == "no: failed"
    assert pd.isna(out.table.loc["meanfield", "error"])
    with pytest.raises(ValueError, match="broken on purpose"):
        pb.compare(_model, {"broken": _broken, "meanfield": "meanfield"}, split, epochs=1, num_samples=5,
                   loo_samples=0, progress=False, errors="raise", workers=2)
    assert _no_workers_left()


def test_warnings_of_a_worker_are_raised_in_the_caller(split):
    with pytest.warns(pb.ConvergenceWarning, match="cannot judge"):
        pb.compare(_model, ["meanfield", "laplace"], split, epochs=1, num_samples=5, loo_samples=0,
                   progress=False, workers=2)

    def noisy(report):
        warnings.warn("from the worker", UserWarning, stacklevel=2)
        return 1

    with pytest.warns(UserWarning, match="from the worker"):
        assert run_jobs([("noisy", noisy)], 2)["noisy"].value == 1


def test_messages_of_a_worker_reach_the_caller_in_order_before_its_outcome():
    """Every message a job reports arrives, in order, before ``on_done`` — those sent just before
    the worker exits too (a job that dies after reporting still delivers what it sent)."""
    events = []

    def chatty(report):
        for i in range(500):
            report(("step", i))
        return "ok"

    def dies(report):
        report("last words")
        os._exit(3)

    out = run_jobs([("chatty", chatty), ("dies", dies)], 2,
                   on_message=lambda index, message: events.append((index, message)),
                   on_done=lambda index, outcome: events.append((index, "done")))
    assert out["chatty"].value == "ok" and "exited with code 3" in str(out["dies"].error)
    chatty_events = [m for i, m in events if i == 1]
    assert chatty_events == [("step", i) for i in range(500)] + ["done"]
    assert [m for i, m in events if i == 2] == ["last words", "done"]
    assert _no_workers_left()


def test_compare_with_workers_draws_a_bar_per_running_guide(split, capsys, monkeypatch):
    """``progress=True`` with workers: each guide's epochs reach a bar named after it in the
    caller (the fit in the worker reports them), between a start and an end line; a worker's
    warnings, printed as they come in, stand on lines of their own (the bars are cleared)."""
    def show(message, category, filename, lineno, file=None, line=None):   # as Python prints one
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    monkeypatch.setattr(warnings, "showwarning", show)   # pytest records warnings instead
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        table = pb.compare(_model, ["meanfield", "laplace"], split, epochs=3, lr=1e-2, num_samples=5,
                           loo_samples=0, progress=True, workers=2)
    assert set(table.index) == {"meanfield", "laplace"}
    err = capsys.readouterr().err
    for i, name in enumerate(["meanfield", "laplace"], 1):
        assert f"[{i}/2] {name} (worker process)" in err
        assert f"[{i}/2] {name} done (" in err
        assert re.search(rf"{name}: 100%.*\| 3/3 \[.*loss=", err), err[-2000:]
    assert "ConvergenceWarning: pb.fit cannot judge" in err    # 3 epochs: both fits warn
    for line in re.split(r"[\r\n]", err):                      # never on a bar's line
        assert not ("loss=" in line and "Warning" in line), line


def test_fit_reports_each_epoch_to_a_progress_callable(split, capsys):
    """``fit(progress=callable)`` (what a worker's fit uses): called after every epoch with the
    epoch, the epoch count and that epoch's loss as in the history; no bar of its own."""
    calls = []
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pb.ConvergenceWarning)
        result = pb.fit(model, pb.guides.MeanField(model), split.train, epochs=4, lr=1e-2, seed=0,
                        progress=lambda epoch, epochs, loss: calls.append((epoch, epochs, loss)))
    assert calls == [(e, 4, loss) for e, loss in enumerate(result.history["loss"], 1)]
    assert "epoch" not in capsys.readouterr().err


def test_a_dead_worker_and_an_unpicklable_result_are_named():
    out = run_jobs([("dies", lambda report: os._exit(3)), ("lambda", lambda report: (lambda: 0)),
                    ("fine", lambda report: torch.arange(3))], 2)
    assert set(out) == {"dies", "lambda", "fine"}
    assert isinstance(out["dies"].error, RuntimeError)
    assert "'dies' exited with code 3 and no result" in str(out["dies"].error)
    assert "the result of 'lambda' could not be sent back" in str(out["lambda"].error)
    assert out["fine"].error is None and torch.equal(out["fine"].value, torch.arange(3))
    assert out["fine"].seconds >= 0


def test_an_interrupt_stops_the_running_workers():
    def stop(index, outcome):
        raise KeyboardInterrupt

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_jobs([("quick", lambda report: 1), ("slow", lambda report: time.sleep(120))], 2, on_done=stop)
    assert time.perf_counter() - t0 < 60
    assert _no_workers_left()


_SLOW_FORK = threading.Event()   # set: a forked child sleeps in Python's after-fork hooks
os.register_at_fork(after_in_child=lambda: _SLOW_FORK.is_set() and time.sleep(0.3))


def test_a_ctrl_c_as_a_worker_starts_does_not_reach_it(capfd, monkeypatch):
    """A SIGINT to a worker the moment it is forked (a terminal's Ctrl-C goes to every process
    of the group) is ignored: the worker's start-up code (here held in an after-fork hook)
    never sees it — no "Exception ignored" traceback, no KeyboardInterrupt — and its job finishes."""
    def interrupt_it(index, name):
        for process in mp.active_children():
            if process.name == f"pyro-bnn {name}":
                os.kill(process.pid, signal.SIGINT)

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)   # pytest's would hide it
    _SLOW_FORK.set()
    try:
        out = run_jobs([(f"job{i}", lambda report: 7) for i in range(2)], 2, on_start=interrupt_it)
    finally:
        _SLOW_FORK.clear()
    assert {name: (o.value, o.error) for name, o in out.items()} == {f"job{i}": (7, None) for i in range(2)}
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def _interrupt(model, **kw):
    raise KeyboardInterrupt


def test_an_interrupt_in_a_worker_interrupts_compare(split):
    with pytest.raises(ComparisonInterrupted) as info:
        pb.compare(_model, {"stop": _interrupt, "meanfield": "meanfield"}, split, epochs=1,
                   num_samples=5, loo_samples=0, progress=False, workers=2)
    assert "stop" in info.value.interrupted
    assert _no_workers_left()


def test_workers_run_one_thread_after_the_caller_used_its_pool():
    """A caller whose intra-op pool is alive (4 threads used) forks 2 workers; they run one
    thread each (two would hang in the forked pool), finish, and compute the caller's product."""
    a = torch.randn(300, 300, dtype=torch.float64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        (a @ a).sum()   # the pool's threads exist now

        def job(report):
            return torch.get_num_threads(), a @ a

        out = run_jobs([("a", job), ("b", job)], 2)
    finally:
        torch.set_num_threads(before)
    for name in ("a", "b"):
        threads, product = out[name].value
        assert threads == 1
        torch.testing.assert_close(product, a @ a, rtol=1e-12, atol=1e-12)


def test_workers_are_checked_before_any_training(split):
    with pytest.raises(ValueError, match="workers must be"):
        pb.compare(_model, ["meanfield"], split, workers=0)
    with pytest.raises(TypeError, match="workers"):
        pb.compare(_model, ["meanfield"], split, workers=1.5)
    with pytest.raises(ValueError, match="workers > 1 trains guides in parallel CPU processes.*'cuda'"):
        check_workers(2, "cuda")
    with pytest.raises(ValueError, match="gpu"):   # the device's own check names a bad device first
        pb.compare(_model, ["meanfield"], split, device="gpu", workers=2)
    assert check_workers(2, "cpu") == 2 and check_workers(1, "cuda") == 1
    with pytest.raises(ValueError, match="unique"):
        run_jobs([("a", int), ("a", int)], 2)


def test_cli_workers_start_the_longest_fit_first_and_keep_the_table_order(tmp_path, capsys):
    out = tmp_path / "report"
    code = cli.main(["--smoke", "--workers", "2", "--guides", "laplace,symmetrized", "--out", str(out)])
    assert code == 0
    err = capsys.readouterr().err
    # Symmetrized's epoch costs 3.8 MeanField epochs, Laplace's 0.9 (cli.EPOCH_COST): it starts first
    assert "[1/2] symmetrized (worker process)" in err and "[2/2] laplace (worker process)" in err
    assert list(pd.read_csv(out / "table.csv", index_col=0).index) == ["laplace", "symmetrized"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--workers", "0"])
    assert cli.main(["--smoke", "--workers", "2", "--threads", "2", "--out", str(tmp_path / "r2")]) == 2
    assert "--workers 2 runs each guide in a process of one torch thread" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()
