"""Permutation-symmetrised mean-field guide (Gelberg, van der Ouderaa, van der Wilk, Gal 2024).

The symmetrised guide is the mixture of all hidden-unit relabelings of a mean-field base
``q = N(μ, diag σ²)`` (``docs/METHODS.md`` §3):

.. math::

    q_G(ω) = \\frac{1}{|G|} \\sum_{g ∈ G} q(g^{-1}·ω),   \\qquad
    \\mathcal L^G = \\mathrm{ELBO}(q) + H(q_G) − H(q) ≥ \\mathrm{ELBO}(q).

Every mixture component computes the same functions as ``q``, so sampling and prediction
use the base ``q`` (the inherited :class:`~pyro_bnn.guides.MeanField` ``forward``); only the
objective changes.  ``H(q_G)`` is replaced by the K-sample lower bound

.. math::

    \\hat H_K = −E_{ω∼q,\\, g_1..g_{K−1}∼U(G)} \\log \\frac1K\\Big[q(ω) + \\sum_{j} q(g_j·ω)\\Big]
    \\;≤\\; H(q_G),

increasing in K (one uniform permutation per hidden layer per j, drawn afresh every step).
With ``d_j = \\log q(g_j·ω) − \\log q(ω) = −½ Σ_i (z_{j,i}² − ε_i²)`` (``z_j = (g_j·ω − μ)/σ``;
the ``log σ`` terms cancel because permutations preserve them) the estimated gap is

.. math::

    \\hat H_K − H(q) = \\log K − \\operatorname{logsumexp}(0, d_1, …, d_{K−1}) ∈ (−∞, \\log K],

using the same ω as the data term.  The training loss is ``−L̂^G = −ELBO − gap``: this is
"−data + KL(q‖p) + H(q) − Ĥ_K".  Only sites that some permutation moves contribute, and
the cost is K−1 gathers and squared distances over those weights per step.

Design choice: a custom objective (:class:`SymmetrizedELBO`) on top of the mean-field
loss, not a guide with a mixture density; ``fit``'s ``history["elbo"]`` is the plain ELBO and
``history["symmetrized_elbo"]`` the symmetrised one.  ``num_permutations=1`` is exactly
:class:`~pyro_bnn.guides.MeanField`'s loss (same random numbers, same arithmetic).
Which architectures the symmetry is discovered for: see :mod:`pyro_bnn.symmetry`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pyro.distributions as dist
import torch
from pyro import poutine
from torch.distributions import kl_divergence

from .._local_params import local_params
from ..data import as_tensors
from ..likelihoods import log_likelihood
from ..symmetry import (
    enumerate_group,
    find_symmetries,
    group_sizes,
    log_group_order,
    permute_batched,
    resolve_symmetries,
    sample_permutations,
)
from ._fused_gaussian import sample_and_kl
from .base import register_guide
from .meanfield import (
    MeanField,
    MeanFieldELBO,
    _fusable_sites,
    _run_with_values,
    closed_form_kl,
    standard_normal_like,
)

__all__ = ["Symmetrized", "SymmetrizedELBO", "symmetrized_elbo", "symmetrized_terms",
           "log_density_ratios", "entropy_gap"]


class Symmetrized(MeanField):
    """Mean-field guide trained with the permutation-symmetrised ELBO ``L^G``.

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
        The model.
    num_permutations : int
        K in the entropy bound ``Ĥ_K`` (``K − 1`` random permutations per step); ``1`` gives
        plain mean-field VI.
    permutations : list of dict, optional
        Declared symmetry: groups ``{site name: permuted axis}`` (see
        :mod:`pyro_bnn.symmetry`); default: discovered from the model's modules.
    **meanfield_kwargs
        ``init_scale``, ``init_loc_fn``, ``local_reparameterization`` of :class:`MeanField`.

    Raises
    ------
    ValueError, TypeError
        ``num_permutations`` is not a positive int; a declared group is malformed (raised
        when the guide is first set up, once the sites' shapes are known).

    Examples
    --------
    >>> guide = pb.guides.Symmetrized(model, num_permutations=10)         # doctest: +SKIP
    >>> result = pb.fit(model, guide, (x, y), epochs=10)                   # doctest: +SKIP
    >>> result.history["elbo"], result.history["symmetrized_elbo"]        # doctest: +SKIP
    """

    def __init__(self, model, num_permutations: int = 10,
                 permutations: Sequence[Mapping[str, int]] | None = None, **meanfield_kwargs):
        if isinstance(num_permutations, bool) or not isinstance(num_permutations, int):
            raise TypeError(f"num_permutations must be an int, got {type(num_permutations).__name__}")
        if num_permutations < 1:
            raise ValueError(f"num_permutations must be >= 1, got {num_permutations}")
        super().__init__(model, **meanfield_kwargs)
        self.num_permutations = num_permutations
        self.declared_permutations = None if permutations is None else list(permutations)
        self._symmetry: list[dict[str, int]] | None = None
        self._original_model = (model,)  # a tuple: not registered as a submodule

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        if self.declared_permutations is not None:  # fail early on a malformed declaration
            self._symmetry = resolve_symmetries(self.declared_permutations, self.site_shapes())
        else:
            example = tuple(a[:8] if isinstance(a, torch.Tensor) and a.dim() else a for a in args)
            with poutine.block():
                self._symmetry = find_symmetries(self._original_model[0], self.site_shapes(),
                                                 example=example, example_kwargs=kwargs)

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
            self._symmetry = find_symmetries(self._original_model[0], self.site_shapes())
        return self._symmetry

    def make_objective(self, num_particles: int = 1):
        return SymmetrizedELBO(self.num_permutations, num_particles)


register_guide("symmetrized", lambda model, **kw: Symmetrized(model, **kw))


# ---------------------------------------------------------------------------- the math
def log_density_ratios(values: Mapping[str, torch.Tensor], locs: Mapping[str, torch.Tensor],
                       scales: Mapping[str, torch.Tensor], groups, perms) -> torch.Tensor:
    """``d_j = log q(g_j·ω) − log q(ω)`` for a mean-field ``q`` and ``K'`` group elements.

    .. math:: d_j = −\\tfrac12 \\sum_i \\big(z_{j,i}^2 − ε_i^2\\big),\\quad
              z_j = (g_j·ω − μ)/σ,\\; ε = (ω − μ)/σ.

    A site permuted along a single axis (size d, the other axes flattened to C) uses the
    assignment-cost matrix ``M[a, r] = Σ_c (ω[a, c] − μ[r, c])² / σ[r, c]²`` (two
    ``d × C × d`` matmuls) and ``Σ_i z_{j,i}² = Σ_r M[p_j(r), r]``, so the cost is
    ``O(d² C + K d)`` instead of ``O(K d C)``; sites moved by two groups (inner layers of
    deep MLPs) are gathered explicitly.

    Parameters
    ----------
    values, locs, scales : dict site -> Tensor
        ω, μ, σ (same shapes).
    groups : list of dict
        The symmetry (see :mod:`pyro_bnn.symmetry`).
    perms : list of Tensor
        One ``(K', d_k)`` index tensor per group.

    Returns
    -------
    Tensor, shape (K',)
    """
    num = perms[0].shape[0] if perms else 0
    first = values[next(iter(values))]
    total = first.new_zeros(num)
    owners: dict[str, list[int]] = {}
    for k, group in enumerate(groups):
        for site in group:
            owners.setdefault(site, []).append(k)
    multi = [k for k, g in enumerate(groups) if any(len(owners[s]) > 1 for s in g)]
    for k, group in enumerate(groups):
        single = [s for s in group if len(owners[s]) == 1]
        if not single:
            continue
        # all sites this group alone moves, side by side as one (d, C) block: one cost matrix
        w, mu, sd = (torch.cat([t[s].movedim(group[s], 0).reshape(t[s].shape[group[s]], -1)
                                for s in single], 1) for t in (values, locs, scales))
        cost = _assignment_cost(w, mu, sd, 0)
        rows = torch.arange(cost.shape[0], device=cost.device)
        moved = cost[perms[k], rows].sum(-1) - cost.diagonal().sum()
        total = total - 0.5 * moved.to(total.dtype)
    if multi:
        sub_groups = [{s: a for s, a in groups[k].items() if len(owners[s]) > 1} for k in multi]
        permuted = permute_batched(values, sub_groups, [perms[k] for k in multi])
        for site, wp in permuted.items():
            loc, scale = locs[site], scales[site]
            z = (wp - loc) / scale
            z0 = (values[site] - loc) / scale
            total = total - 0.5 * (z.square() - z0.square()).flatten(1).sum(1)
    return total


def _assignment_cost(value, loc, scale, axis: int) -> torch.Tensor:
    """``M[a, r] = Σ_c (ω[a, c] − μ[r, c])² / σ[r, c]²`` along ``axis``, shape (d, d).

    The diagonal is computed elementwise (exact, so the identity gives exactly 0);
    off-diagonal entries by matmuls on values centred per column.  In float32 their
    absolute error is about ``1e-7 · Σ_c ((ω_a − m)² + (μ_r − m)²)/σ_r²`` (m: the column
    mean of μ); it only matters where ``d_j`` is near 0 — two units whose weights agree to
    within σ while far from the layer's mean.  Use a float64 model for such cases (the
    cost is computed in the inputs' dtype; float64 made a K = 10 MNIST step ~20% slower).
    """
    d = value.shape[axis]
    w = value.movedim(axis, 0).reshape(d, -1)
    mu = loc.movedim(axis, 0).reshape(d, -1)
    prec = scale.movedim(axis, 0).reshape(d, -1).reciprocal().square()
    centre = mu.mean(0, keepdim=True)
    w_c, mu_c = w - centre, mu - centre
    cost = (w_c.square() @ prec.T - 2.0 * (w_c @ (mu_c * prec).T)
            + (mu_c.square() * prec).sum(1)[None, :])
    diag = ((w - mu).square() * prec).sum(1)
    eye = torch.eye(d, dtype=torch.bool, device=cost.device)
    return torch.where(eye, diag[None, :].expand(d, d), cost)


def entropy_gap(values, locs, scales, groups, perms) -> torch.Tensor:
    """One-sample estimate of ``Ĥ_K − H(q) = log K − logsumexp(0, d_1..d_{K−1})``.

    ``perms`` hold the ``K − 1`` random elements (``(K−1, d_k)`` each); the identity is
    the mixture's first component.  Returns a scalar tensor ``≤ log K``.
    """
    d = log_density_ratios(values, locs, scales, groups, perms)
    logits = torch.cat([d.new_zeros(1), d])
    return math.log(logits.shape[0]) - torch.logsumexp(logits, 0)


def symmetrized_terms(model, locs, scales, x, y, noise, groups, perms, num_data=None, values=None):
    """One-sample data term and entropy gap of a BNN at ``ω = μ + σ ε`` (random numbers given).

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
    f = _run_with_values(model, values, x)
    nll = 0.0 - log_likelihood(model.likelihood, f, y).sum() * scale_factor
    if perms is None or not groups:
        return nll, torch.zeros((), device=nll.device, dtype=nll.dtype)
    return nll, entropy_gap(values, locs, scales, groups, perms)


class SymmetrizedELBO:
    """Loss ``−L̂^G = −E_q log p(D|ω) + KL(q‖p) − (Ĥ_K − H(q))`` of a mean-field guide.

    Returns ``(loss, extras)`` with extras ``elbo`` (plain ELBO estimate),
    ``symmetrized_elbo`` (``−loss``) and ``entropy_gap`` (``Ĥ_K − H(q)``), all detached.

    For a :class:`pyro_bnn.BNN` with closed-form KL and no local reparameterisation the
    data term and the entropy gap share the weight sample ω; otherwise the plain mean-field
    loss is computed as usual and the gap uses a fresh ω ∼ q.
    """

    def __init__(self, num_permutations: int = 10, num_particles: int = 1):
        self.num_permutations = int(num_permutations)
        self.num_particles = int(num_particles)
        self._meanfield = MeanFieldELBO(self.num_particles)

    def __call__(self, model, guide, x, y, num_data=None):
        if guide.prototype_trace is None:
            guide._setup_prototype(x, y, num_data=num_data)
        groups = guide.symmetry() if self.num_permutations > 1 else []
        sites = guide.site_names()
        qs = {name: guide.loc_and_scale(name) for name in sites}
        locs = {k: v[0] for k, v in qs.items()}
        scales = {k: v[1] for k, v in qs.items()}
        sizes = group_sizes(groups, {k: v.shape for k, v in locs.items()})
        device = locs[sites[0]].device
        K = self.num_permutations

        def gap_of(values):
            if not groups or K == 1:
                return torch.zeros((), device=device)
            perms = sample_permutations(sizes, K - 1, device=device)
            return entropy_gap(values, locs, scales, groups, perms)

        fast = (hasattr(model, "site_names") and hasattr(model, "site_prior")
                and not guide.local_reparameterization)
        kl_closed = 0.0
        # the fused sample-and-KL node of MeanField when every site allows it
        fused = _fusable_sites(model, guide, sites) if fast else {}
        fused = fused if len(fused) == len(sites) else {}
        if fast and not fused:
            kl_closed, mc_sites = closed_form_kl(model, qs)
            fast = not mc_sites
        gap = 0.0
        if fast:  # the same arithmetic as meanfield_loss, plus the gap on the same ω
            nll = 0.0
            for _ in range(self.num_particles):
                noise = {name: standard_normal_like(locs[name]) for name in sites}
                values = None
                if fused:
                    values = {}
                    for name, (loc, rho, prior_loc, prior_scale) in fused.items():
                        values[name], kl = sample_and_kl(loc, rho, noise[name], prior_loc,
                                                         prior_scale, guide.scale_parameterization)
                        kl_closed = kl_closed + kl / self.num_particles
                perms = (sample_permutations(sizes, K - 1, device=device)
                         if groups and K > 1 else None)
                nll_p, gap_p = symmetrized_terms(model, locs, scales, x, y, noise, groups, perms,
                                                 num_data=num_data, values=values)
                nll = nll + nll_p
                gap = gap + gap_p
            kl_weight = getattr(guide, "kl_weight", 1.0)  # KL annealing of the base guide
            neg_elbo = nll / self.num_particles + (
                kl_closed if kl_weight == 1.0 else kl_weight * kl_closed)
        else:
            neg_elbo = self._meanfield(model, guide, x, y, num_data)
            for _ in range(self.num_particles):
                gap = gap + gap_of({n: locs[n] + scales[n] * standard_normal_like(locs[n]) for n in sites})
        gap = gap / self.num_particles
        w = getattr(guide, "kl_weight", 1.0)  # the modified KL, KL(q‖p) − gap, is annealed as one
        loss = (neg_elbo - (gap if w == 1.0 else w * gap)) if K > 1 else neg_elbo
        extras = {"elbo": -neg_elbo.detach(), "symmetrized_elbo": -loss.detach(),
                  "entropy_gap": torch.as_tensor(gap).detach()}
        return loss, extras


# ------------------------------------------------------------------ evaluation of L^G
@torch.no_grad()
def symmetrized_elbo(model, guide, data, num_permutations: int = 500,
                     permutations: Sequence[Mapping[str, int]] | None = None, *,
                     num_samples: int = 32, exact: bool = False, batch_size: int = 1024,
                     return_terms: bool = False):
    """The symmetrised ELBO ``L^G = ELBO + Ĥ_K − H(q)`` of any mean-field guide (full data).

    Parameters
    ----------
    model : pyro_bnn.BNN or PyroModule
    guide : MeanField (or any guide with ``loc_and_scale`` and ``site_names``), set up
    data : (x, y) tensors
        The whole training set (the ELBO is not minibatch-scaled).
    num_permutations : int
        K of the entropy bound (the paper's Table 3 uses large K, e.g. 500).
    permutations : list of dict, optional
        Declared symmetry; default: the guide's own (``Symmetrized``) or discovered.
    num_samples : int
        Monte Carlo draws ω ∼ q for the data term and the entropy gap.
    exact : bool
        Sum over all of G instead of K random elements: ``log q_G(ω)`` exactly (only for
        small ``|G|``; raises ``ValueError`` above 10⁵ elements).
    return_terms : bool
        Also return the parts.

    Returns
    -------
    float or dict
        ``L^G`` (not normalised by N), or ``{"symmetrized_elbo", "elbo",
        "expected_log_likelihood", "kl", "entropy_gap", "log_group_order"}``.
    """
    x, y = as_tensors(data)
    if isinstance(num_permutations, bool) or not isinstance(num_permutations, int) or num_permutations < 1:
        raise ValueError(f"num_permutations must be a positive int, got {num_permutations!r}")
    sites = guide.site_names()
    qs = {name: guide.loc_and_scale(name) for name in sites}
    locs = {k: v[0].detach() for k, v in qs.items()}
    scales = {k: v[1].detach() for k, v in qs.items()}
    shapes = {k: v.shape for k, v in locs.items()}
    device = locs[sites[0]].device
    x = x.to(device)
    y = None if y is None else y.to(device)
    if permutations is not None:
        groups = resolve_symmetries(list(permutations), shapes)
    elif hasattr(guide, "symmetry"):
        groups = guide.symmetry()
    else:
        groups = find_symmetries(model, shapes)
    sizes = group_sizes(groups, shapes)
    log_order = log_group_order(sizes)
    if exact and log_order > math.log(1e5):
        raise ValueError(f"exact=True enumerates G, but |G| = exp({log_order:.1f}) > 1e5; "
                         "use num_permutations instead")
    all_g = enumerate_group(sizes, device=device) if exact and groups else None
    is_bnn = hasattr(model, "site_names") and hasattr(model, "site_prior")
    kl, mc_kl = 0.0, []
    for name in sites if is_bnn else []:
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
    with local_params(model, guide):
        for _ in range(num_samples):
            values = {n: locs[n] + scales[n] * torch.randn(locs[n].shape, generator=omega_rng,
                                                           device=device, dtype=locs[n].dtype)
                      for n in sites}
            if is_bnn:
                lls.append(_bnn_log_likelihood(model, values, x, y, batch_size))
                kls.append(sum(float(dist.Normal(locs[n], scales[n]).log_prob(values[n]).sum()
                                     - model.site_prior(n).log_prob(values[n])) for n in mc_kl))
            else:
                ll, log_prior = _trace_log_densities(model, values, x, y)
                log_q = sum(float(dist.Normal(locs[n], scales[n]).log_prob(values[n]).sum()) for n in sites)
                lls.append(ll)
                kls.append(log_q - log_prior)
            if not groups or (all_g is None and num_permutations == 1):
                gaps.append(0.0)
            elif all_g is not None:
                d = log_density_ratios(_f64(values), locs64, scales64, groups, all_g)
                gaps.append(float(log_order - torch.logsumexp(d, 0)))
            else:
                perms = sample_permutations(sizes, num_permutations - 1, device=device)
                gaps.append(float(entropy_gap(_f64(values), locs64, scales64, groups, perms)))
    ell = sum(lls) / num_samples
    kl_total = kl + sum(kls) / num_samples
    gap = sum(gaps) / num_samples
    elbo = ell - kl_total
    terms = {"symmetrized_elbo": elbo + gap, "elbo": elbo, "expected_log_likelihood": ell,
             "kl": kl_total, "entropy_gap": gap, "log_group_order": log_order}
    return terms if return_terms else terms["symmetrized_elbo"]


def _f64(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in tensors.items()}


def _bnn_log_likelihood(model, values, x, y, batch_size) -> float:
    if y is None:
        raise ValueError("symmetrized_elbo needs targets: data must be (x, y)")
    total = 0.0
    for start in range(0, len(x), batch_size):
        f = _run_with_values(model, values, x[start:start + batch_size])
        total += float(log_likelihood(model.likelihood, f, y[start:start + batch_size]).sum())
    return total


def _trace_log_densities(model, values, x, y) -> tuple[float, float]:
    """``log p(D|ω)`` and ``log p(ω)`` of a hand-written model, from one conditioned trace."""
    tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
    ll = log_prior = 0.0
    for name, site in tr.nodes.items():
        if site["type"] != "sample":
            continue
        lp = float(site["fn"].log_prob(site["value"]).sum())
        if site["is_observed"] and name not in values:
            ll += lp
        elif name in values:
            log_prior += lp
    return ll, log_prior
