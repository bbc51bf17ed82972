"""Data-parallel training (``fit(distributed=True)``) against one process.

The two-process checks spawn 2 CPU processes with the Gloo backend on 127.0.0.1 (a free
port) through :func:`pyro_bnn.training.distributed.launch_local`, which kills them on failure or
timeout.  Both ranks share the seed, so they draw the same weight sample each step; each
rank scales its half of the global batch by ``N / (M/2)`` and DDP averages the gradients,
which gives exactly the single-process gradient of the global batch ``M``.  We compare
guide parameters after 30 Adam steps in float64 (MeanField, Symmetrized, Laplace), where the
only difference is the summation order: tolerance 1e-9 (observed ~1e-15); the float32-only
guides (Hypernet, Pyro's AutoNormal through Trace_ELBO) to 1e-5 (observed ~5e-7).  The Laplace
evidence must agree to 1e-6 relative, end to end and for the raw float32 KFAC/diag/full sums.
Invariance learning: η after one evidence step (and one more SGD step) agrees to 1e-9 in
float64, and visibly differs (> 1e-4) when the all-reduce is left out.
"""

from __future__ import annotations

import functools
import os

import pyro
import pytest
import torch
from torch import nn

import pyro_bnn as pb
from pyro_bnn.training import distributed as pbd

N, GLOBAL_BATCH, EPOCHS, SEED = 96, 16, 5, 123
FLOAT32_KINDS = ("hypernet", "autonormal")


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    y = (x[:, 0] - x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return x, y


def _model_and_guide(kind):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    if kind in FLOAT32_KINDS:           # flows are float32-only; Pyro's own Trace_ELBO path
        model = pb.BNN(net, "categorical")
        if kind == "hypernet":
            return model, pb.guides.Hypernet(model, full=True, num_flows=2, hidden=16)
        return model, pyro.infer.autoguide.AutoNormal(model)
    model = pb.BNN(net.double(), "categorical").double()
    if kind == "meanfield":
        # weight noise: one draw of the weights, shared by the ranks through the seed, equals
        # one process's draw; local reparameterisation draws per-example noise, which a rank's
        # half batch cannot reproduce bit for bit (docs/distributed.md)
        return model, pb.guides.MeanField(model, init_scale=0.05, local_reparameterization=False)
    if kind == "symmetrized":      # K-1 random permutations per step: must agree across ranks
        # (weight noise, as for MeanField above)
        return model, pb.guides.Symmetrized(model, num_permutations=3, init_scale=0.05,
                                            local_reparameterization=False)
    return model, pb.guides.Laplace(model, "kron")


def _fit(kind, epochs=EPOCHS, **kw):
    """Train with a fixed seed, global batch 16, no shuffling; (guide state, history, evidence)."""
    model, guide = _model_and_guide(kind)
    extra = {"marglik": pb.MarglikOptions(every=1, steps=10, lr=0.1)} if kind == "laplace" else {}
    x, y = _data()
    x = x.float() if kind in FLOAT32_KINDS else x
    result = pb.fit(model, guide, (x, y), epochs=epochs, batch_size=GLOBAL_BATCH, lr=0.02,
                    seed=SEED, shuffle=False, progress=False, device="cpu", **extra, **kw)
    state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    evidence = float(guide.log_evidence()) if kind == "laplace" and epochs else None
    return state, result.history, evidence


@functools.cache
def _reference(kind):
    """The single-process run (cached: several tests compare against it)."""
    return _fit(kind)


KINDS = ("meanfield", "symmetrized", "laplace", "hypernet", "autonormal")


def _curvature_evidence(structure, loader):
    """Laplace-GGN log evidence at the network's initial weights, curvature from ``loader``."""
    from pyro_bnn.curvature import accumulate_curvature, find_layers, network_output
    from pyro_bnn.curvature.marglik import log_evidence, log_likelihood_from_stats

    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    model = pb.BNN(net, "categorical")
    values = {k: v.clone().requires_grad_(True) for k, v in model.initial_values().items()}
    layers = find_layers(model, {k: v.shape for k, v in values.items()})
    reduce_fn = pbd.all_reduce_sums if pbd.is_distributed() else None
    fit = accumulate_curvature(layers, loader, lambda x: network_output(model, values, x),
                               "categorical", structure, reduce_fn=reduce_fn)
    theta = [layer.flatten(values).detach().reshape(-1) for layer in layers]
    if structure == "full":
        theta = [torch.cat(theta)]
    delta = [torch.tensor(2.0)] * len(theta)
    ev = log_evidence(log_likelihood_from_stats(fit.loglik_stats), fit.blocks, theta, delta)
    return float(ev), fit.num_data


STRUCTURES = ("kron", "diag", "full")

# ---- invariance learning (LILA): η by the evidence gradient, batches split across ranks
LILA_N, LILA_EPOCHS, LILA_BATCH = 48, 3, 16


def _lila_data():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(LILA_N, 16, generator=g, dtype=torch.float64)      # 4×4 grey "images"
    y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).long() + (x[:, 5] > 0.7).long()
    return x, y


