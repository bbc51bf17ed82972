"""Permutation-symmetrised mean-field guide (Gelberg, van der Ouderaa, van der Wilk, Gal 2024).

The symmetrised guide is the mixture of all hidden-unit relabelings of a mean-field base
``q = N(μ, diag σ²)`` (``docs/METHODS.md`` §3):

.. math::

    q_G(ω) = \\frac{1}{|G|} \\sum_{g ∈ G} q(g^{-1}·ω),   \\qquad
    \\mathcal L^G = \\mathrm{ELBO}(q) + H(q_G) − H(q) ≥ \\mathrm{ELBO}(q).

Every mixture component computes the same functions as ``q``, so sampling and prediction
use the base ``q`` (the inherited :class:`~pyro_bnn.guides.MeanField` ``forward``); only the
objective changes.  The entropy gap ``H(q_G) − H(q)`` is replaced by a lower bound
estimated at a weight draw ω ∼ q (:mod:`.symmetrized_entropy`, ``docs/symmetrized_estimator.md``):
the data term's own draw under weight noise, a draw of its own under per-example noise (local
reparameterisation and Flipout, MeanField's default where they apply), which draws no single
weight sample for the data term:

* ``estimator="local"`` (default): an equivariant assignment distribution ``ρ(g|ω)`` built
  from how well each of ω's hidden units fits each unit ``(μ_r, σ_r)`` of q.  With
  ``num_permutations=1`` (default) the bound is ``log|G| + log ρ(e|ω)``: deterministic
  given ω, exact gradients, cost ``O(d² C)`` per hidden layer.  ``K > 1`` adds ``K − 1``
  proposals ``g ∼ ρ`` importance-weighted against the uniform measure on G.
* ``estimator="uniform"``: the paper's bound with ``K − 1`` uniformly random permutations,
  ``log K − logsumexp(0, d_1..d_{K−1})``; on real networks every random permutation moves
  units far from their own, so it equals ``log K`` with zero gradient (issue 17).
* ``estimator="exact"``: ``log|G| − logsumexp_g d_g`` summed over all of G — the exact
  per-ω gap, for small groups (≤ 10⁵ elements) as a reference.

The training loss is ``−L̂^G = −ELBO − gap``.  ``fit``'s ``history["elbo"]`` is the plain
ELBO, ``history["symmetrized_elbo"]`` the symmetrised one and ``history["entropy_gap"]`` the
gap estimate.  ``estimator="uniform", num_permutations=1`` is exactly
:class:`~pyro_bnn.guides.MeanField`'s loss.  Which architectures the symmetry is
discovered for: see :mod:`pyro_bnn.guides.symmetry`.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping, Sequence

import pyro.distributions as dist
import torch
from pyro import poutine
from torch.distributions import kl_divergence

from ..contract.guide import register_guide
from ..contract.local_params import local_params, unwrap_model
from ..contract.objective import GuideObjective
from ..contract.pyro_objective import observed_sites
from ..data.batches import as_tensors
from ..model.bnn import is_bnn
from ..model.likelihoods import log_likelihood
from ..model.modes import buffers_kept
from .meanfield import (
    MeanField,
    MeanFieldELBO,
    _fusable_sites,
    meanfield_loss,
    standard_normal_like,
)
from .symmetrized_entropy import local_entropy_gap, log_density_ratios, uniform_entropy_gap
from .symmetry import (
    check_batch_statistics,
    check_declared_symmetries,
    discover_symmetries,
    enumerate_group,
    group_sizes,
    log_group_order,
    resolve_symmetries,
    running_statistics_layers,
    sample_permutations,
)

__all__ = ["Symmetrized", "SymmetrizedELBO", "symmetrized_elbo", "symmetrized_terms",
           "log_density_ratios", "ESTIMATORS"]

#: The entropy-gap estimators and their default K (training; :func:`symmetrized_elbo`);
#: ``"exact"`` sums over all of G (small groups only: a reference, K is not used).
ESTIMATORS = {"local": (1, 100), "uniform": (10, 500), "exact": (1, 1)}

#: Largest group ``"exact"`` enumerates.
MAX_EXACT_GROUP = 100_000


def _check_estimator(estimator) -> str:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ESTIMATORS)}, got {estimator!r}")
    return estimator


def _check_k(num_permutations, estimator: str, which: int) -> int:
    if num_permutations is None:
        return ESTIMATORS[estimator][which]
    if isinstance(num_permutations, bool) or not isinstance(num_permutations, int):
        raise TypeError(f"num_permutations must be an int, got {type(num_permutations).__name__}")
    if num_permutations < 1:
        raise ValueError(f"num_permutations must be >= 1, got {num_permutations}")
    return num_permutations


class Symmetrized(MeanField):
    """Mean-field guide trained with the permutation-symmetrised ELBO ``L^G``.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model.
    num_permutations : int, optional
        K, the number of group elements evaluated per step: for ``"local"`` the identity and
        ``K − 1`` proposals (default 1: the deterministic bound), for ``"uniform"`` the
        identity and ``K − 1`` uniform random permutations (default 10; ``1`` gives plain
        mean-field VI).
    permutations : list of dict, optional
        Declared symmetry: groups ``{site name: permuted axis}`` (see
        :mod:`pyro_bnn.guides.symmetry`); default: discovered from the model's modules.
    estimator : {"local", "uniform", "exact"}
        The entropy-gap bound (see the module docstring).
    **meanfield_kwargs
        ``init_scale``, ``init_loc_fn``, ``local_reparameterization`` of :class:`MeanField`.
        Per-example noise (``"auto"``: local reparameterisation and Flipout where they apply,
        as in :class:`MeanField`) samples the data term's pre-activations (or per-example
        weights) and evaluates the entropy gap on a weight draw of its own; with weight
        noise (``False``) the gap is taken on the data term's draw.  The bound is the same; on
        Fashion-MNIST (MLP, 60 epochs) local reparameterisation reached a 4,000-nat higher
        symmetrised bound, 1.5 points more accuracy and a lower NLL
        (``docs/results/fashion_mnist.md``).

    Raises
    ------
    ValueError, TypeError
        ``num_permutations`` is not a positive int; unknown ``estimator``; a declared group
        is malformed (raised when the guide is first set up, once the sites' shapes are
        known).

    Examples
    --------
    >>> guide = pb.guides.Symmetrized(model)                               # doctest: +SKIP
    >>> result = pb.fit(model, guide, (x, y), epochs=10)                   # doctest: +SKIP
    >>> result.history["elbo"], result.history["symmetrized_elbo"]        # doctest: +SKIP
    """

    #: :meth:`learning_rate`'s factor on a net with a convolution that feeds no normalisation
    #: layer: a quarter, half MeanField's rate for that net (0.0051 for the LeNet on 60,000
    #: Fashion-MNIST images, MeanField 0.0102).  Measured there (``docs/results/fashion_mnist.md``,
    #: thirty-fifth session), 240 epochs, seeds 0 and 1: lr
    #: 0.01 ended at symmetrised bounds −24,075 / −23,835 (below seed 0's own 120-epoch fit,
    #: −22,827), lr 0.005 at −22,276 / −22,266 (1.7 points more accurate); at 120 epochs the two
    #: rates were level (−22,922 vs −22,827), and on 10,000 images (80 epochs, 3 seeds) 0.0125
    #: and 0.025 were level (mean −7,475 vs −7,359).
    unnormalized_conv_lr_factor = 0.25
    #: :meth:`learning_rate`'s factor on a net without random convolutions (an MLP), after
    #: MeanField's ceiling: half MeanField's rate (0.0125 up to 40,000 points, 0.0102 at 60,000).
    #: Measured on the Fashion-MNIST MLP (``docs/results/fashion_mnist.md``, thirty-seventh
    #: session), 10,000 images, seed 0: lr 0.0125 ended at the symmetrised bound −10,221 at 160
    #: epochs and −10,124 at 320 (the 2× check passes), lr 0.025 at −10,408 and −10,734 (its longer
    #: fit ended lower) and lr 0.05 at −11,801; accuracy 0.818 against 0.789 and 0.682.
    dense_lr_factor = 0.5

    def __init__(self, model, num_permutations: int | None = None,
                 permutations: Sequence[Mapping[str, int]] | None = None, *,
                 estimator: str = "local", **meanfield_kwargs):
        self.estimator = _check_estimator(estimator)
        self.num_permutations = _check_k(num_permutations, self.estimator, 0)
        network = unwrap_model(model)
        if not isinstance(network, torch.nn.Module):
            raise TypeError("Symmetrized finds the permutable hidden units in the network's module structure, "
                            "so it needs a pyro_bnn.BNN or a PyroModule model (possibly wrapped in Pyro "
                            f"handlers such as pyro.condition), got {type(network).__name__} {network!r}; "
                            "use MeanField for other models")
        super().__init__(model, **meanfield_kwargs)
        self.declared_permutations = None if permutations is None else list(permutations)
        self._symmetry: list[dict[str, int]] | None = None
        self._running_statistics: list[str] = []  # normalisation layers the groups pass through
        self._original_model = (network,)  # the module under any handlers; a tuple: no submodule

    def learning_rate(self, num_data: int) -> float:
        """:meth:`MeanField.learning_rate`, times :attr:`dense_lr_factor` on a net without random
        convolutions (an MLP; on convolutional nets :attr:`unnormalized_conv_lr_factor` applies)."""
        rate = super().learning_rate(num_data)
        return rate if self.random_convolutions() else rate * self.dense_lr_factor

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        network = self._original_model[0]
        example = tuple(a[:8] if isinstance(a, torch.Tensor) and a.dim() else a for a in args)
        if self.declared_permutations is not None:  # fail early on a malformed declaration
            self._symmetry = resolve_symmetries(self.declared_permutations, self.site_shapes())
            with poutine.block():
                verified, needed = check_declared_symmetries(network, self._symmetry, self.site_shapes(),
                                                             example, kwargs)
            self._running_statistics = list(dict.fromkeys(
                running_statistics_layers(network, self._symmetry) + needed))
            for group, ok in zip(self._symmetry, verified):
                if not ok:
                    warnings.warn(
                        f"the declared permutation group {group} is not a symmetry of the model: permuting it "
                        "changes the model's output on random weights (eval mode, running statistics alike "
                        "across units), so the symmetrised bound would count mixture components that are not "
                        "posterior modes. Check the sites and axes of permutations=", UserWarning, stacklevel=2)
        else:
            with poutine.block():
                self._symmetry, self._running_statistics = discover_symmetries(
                    network, self.site_shapes(), example=example, example_kwargs=kwargs)
            if not self._symmetry:
                warnings.warn(
                    "Symmetrized found no permutable hidden layer in the model, so it trains exactly as "
                    "MeanField: a group needs Linear -> activation -> Linear (or Conv -> ... -> Conv) with "
                    "random weights and biases and nothing else between but BatchNorm / InstanceNorm / "
                    "LayerNorm whose affine parameters are random too (pb.BNN(net, stochastic=...) can select "
                    "them); a deterministic parameter in the way and a Conv -> Flatten -> Linear boundary end "
                    "a group. Declare the symmetry with permutations=[{site: axis, ...}, ...] if the "
                    "network has one the search does not see", UserWarning, stacklevel=2)

    def site_shapes(self) -> dict[str, torch.Size]:
        """Shapes of the random sites (the guide must be set up)."""
        return {name: self.loc_and_scale(name)[0].shape for name in self.site_names()}

    def symmetry(self) -> list[dict[str, int]]:
        """The groups ``{site: axis}`` that are permuted (declared or discovered).

        Returns
        -------
        list of dict
            ``[{site: axis}, ...]``, one per permutable hidden layer (``[]`` if none).
        """
        if self.prototype_trace is None:
            raise RuntimeError("the guide is not set up yet: call it (or pb.fit) on data first")
        if self._symmetry is None:
            self._symmetry, self._running_statistics = discover_symmetries(self._original_model[0],
                                                                           self.site_shapes())
        return self._symmetry

    def check_batch_statistics(self) -> None:
        """Raise ``ValueError`` if a group passes through a normalisation layer that is in eval
        mode (running statistics): the permutation is then no symmetry of the model
        (:func:`pyro_bnn.guides.symmetry.check_batch_statistics`)."""
        self.symmetry()
        check_batch_statistics(self._original_model[0], self._running_statistics)

    def training_bound(self, model, data, *, num_samples: int = 32) -> tuple[float, str, float]:
        """``(L^G, "symmetrized_elbo", se)``: the symmetrised ELBO this guide maximises
        (:func:`symmetrized_elbo` with ``num_samples`` draws), not its base ``q``'s ELBO, and its
        Monte Carlo standard error."""
        terms = symmetrized_elbo(model, self, data, num_samples=num_samples, return_terms=True)
        return float(terms["symmetrized_elbo"]), "symmetrized_elbo", terms["symmetrized_elbo_se"]

    def _objective_settings(self) -> list[str]:
        return [f"estimator={self.estimator}, K={self.num_permutations}"]

    def make_objective(self, num_particles: int = 1):
        return SymmetrizedELBO(self.num_permutations, num_particles, estimator=self.estimator)


register_guide("symmetrized", lambda model, **kw: Symmetrized(model, **kw))


def symmetrized_terms(model, locs, scales, x, y, noise, groups, perms, num_data=None, values=None):
    """One-sample data term and uniform-estimator entropy gap of a BNN at ``ω = μ + σ ε``
    (random numbers given).

    Parameters
    ----------
    model : pyro_bnn.BNN
    locs, scales, noise : dict site -> Tensor
        μ, σ and ε (same shapes).
    x, y : Tensor
        A minibatch; the log-likelihood is scaled by ``num_data / len(x)``.
    groups, perms
        The symmetry and ``K − 1`` elements (``(K−1, d_k)`` each), or ``perms=None`` (K = 1).
    values : dict site -> Tensor, optional
        ``ω`` already formed from these ``μ, σ, ε`` (e.g. by MeanField's fused node).

    Returns
    -------
    (Tensor, Tensor)
        ``−(N/M) log p(y|x, ω)`` and ``Ĥ_K − H(q)`` estimate (scalars).  The loss of one
        particle is ``nll + KL(q‖p) − gap``.
    """
    scale_factor = (num_data or len(x)) / len(x)
    if values is None:
        values = {name: locs[name] + scales[name] * noise[name] for name in locs}
    f = model.run_with(values, x)
    nll = 0.0 - log_likelihood(model.likelihood, f, y).sum() * scale_factor
    if perms is None or not groups:
        return nll, torch.zeros((), device=nll.device, dtype=nll.dtype)
    return nll, uniform_entropy_gap(values, locs, scales, groups, perms)


class SymmetrizedELBO(GuideObjective):
    """Loss ``−L̂^G = −E_q log p(D|ω) + KL(q‖p) − gap`` of a mean-field guide.

    ``gap`` is the chosen estimator's lower bound of ``H(q_G) − H(q)``.  Returns
    ``(loss, extras)`` with extras ``elbo`` (plain ELBO estimate), ``symmetrized_elbo``
    (``−loss``) and ``entropy_gap`` (the gap estimate), all detached.

    For a :class:`pyro_bnn.BNN` with closed-form KL and no local reparameterisation the
    data term and the entropy gap share the weight sample ω; otherwise the plain mean-field
    loss is computed as usual and the gap uses a fresh ω ∼ q.

    Parameters
    ----------
    num_permutations : int, optional
        K (default: the estimator's, see :data:`ESTIMATORS`).
    num_particles : int
        Weight samples per step.
    estimator : {"local", "uniform", "exact"}

    Notes
    -----
    It is also a Pyro ``ELBO`` (:class:`~pyro_bnn.contract.objective.GuideObjective`):
    ``SVI(model, guide, optim, loss=guide.make_objective())`` optimises the symmetrised
    objective (Pyro's ``Trace_ELBO`` would optimise the plain ELBO).
    """

    def __init__(self, num_permutations: int | None = None, num_particles: int = 1, *,
                 estimator: str = "local"):
        super().__init__(num_particles=int(num_particles))
        self.estimator = _check_estimator(estimator)
        self.num_permutations = _check_k(num_permutations, self.estimator, 0)
        self._meanfield = MeanFieldELBO(self.num_particles)
        self._all_elements: tuple | None = None     # (sizes, elements) for "exact"

    def _enumerated(self, sizes, device):
        if self._all_elements is None or self._all_elements[0] != sizes:
            if log_group_order(sizes) > math.log(MAX_EXACT_GROUP):
                raise ValueError(f"estimator='exact' enumerates G, but |G| = exp({log_group_order(sizes):.1f})"
                                 f" > {MAX_EXACT_GROUP}; use estimator='local'")
            self._all_elements = (list(sizes), enumerate_group(sizes, device=device))
        return self._all_elements[1]

    def _gap(self, values, locs, scales, groups, sizes, device, log_scales=False):
        """(estimate, surrogate) of the entropy gap at ω = ``values``."""
        K = self.num_permutations
        if not groups or (K == 1 and self.estimator == "uniform"):
            zero = torch.zeros((), device=device)
            return zero, zero
        if self.estimator == "local":
            return local_entropy_gap(values, locs, scales, groups, K, log_scales=log_scales)
        if self.estimator == "exact":
            ratios = log_density_ratios(values, locs, scales, groups, self._enumerated(sizes, device))
            gap = log_group_order(sizes) - torch.logsumexp(ratios, 0)
            return gap, gap
        gap = uniform_entropy_gap(values, locs, scales, groups,
                                  sample_permutations(sizes, K - 1, device=device))
        return gap, gap

    def __call__(self, model, guide, x, y, num_data=None):
        if guide.prototype_trace is None:
            guide._setup_prototype(x, y, num_data=num_data)
        sites = guide.site_names()
        fast = (is_bnn(model)
                and not guide.local_reparameterization)
        # the fused sample-and-KL node of MeanField when every site allows it
        fused = _fusable_sites(model, guide, sites) if fast else {}
        fused = fused if len(fused) == len(sites) else {}
        # the local bound reads log σ directly when σ = exp(ρ): on the fused path σ is then
        # never needed outside the fused node (one pass less over the weights)
        log_scales = (bool(fused) and self.estimator == "local" and self.num_permutations == 1
                      and guide.scale_parameterization == "exp")
        if log_scales:
            raw = {name: guide.loc_and_raw_scale(name) for name in sites}
            locs, scales = {k: v[0] for k, v in raw.items()}, {k: v[1] for k, v in raw.items()}
        else:
            qs = {name: guide.loc_and_scale(name) for name in sites}
            locs, scales = {k: v[0] for k, v in qs.items()}, {k: v[1] for k, v in qs.items()}
        trivial = self.estimator == "uniform" and self.num_permutations == 1
        groups = [] if trivial else guide.symmetry()
        if groups:
            guide.check_batch_statistics()
        sizes = group_sizes(groups, {k: v.shape for k, v in locs.items()})
        device = locs[sites[0]].device
        gap = surrogate = 0.0
        w = guide.kl_weight  # the modified KL, KL(q‖p) − gap, is annealed as one
        if fast:  # MeanField's own loss; the gap is taken on each particle's weight draw ω
            draws = []
            out = meanfield_loss(model, guide, x, y, num_data, self.num_particles,
                                 on_draw=lambda values: draws.append(
                                     self._gap(values, locs, scales, groups, sizes, device, log_scales)),
                                 return_neg_elbo=w != 1.0)
        else:     # local reparameterisation draws no weights: the gap gets its own ω ~ q
            out = self._meanfield(model, guide, x, y, num_data)
            draws = [self._gap({n: locs[n] + scales[n] * standard_normal_like(locs[n]) for n in sites},
                               locs, scales, groups, sizes, device)
                     for _ in range(self.num_particles)]
        for gap_p, sur_p in draws:
            gap, surrogate = gap + gap_p, surrogate + sur_p
        gap, surrogate = gap / self.num_particles, surrogate / self.num_particles
        gap = torch.as_tensor(gap).detach()
        if w == 1.0:
            loss = out - surrogate
            extras = {"elbo": -out.detach(), "symmetrized_elbo": -loss.detach(), "entropy_gap": gap}
        else:   # annealed: the loss weighs KL − gap by w, the reported bounds are at full weight
            annealed, neg_elbo = out          # meanfield_loss's (loss, −ELBO) or MeanFieldELBO's (loss, extras)
            if isinstance(neg_elbo, dict):
                neg_elbo = -neg_elbo["elbo"]
            loss = annealed - w * surrogate
            extras = {"elbo": -neg_elbo, "symmetrized_elbo": gap - neg_elbo, "entropy_gap": gap}
        return loss, extras


# ------------------------------------------------------------------ evaluation of L^G
@torch.no_grad()
def symmetrized_elbo(model, guide, data, num_permutations: int | None = None,
                     permutations: Sequence[Mapping[str, int]] | None = None, *,
                     num_samples: int = 32, exact: bool = False, batch_size: int = 1024,
                     estimator: str = "local", return_terms: bool = False):
    """A lower bound of the symmetrised ELBO ``L^G = ELBO + H(q_G) − H(q)`` (full data).

    Works for any mean-field guide (a :class:`~pyro_bnn.guides.MeanField` trained with the
    plain ELBO as well as :class:`Symmetrized`), so guides can be compared on ``L^G``.  The
    gap is evaluated in float64.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
    guide : MeanField (or any guide with ``loc_and_scale`` and ``site_names``), set up
    data : (x, y) tensors
        The whole training set (the ELBO is not minibatch-scaled).
    num_permutations : int, optional
        K of the entropy bound (default 100 for ``"local"``, 500 for ``"uniform"``, as in
        the paper's Table 3).
    permutations : list of dict, optional
        Declared symmetry; default: the guide's own (``Symmetrized``) or discovered.
    num_samples : int
        Monte Carlo draws ω ∼ q for the data term and the entropy gap.
    exact : bool
        Sum over all of G instead of K random elements: ``log q_G(ω)`` exactly (only for
        small ``|G|``; raises ``ValueError`` above 10⁵ elements).
    estimator : {"local", "uniform", "exact"}
        The gap bound (:mod:`.symmetrized_entropy`); ``"exact"`` is ``exact=True``.
    return_terms : bool
        Also return the parts.

    Returns
    -------
    float or dict
        ``L^G`` (not normalised by N), or ``{"symmetrized_elbo", "elbo",
        "expected_log_likelihood", "kl", "entropy_gap", "log_group_order",
        "symmetrized_elbo_se"}``; the last is the Monte Carlo standard error of ``L^G`` over the
        ``num_samples`` draws (``sd / √S``, NaN for one draw).
    """
    x, y = as_tensors(data)
    estimator = _check_estimator(estimator)
    exact = exact or estimator == "exact"
    try:
        num_permutations = _check_k(num_permutations, estimator, 1)
    except TypeError as err:
        raise ValueError(str(err)) from None
    sites = guide.site_names()
    qs = {name: guide.loc_and_scale(name) for name in sites}
    locs = {k: v[0].detach() for k, v in qs.items()}
    scales = {k: v[1].detach() for k, v in qs.items()}
    shapes = {k: v.shape for k, v in locs.items()}
    device = locs[sites[0]].device
    x = x.to(device)
    y = None if y is None else y.to(device)
    network = unwrap_model(model)
    if permutations is not None:
        groups = resolve_symmetries(list(permutations), shapes)
        check_batch_statistics(network, running_statistics_layers(network, groups))
    elif isinstance(guide, Symmetrized):
        groups = guide.symmetry()
        guide.check_batch_statistics()
    else:
        groups, running = discover_symmetries(network, shapes)
        check_batch_statistics(network, running)
    sizes = group_sizes(groups, shapes)
    log_order = log_group_order(sizes)
    if exact and log_order > math.log(MAX_EXACT_GROUP):
        raise ValueError(f"exact=True enumerates G, but |G| = exp({log_order:.1f}) > 1e5; "
                         "use num_permutations instead")
    all_g = enumerate_group(sizes, device=device) if exact and groups else None
    bnn = is_bnn(model)
    kl, mc_kl = 0.0, []
    for name in sites if bnn else []:
        try:
            kl = kl + float(kl_divergence(dist.Normal(locs[name], scales[name]).to_event(locs[name].dim()),
                                          model.site_prior(name)))
        except NotImplementedError:
            mc_kl.append(name)
    lls, gaps, kls = [], [], []
    locs64, scales64 = _f64(locs), _f64(scales)  # the gap in float64: evaluation, not training
    # ω gets its own stream (seeded from the global one), so two calls under the same seed
    # see the same weight draws whatever permutations they sample: paired comparisons.
    omega_rng = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, ())))
    with local_params(model, guide), buffers_kept(model, guide):  # BatchNorm's statistics stay
        for _ in range(num_samples):
            values = {n: locs[n] + scales[n] * torch.randn(locs[n].shape, generator=omega_rng,
                                                           device=device, dtype=locs[n].dtype)
                      for n in sites}
            if bnn:
                lls.append(_bnn_log_likelihood(model, values, x, y, batch_size))
                kls.append(sum(float(dist.Normal(locs[n], scales[n]).log_prob(values[n]).sum()
                                     - model.site_prior(n).log_prob(values[n])) for n in mc_kl))
            else:
                ll, log_prior = _trace_log_densities(model, values, x, y)
                log_q = sum(float(dist.Normal(locs[n], scales[n]).log_prob(values[n]).sum()) for n in sites)
                lls.append(ll)
                kls.append(log_q - log_prior)
            if not groups or (all_g is None and estimator == "uniform" and num_permutations == 1):
                gaps.append(0.0)
            elif all_g is not None:
                d = log_density_ratios(_f64(values), locs64, scales64, groups, all_g)
                gaps.append(float(log_order - torch.logsumexp(d, 0)))
            elif estimator == "local":
                gaps.append(float(local_entropy_gap(_f64(values), locs64, scales64, groups,
                                                    num_permutations)[0]))
            else:
                perms = sample_permutations(sizes, num_permutations - 1, device=device)
                gaps.append(float(uniform_entropy_gap(_f64(values), locs64, scales64, groups, perms)))
    ell = sum(lls) / num_samples
    kl_total = kl + sum(kls) / num_samples
    gap = sum(gaps) / num_samples
    elbo = ell - kl_total
    per_draw = [ll - k + g for ll, k, g in zip(lls, kls, gaps)]   # the closed-form KL is a constant
    se = statistics.stdev(per_draw) / math.sqrt(num_samples) if num_samples > 1 else math.nan
    terms = {"symmetrized_elbo": elbo + gap, "elbo": elbo, "expected_log_likelihood": ell,
             "kl": kl_total, "entropy_gap": gap, "log_group_order": log_order,
             "symmetrized_elbo_se": se}
    return terms if return_terms else terms["symmetrized_elbo"]


def _f64(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in tensors.items()}


def _bnn_log_likelihood(model, values, x, y, batch_size) -> float:
    if y is None:
        raise ValueError("symmetrized_elbo needs targets: data must be (x, y)")
    total = 0.0
    for start in range(0, len(x), batch_size):
        f = model.run_with(values, x[start:start + batch_size])
        total += float(log_likelihood(model.likelihood, f, y[start:start + batch_size]).sum())
    return total


def _trace_log_densities(model, values, x, y) -> tuple[float, float]:
    """``log p(D|ω)`` and ``log p(ω)`` of a hand-written model, from one conditioned trace."""
    tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
    ll = sum(float(site["fn"].log_prob(site["value"]).sum()) for _, site in observed_sites(tr, values))
    log_prior = sum(float(site["fn"].log_prob(site["value"]).sum()) for name, site in tr.nodes.items()
                    if site["type"] == "sample" and name in values)
    return float(ll), float(log_prior)
