"""The main job (``pyro-bnn``) loses nothing and absorbs no mistake (issue 15).

``--out`` is checked before training; the report folder is replaced whole at the end or not
at all (no partial, mixed or stale report, also on Ctrl-C); numeric options are validated and
``--epochs 0`` means no training.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyro_bnn.reporting import cli
from pyro_bnn.reporting.staged_folder import StagedFolder

ROOT = Path(__file__).resolve().parents[1]


def _run_cli(*args, **kw):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, MPLBACKEND="Agg")
    # SIGINT back to its default: a shell starts background jobs with it ignored, and Python
    # then installs no KeyboardInterrupt handler in the child
    return subprocess.Popen([sys.executable, "-m", "pyro_bnn.reporting.cli", *args], cwd=kw.get("cwd", ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _previous_report(folder: Path) -> dict[str, bytes]:
    """A stand-in for an earlier run's report, with a datatree of a guide the next run skips
    (marked as this program's, so a rerun may replace it: issue 23)."""
    (folder / "datatrees").mkdir(parents=True)
    files = {"table.md": b"| old |\n", "metrics.json": b"{}", "datatrees/hypernet.nc": b"old"}
    marker = json.dumps({"program": "pyro-bnn", "files": sorted(files)}).encode()
    files[".pyro-bnn-report"] = marker
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


# ------------------------------------------------------------------ --out checked first
def test_unwritable_out_fails_at_once_without_traceback():
    t0 = time.perf_counter()
    proc = _run_cli("--out", "/proc/x", "--no-progress")  # would train for minutes
    out, err = proc.communicate(timeout=120)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "cannot write the report to /proc/x" in err and "--out /proc/x" in err
    assert seconds < 60  # the imports only; training would take minutes


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("keep me")
    assert cli.main(["--smoke", "--guides", "meanfield", "--out", str(target), "--no-progress"]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("option, value", [
    ("--epochs", "-1"), ("--batch-size", "0"), ("--num-samples", "0"), ("--loo-samples", "0"),
    ("--hidden", "0"), ("--threads", "0"), ("--seed", "-3"), ("--batch-size", "ten"),
])
def test_numeric_options_are_validated(option, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([option, value, "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected an integer >=" in err and value in err
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ whole report, no stale files
def test_epochs_zero_and_a_rerun_replaces_the_whole_folder(tmp_path, capsys):
    out = tmp_path / "report"
    _previous_report(out)
    assert cli.main(["--smoke", "--epochs", "0", "--guides", "meanfield", "--out", str(out),
                     "--no-progress", "--loo-samples", "30"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["settings"]["epochs"] == {"meanfield": 0}
    assert metrics["history"]["meanfield"]["loss"] == []  # 0 epochs, not 100
    assert sorted(p.name for p in (out / "datatrees").iterdir()) == ["meanfield.nc"]  # no stale hypernet.nc
    assert "| old |" not in (out / "table.md").read_text()
    assert _siblings(out) == []  # no staging folder left behind
    assert "| meanfield |" in capsys.readouterr().out


def test_interrupt_during_training_keeps_the_previous_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "report"
    before = _previous_report(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "compare", interrupted)
    assert cli.main(["--smoke", "--guides", "meanfield", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"interrupted: no report written; the previous one in {out} is unchanged"
    assert _contents(out) == before and _siblings(out) == []


def test_interrupt_inside_an_extension_import_is_an_interrupt(tmp_path, monkeypatch, capsys):
    # Ctrl-C during a C extension's import (matplotlib's Agg backend, as seen in CI) arrives as
    # ImportError("initialization failed") raised from the KeyboardInterrupt: exit 130, no traceback.
    out = tmp_path / "report"
    before = _previous_report(out)

    def import_interrupted(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    monkeypatch.setattr(cli, "write_report", import_interrupted)
    assert cli.main(["--smoke", "--guides", "meanfield", "--out", str(out), "--no-progress",
                     "--loo-samples", "30"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == f"interrupted: no report written; the previous one in {out} is unchanged"
    assert _contents(out) == before and _siblings(out) == []


def test_an_unrelated_import_error_is_not_an_interrupt(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ImportError("no module named matplotlib")

    monkeypatch.setattr(cli, "write_report", broken)
    with pytest.raises(ImportError, match="no module named matplotlib"):
        cli.main(["--smoke", "--guides", "meanfield", "--out", str(tmp_path / "r"), "--no-progress",
                  "--loo-samples", "30"])


def test_failed_report_write_keeps_the_previous_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "report"
    before = _previous_report(out)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "write_report", disk_full)
    assert cli.main(["--smoke", "--guides", "meanfield", "--out", str(out), "--no-progress",
                     "--loo-samples", "30"]) == 1
    captured = capsys.readouterr()
    assert "| meanfield |" in captured.out  # the table is printed before the report is written
    assert "could not write the report" in captured.err and "previous one is unchanged" in captured.err
    assert _contents(out) == before and _siblings(out) == []


class _SwallowedInterrupt:
    """Sends SIGINT from ``__del__``, where Python prints and swallows the KeyboardInterrupt
    (as when Ctrl-C lands in a weakref callback during garbage collection)."""

    def __del__(self):
        signal.raise_signal(signal.SIGINT)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_swallowed_sigint_still_keeps_the_previous_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "report"
    before = _previous_report(out)
    real = cli.write_report

    def write_then_interrupt(*args, **kwargs):
        written = real(*args, **kwargs)
        _SwallowedInterrupt()   # collected at once: the interrupt is swallowed, the write returns
        return written

    monkeypatch.setattr(cli, "write_report", write_then_interrupt)
    code = cli.main(["--smoke", "--guides", "meanfield", "--out", str(out), "--no-progress", "--loo-samples", "30"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1] == f"interrupted: no report written; the previous one in {out} is unchanged"
    assert _contents(out) == before and _siblings(out) == []


@pytest.mark.slow
def test_sigint_while_the_report_is_written_keeps_the_previous_report(tmp_path):
    out = tmp_path / "report"
    before = _previous_report(out)
    proc = _run_cli("--smoke", "--guides", "meanfield", "--out", str(out), "--no-progress")
    deadline = time.monotonic() + 240
    staged = None
    while proc.poll() is None and time.monotonic() < deadline:
        staged = next((p for p in tmp_path.glob(".report.tmp-*") if (p / "table.md").exists()), None)
        if staged is not None:  # the report is being written: interrupt it
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    assert staged is not None, f"the run ended before its report was written: {err}"
    assert proc.returncode == 130, err
    # a SIGINT that lands in a weakref callback (say, importlib's module-lock callback during a
    # lazy import) is printed and swallowed by Python itself ("Exception ignored in: ...") and
    # recorded by the program (test_a_swallowed_sigint_still_keeps_the_previous_report): only
    # that report of Python's may carry a traceback
    err = re.sub(r"Exception ignored in: .*?\nKeyboardInterrupt[^\n]*\n?", "", err, flags=re.DOTALL)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"interrupted: no report written; the previous one in {out} is unchanged")
    assert _contents(out) == before and _siblings(out) == []


# ------------------------------------------------------------------ the staged folder itself
def test_staged_folder_commit_and_discard(tmp_path):
    out = tmp_path / "r"
    _previous_report(out)
    with StagedFolder(out) as staged:
        (staged.path / "new.txt").write_text("new")
        assert staged.path.parent == tmp_path and staged.path.name.startswith(".r.tmp-")
    written = _contents(out)
    assert set(written) == {"new.txt", ".pyro-bnn-report"} and written["new.txt"] == b"new"
    assert json.loads(written[".pyro-bnn-report"])["files"] == ["new.txt"]
    assert _siblings(out) == []
    with pytest.raises(RuntimeError), StagedFolder(out) as staged:
        (staged.path / "half.txt").write_text("half")
        raise RuntimeError("boom")
    assert _contents(out) == written and _siblings(out) == []


def test_staged_folder_cleans_up_after_a_killed_run(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f".r.tmp-{dead}-abcd").mkdir()                         # staged by a killed run
    alive = tmp_path / f".r.tmp-{os.getpid()}-beef"                     # a running one's: kept
    alive.mkdir()
    StagedFolder(out).discard()
    assert _siblings(out) == [alive.name]
    alive.rmdir()
    # killed between the two renames of a swap: the previous report comes back
    aside = tmp_path / f".r.old-{dead}-abcd"
    out.rename(aside)
    (aside / "table.md").write_text("previous")
    StagedFolder(out).discard()
    assert (out / "table.md").read_text() == "previous" and _siblings(out) == []
