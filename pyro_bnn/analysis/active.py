"""Pool-based active learning with Bayesian acquisition functions (BHN paper, §5.2; Gal et al. 2017).

Start from a small class-balanced labelled set, train, score every unlabelled pool point
with an acquisition function computed from S posterior draws ``p_t`` (``(S, N, C)``),
label the ``per_round`` highest-scoring points, retrain, repeat.

Acquisition functions:

* ``"bald"``: mutual information ``H[p̄] − mean_t H[p_t]`` (Houlsby et al. 2011);
* ``"entropy"``: predictive entropy ``H[p̄]``;
* ``"variation_ratio"``: ``1 − (votes of the modal class)/S``;
* ``"random"``: uniform baseline.

Batch selection: ``selection="topk"`` labels the ``per_round`` highest scores (the classic rule;
its batches can be redundant — many near-identical points of one class); ``selection="power"``
samples ``per_round`` points without replacement with probability ∝ ``score^β``
(Gumbel-top-k; Kirsch et al. 2023, "stochastic batch acquisition").

``warm_start=False`` (the default) retrains from scratch every round; ``True`` continues
training the previous round's model and guide on the enlarged set, as the BHN paper did.
Measured on digits (MLP 64-50-10, 300 cosine epochs per round, 20 + 10 × 10 labels;
``docs/results/uncertainty.md``): with a mean-field guide over all weights (N(0, 1) prior) the
first round's 20 labels leave the posterior near the prior, at chance, and a warm start keeps
it there for every later round (final accuracy 0.09, 10 seeds) while a cold start escapes as
labels accumulate (0.72 with BALD, 3 seeds); with weight norm (only the scales random) the
two are level (BALD 0.919 cold vs 0.912 warm, 10 seeds).  A warm start is therefore opt-in.

``seed`` makes a run reproducible (initial set, network initialisation, training, draws)
without touching the caller's random streams.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from ..data.prediction_data import prediction_data
from ..posterior import metrics
from ..posterior.prediction import evaluate_checked, predict
from ..training.loop import fit
from .tool_support import class_probabilities, seeded, to_model_device

__all__ = ["run", "ActiveResult", "acquisition_scores", "balanced_initial", "ACQUISITIONS"]

ACQUISITIONS = ("bald", "entropy", "variation_ratio", "random")


@dataclass
class ActiveResult:
    """Outcome of :func:`run`.

    Attributes
    ----------
    num_labelled : list[int]
        Labelled-set size when each accuracy was measured (``rounds + 1`` entries).
    accuracy, nll : list[float]
        Test accuracy and NLL after training on that many labels.
    acquired : list[list[int]]
        Pool indices labelled in each round.
    elbo : list[float]
        Each round's training objective at the end of its fit (the last epoch's mean).
    converged : list[bool]
        Each round fit's convergence diagnosis (``FitResult.convergence.converged``).
    """

    acquisition: str
    num_labelled: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    acquired: list[list[int]] = field(default_factory=list)
    initial: list[int] = field(default_factory=list)
    elbo: list[float] = field(default_factory=list)
    converged: list[bool] = field(default_factory=list)

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1]


def acquisition_scores(probs: torch.Tensor, *, acquisition: str,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Acquisition score per pool point (higher = label first); ``(S, N, C) -> (N,)``."""
    if acquisition == "bald":
        return metrics.mutual_information(probs)
    if acquisition == "entropy":
        return metrics.predictive_entropy(probs)
    if acquisition == "variation_ratio":
        return metrics.variation_ratio(probs)
    if acquisition == "random":
        return torch.rand(probs.shape[1], generator=generator).to(probs.device)
    raise ValueError(f"acquisition must be one of {ACQUISITIONS}, got {acquisition!r}")


