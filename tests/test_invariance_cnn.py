"""LILA on a convolutional network: invariant conv KFAC and the evidence η-gradient against an
independent dense reference (conv + ReLU + max-pool + linear, rotations and more, float64)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import check_evidence_step_against_dense
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature import batch_kfac_factors
from pyro_bnn.invariance import AffineAugmentation
from pyro_bnn.invariance.evidence import invariant_layers
from pyro_bnn.model.bnn import num_augmentations
from pyro_bnn.model.likelihoods import log_likelihood
from pyro_bnn.training.seeding import seeded

SOME = [0.15, 0.1, 0.9, 0.1, 0.12, 0.08]
SITES = (("net.0.weight", "net.0.bias"), ("net.4.weight", "net.4.bias"))


def _cnn_model(num_samples=3):
    """Conv 1→2 3×3, ReLU, 2×2 max-pool, Linear 18→3 on 8×8 images, with an augmentation."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(18, 3))
    aug = AffineAugmentation(num_samples=num_samples, init_extent=SOME).double()
    model = pb.BNN(net, "categorical", augmentation=aug).double()
    values = {k: v.double() for k, v in model.initial_values().items()}
    return model, values


def _reference_cnn_kfac(values, x, aug):
    """Augmentation-averaged KFAC of :func:`_cnn_model` without hooks: per-copy Jacobians by
    ``torch.func.jacrev``, each copy's patches unfolded separately and then averaged (the
    definition ``ã_n = mean_s ã_{n,s}``).  Returns ``[(A, G, T)]`` per layer and ``f̂``."""
    (w1, b1), (w2, b2) = ((values[w], values[b]) for w, b in SITES)
    m, s = len(x), aug.num_samples
    copies = aug(x)                                                    # (M·S, 1, 8, 8)

    def head(conv_out):                                                # one copy's conv output → logits
        return F.linear(F.max_pool2d(F.relu(conv_out), 2).flatten(), w2, b2)

    s1 = F.conv2d(copies, w1, b1)                                      # (M·S, 2, 6, 6)
    h = F.max_pool2d(F.relu(s1), 2).flatten(1)                         # (M·S, 18)
    f = F.linear(h, w2, b2).reshape(m, s, -1).mean(1)
    p = torch.softmax(f, -1)
    sq = p.sqrt()
    lam = torch.diag_embed(sq) - p.unsqueeze(-1) * sq.unsqueeze(-2)     # L Lᵀ = diag p − p pᵀ
    cols = lam.repeat_interleave(s, 0) / s                              # (M·S, C, K): ∂f̂/∂f_copy = 1/S
    jac = torch.func.vmap(torch.func.jacrev(head))(s1)                 # (M·S, C, 2, 6, 6)
    g1 = torch.einsum("rck,rcdt->rktd", cols, jac.flatten(3))          # (M·S, K, T, out)
    g1 = g1.reshape(m, s, *g1.shape[1:]).sum(1)
    g2 = torch.einsum("rck,cd->rkd", cols, torch.eye(3, dtype=x.dtype)).reshape(m, s, 3, 3).sum(1)
    patches = F.unfold(copies, 3).transpose(1, 2)                      # (M·S, T, 9)
    patches = torch.cat([patches, torch.ones(*patches.shape[:2], 1, dtype=x.dtype)], -1)
    a1 = patches.reshape(m, s, *patches.shape[1:]).mean(1).reshape(-1, 10)
    a2 = torch.cat([h, torch.ones(len(h), 1, dtype=x.dtype)], 1).reshape(m, s, -1).mean(1)
    return [(a1.T @ a1, torch.einsum("nktd,nkte->de", g1, g1), 36),
            (a2.T @ a2, torch.einsum("nkd,nke->de", g2, g2), 1)], f


def _dense_evidence(model, values, batches, seeds, delta):
    """Laplace-KFAC log evidence of the whole data in one graph: dense Kronecker products."""
    factors, ll = None, 0.0
    for (xb, yb), sd in zip(batches, seeds):
        with seeded(sd, device="cpu"):
            fb, f = _reference_cnn_kfac(values, xb, model.augmentation)
        ll = ll + log_likelihood(model.likelihood, f, yb).sum()
        factors = fb if factors is None else [(a0 + a, g0 + g, t) for (a0, g0, t), (a, g, _) in zip(factors, fb)]
    n = sum(len(xb) for xb, _ in batches)
    total = ll
    for (a, g, t), d, (w, b) in zip(factors, delta, SITES):
        size = len(a) * len(g)
        prec = torch.kron(g / (n * t), a) + d * torch.eye(size, dtype=a.dtype)
        sq = values[w].pow(2).sum() + values[b].pow(2).sum()
        total = total - 0.5 * (torch.logdet(prec) - size * torch.log(d) + d * sq)
    return total


@pytest.mark.parametrize("create_graph", [False, True])
def test_invariant_conv_kfac_equals_per_copy_reference(create_graph):
    """The library's conv KFAC factors (inputs averaged over the copies before unfolding,
    gradients summed over the copies before the patch layout) equal the per-copy reference,
    with and without a graph; with a graph their η-derivatives agree too."""
    model, values = _cnn_model()
    model.augmentation.eta.requires_grad_(create_graph)
    x = torch.rand(5, 1, 8, 8, dtype=torch.float64)
    vals = {k: v.detach().requires_grad_() for k, v in values.items()}
    layers = invariant_layers(model, vals)
    with seeded(3, device="cpu"):
        f, sums = batch_kfac_factors(layers, lambda: model.run_with(vals, x), "categorical",
                                     num_augmentations=num_augmentations(model), create_graph=create_graph)
    with seeded(3, device="cpu"):
        ref, f_ref = _reference_cnn_kfac(values, x, model.augmentation)
    assert torch.allclose(f, f_ref, atol=1e-12)
    parts = [sums[layer.path] for layer in layers]
    for part, (a, g, t) in zip(parts, ref):
        assert torch.allclose(part["A"], a, rtol=1e-10) and torch.allclose(part["G"], g, rtol=1e-8, atol=1e-14)
        assert float(part["count"]) == len(x) * t
    if create_graph:
        weights = torch.randn(4, dtype=torch.float64)
        eta = model.augmentation.eta
        mine = torch.autograd.grad(sum(w * q for w, q in zip(weights, (parts[0]["A"].sum(), parts[0]["G"].sum(),
                                                                       parts[1]["A"].sum(), parts[1]["G"].sum()))), eta)[0]
        theirs = torch.autograd.grad(sum(w * q for w, q in zip(weights, (ref[0][0].sum(), ref[0][1].sum(),
                                                                         ref[1][0].sum(), ref[1][1].sum()))), eta)[0]
        assert torch.allclose(mine, theirs, rtol=1e-8, atol=1e-12) and mine.abs().max() > 1e-6


def test_cnn_evidence_step_value_and_eta_gradient_match_dense_reference():
    """evidence_step on the CNN vs the dense reference: the log evidence, the batched
    η-gradient (two batches) and central finite differences of the reference."""
    model, values = _cnn_model()
    torch.manual_seed(4)
    x, y = torch.rand(7, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (7,))
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    delta = torch.tensor([0.5, 2.0], dtype=torch.float64)
    check_evidence_step_against_dense(model, values, batches, delta, _dense_evidence, atol=1e-10, min_grad=1e-5)
