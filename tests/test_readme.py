"""The README's Python examples run as written (with fewer epochs and draws)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _shrunk_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    out = []
    for code in blocks:
        code = re.sub(r"epochs=\d+", "epochs=1", code)
        code = re.sub(r"num_samples=\d+\)", "num_samples=4)", code)
        code = re.sub(r"num_permutations=500", "num_permutations=20", code)
        out.append(code)
    return out


@pytest.mark.slow
def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = _shrunk_blocks()
    assert len(blocks) >= 2, "the README lost its examples"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["aug"].extent.shape == (6,)
    assert namespace["probs"].shape[1:] == (449, 10)