def _lila_fit(**kw):
    """MAP for 2 epochs at η = 0 (identity: no draws), then one δ + η evidence step after
    epoch 3 with S = 2 augmentation draws per example (seeded per global batch)."""
    from pyro_bnn.invariance import AffineAugmentation

    torch.manual_seed(0)
    aug = AffineAugmentation(num_samples=2, image_shape=(1, 4, 4))
    net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    model = pb.BNN(net.double(), "categorical", augmentation=aug.double()).double()
    guide = pb.guides.Laplace(model, "kron", curvature_batch_size=LILA_BATCH)
    pb.fit(model, guide, _lila_data(), epochs=LILA_EPOCHS, batch_size=LILA_BATCH, lr=0.02,
           seed=SEED, shuffle=False, progress=False, device="cpu",
           marglik=pb.MarglikOptions(every=1, burnin=LILA_EPOCHS - 1, steps=5, lr=0.1), **kw)
    return model, guide


def _lila_sgd_step(model, guide, batches, distributed=None):
    """One more η step with plain SGD (step ∝ gradient, unlike Adam's first step ≈ lr·sign):
    (η after it, log evidence per datum); η is put back afterwards."""
    from pyro_bnn.invariance.learning import guide_eta_step

    eta0 = model.augmentation.eta.detach().clone()
    opt = torch.optim.SGD([model.augmentation.eta], lr=1.0)
    ev = guide_eta_step(guide, model, batches, opt, seed=7, distributed=distributed)
    eta = model.augmentation.eta.detach().clone()
    with torch.no_grad():
        model.augmentation.eta.copy_(eta0)
    return eta, ev


class _NoReduce:
    """A DistributedState whose all-reduce is missing: each rank uses its own batches only."""

    def __init__(self, state):
        self.rank, self.world_size = state.rank, state.world_size

    @staticmethod
    def reduce_sums(sums):
        return dict(sums)


