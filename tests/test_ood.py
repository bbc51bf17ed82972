"""OOD detection: AUROC/AUPR and uncertainty scores against hand-worked values; every guide."""

import math

import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score
from uncertainty_helpers import GUIDE_NAMES, digits, trained

import pyro_bnn as pb
from pyro_bnn import metrics
from pyro_bnn.analysis.ood import SCORES, aupr, auroc, evaluate_probs, uncertainty_scores


def test_auroc_hand_worked():
    # positives 0.35, 0.8 vs negatives 0.1, 0.4: pairs won 1 (0.35>0.1) + 2 (0.8>both) = 3 of 4
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    labels = torch.tensor([0, 0, 0, 1, 1])
    assert auroc(torch.tensor([1.0, 2, 3, 4, 5]), labels) == 1.0          # perfect
    assert auroc(torch.tensor([5.0, 4, 3, 2, 1]), labels) == 0.0          # reversed
    assert auroc(torch.zeros(5), labels) == 0.5                           # constant: all ties
    # one tie between a positive and a negative counts one half: (1 + 0.5 + 2) / 4
    assert auroc(torch.tensor([0.1, 0.4, 0.4, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.875)


def test_aupr_hand_worked():
    # sorted scores 0.8(+) 0.4(-) 0.35(+) 0.1(-): AP = 0.5·1 + 0.5·(2/3) = 5/6
    assert aupr(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(5 / 6)
    assert aupr(torch.tensor([1.0, 2, 3, 4, 5]), torch.tensor([0, 0, 0, 1, 1])) == 1.0
    # a constant score: precision = positive rate at the only threshold
    assert aupr(torch.zeros(5), torch.tensor([0, 0, 0, 1, 1])) == pytest.approx(0.4)


def test_auroc_aupr_match_sklearn_with_ties():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        s = torch.randint(0, 6, (80,), generator=g).double()
        lab = torch.randint(0, 2, (80,), generator=g)
        assert auroc(s, lab) == pytest.approx(roc_auc_score(lab.numpy(), s.numpy()), abs=1e-12)
        assert aupr(s, lab) == pytest.approx(average_precision_score(lab.numpy(), s.numpy()), abs=1e-12)


def test_random_score_auroc_near_half():
    g = torch.Generator().manual_seed(1)
    s, lab = torch.rand(20000, generator=g), torch.randint(0, 2, (20000,), generator=g)
    assert auroc(s, lab) == pytest.approx(0.5, abs=0.015)        # sd ≈ 0.004
    assert aupr(s, lab) == pytest.approx(float(lab.double().mean()), abs=0.015)


def test_metric_errors():
    with pytest.raises(ValueError, match="both positive and negative"):
        auroc(torch.rand(4), torch.ones(4))
    with pytest.raises(ValueError, match="same length"):
        aupr(torch.rand(4), torch.ones(3))
    with pytest.raises(ValueError, match="0 .* or 1"):
        auroc(torch.rand(3), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match=r"\(S, N, C\)"):
        uncertainty_scores(torch.rand(4, 3))


def test_uncertainty_scores_known_distributions():
    # input 0: two confident samples that disagree -> H[p̄] = log 2, E H = 0, MI = log 2
    # input 1: two identical uniform samples over 4 classes -> H = log 4, MI = 0
    probs = torch.tensor([[[1.0, 0, 0, 0], [0.25] * 4],
                          [[0.0, 1, 0, 0], [0.25] * 4]])
    s = uncertainty_scores(probs)
    torch.testing.assert_close(s["entropy"], torch.tensor([math.log(2), math.log(4)]))
    torch.testing.assert_close(s["mutual_information"], torch.tensor([math.log(2), 0.0]))
    torch.testing.assert_close(s["max_prob"], torch.tensor([0.5, 0.75]))
    torch.testing.assert_close(s["std"], torch.tensor([0.5, 0.0]))   # p(class 0): 1 and 0
    # variation ratio: votes 2:1 among 3 samples -> 1 - 2/3
    votes = torch.tensor([[[0.9, 0.1]], [[0.8, 0.2]], [[0.3, 0.7]]])
    assert float(metrics.variation_ratio(votes)) == pytest.approx(1 / 3)


def test_evaluate_probs_separates_known_scores():
    # in-distribution: confident; OOD: uniform -> entropy and max-prob separate
    conf = torch.tensor([[0.97, 0.01, 0.01, 0.01]]).expand(3, 5, 4)
    flat = torch.full((3, 5, 4), 0.25)
    res = evaluate_probs(torch.cat([conf, flat], 1), torch.tensor([0] * 5 + [1] * 5))
    assert set(res) == set(SCORES)
    assert res["entropy"]["auroc"] == 1.0 and res["max_prob"]["aupr"] == 1.0
    # identical samples: MI = 0 for both groups (up to float rounding), so it carries no signal
    assert abs(res["mutual_information"]["mean_in"]) < 1e-6
    assert abs(res["mutual_information"]["mean_out"]) < 1e-6


@pytest.mark.parametrize("name", GUIDE_NAMES)
def test_evaluate_every_guide_noise_ood(name):
    model, guide = trained(name)
    d = digits()
    x_in = d.x_test[:150]
    x_out = torch.rand(150, 64, generator=torch.Generator().manual_seed(0))
    res = pb.analysis.ood.evaluate(model, guide, x_in, x_out, num_samples=16)
    assert set(res) == set(SCORES)
    for score in res.values():
        assert 0.0 <= score["auroc"] <= 1.0 and 0.0 <= score["aupr"] <= 1.0
    # uniform-noise "images" are far from the digits: the predictive entropy flags them
    # (0.77–0.99 measured across guides with these 60-step models; chance is 0.5)
    assert res["entropy"]["auroc"] > 0.7, res["entropy"]
