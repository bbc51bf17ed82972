"""The warning when a ``pb.BNN`` is trained on changing minibatches without ``num_data=``.

A ``pb.BNN`` observes its targets in ``pyro.plate("data", num_data, subsample_size=len(x))``.
Without ``num_data`` the plate's size is the batch's, so an ELBO computed on a minibatch of M
points treats those M points as the whole data set: the data term counts ``M / N`` of what it
should and the prior's KL term outweighs it.  The fit then stays close to the prior and predicts
at chance, with no error (``docs/pyro.md``: on digits, a small CNN under plain ``SVI``,
accuracy 0.08–0.13 / NLL 2.31 against 0.94–0.96 / 0.16–0.20 from ``pb.fit``).  ``pb.fit``
passes ``num_data`` itself; a Pyro user's own loop must (``svi.step(xb, yb, num_data=N)``).

The model cannot know N, but it can see the symptom: gradient-carrying calls with targets and
without ``num_data`` on inputs that keep changing.  :class:`UnscaledBatchWatch` looks at the
first few such calls only (the inputs' per-feature sums each, so the cost is nil after them)
and warns once if the inputs changed twice, that is when a third batch arrives.  Full-batch
training, even on a tensor moved to the device anew or shuffled every step, keeps the sums;
predictions (no targets, or ``torch.no_grad``, as ``Predictive`` runs) are not
watched; passing ``num_data`` once ends the watch.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["UnscaledBatchWatch", "WATCHED_CALLS"]

#: Gradient-carrying calls with targets and without ``num_data`` that are looked at: enough for
#: three steps when Pyro runs the model once per particle (``Trace_ELBO(num_particles=20)``).
WATCHED_CALLS = 64


def _fingerprint(x: torch.Tensor) -> tuple:
    """Shape, device and per-feature sums over the batch: the same for the same inputs in any
    order (a shuffled full batch), different for another minibatch."""
    sums = x.detach().reshape(len(x), -1).sum(0) if x.dim() and len(x) else torch.zeros(0)
    return tuple(x.shape), x.device, sums.float().cpu()


class UnscaledBatchWatch:
    """Detect minibatch training of a model that was not told the data set's size.

    Attributes
    ----------
    warned : bool
        Whether the warning has been given (once per model: a ``pb.BNN`` holds one watch, as
        ``model.batch_watch``, which its ``forward`` and the guides' objectives both report to).
    """

    def __init__(self):
        self._calls = 0
        self._changes = 0
        self._last: tuple | None = None
        self.warned = False

    def see(self, model_name: str, x: torch.Tensor, y, num_data) -> None:
        """Record one call of the model; warn at the second change of inputs.

        Parameters
        ----------
        model_name : str
            How the warning names the model.
        x, y : Tensor
            The call's inputs and targets.
        num_data : int or None
            The call's ``num_data``.
        """
        if self._calls >= WATCHED_CALLS or y is None or not torch.is_grad_enabled():
            return
        if num_data is not None:  # the caller scales its batches: nothing to watch
            self._calls, self._last = WATCHED_CALLS, None
            return
        self._calls += 1
        last, self._last = self._last, _fingerprint(x)
        if last is not None and not _same(last, self._last):
            self._changes += 1
        if self._changes >= 2:
            self._calls, self._last, self.warned = WATCHED_CALLS, None, True
            warnings.warn(
                f"{model_name} is being trained on changing batches of {len(x)} inputs without num_data=: "
                f"each step then treats its batch as the whole data set, so the prior outweighs the data "
                f"by N / {len(x)} and the posterior stays near the prior (predictions near chance). Pass the "
                "training set's size: svi.step(xb, yb, num_data=N) (pb.fit does this itself); if every step "
                "does see all the data, pass num_data=len(x) to say so", UserWarning, stacklevel=2)
        if self._calls >= WATCHED_CALLS:
            self._last = None


def _same(a: tuple, b: tuple) -> bool:
    if a[0] != b[0] or a[1] != b[1]:
        return False
    tol = 1e-4 * float(a[2].abs().mean()) if a[2].numel() else 0.0  # summation order
    return bool(torch.allclose(a[2], b[2], rtol=1e-4, atol=tol))
