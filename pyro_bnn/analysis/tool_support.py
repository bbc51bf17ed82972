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
* **Classes** — the scores read class probabilities ``(S, N, C)``:
  :func:`class_probabilities` turns a Bernoulli model's success probabilities into two classes
  and refuses a regression model's means.
* **Signatures** — ``(model, guide, x, y)`` (or the tool's data, e.g. ``(model_fn, guide_fn,
  pool, test)``) positionally, every option keyword-only; ``num_samples`` is the number of
  posterior draws (``eval_num_samples`` where a tool evaluates with a second set) and
  ``batch_size`` the inputs per forward pass.
"""

from __future__ import annotations

import torch

from ..model.devices import module_device
from ..posterior.prediction import bernoulli_as_classes, predictive_likelihood
from ..training.seeding import seeded

__all__ = ["seeded", "to_model_device", "class_probabilities"]


def to_model_device(model, guide, *tensors: torch.Tensor | None):
    """``tensors`` moved to the device of the model's (else the guide's) first parameter or
    buffer (:func:`pyro_bnn.model.devices.module_device`; ``None`` stays ``None``); a tuple, or the
    one tensor if only one is given."""
    device = module_device(model, guide)
    moved = tuple(t if t is None else t.to(device) for t in tensors)
    return moved[0] if len(moved) == 1 else moved



def class_probabilities(model, guide, probs: torch.Tensor) -> torch.Tensor:
    """``pb.predict``'s output ``probs`` as class probabilities ``(S, N, C)``.

    A Bernoulli model's success probabilities ``(S, N, 1)`` become two classes ``[1 − p, p]``
    (read as one class, every input's "confidence" was ``p`` and its predicted class 0, so
    ``max_prob`` and ``variation_ratio`` scored nothing: an OOD AUROC of 0.58 for 0.96).  The
    kind is the model's likelihood (:func:`pyro_bnn.posterior.prediction.predictive_likelihood`);
    where neither model nor guide names one, a single output is read as Bernoulli (a softmax
    over one output is constant).

    Raises
    ------
    TypeError
        A Gaussian (regression) predictive: it has no classes.
    ValueError
        A Bernoulli predictive with several outputs (one score per input is not defined), or
        probabilities of an unnamed kind whose rows do not sum to 1.
    """
    kind = predictive_likelihood(model, guide)[0]
    if kind == "gaussian":
        raise TypeError("this tool scores class probabilities, but the model's predictive is a Gaussian "
                        "(regression) one")
    if kind is None and probs.shape[-1] == 1:
        kind = "bernoulli"
    if kind == "bernoulli":
        if probs.shape[-1] != 1:
            raise ValueError(f"a Bernoulli model with {probs.shape[-1]} outputs has no single class per "
                             "input to score; give the network one output")
        return bernoulli_as_classes(probs)
    if kind is None and not bool(torch.allclose(probs.sum(-1), torch.ones((), dtype=probs.dtype,
                                                                           device=probs.device), atol=1e-4)):
        raise ValueError(f"expected class probabilities (rows summing to 1) of shape (S, N, C), got rows "
                         f"summing to [{float(probs.sum(-1).min()):.4g}, {float(probs.sum(-1).max()):.4g}]")
    return probs
