"""KFAC eigendecompositions that fail are retried (symmetrised, float64, jitter) instead of
crashing a long run; only then an error names the factor, its layer and its condition (issue 15)."""

import pytest
import torch
from helpers import mlp

import pyro_bnn as pb
from pyro_bnn.curvature import structures
from pyro_bnn.curvature.structures import KronBlock, robust_eigh


def _psd(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(3 * n, n, generator=g, dtype=dtype)
    return X.T @ X / (3 * n)


class _FailingEigh:
    """``torch.linalg.eigh`` that raises LAPACK's error on its first ``failures`` calls."""

    def __init__(self, failures):
        self.failures, self.calls, self.real = failures, 0, torch.linalg.eigh

    def __call__(self, M, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge because the input "
                                           "matrix is ill-conditioned or has too many repeated eigenvalues")
        return self.real(M, *args, **kwargs)


def test_plain_path_is_unchanged():
    A = _psd(12)
    lam, Q = robust_eigh(A)
    ref_lam, ref_Q = torch.linalg.eigh(A)
    assert torch.equal(lam, ref_lam) and torch.equal(Q, ref_Q)


def test_a_non_finite_result_is_retried_in_float64(monkeypatch):
    """A result with NaN and no error (as LAPACK gives for some inputs) is not accepted."""
    A = _psd(8) * 1e30
    real = torch.linalg.eigh
    calls = []

    def nan_first(M, *args, **kwargs):
        calls.append(M.dtype)
        lam, Q = real(M, *args, **kwargs)
        return (lam * float("nan"), Q) if len(calls) == 1 else (lam, Q)

    monkeypatch.setattr(torch.linalg, "eigh", nan_first)
    lam, Q = robust_eigh(A)
    assert calls == [torch.float32, torch.float64]
    assert lam.dtype == torch.float32 and torch.isfinite(lam).all() and torch.isfinite(Q).all()
    ref = torch.linalg.eigvalsh(A.double())
    torch.testing.assert_close(lam.double(), ref, rtol=1e-5, atol=0)
    torch.testing.assert_close((Q.double() * lam.double()) @ Q.double().T, A.double(), rtol=0,
                               atol=1e-5 * float(ref[-1]))


@pytest.mark.parametrize("failures", [1, 2, 4])
def test_lapack_failures_are_retried(monkeypatch, failures):
    """1: the float64 retry works; 2: the first jitter; 4: a jitter of 1e-8·mean|diag|."""
    A = _psd(10, seed=1)
    fake = _FailingEigh(failures)
    monkeypatch.setattr(torch.linalg, "eigh", fake)
    lam, Q = robust_eigh(A)
    assert fake.calls == failures + 1
    ref = torch.linalg.eigvalsh(A.double())
    torch.testing.assert_close(lam.double(), ref, rtol=0, atol=1e-6 * float(ref[-1]))
    torch.testing.assert_close(Q @ torch.diag(lam) @ Q.T, A, rtol=0, atol=1e-5)


def test_error_names_layer_factor_and_condition(monkeypatch):
    A, G = _psd(5), _psd(3, seed=2)
    monkeypatch.setattr(torch.linalg, "eigh", _FailingEigh(100))
    with pytest.raises(torch.linalg.LinAlgError,
                       match=r"KFAC factor A \(5×5\) of layer 'net.0' failed.*float64.*jitter up to 0.0001.*"
                             r"condition number"):
        KronBlock(A, G, name="net.0")


def test_non_finite_factor_is_a_clear_error():
    A = _psd(4)
    A[2, 1] = float("nan")  # eigh reads the lower triangle
    with pytest.raises(ValueError, match=r"KFAC factor A \(4×4\) has 1 NaN/inf entries"):
        KronBlock(A, _psd(3))


def test_laplace_fit_survives_an_eigh_failure(monkeypatch):
    """The long online-marglik run that died at epoch 310: one failing eigh no longer crashes it."""
    d = pb.datasets.digits()
    x, y = d.x_train[:200], d.y_train[:200]

    def run():
        torch.manual_seed(0)
        model = pb.BNN(mlp(64, 16, 10))
        guide = pb.guides.Laplace(model, structure="kron")
        pb.fit(model, guide, (x, y), epochs=4, lr=1e-2, seed=0, progress=False,
               marglik=pb.MarglikOptions(every=1, burnin=1, steps=5, lr=0.1))
        return float(guide.log_evidence())

    reference = run()
    fake = _FailingEigh(1)
    monkeypatch.setattr(torch.linalg, "eigh", fake)
    assert fake.calls == 0
    patched = run()
    assert fake.calls > 1
    assert patched == pytest.approx(reference, rel=1e-4)


def test_jitter_schedule_is_increasing():
    assert list(structures.EIGH_JITTERS) == sorted(structures.EIGH_JITTERS) and structures.EIGH_JITTERS[0] == 0