def balanced_initial(y: torch.Tensor, *, size: int, generator: torch.Generator) -> torch.Tensor:
    """``size`` random indices with (as nearly as possible) equally many of every class."""
    classes = torch.unique(y)
    if size < len(classes):
        raise ValueError(f"initial={size} cannot hold one example of each of {len(classes)} classes")
    base, extra = divmod(size, len(classes))
    chosen = []
    for i, c in enumerate(classes.tolist()):
        idx = torch.nonzero(y == c).reshape(-1)
        k = base + (1 if i < extra else 0)
        if len(idx) < k:
            raise ValueError(f"class {c} has {len(idx)} pool examples, {k} needed for a balanced start")
        chosen.append(idx[torch.randperm(len(idx), generator=generator)[:k]])
    return torch.cat(chosen)


def _power_k(scores: torch.Tensor, k: int, beta: float, generator: torch.Generator) -> torch.Tensor:
    """k indices sampled without replacement with probability ∝ ``scores^beta`` (Gumbel-top-k)."""
    u = torch.rand(len(scores), generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    keys = beta * torch.log(scores.cpu().double().clamp_min(1e-30)) - torch.log(-torch.log(u))
    return torch.argsort(-keys, stable=True)[:k]


def _top_k(scores: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of the k largest scores, ties broken at random."""
    perm = torch.randperm(len(scores), generator=generator)
    order = torch.argsort(-scores.cpu()[perm], stable=True)
    return perm[order[:k]]


def run(model_fn: Callable, guide_fn: Callable, pool, test, *, acquisition: str = "bald",
        initial: int = 20, per_round: int = 10, rounds: int = 10, warm_start: bool = False,
        epochs: int = 100, num_samples: int = 32, seed: int = 0, batch_size: int = 32,
        lr: float | None = None, eval_num_samples: int = 32, progress: bool = False,
        selection: str = "topk", beta: float = 1.0, predictive: str = "sample",
        **fit_kwargs) -> ActiveResult:
    """Run pool-based active learning and return the test-accuracy curve.

    Parameters
    ----------
    model_fn : callable
        ``model_fn() -> model`` builds a fresh model (e.g. a ``pb.BNN``).
    guide_fn : callable
        ``guide_fn(model) -> guide``.
    pool : (x, y) tensors
        Unlabelled pool (labels revealed on acquisition).  Tensors: the rounds index it by
        the points labelled (a ``DataLoader`` is refused; stack its batches).
    test : (x, y) tensors or DataLoader
        The test set, or a ``DataLoader`` of ``(x, y)`` batches, read once with the first round's
        model and each batch checked as :func:`pyro_bnn.evaluate` reads one
        (:func:`pyro_bnn.data.prediction_data.read_loader`): every round scores the same
        examples, bit-equal to the tensors at the same ``seed``.  A shuffled loader gives the
        same metrics up to rounding.
    acquisition : {"bald", "entropy", "variation_ratio", "random"}
    initial : int
        Size of the class-balanced random starting set.
    per_round, rounds : int
        Points labelled per round, number of acquisition rounds.
    warm_start : bool
        Continue training the previous model/guide (True) or start fresh each round (False,
        the default: a warm start can keep a collapsed posterior collapsed, see above).
    epochs, batch_size, lr, **fit_kwargs
        Passed to :func:`pyro_bnn.fit` every round (``lr=None``: the guide's default; the
        learning-rate schedule, fit's cosine decay by default, restarts every round).
    num_samples : int
        Posterior draws for the acquisition scores; ``eval_num_samples`` for test accuracy.
    seed : int
        Seeds the initial set, the tie-breaking, training and sampling; the caller's random
        streams are left as they were.
    selection : {"topk", "power"}
        Take the ``per_round`` best scores, or sample them ∝ ``score^beta``.
    predictive : str
        Predictive of the acquisition scores and the test metrics (:func:`pyro_bnn.predict`:
        ``"sample"`` or a guide's own, e.g. Laplace's ``"glm"``).

    Returns
    -------
    ActiveResult
        ``accuracy[r]`` after training with ``num_labelled[r] = initial + r·per_round``
        labels, ``r = 0..rounds``.

    Raises
    ------
    TypeError, ValueError
        ``pool`` not a pair of tensors, ``test`` neither a pair of tensors nor a ``DataLoader``
        (naming what was received), a test loader that yields no batch or batches without
        labels, data the model cannot take; bad options.
    """
    if acquisition not in ACQUISITIONS:
        raise ValueError(f"acquisition must be one of {ACQUISITIONS}, got {acquisition!r}")
    if selection not in ("topk", "power"):
        raise ValueError(f"selection must be 'topk' or 'power', got {selection!r}")
    x_pool, y_pool = _pair(pool, "pool", loader=False)
    test = test if isinstance(test, DataLoader) else _pair(test, "test", loader=True)
    if initial + rounds * per_round > len(x_pool):
        raise ValueError(f"the pool has {len(x_pool)} points, fewer than initial + rounds·per_round "
                         f"= {initial + rounds * per_round}")
    with seeded(seed):
        g = torch.Generator().manual_seed(seed)
        labelled = balanced_initial(y_pool, size=initial, generator=g)
        mask = torch.zeros(len(x_pool), dtype=torch.bool)
        mask[labelled] = True
        result = ActiveResult(acquisition, initial=labelled.tolist())
        model = guide = None
        for r in range(rounds + 1):
            if model is None or not warm_start:
                with seeded(seed * 1009 + r):
                    model = model_fn()
                    guide = guide_fn(model)
            if r == 0:  # checked (a loader read) once, with the first model: every round scores these
                x_test, y_test = prediction_data(model, *((test,) if isinstance(test, DataLoader) else test),
                                                 where="pb.analysis.active.run (test)", targets=True)
            idx = torch.nonzero(mask).reshape(-1)
            fitted = fit(model, guide, (x_pool[idx], y_pool[idx]), epochs=epochs, batch_size=batch_size,
                         lr=lr, progress=progress, seed=seed * 1009 + r, **fit_kwargs)
            result.elbo.append(-fitted.final_loss)
            result.converged.append(bool(fitted.convergence.converged))
            with seeded(seed * 7919 + r):
                test_metrics = evaluate_checked(model, guide, *to_model_device(model, guide, x_test, y_test),
                                                num_samples=eval_num_samples, predictive=predictive)
                result.num_labelled.append(int(mask.sum()))
                result.accuracy.append(test_metrics["accuracy"])
                result.nll.append(test_metrics["nll"])
                if r == rounds:
                    break
                rest = torch.nonzero(~mask).reshape(-1)
                if acquisition == "random":
                    pick = rest[torch.randperm(len(rest), generator=g)[:per_round]]
                else:
                    probs = predict(model, guide, to_model_device(model, guide, x_pool[rest]),
                                    num_samples=num_samples, predictive=predictive)
                    if probs.dim() == 2:  # a deterministic predictive (N, C)
                        probs = probs.unsqueeze(0)
                    probs = class_probabilities(model, guide, probs)
                    score = acquisition_scores(probs, acquisition=acquisition)
                    chosen = (_top_k(score, per_round, g) if selection == "topk"
                              else _power_k(score, per_round, beta, g))
                    pick = rest[chosen]
            mask[pick] = True
            result.acquired.append(pick.tolist())
    return result


def _pair(data, name: str, *, loader: bool):
    """``(x, y)`` of ``pool=`` / ``test=``: a tuple or list of two tensors, else ``TypeError``
    naming what was expected and what was received."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return data
    expected = "a tuple (x, y) of tensors" + (" or a DataLoader of (x, y) batches" if loader else "")
    got = (f"a {type(data).__name__} of {len(data)} ({', '.join(type(t).__name__ for t in data[:3])})"
           if isinstance(data, (tuple, list)) else type(data).__name__)
    hint = ("; the pool is indexed by the points each round labels, so it must be tensors: stack the "
            "loader's batches, x, y = map(torch.cat, zip(*loader))" if isinstance(data, DataLoader) else "")
    raise TypeError(f"{name} in pb.analysis.active.run must be {expected}, got {got}{hint}")
