"""Probit vs Monte-Carlo GLM on digits: registry 'laplace' (last-layer KFAC, δ by evidence), MAP 300 epochs."""
import numpy as np
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.contract.guide import registered_guides

d = pb.datasets.digits()
torch.manual_seed(0)
model = pb.BNN(nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10)))
guide = registered_guides()["laplace"](model)
pb.fit(model, guide, d.train, epochs=300, batch_size=64, lr=1e-2, progress=False, seed=0)
for meth, S in [("glm_probit", 1), ("glm", 64), ("glm", 1000)]:
    r = []
    for seed in range(5 if meth == "glm" else 1):
        torch.manual_seed(seed)
        r.append(pb.evaluate(model, guide, *d.test, num_samples=S, predictive=meth))
    print(r[0]["predictive"], {k: (round(float(np.mean([x[k] for x in r])), 4), round(float(np.std([x[k] for x in r])), 4)) for k in ("accuracy", "nll", "ece", "brier")})
for S in (64, 1000):
    nll = []
    for seed in range(3):
        dt = pb.to_arviz(model, guide, *d.test, num_samples=S, seed=seed)
        ll = torch.as_tensor(dt["log_likelihood"]["obs"].values[0])
        nll.append(float(-(torch.logsumexp(ll, 0) - np.log(S)).mean()))
    print("to_arviz", dt.attrs["predictive"], "test NLL", np.round(nll, 4))
