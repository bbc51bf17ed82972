"""Active learning: balanced start, acquisition scores, top-k, the loop for every guide."""

import math

import pytest
import torch
from uncertainty_helpers import GUIDE_NAMES, MODEL_OPTIONS, all_guides, digits, mlp

import pyro_bnn as pb
from pyro_bnn.analysis import active


def test_balanced_initial_counts():
    y = torch.arange(10).repeat(30)
    idx = active.balanced_initial(y, size=20, generator=torch.Generator().manual_seed(0))
    assert len(idx) == 20 and len(set(idx.tolist())) == 20
    assert torch.bincount(y[idx], minlength=10).tolist() == [2] * 10
    idx = active.balanced_initial(y, size=23, generator=torch.Generator().manual_seed(0))
    assert sorted(torch.bincount(y[idx], minlength=10).tolist()) == [2] * 7 + [3] * 3
    with pytest.raises(ValueError, match="one example of each"):
        active.balanced_initial(y, size=5, generator=torch.Generator())


def test_acquisition_scores_known_values():
    probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.9, 0.1]],
                          [[0.0, 1.0], [0.5, 0.5], [0.9, 0.1]]])
    # BALD: disagreeing confident samples log 2; agreeing samples 0
    torch.testing.assert_close(active.acquisition_scores(probs, acquisition="bald"),
                               torch.tensor([math.log(2), 0.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(active.acquisition_scores(probs, acquisition="entropy")[:2],
                               torch.tensor([math.log(2), math.log(2)]))
    torch.testing.assert_close(active.acquisition_scores(probs, acquisition="variation_ratio"),
                               torch.tensor([0.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="acquisition must be one of"):
        active.acquisition_scores(probs, acquisition="margin")


def test_top_k_picks_largest_and_breaks_ties_randomly():
    s = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.2])
    assert set(active._top_k(s, 2, torch.Generator().manual_seed(0)).tolist()) == {1, 3}
    picks = {int(active._top_k(torch.zeros(5), 1, torch.Generator().manual_seed(i))) for i in range(20)}
    assert len(picks) > 1


def test_power_batch_sampling():
    g = torch.Generator().manual_seed(0)
    # zero scores are never picked while positive ones remain
    s = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0])
    assert set(active._power_k(s, 2, 1.0, g).tolist()) == {1, 3}
    # first pick ∝ score: P(index 1) = 2/3 (binomial sd over 3000 draws ≈ 0.009)
    firsts = torch.tensor([int(active._power_k(s, 1, 1.0, g)) for _ in range(3000)])
    assert float((firsts == 1).double().mean()) == pytest.approx(2 / 3, abs=0.04)
    # large β -> top-k
    assert set(active._power_k(torch.tensor([0.1, 0.9, 0.5, 0.8]), 2, 200.0, g).tolist()) == {1, 3}


@pytest.mark.parametrize("name", GUIDE_NAMES)
def test_run_every_guide(name):
    d = digits()
    pool, test = (d.x_train[:300], d.y_train[:300]), (d.x_test[:100], d.y_test[:100])
    factory = all_guides()[name]
    res = active.run(lambda: pb.BNN(mlp(), "categorical", **MODEL_OPTIONS.get(name, {})), factory,
                     pool, test, acquisition="bald", initial=20, per_round=5, rounds=2, epochs=3,
                     num_samples=4, eval_num_samples=4, seed=0)
    assert res.num_labelled == [20, 25, 30]
    assert len(res.accuracy) == 3 and all(0.0 <= a <= 1.0 for a in res.accuracy)
    chosen = res.initial + [i for r in res.acquired for i in r]
    assert len(chosen) == len(set(chosen)) == 30          # no point labelled twice
    # each round's fit is reported: its final objective and convergence diagnosis (3-epoch
    # fits cannot be judged, so none is reported converged)
    assert len(res.elbo) == 3 and all(math.isfinite(e) for e in res.elbo)
    assert res.converged == [False, False, False]


def test_run_random_and_cold_start_reproducible():
    d = digits()
    pool, test = (d.x_train[:300], d.y_train[:300]), (d.x_test[:100], d.y_test[:100])
    kw = dict(acquisition="random", initial=10, per_round=5, rounds=1, epochs=2, eval_num_samples=4,
              warm_start=False, seed=3)
    model_fn, guide_fn = (lambda: pb.BNN(mlp(), "categorical")), pb.guides.MeanField
    a = active.run(model_fn, guide_fn, pool, test, **kw)
    b = active.run(model_fn, guide_fn, pool, test, **kw)
    assert a.acquired == b.acquired and a.accuracy == b.accuracy
    with pytest.raises(ValueError, match="fewer than"):
        active.run(model_fn, guide_fn, pool, test, initial=20, per_round=100, rounds=3)
