"""``GuideObjective``: a guide's training loss that both :func:`pyro_bnn.fit` and ``SVI`` use."""

from __future__ import annotations

import pyro
import torch

from ..model.bnn import BNN
from .guide import BNNGuide
from .param_store import emit_param_statements, sync_param_store
from .pyro_objective import call_model, model_arguments

__all__ = ["GuideObjective"]


class GuideObjective(pyro.infer.ELBO):
    """A pyro_bnn training objective that is also a Pyro ``ELBO``.

    :func:`pyro_bnn.fit` calls ``objective(model, guide, x, y, num_data)``; subclasses
    implement that :meth:`__call__`, returning the loss or ``(loss, extras)``.  Passed to
    ``pyro.infer.SVI`` as its ``loss``, the same object computes the same loss from
    ``svi.step(x, y)`` or ``svi.step(x, y, num_data=N)`` (minibatches of a data set of size
    N): :meth:`differentiable_loss` sets the guide up, syncs it with Pyro's param store
    (:mod:`pyro_bnn.contract.param_store`) and makes guide and model emit their ``param``
    statements, so that ``SVI`` finds and optimises their parameters, then calls
    :meth:`__call__`.

    Examples
    --------
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}),
    ...                      loss=pb.guides.MeanFieldELBO())                # doctest: +SKIP
    >>> svi.step(x_batch, y_batch, num_data=len(x_train))                   # doctest: +SKIP
    """

    def __call__(self, model, guide, x, y, num_data=None):
        raise NotImplementedError

    def _get_trace(self, model, guide, args, kwargs):
        raise NotImplementedError(f"{type(self).__name__} computes its loss without Pyro traces")

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """The loss as a differentiable 0-d tensor (Pyro's ``ELBO`` interface)."""
        x, y, num_data = model_arguments(model, args, kwargs)
        if isinstance(model, BNN):  # minibatches without num_data=, unscaled pixels (our losses skip model.forward)
            model.batch_watch.see(x, y, num_data)
            if model.input_watch.looking[y is None]:
                model.input_watch.see(x, y is None)
        if isinstance(guide, BNNGuide):
            model_args, model_kwargs, _ = call_model(model, x, y, num_data)
            guide.set_up(*model_args, **model_kwargs)
            guide.watch_batch(x, y, num_data, model_args, model_kwargs)
            if True in guide.input_watch.looking:  # a hand-written model's unscaled pixels (first calls)
                guide.watch_inputs(model_args, model_kwargs)
        sync_param_store(guide, model)
        emit_param_statements(guide)
        emit_param_statements(model)
        out = self(model, guide, x, y, num_data)
        return out[0] if isinstance(out, tuple) else out

    def loss(self, model, guide, *args, **kwargs) -> float:
        """The loss as a float, without gradients."""
        with torch.no_grad():
            return float(self.differentiable_loss(model, guide, *args, **kwargs))

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """The loss as a float, after back-propagating it into the parameters' gradients."""
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward()
        return float(loss.detach())
