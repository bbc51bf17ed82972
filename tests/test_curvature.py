"""Curvature oracles: KFAC/diag/full GGN against Jᵀ Λ J built from torch.func Jacobians.

All checks run in float64 on tiny nets; tolerances are float64 round-off (1e-9 relative).
"""

import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.curvature import (
    DenseBlock,
    DiagBlock,
    KronBlock,
    SplitBiasKronBlock,
    accumulate_curvature,
    batch_kfac_factors,
    find_layers,
    functional_covariance,
    network_output,
)

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _float64():
    """Oracle comparisons run in float64; restore the default for the rest of the suite
    (a module-level ``set_default_dtype`` leaks into every module collected after it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ------------------------------------------------------------------ oracle
def _flat_params(net):
    """Parameters of Linear/Conv layers in W̃ = [W, b] row-major order."""
    parts = []
    for m in net.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            parts.append(torch.cat([m.weight.reshape(m.weight.shape[0], -1), m.bias[:, None]], 1).reshape(-1))
    return torch.cat(parts).detach()


def _functional(net):
    mods = [(n, m) for n, m in net.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]

    def f(theta, x):
        params, i = {}, 0
        for name, m in mods:
            out, inn = m.weight.shape[0], m.weight[0].numel()
            W = theta[i:i + out * (inn + 1)].reshape(out, inn + 1)
            params[f"{name}.weight"] = W[:, :-1].reshape(m.weight.shape)
            params[f"{name}.bias"] = W[:, -1]
            i += out * (inn + 1)
        return torch.func.functional_call(net, params, (x,))
    return f


def oracle_ggn(net, x, kind):
    """Σ_n J_nᵀ Λ_n J_n with J from torch.func.jacrev (Λ = I for Gaussian)."""
    theta = _flat_params(net)
    f = _functional(net)
    J = torch.func.jacrev(f)(theta, x)                       # (N, C, P)
    out = f(theta, x)
    if kind == "categorical":
        p = torch.softmax(out, -1)
        Lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    else:
        Lam = torch.eye(out.shape[-1]).expand(len(x), -1, -1)
    return torch.einsum("ncp,ncd,ndq->pq", J, Lam, J), J


def _curvature(net, x, y, kind, structure, batch_size=None):
    model = pb.BNN(net, "gaussian" if kind == "gaussian" else "categorical").double()
    values = {k: v.clone().requires_grad_() for k, v in model.initial_values().items()}
    shapes = {k: v.shape for k, v in values.items()}
    layers = find_layers(model, shapes)
    bs = batch_size or len(x)
    batches = [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]
    fit = accumulate_curvature(layers, batches, lambda xb: network_output(model, values, xb), kind, structure)
    return fit, layers, model, values


def _dense(fit):
    return torch.block_diag(*[b.to_dense() for b in fit.blocks])


# ------------------------------------------------------------------- tests
def test_kfac_exact_for_linear_regression():
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    x, y = torch.randn(50, 4), torch.randn(50, 3)
    fit, *_ = _curvature(net, x, y, "gaussian", "kron", batch_size=16)   # 4 batches
    H, _ = oracle_ggn(net, x, "gaussian")
    torch.testing.assert_close(_dense(fit), H, rtol=1e-10, atol=1e-10)


def test_kfac_exact_for_softmax_regression_single_example():
    # With one example Σ_n (a aᵀ) ⊗ Λ_n is one Kronecker product, so KFAC is exact.
    torch.manual_seed(1)
    net = nn.Linear(5, 4)
    x, y = torch.randn(1, 5), torch.tensor([2])
    fit, *_ = _curvature(net, x, y, "categorical", "kron")
    H, _ = oracle_ggn(net, x, "categorical")
    torch.testing.assert_close(_dense(fit), H, rtol=1e-10, atol=1e-12)


def test_kfac_softmax_regression_many_examples_is_the_kronecker_approximation():
    # For N > 1, KFAC = (Σ a aᵀ) ⊗ (Σ Λ_n)/N, checked against that closed form.
    torch.manual_seed(2)
    net = nn.Linear(3, 4)
    x, y = torch.randn(20, 3), torch.randint(0, 4, (20,))
    fit, *_ = _curvature(net, x, y, "categorical", "kron", batch_size=7)
    xt = torch.cat([x, torch.ones(20, 1)], 1)
    p = torch.softmax(net(x), -1)
    Lam = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).sum(0) / 20
    torch.testing.assert_close(_dense(fit), torch.kron(Lam, xt.T @ xt), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_full_ggn_of_mlp_matches_torch_func(kind):
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x = torch.randn(30, 4)
    y = torch.randint(0, 3, (30,)) if kind == "categorical" else torch.randn(30, 3)
    fit, *_ = _curvature(net, x, y, kind, "full", batch_size=11)
    H, _ = oracle_ggn(net, x, kind)
    torch.testing.assert_close(fit.blocks[0].H, H, rtol=1e-9, atol=1e-12)
    diag, *_ = _curvature(net, x, y, kind, "diag", batch_size=11)
    torch.testing.assert_close(torch.cat([b.h.reshape(-1) for b in diag.blocks]), torch.diagonal(H),
                               rtol=1e-9, atol=1e-12)


def test_conv_full_and_diag_ggn_match_torch_func():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.Tanh(), nn.Flatten(),
                        nn.Linear(3 * 3 * 3, 4))
    x, y = torch.randn(6, 2, 5, 5), torch.randint(0, 4, (6,))
    fit, *_ = _curvature(net, x, y, "categorical", "full", batch_size=4)
    H, _ = oracle_ggn(net, x, "categorical")
    torch.testing.assert_close(fit.blocks[0].H, H, rtol=1e-9, atol=1e-12)
    diag, *_ = _curvature(net, x, y, "categorical", "diag", batch_size=4)
    torch.testing.assert_close(torch.cat([b.h.reshape(-1) for b in diag.blocks]), torch.diagonal(H),
                               rtol=1e-9, atol=1e-12)
    kron, *_ = _curvature(net, x, y, "categorical", "kron", batch_size=4)
    assert kron.blocks[0].shape == (3, 2 * 9 + 1)        # conv factors: (out, in·k·k + 1)


@pytest.mark.parametrize("block_type", ["kron", "split", "diag", "dense"])
def test_block_linear_algebra_matches_dense(block_type):
    torch.manual_seed(5)
    if block_type == "kron":
        A, G = torch.randn(4, 4), torch.randn(3, 3)
        block = KronBlock(A @ A.T, G @ G.T)
        delta = torch.tensor(0.7)
    elif block_type == "split":
        A, G = torch.randn(4, 4), torch.randn(3, 3)
        A, G = A @ A.T, G @ G.T
        block = SplitBiasKronBlock(A, G)
        delta = torch.tensor(0.7)
        A0 = A.clone()
        A0[:-1, -1] = A0[-1, :-1] = 0                      # no weight-bias cross terms
        torch.testing.assert_close(block.to_dense(), torch.kron(G, A0))
        a, g = torch.randn(5, 1, 4), torch.randn(2, 5, 1, 3)
        J = torch.einsum("cmto,mti->cmoi", g, a).flatten(2)
        torch.testing.assert_close(block.functional_variance(a, g, delta),
                                   torch.einsum("cmp,pq,dmq->mcd", J, block.covariance(delta), J))
    elif block_type == "diag":
        block = DiagBlock(torch.rand(3, 4))
        delta = torch.rand(12) + 0.1
    else:
        B = torch.randn(12, 12)
        block = DenseBlock(B @ B.T)
        delta = torch.rand(12) + 0.1
    scale = 2.5
    P = block.to_dense(scale) + torch.diag(delta.expand(12))
    torch.testing.assert_close(block.logdet(delta, scale), torch.logdet(P))
    torch.testing.assert_close(block.covariance(delta, scale), torch.linalg.inv(P))
    S = block.sample(torch.eye(12), delta, scale)            # rows: P^{-1/2} e_i
    torch.testing.assert_close(S.T @ S, torch.linalg.inv(P))
    v = torch.randn(12)
    torch.testing.assert_close(block.matvec(v, scale), block.to_dense(scale) @ v)
    torch.testing.assert_close(block.solve(v, delta, scale), torch.linalg.solve(P, v))


def test_split_bias_block_with_a_weight_and_a_bias_prior_precision():
    """δ_W on the weight entries and δ_b on the bias column (``W̃`` order): log det, covariance,
    draws and functional variance equal the dense ``s H + diag(δ)``; a vector that varies
    within the weight entries is rejected, not silently misread."""
    torch.manual_seed(6)
    A, G = torch.randn(4, 4), torch.randn(3, 3)
    block = SplitBiasKronBlock(A @ A.T, G @ G.T)
    delta = torch.cat([torch.full((3, 3), 0.4), torch.full((3, 1), 2.5)], 1).reshape(-1)
    scale = 1.7
    P = block.to_dense(scale) + torch.diag(delta)
    torch.testing.assert_close(block.logdet(delta, scale), torch.logdet(P))
    torch.testing.assert_close(block.covariance(delta, scale), torch.linalg.inv(P))
    S = block.sample(torch.eye(12), delta, scale)
    torch.testing.assert_close(S.T @ S, torch.linalg.inv(P))
    a, g = torch.randn(5, 1, 4), torch.randn(2, 5, 1, 3)
    J = torch.einsum("cmto,mti->cmoi", g, a).flatten(2)
    torch.testing.assert_close(block.functional_variance(a, g, delta, scale),
                               torch.einsum("cmp,pq,dmq->mcd", J, torch.linalg.inv(P), J))
    bad = delta.clone()
    bad[0] = 0.5
    with pytest.raises(ValueError, match="weight"):
        block.logdet(bad)
    # issue 24: the joint block takes the per-column δ exactly (whitened A), with the cross terms
    joint = KronBlock(A @ A.T, G @ G.T)
    Pj = joint.to_dense(scale) + torch.diag(delta)
    torch.testing.assert_close(joint.logdet(delta, scale), torch.logdet(Pj))
    torch.testing.assert_close(joint.covariance(delta, scale), torch.linalg.inv(Pj))
    Sj = joint.sample(torch.eye(12), delta, scale)
    torch.testing.assert_close(Sj.T @ Sj, torch.linalg.inv(Pj))
    torch.testing.assert_close(joint.functional_variance(a, g, delta, scale),
                               torch.einsum("cmp,pq,dmq->mcd", J, torch.linalg.inv(Pj), J))
    with pytest.raises(ValueError, match="varies across rows"):
        joint.logdet(torch.arange(1.0, 13.0))


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_glm_functional_covariance_matches_dense(structure):
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))
    x, y = torch.randn(25, 3), torch.randint(0, 4, (25,))
    fit, layers, model, values = _curvature(net, x, y, "categorical", structure)
    deltas = [torch.tensor(0.9)] * len(fit.blocks)
    cov = torch.block_diag(*[b.covariance(d) for b, d in zip(fit.blocks, deltas)])
    xs = torch.randn(9, 3)
    _, J = oracle_ggn(net, xs, "categorical")
    f, Sf = functional_covariance(layers, fit.blocks, deltas, 1.0,
                                  lambda xb: network_output(model, values, xb), xs, batch_size=4)
    torch.testing.assert_close(Sf, torch.einsum("ncp,pq,ndq->ncd", J, cov, J))
    torch.testing.assert_close(f, net(xs))


def test_reduce_fn_sees_sums_and_equals_duplicated_data():
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(12, 3), torch.randint(0, 2, (12,))
    seen = []

    def double(sums):
        seen.append(sorted(sums))
        return {k: 2 * v for k, v in sums.items()}
    model = pb.BNN(net, "categorical").double()
    values = {k: v.clone().requires_grad_() for k, v in model.initial_values().items()}
    layers = find_layers(model, {k: v.shape for k, v in values.items()})
    run = lambda xb: network_output(model, values, xb)  # noqa: E731
    a = accumulate_curvature(layers, [(x, y)], run, "categorical", "kron", reduce_fn=double)
    b = accumulate_curvature(layers, [(x, y), (x, y)], run, "categorical", "kron")
    assert "num_data" in seen[0] and a.num_data == 24
    torch.testing.assert_close(a.loglik_stats["loglik"], b.loglik_stats["loglik"])
    for ba, bb in zip(a.blocks, b.blocks):
        torch.testing.assert_close(ba.to_dense(), bb.to_dense())


def test_batch_kfac_differentiable_and_augmentation_average():
    # f̂(x) = mean_s W (c_s x) for a linear layer: with averaged inputs KFAC stays exact,
    # and the factors are differentiable in the augmentation parameter c.
    torch.manual_seed(8)
    net = nn.Linear(3, 2)
    model = pb.BNN(net, "gaussian").double()
    values = {k: v.clone().requires_grad_() for k, v in model.initial_values().items()}
    layers = find_layers(model, {k: v.shape for k, v in values.items()})
    x = torch.randn(10, 3)

    def sums_for(c, create_graph):
        xs = (x[:, None, :] * c[None, :, None]).reshape(-1, 3)             # example-major copies
        fwd = lambda: network_output(model, values, xs).reshape(10, len(c), 2).mean(1)  # noqa: E731
        return batch_kfac_factors(layers, fwd, "gaussian", num_augmentations=len(c),
                                  create_graph=create_graph)[1][layers[0].path]
    c = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    s = sums_for(c, True)
    xbar = torch.cat([x * c.mean(), torch.ones(10, 1)], 1)
    torch.testing.assert_close(s["A"], xbar.T @ xbar)
    torch.testing.assert_close(s["G"] / s["count"], torch.eye(2))
    (grad,) = torch.autograd.grad(s["A"].sum(), c)
    eps = 1e-6
    fd = [(sums_for(c.detach() + eps * e, False)["A"].sum() - sums_for(c.detach() - eps * e, False)["A"].sum())
          / (2 * eps) for e in torch.eye(3)]
    torch.testing.assert_close(grad, torch.stack(fd), rtol=1e-6, atol=1e-6)


def test_unsupported_layer_raises():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.s
    model = pb.BNN(nn.Sequential(nn.Linear(2, 3), Scale()), "categorical",
                   stochastic=lambda n, m, p: True)
    with pytest.raises(ValueError, match="Linear"):
        find_layers(model, {k: v.shape for k, v in model.initial_values().items()})


def test_dense_block_eigen_path_equals_cholesky_path():
    """Scalar δ uses one cached eigendecomposition of H; a per-weight δ the Cholesky of P.
    Both give the same log det, covariance, draws' covariance map and J P⁻¹ Jᵀ, and the
    eigen path stays differentiable in δ and s."""
    g = torch.Generator().manual_seed(0)
    V = torch.randn(8, 5, generator=g)
    H = V @ V.T                                           # rank 5 < 8: singular H
    block = DenseBlock(H)
    d, s = torch.tensor(0.3, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    dvec = d.detach().expand(8).clone()                   # same δ, Cholesky path
    P = s.detach() * H + 0.3 * torch.eye(8)
    torch.testing.assert_close(block.logdet(d, s), torch.logdet(P))
    torch.testing.assert_close(block.logdet(dvec, s.detach()), torch.logdet(P))
    torch.testing.assert_close(block.covariance(d, s), torch.linalg.inv(P))
    torch.testing.assert_close(block.covariance(dvec, s.detach()), torch.linalg.inv(P))
    R = block.sample(torch.eye(8), d, s)                  # rows: P^{-1/2} e_i
    torch.testing.assert_close(R.T @ R, torch.linalg.inv(P))
    J = torch.randn(3, 4, 8, generator=g)
    torch.testing.assert_close(block.functional_variance_dense(J, d, s),
                               block.functional_variance_dense(J, dvec, s.detach()))
    gd, gs = torch.autograd.grad(block.logdet(d, s), (d, s))
    torch.testing.assert_close(gd, torch.linalg.inv(P).trace())
    torch.testing.assert_close(gs, (torch.linalg.inv(P) @ H).trace())


def test_layer_unflatten_round_trips_and_is_unambiguous_for_one_output():
    """flatten → unflatten is the identity, in matrix and flat form, with leading draw
    dimensions, also for a layer with one output (where a (1, in') matrix and a flat
    (in',) vector have the same last dimension)."""
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    model = pb.BNN(net, "gaussian")
    values = model.initial_values()
    shapes = {k: v.shape for k, v in values.items()}
    layers = find_layers(model, shapes)
    assert [layer.shape for layer in layers] == [(3, 5), (1, 4)]
    for layer in layers:
        mat = layer.flatten(values)
        for name, value in layer.unflatten(mat, shapes).items():
            torch.testing.assert_close(value, values[name])
        for name, value in layer.unflatten_flat(mat.reshape(-1), shapes).items():
            torch.testing.assert_close(value, values[name])
        draws = torch.stack([mat, 2 * mat])  # (2, out, in')
        for name, value in layer.unflatten(draws, shapes).items():
            assert value.shape == (2, *shapes[name])
            torch.testing.assert_close(value[1], 2 * values[name])
        for name, value in layer.unflatten_flat(draws.flatten(-2), shapes).items():
            assert value.shape == (2, *shapes[name])
    last = layers[1]
    with pytest.raises(ValueError, match=r"expected a matrix of shape \(\.\.\., 1, 4\), got \(4,\)"):
        last.unflatten(last.flatten(values).reshape(-1), shapes)
    with pytest.raises(ValueError, match="expected a flat vector of 4 entries"):
        last.unflatten_flat(torch.zeros(2, 3), shapes)
