"""One progress bar per running worker of ``pb.compare(..., workers=N)``.

A worker's fit reports each epoch (``fit(progress=callable)``) through
:func:`~pyro_bnn.reporting.workers.run_jobs`'s channel; the caller draws the bars, one line per
worker slot, so two processes never write over each other's line.  Status lines (a guide
starts, ends) are written between the bars' redraws.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["WorkerBars"]


class WorkerBars:
    """``tqdm`` bars of the running jobs, each on the lowest free line.

    Parameters
    ----------
    file : text stream, optional
        Where to draw (default ``sys.stderr`` at construction).
    """

    def __init__(self, file=None):
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self._file = sys.stderr if file is None else file
        self._bars: dict[int, object] = {}   # by job index
        self._slots: dict[int, int] = {}     # job index -> line
        self._clearing = False

    def start(self, index: int, name: str, epochs: int) -> None:
        """A bar for job ``index`` (``name``, ``epochs`` to go) on the first free line."""
        slot = min(set(range(len(self._slots) + 1)) - set(self._slots.values()))
        self._slots[index] = slot
        self._bars[index] = self._tqdm(total=epochs, desc=name, unit="epoch", position=slot,
                                       leave=False, file=self._file)

    def update(self, index: int, epoch: int, epochs: int, loss: float) -> None:
        """Job ``index`` has finished ``epoch`` of ``epochs`` with mean loss ``loss``."""
        bar = self._bars[index]   # run_jobs relays a job's messages between its start and end
        bar.total = epochs
        bar.n = epoch
        bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        bar.refresh()

    def finish(self, index: int) -> None:
        """Remove job ``index``'s bar (its line is free again)."""
        bar = self._bars.pop(index, None)
        self._slots.pop(index, None)
        if bar is not None:
            bar.close()

    @contextmanager
    def cleared(self) -> Iterator[None]:
        """The bars are cleared in this context and redrawn after it, so that anything written
        to the terminal meanwhile (a line, a warning) stands on lines of its own."""
        if self._clearing:   # nested: the outer context redraws
            yield
            return
        self._clearing = True
        try:
            with self._tqdm.external_write_mode(file=self._file):
                yield
        finally:
            self._clearing = False

    def write(self, line: str) -> None:
        """Write ``line`` (one call, newline included) above the bars, then redraw them."""
        with self.cleared():
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        """Remove every bar."""
        for index in list(self._bars):
            self.finish(index)
