"""The scripts' output files (``pyro_bnn.reporting.output_files``): an existing file is never
replaced unasked, and a write is atomic (a failure leaves the previous file and no temporary)."""

import json
import os
import stat

import pytest
import torch

from pyro_bnn.reporting.output_files import (
    check_new_file,
    save_figure,
    save_torch,
    write_file,
    write_json,
    write_text,
)

OLD = b"the user's file\n"


@pytest.fixture
def existing(tmp_path):
    path = tmp_path / "result.json"
    path.write_bytes(OLD)
    return path


def test_check_new_file_refuses_an_existing_file_and_leaves_it(existing):
    with pytest.raises(FileExistsError, match=r"result\.json.*pass --overwrite \(overwrite=True\) to "
                                              r"replace it, or choose another path"):
        check_new_file(existing)
    assert existing.read_bytes() == OLD
    assert check_new_file(existing, overwrite=True) == existing
    assert check_new_file(str(existing.with_name("new.json"))) == existing.with_name("new.json")


def test_write_file_refuses_an_existing_file_and_leaves_it(existing):
    for write in (lambda: write_text(existing, "new"), lambda: write_json(existing, {"a": 1}),
                  lambda: write_file(existing, lambda fh: fh.write(b"new"), binary=True)):
        with pytest.raises(FileExistsError, match="--overwrite"):
            write()
        assert existing.read_bytes() == OLD
    assert sorted(os.listdir(existing.parent)) == ["result.json"]


def test_overwrite_replaces_the_file_and_keeps_its_mode(existing):
    existing.chmod(0o600)
    write_text(existing, "new text\n", overwrite=True)
    assert existing.read_bytes() == b"new text\n"
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600
    assert sorted(os.listdir(existing.parent)) == ["result.json"]


def test_a_dangling_symlink_is_refused(tmp_path):
    link = tmp_path / "out.txt"
    link.symlink_to(tmp_path / "missing")
    with pytest.raises(FileExistsError, match="out.txt"):
        check_new_file(link)
    with pytest.raises(FileExistsError):
        write_text(link, "x")
    assert link.is_symlink() and not (tmp_path / "missing").exists()


def test_overwrite_replaces_a_link_instead_of_writing_through_it(tmp_path, existing):
    link = tmp_path / "link.json"
    link.symlink_to(existing)
    write_text(link, "new", overwrite=True)
    assert not link.is_symlink() and link.read_text() == "new"
    assert existing.read_bytes() == OLD


def test_a_directory_is_refused_even_with_overwrite(tmp_path):
    folder = tmp_path / "figures"
    folder.mkdir()
    for overwrite in (False, True):
        with pytest.raises(IsADirectoryError, match="figures"):
            check_new_file(folder, overwrite=overwrite)
        with pytest.raises(IsADirectoryError):
            write_text(folder, "x", overwrite=overwrite)
    assert folder.is_dir() and os.listdir(folder) == []


def test_a_failing_write_leaves_the_previous_file_and_no_temporary(existing):
    seen = {}

    def write(fh):
        fh.write(b"half of the new content")
        fh.flush()
        seen["tmp"] = fh.name
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_file(existing, write, overwrite=True, binary=True)
    assert existing.read_bytes() == OLD
    assert sorted(os.listdir(existing.parent)) == ["result.json"]
    assert "tmp" in seen        # the callback did run and wrote into a temporary file


def test_a_new_file_gets_the_permissions_open_would_give(tmp_path):
    old = os.umask(0o027)       # not the common 0o022, so a hard-coded mode fails
    try:
        path = write_text(tmp_path / "sub" / "new.txt", "hello")
    finally:
        os.umask(old)
    assert path.read_text(encoding="utf-8") == "hello"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~0o027 == 0o640


def test_save_figure_writes_a_png(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    try:
        path = save_figure(fig, tmp_path / "plot.png", dpi=50)
        with pytest.raises(FileExistsError):
            save_figure(fig, path)
    finally:
        plt.close(fig)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 100


def test_write_json_round_trips(tmp_path):
    obj = {"args": {"epochs": 3, "tag": "quick"}, "curve": [0.5, 0.25], "ok": True, "none": None, "π": "é"}
    path = write_json(tmp_path / "r.json", obj, indent=1)
    assert json.loads(path.read_text(encoding="utf-8")) == obj
    assert path.read_text(encoding="utf-8") == json.dumps(obj, indent=1)


def test_save_torch_round_trips(tmp_path):
    state = {"w": torch.arange(4.0)}
    path = save_torch(state, tmp_path / "state.pt")
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
