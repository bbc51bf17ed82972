"""Rules shared by the uncertainty tools (pruning, OOD, FGSM, active learning, corruption).

* **Seeding** — a tool called with ``seed=s`` draws its random numbers from a stream seeded
  with ``s`` and leaves the caller's streams as they were: :func:`seeded` forks torch's RNG
  (``torch.random.fork_rng``, CUDA devices included) and saves and restores Pyro's RNG state
  (``pyro.util.get_rng_state``: torch, Python ``random`` and NumPy).  ``seed=None`` draws from
  the caller's streams and advances them, as ``torch.randn`` would.
* **Device** — inputs are moved to the model's device (:func:`to_model_device`); tensors a
  tool returns live there too, as those of :func:`pyro_bnn.predict` do.
* **Predictive** — one keyword, ``predictive=``, selects the predictive (``"sample"``, a guide's
  own such as Laplace's ``"glm"``, or a tool's own such as pruning's ``"mean"``), as for
  :func:`pyro_bnn.predict`.
* **Signatures** — ``(model, guide, x, y)`` (or the tool's data, e.g. ``(model_fn, guide_fn,
  pool, test)``) positionally, every option keyword-only; ``num_samples`` is the number of
  posterior draws (``eval_num_samples`` where a tool evaluates with a second set) and
  ``batch_size`` the inputs per forward pass.
"""

from __future__ import annotations

import torch

from ..model.devices import module_device
from ..training.seeding import seeded

__all__ = ["seeded", "to_model_device"]


def to_model_device(model, guide, *tensors: torch.Tensor | None):
    """``tensors`` moved to the device of the model's (else the guide's) first parameter or
    buffer (:func:`pyro_bnn.model.devices.module_device`; ``None`` stays ``None``); a tuple, or the
    one tensor if only one is given."""
    device = module_device(model, guide)
    moved = tuple(t if t is None else t.to(device) for t in tensors)
    return moved[0] if len(moved) == 1 else moved

