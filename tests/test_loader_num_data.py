"""The data set size N that ``pb.fit`` scales each minibatch's likelihood to, read from a
``DataLoader``: the examples its sampler draws from, not every example of its data set.

A train/validation split through ``DataLoader(full, sampler=SubsetRandomSampler(train_idx))``
used to be scaled to ``len(full)``, over-weighting the likelihood by ``len(full) / len(train_idx)``
(a posterior too narrow, silently).  A sampler whose examples cannot be known must not be
guessed: ``num_data=`` says N, and wins whenever it is given.
"""

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import pyro_bnn as pb
from pyro_bnn.data.batches import CheckedBatches, TensorBatches, dataset_size
from pyro_bnn.invariance.learning import _Source
from pyro_bnn.training.convergence_check import objective_draws

TOTAL = 60
TRAIN = 24


@pytest.fixture
def dataset():
    torch.manual_seed(0)
    x = torch.randn(TOTAL, 4)
    y = torch.randint(0, 3, (TOTAL,))
    return TensorDataset(x, y)


def _model():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return pb.BNN(net, likelihood="categorical")


class _Spy(pb.guides.MeanFieldELBO):
    """The MeanField objective, recording the ``num_data`` each minibatch is scaled to."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self, model, guide, x, y, num_data=None):
        self.seen.append(num_data)
        return super().__call__(model, guide, x, y, num_data)


def _fit_num_data(loader, **options) -> set:
    model = _model()
    spy = _Spy()
    pb.fit(model, pb.guides.MeanField(model), loader, epochs=1, objective=spy, progress=False, **options)
    return set(spy.seen)


class _Firsts(Sampler):
    """A sampler of one's own: the first ``k`` indices."""

    def __init__(self, k):
        self.k = k

    def __iter__(self):
        return iter(range(self.k))

    def __len__(self):
        return self.k


class _Pairs(Sampler):
    """A batch sampler of one's own: consecutive pairs of the first ``k`` indices."""

    def __init__(self, k):
        self.k = k

    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, self.k, 2)])

    def __len__(self):
        return self.k // 2


# ------------------------------------------------------------------ pb.fit


def test_subset_sampler_scales_to_its_indices(dataset):
    train = list(range(TRAIN))
    loader = DataLoader(dataset, batch_size=8, sampler=SubsetRandomSampler(train))
    assert _fit_num_data(loader) == {TRAIN}   # was {TOTAL}


def test_batch_sampler_over_a_subset_scales_to_its_indices(dataset):
    batches = BatchSampler(SubsetRandomSampler(range(TRAIN)), batch_size=8, drop_last=False)
    assert _fit_num_data(DataLoader(dataset, batch_sampler=batches)) == {TRAIN}


def test_sampler_yielding_batches_over_a_subset(dataset):
    """``sampler=BatchSampler(...)`` with ``batch_size=None`` (the dataset indexed by lists)."""
    batches = BatchSampler(SubsetRandomSampler(range(TRAIN)), batch_size=8, drop_last=False)
    assert _fit_num_data(DataLoader(dataset, sampler=batches, batch_size=None)) == {TRAIN}


@pytest.mark.parametrize("shuffle", [False, True])
def test_plain_loader_unchanged(dataset, shuffle):
    assert _fit_num_data(DataLoader(dataset, batch_size=8, shuffle=shuffle)) == {TOTAL}


def test_tensors_unchanged(dataset):
    x, y = dataset.tensors
    assert _fit_num_data((x, y), batch_size=8) == {TOTAL}


def test_unknowable_sampler_refused(dataset):
    """A sampler drawing another number of examples than the data set holds, whose examples
    cannot be known, is not guessed: the error asks for num_data."""
    loader = DataLoader(dataset, batch_size=8, sampler=_Firsts(TRAIN))
    with pytest.raises(TypeError, match=r"_Firsts yields 24 indices per epoch over a data set of 60 examples.*"
                                        r"pass num_data=N"):
        _fit_num_data(loader)


def test_weighted_sampler_scales_to_the_examples_it_can_draw(dataset):
    """Class rebalancing draws from every example (N = the data set, whatever the epoch's
    length); zero weights on a held-out part leave the rest."""
    rebalance = WeightedRandomSampler(torch.rand(TOTAL) + 0.1, num_samples=TRAIN)
    assert _fit_num_data(DataLoader(dataset, batch_size=8, sampler=rebalance)) == {TOTAL}
    weights = torch.zeros(TOTAL)
    weights[:TRAIN] = 1.0
    held_out = WeightedRandomSampler(weights, num_samples=TOTAL)
    assert _fit_num_data(DataLoader(dataset, batch_size=8, sampler=held_out)) == {TRAIN}


def test_unknowable_batch_sampler_refused(dataset):
    with pytest.raises(TypeError, match=r"_Pairs yields 12 batches per epoch.*pass num_data=N"):
        _fit_num_data(DataLoader(dataset, batch_sampler=_Pairs(TRAIN)))


