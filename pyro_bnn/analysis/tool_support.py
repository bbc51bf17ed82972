"""Rules shared by the uncertainty tools (pruning, OOD, FGSM, active learning, corruption).

* **Seeding** — a tool called with ``seed=s`` draws its random numbers from a stream seeded
  with ``s`` and leaves the caller's streams as they were: :func:`seeded` forks torch's RNG
  (``torch.random.fork_rng``, CUDA devices included) and saves and restores Pyro's RNG state
  (``pyro.util.get_rng_state``: torch, Python ``random`` and NumPy).  ``seed=None`` draws from
  the caller's streams and advances them, as ``torch.randn`` would.
* **Device** — inputs are moved to the model's device (:func:`to_model_device`); tensors a
  tool returns live there too, as those of :func:`pyro_bnn.predict` do.
* **Predictive** — one keyword, ``method=``, selects the predictive (``"sample"``, a guide's
  own such as Laplace's ``"glm"``, or a tool's own such as pruning's ``"mean"``);
  :func:`renamed_keyword` turns an old name (``predictive=``) into a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings

import torch

from ..devices import module_device
from ..seeding import seeded

__all__ = ["seeded", "model_device", "to_model_device", "renamed_keyword"]

_UNSET = object()


def model_device(model, guide=None, default: torch.device | str = "cpu") -> torch.device:
    """The device of the model's (else the guide's) first parameter or buffer, else ``default``."""
    return module_device(model, guide, default=default)


def to_model_device(model, guide, *tensors: torch.Tensor | None):
    """``tensors`` moved to :func:`model_device` (``None`` stays ``None``); a tuple, or the one
    tensor if only one is given."""
    device = model_device(model, guide)
    moved = tuple(t if t is None else t.to(device) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def renamed_keyword(new_name: str, new_value, old_name: str, old_value, where: str, default):
    """The value of a keyword renamed from ``old_name`` to ``new_name``.

    ``old_value`` is the old keyword's argument (``_UNSET``/``None`` if not passed), ``new_value``
    the new one's (``default`` if not passed).  Passing the old name warns with a
    ``DeprecationWarning``; passing both with different values is an error.
    """
    if old_value is None or old_value is _UNSET:
        return new_value
    warnings.warn(f"{where}: {old_name}= is deprecated, use {new_name}={old_value!r}",
                  DeprecationWarning, stacklevel=3)
    if new_value != default and new_value != old_value:
        raise ValueError(f"{where}: got {new_name}={new_value!r} and the deprecated "
                         f"{old_name}={old_value!r}; pass only {new_name}=")
    return old_value