def _lila_worker():
    model, guide = _lila_fit(distributed=True)
    state = pbd.init_process_group("cpu")
    batches = pbd.unsharded_batches(pbd.ShardedTensorBatches(
        *_lila_data(), LILA_BATCH // 2, num_replicas=2, rank=state.rank, shuffle=False), LILA_BATCH)
    return {"eta": model.augmentation.eta.detach().clone(),
            "sgd": _lila_sgd_step(model, guide, batches, state),
            "sgd_no_reduce": _lila_sgd_step(model, guide, batches, _NoReduce(state))}


@functools.cache
def _lila_reference():
    model, guide = _lila_fit()
    x, y = _lila_data()
    batches = [(x[i:i + LILA_BATCH], y[i:i + LILA_BATCH]) for i in range(0, LILA_N, LILA_BATCH)]
    return {"eta": model.augmentation.eta.detach().clone(),
            "sgd": _lila_sgd_step(model, guide, batches)}


def _worker(rank, out_dir):
    calls = []
    real_save = pb.training.loop.save_checkpoint
    pb.training.loop.save_checkpoint = lambda *a, **k: (calls.append(1), real_save(*a, **k))
    fits = {"meanfield": _fit("meanfield", distributed=True,
                              checkpoint=os.path.join(out_dir, "ckpt.pt"))}
    fits.update({k: _fit(k, distributed=True) for k in KINDS[1:]})
    fits["independent"] = _fit("meanfield", distributed=pbd.DistributedOptions(shared_noise=False))
    x, y = _data()
    shard = pbd.ShardedTensorBatches(x.float(), y, 8, num_replicas=2, rank=rank, shuffle=True)
    evidence = {s: _curvature_evidence(s, shard) for s in STRUCTURES}
    torch.manual_seed(0)
    torch.rand(5 + rank)                          # ranks fall out of step ...
    pbd.init_process_group("cpu").sync_rng_()     # ... and are put back on rank 0's stream
    draws = torch.rand(3)
    lila = _lila_worker()
    torch.save({"fits": fits, "saves": len(calls), "evidence": evidence, "draws": draws, "lila": lila,
                "world": pbd.get_world_size(), "main": pbd.is_main_process()},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Run :func:`_worker` on 2 Gloo processes once; the per-rank results and the folder."""
    out = tmp_path_factory.mktemp("ddp")
    pbd.launch_local(_worker, nprocs=2, args=(str(out),), timeout_s=150)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


def test_only_rank0_checkpoints(two_ranks):
    (r0, r1), out = two_ranks
    assert (r0["world"], r1["world"], r0["main"], r1["main"]) == (2, 2, True, False)
    assert (r0["saves"], r1["saves"]) == (EPOCHS, 0)
    assert (out / "ckpt.pt").exists()


def test_independent_noise_is_not_the_single_process_run(two_ranks):
    (r0, r1), _ = two_ranks
    ref_state = _reference("meanfield")[0]
    state0, state1 = r0["fits"]["independent"][0], r1["fits"]["independent"][0]
    assert all(torch.equal(state0[k], state1[k]) for k in ref_state)   # still in sync via DDP
    assert max((state0[k] - ref).abs().max().item() for k, ref in ref_state.items()) > 1e-3


def test_sync_rng_puts_ranks_on_rank0_stream(two_ranks):
    (r0, r1), _ = two_ranks
    torch.manual_seed(0)
    torch.rand(5)
    assert torch.equal(r0["draws"], torch.rand(3)) and torch.equal(r1["draws"], r0["draws"])


@pytest.mark.parametrize("kind", KINDS)
def test_two_gloo_processes_match_one_process(two_ranks, kind):
    (r0, r1), _ = two_ranks
    ref_state, ref_history, ref_evidence = _reference(kind)
    state0, history0, evidence0 = r0["fits"][kind]
    state1, _, evidence1 = r1["fits"][kind]
    assert ref_state.keys() == state0.keys()
    tol = 1e-5 if kind in FLOAT32_KINDS else 1e-9
    for k, ref in ref_state.items():
        assert torch.equal(state0[k], state1[k]), k              # DDP keeps ranks identical
        torch.testing.assert_close(state0[k], ref, rtol=tol, atol=tol, msg=k)
    init = _initial_state(kind)
    moved = max((ref - init[k]).abs().max().item() for k, ref in ref_state.items())
    assert moved > 1e-2                                            # training did move them
    for name in ("loss", "elbo", "log_evidence"):                  # histories are global
        if name in ref_history:
            torch.testing.assert_close(torch.tensor(history0[name]), torch.tensor(ref_history[name]),
                                       rtol=tol, atol=0, msg=name)
    if kind == "laplace":
        assert "log_evidence" in ref_history
        for ev in (evidence0, evidence1):
            assert abs(ev - ref_evidence) <= 1e-6 * abs(ref_evidence), (ev, ref_evidence)


def _initial_state(kind):
    return _fit(kind, epochs=0)[0]


@pytest.mark.parametrize("structure", STRUCTURES)
def test_curvature_summed_across_ranks_gives_single_process_evidence(two_ranks, structure):
    (r0, r1), _ = two_ranks
    x, y = _data()
    ref, n = _curvature_evidence(structure, [(x.float(), y)])
    assert n == N and r0["evidence"][structure][1] == N            # global N after the all-reduce
    for r in (r0, r1):
        ev = r["evidence"][structure][0]
        assert abs(ev - ref) <= 1e-6 * abs(ref), (structure, ev, ref)


# ------------------------------------------------------------------ single-process units
def test_a_rank_without_its_gpu_is_a_clear_error():
    """Process ``local_rank`` trains on ``cuda:local_rank``; with fewer visible GPUs than
    processes per node that is named (not CUDA's 'invalid device ordinal')."""
    from pyro_bnn.training.distributed.group import _resolve_device

    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"local rank {n}.*{n} CUDA device"):
        _resolve_device("cuda", n)
    assert _resolve_device("cpu", n) == torch.device("cpu")


def test_backend_choice():
    assert pbd.default_backend("cpu") == "gloo"
    assert pbd.default_backend(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(ValueError, match="cpu and cuda"):
        pbd.default_backend("meta")


def test_without_group_helpers_are_single_process():
    assert not pbd.is_distributed()
    assert (pbd.get_rank(), pbd.get_world_size(), pbd.is_main_process()) == (0, 1, True)
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(pbd.all_reduce_sum_(t), torch.tensor([1.0, 2.0]))
    assert pbd.broadcast_seed(7) == 7


def test_fit_distributed_without_torchrun_says_how_to_launch(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    model, guide = _model_and_guide("meanfield")
    with pytest.raises(ValueError, match="torchrun"):
        pb.fit(model, guide, _data(), epochs=1, distributed=True, progress=False)
    with pytest.raises(TypeError, match="DistributedOptions"):
        pb.fit(model, guide, _data(), epochs=1, distributed="yes", progress=False)


def test_local_batch_size_must_split_evenly():
    assert pbd.local_batch_size(16, 2) == 8
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        pbd.local_batch_size(15, 2)


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_of_each_batch_form_the_global_batch(shuffle):
    x = torch.arange(20.0).unsqueeze(1)
    y = torch.arange(20)
    shards = [pbd.ShardedTensorBatches(x, y, 2, num_replicas=2, rank=r, shuffle=shuffle, seed=3)
              for r in range(2)]
    orders = []
    for epoch in (0, 1):
        for s in shards:
            s.set_epoch(epoch)
        batches = [list(s) for s in shards]
        assert [len(b) for b in batches] == [5, 5]
        seen = []
        for i, (b0, b1) in enumerate(zip(*batches)):
            ids = torch.cat([b0[1], b1[1]])
            assert torch.equal(b0[0].squeeze(1).long(), b0[1])
            if not shuffle:                                    # global batch i = x[4i:4i+4]
                assert sorted(ids.tolist()) == list(range(4 * i, 4 * i + 4))
            seen += ids.tolist()
        assert sorted(seen) == list(range(20))                 # each example once per epoch
        orders.append(seen)
    assert (orders[0] != orders[1]) == shuffle                 # set_epoch reshuffles


def test_unpadded_shards_cover_the_data_exactly_once():
    x, y = torch.arange(21.0).unsqueeze(1), torch.arange(21)          # 21 = 2·10 + 1
    seen = []
    for rank in range(2):
        train = pbd.ShardedTensorBatches(x, y, 4, num_replicas=2, rank=rank, shuffle=True)
        assert sum(len(b[1]) for b in train) == 11                     # the sampler pads ...
        seen += [int(i) for _, yb in pbd.unpadded_shard(train, rank, 2) for i in yb]
    assert sorted(seen) == list(range(21))                             # ... these shards don't


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


def test_shard_loader_for_datasets_and_loaders():
    state = pbd.DistributedState(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"),
                                 backend="gloo", options=pbd.DistributedOptions(), seed=5)
    loader = pbd.shard_loader(_Squares(), 4, state, shuffle=False)
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    assert [b[1].tolist() for b in loader] == [[1, 3], [5, 7], [9]]   # local batch 4/2
    assert len(loader.dataset) == 10                                  # global N for scaling
    assert [b[1].tolist() for b in pbd.unpadded_shard(loader, 1, 2)] == [[1, 3], [5, 7], [9]]
    with pytest.raises(ValueError, match="DistributedSampler"):
        pbd.shard_loader(torch.utils.data.DataLoader(_Squares(), batch_size=2), 4, state)


def test_invariance_learning_across_ranks_equals_one_process(two_ranks):
    """η after training with one evidence step (Adam), and after one more SGD step, equals the
    single-process value (float64, summation order only: 1e-9); without the all-reduce of
    the factor sums, N, log-likelihood and η gradient it does not."""
    (r0, r1), _ = two_ranks
    ref = _lila_reference()
    assert ref["eta"].abs().max() > 0.05                               # η did move
    for r in (r0, r1):
        lila = r["lila"]
        torch.testing.assert_close(lila["eta"], ref["eta"], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lila["sgd"][0], ref["sgd"][0], rtol=1e-9, atol=1e-9)
        assert abs(lila["sgd"][1] - ref["sgd"][1]) <= 1e-9 * abs(ref["sgd"][1])
        eta_local, ev_local = lila["sgd_no_reduce"]
        assert (eta_local - ref["sgd"][0]).abs().max() > 1e-4          # a missing all-reduce shows
        assert abs(ev_local - ref["sgd"][1]) > 1e-3
    assert torch.equal(r0["lila"]["sgd"][0], r1["lila"]["sgd"][0])


def test_laplace_accepts_learning_an_augmentation_across_ranks():
    from pyro_bnn.invariance import AffineAugmentation
    from pyro_bnn.training.loop import FitContext

    aug = AffineAugmentation(num_samples=2, image_shape=(1, 4, 4))
    model = pb.BNN(nn.Linear(16, 3), "categorical", augmentation=aug)
    guide = pb.guides.Laplace(model)
    x, y = torch.rand(4, 16), torch.tensor([0, 1, 2, 0])
    pb.training.setup_guide(model, guide, x, y)
    state = pbd.DistributedState(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"),
                                 backend="gloo", options=pbd.DistributedOptions())
    ctx = FitContext(model, guide, None, 4, torch.device("cpu"), 1,
                     options={"marglik": pb.MarglikOptions(steps=1)}, distributed=state)
    guide.on_fit_start(ctx)                        # η learning under distributed=True: no guard
    assert guide.online is not None and guide.online.eta_optimizer is not None


def test_example_script_runs_in_one_process(capsys, monkeypatch):
    import importlib.util
    import pathlib

    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    path = pathlib.Path(__file__).parents[1] / "examples" / "distributed_digits.py"
    spec = importlib.util.spec_from_file_location("distributed_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--epochs", "2", "--hidden", "16", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "processes=1" in out and "test accuracy=" in out
    accuracy = float(out.split("test accuracy=")[1].split()[0])
    assert accuracy > 0.5                                              # 10 classes: chance 0.1


def test_unused_parameter_probe_restores_the_rng():
    from pyro_bnn.training.distributed.group import _has_unused_parameters

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(2, 1), nn.Linear(2, 1)

        def forward(self, x, y):
            return ((self.used(x + torch.randn_like(x)) - y) ** 2).sum()

    x, y = torch.ones(3, 2), torch.zeros(3, 1)
    torch.manual_seed(0)
    module = Loss()
    after_init = torch.get_rng_state()
    assert _has_unused_parameters(module, x, y)                       # `unused` gets no grad
    assert torch.equal(torch.get_rng_state(), after_init)            # the probe's randn undone
    module.unused = None
    assert not _has_unused_parameters(module, x, y)


def test_plain_fit_under_torchrun_warns(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    model, guide = _model_and_guide("meanfield")
    with pytest.warns(UserWarning, match="distributed=False"):
        pb.fit(model, guide, _data(), epochs=0, progress=False)