@pytest.mark.parametrize("sampler", ["subset", "weighted", "own_batches"])
def test_explicit_num_data_wins(dataset, sampler):
    """``num_data=`` is used as given, and nothing warns (pytest turns warnings into errors)."""
    if sampler == "subset":
        loader = DataLoader(dataset, batch_size=8, sampler=SubsetRandomSampler(range(TRAIN)))
    elif sampler == "weighted":
        loader = DataLoader(dataset, batch_size=8, sampler=WeightedRandomSampler(torch.ones(TOTAL), TRAIN))
    else:
        loader = DataLoader(dataset, batch_sampler=_Pairs(TRAIN))
    assert _fit_num_data(loader, num_data=500) == {500}


def test_laplace_curvature_on_a_subset_loader_is_consistent(dataset):
    """The curvature ``fit`` computes at its end sees the subset it trained on: no warning
    that examples were left out (the subset is the data set), and N is the subset's."""
    model = _model()
    guide = pb.guides.Laplace(model)
    loader = DataLoader(dataset, batch_size=8, sampler=SubsetRandomSampler(range(TRAIN)))
    pb.fit(model, guide, loader, epochs=1, progress=False)
    assert guide.posterior.num_data == TRAIN


def test_objective_draws_scale_to_the_subset(dataset):
    model = _model()
    guide = pb.guides.MeanField(model)
    loader = DataLoader(dataset, batch_size=8, sampler=SubsetRandomSampler(range(TRAIN)))
    pb.fit(model, guide, loader, epochs=1, progress=False)
    spy = _Spy()
    objective_draws(model, guide, loader, num_samples=1, objective=spy)
    assert set(spy.seen) == {TRAIN}


# ------------------------------------------------------------- dataset_size


@pytest.mark.parametrize("make, expected", [
    (lambda ds: DataLoader(ds, batch_size=8), TOTAL),
    (lambda ds: DataLoader(ds, batch_size=8, shuffle=True), TOTAL),
    (lambda ds: DataLoader(ds, sampler=SequentialSampler(range(TRAIN)), batch_size=8), TRAIN),
    (lambda ds: DataLoader(ds, sampler=SubsetRandomSampler(torch.arange(TRAIN)), batch_size=8), TRAIN),
    # uniform draws over the whole data set, whatever the epoch's length: N is the data set's
    (lambda ds: DataLoader(ds, sampler=RandomSampler(ds, replacement=True, num_samples=TRAIN), batch_size=8),
     TOTAL),
    (lambda ds: DataLoader(ds, sampler=RandomSampler(ds, num_samples=2 * TOTAL), batch_size=8), TOTAL),
    # one data set's worth of draws per epoch (class rebalancing): the data set's size, as before
    (lambda ds: DataLoader(ds, sampler=WeightedRandomSampler(torch.ones(TOTAL), TOTAL), batch_size=8), TOTAL),
    (lambda ds: DataLoader(ds, sampler=_Firsts(TOTAL), batch_size=8), TOTAL),
    # distributed: each rank reads a shard, N is the global data set's
    (lambda ds: DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=1), batch_size=8), TOTAL),
    (lambda ds: CheckedBatches(DataLoader(ds, sampler=SubsetRandomSampler(range(TRAIN)), batch_size=8)), TRAIN),
    (lambda ds: TensorBatches(*ds.tensors, batch_size=8), TOTAL),
], ids=["sequential", "shuffled", "sequential-range", "subset-tensor", "random-replacement", "random-longer",
        "weighted-full-length", "own-full-length", "distributed", "checked-subset", "tensor-batches"])
def test_dataset_size(dataset, make, expected):
    assert dataset_size(make(dataset)) == expected


def test_dataset_size_of_a_sampler_without_length(dataset):
    class Endless(Sampler):
        def __iter__(self):
            while True:
                yield 0

    with pytest.raises(TypeError, match="Endless yields an unknown number of indices.*num_data=N"):
        dataset_size(DataLoader(dataset, sampler=Endless(), batch_size=8))


def test_resume_with_a_loader_over_another_part_of_the_data_is_refused(dataset, tmp_path):
    """The checkpoint records the examples an epoch covers, so a resume with a sampler over a
    different number of the same data set's examples is refused, not continued on other data."""
    path = tmp_path / "run.pt"
    model = _model()
    guide = pb.guides.MeanField(model)
    first = DataLoader(dataset, batch_size=8, sampler=SubsetRandomSampler(range(TRAIN)))
    pb.fit(model, guide, first, epochs=1, checkpoint=str(path), progress=False)
    other = DataLoader(dataset, batch_size=8, sampler=SubsetRandomSampler(range(TRAIN + 6)))
    again = _model()
    with pytest.raises(ValueError, match="data size: 24 there, 30 now"):
        pb.fit(again, pb.guides.MeanField(again), other, epochs=2, checkpoint=str(path), resume=True,
               progress=False)


def test_learn_invariance_scales_to_the_examples_its_loader_draws(dataset):
    """``pb.invariance.learn_invariance`` reads N from the loader as ``pb.fit`` does."""
    loader = DataLoader(dataset, batch_size=8, sampler=SubsetRandomSampler(range(TRAIN)))
    source = _Source(_model(), loader, 8, 8, torch.device("cpu"), None)
    assert source.num_data == TRAIN
    own = DataLoader(dataset, batch_sampler=_Pairs(TRAIN))
    with pytest.raises(TypeError, match="pass num_data=N"):
        _Source(_model(), own, 8, 8, torch.device("cpu"), None)
    assert _Source(_model(), own, 8, 8, torch.device("cpu"), None, num_data=TRAIN).num_data == TRAIN
