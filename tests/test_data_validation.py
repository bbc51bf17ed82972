"""Bad training data gets one clear error, from tensors and from loaders alike (issue 15).

Tensors are checked once before training; batches of a ``Dataset``/``DataLoader`` are checked
as they are read (``pyro_bnn.data.batches.BatchCheck``).  Priors reject invalid hyperparameters and
prior-dict keys that match no site; the MNIST reader rejects damaged or inconsistent files.
"""

import gzip
import math
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import mlp
from torch.utils.data import DataLoader, Dataset, TensorDataset

import pyro_bnn as pb
from pyro_bnn.data.batches import BatchCheck, CheckedBatches, check_inputs, make_loader, validate_data
from pyro_bnn.model.likelihoods import log_likelihood


def _model(likelihood="categorical", d_out=3, **kw):
    torch.manual_seed(0)
    return pb.BNN(mlp(8, 6, d_out), likelihood, **kw)


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _fit(model, data, **kw):
    return pb.fit(model, pb.guides.MeanField(model), data, epochs=1, progress=False, **kw)


def _checked_batches(model, data, batch_size=8):
    """What fit does with a loader: validate up front, then check each batch as it is read."""
    return list(make_loader(data, batch_size, shuffle=False, check=validate_data(model, data)))


# ------------------------------------------------------------------ batches of a DataLoader
def test_ignore_index_labels_in_a_loader_batch_are_an_error():
    model = _model()
    x, y = _data()
    y[21] = -100  # batch 3 of 8-example batches: F.cross_entropy would silently skip it
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with pytest.raises(ValueError, match=r"y in batch 3 of the DataLoader.*\[-100, 2\].*ignore_index"):
        _checked_batches(model, loader)
    y[21] = 3  # one past the last class
    with pytest.raises(ValueError, match=r"batch 3 .*labels must lie in \[0, 2\].*\[0, 3\]"):
        _checked_batches(model, DataLoader(TensorDataset(x, y), batch_size=8))


@pytest.mark.parametrize("case, error, pattern", [
    ("nan_x", ValueError, r"x in batch 2 of the DataLoader contains 1 NaN/inf"),
    ("int_x", TypeError, r"x in batch 1 of the DataLoader has dtype torch.int64.*x.float\(\)"),
    ("float64_x", TypeError, r"x in batch 1 .*torch.float64 but the model's weights are torch.float32"),
    ("float_y", TypeError, r"y in batch 1 .*integer class labels"),
    ("int32_y", TypeError, r"y in batch 1 .*int64.*y.long\(\)"),
])
def test_bad_loader_batches(case, error, pattern):
    x, y = _data()
    if case == "nan_x":
        x[12, 3] = math.nan
    elif case == "int_x":
        x = (x * 10).long()
    elif case == "float64_x":
        x = x.double()
    elif case == "float_y":
        y = y.float()
    else:
        y = y.int()
    with pytest.raises(error, match=pattern):
        _checked_batches(_model(), DataLoader(TensorDataset(x, y), batch_size=8))


class _PreBatched(Dataset):
    """Each item is a whole batch; the 3rd has one target too few."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return 4

    def __getitem__(self, k):
        return self.x[10 * k:10 * (k + 1)], self.y[10 * k:10 * (k + 1) - (k == 2)]


def test_lengths_must_match_in_every_batch():
    loader = DataLoader(_PreBatched(*_data()), batch_size=None)
    with pytest.raises(ValueError, match=r"x and y in batch 3 .*same length, got 10 inputs and 9 targets"):
        _checked_batches(_model(), loader)


def test_regression_and_bernoulli_targets_per_batch():
    x, _ = _data()
    gaussian = _model("gaussian", d_out=1, noise=0.1)
    with pytest.raises(TypeError, match="floating-point targets"):
        _checked_batches(gaussian, DataLoader(TensorDataset(x, torch.zeros(40, 1, dtype=torch.long)), batch_size=8))
    y = torch.zeros(40, 1)
    y[30] = math.inf
    with pytest.raises(ValueError, match="y in batch 4 of the DataLoader contains 1 NaN/inf"):
        _checked_batches(gaussian, DataLoader(TensorDataset(x, y), batch_size=8))
    bernoulli = _model("bernoulli", d_out=1)
    y = torch.zeros(40, 1)
    y[5] = 2.0
    with pytest.raises(ValueError, match="bernoulli targets must be 0 or 1"):
        _checked_batches(bernoulli, DataLoader(TensorDataset(x, y), batch_size=8))


def test_good_loader_passes_unchanged_and_the_wrapper_is_transparent():
    x, y = _data()
    base = DataLoader(TensorDataset(x, y), batch_size=8)
    loader = make_loader(base, check=validate_data(_model(), base))
    assert isinstance(loader, CheckedBatches) and make_loader(loader) is loader
    assert len(loader) == 5 and loader.dataset is base.dataset and loader.batch_size == 8
    batches = list(loader)
    assert torch.equal(torch.cat([b[0] for b in batches]), x) and torch.equal(torch.cat([b[1] for b in batches]), y)
    # a Dataset gets a DataLoader, checked too
    assert isinstance(make_loader(_PreBatched(x, y), 8), CheckedBatches)


def test_model_free_default_check_still_catches_nan_and_lengths():
    x, y = _data()
    x[3, 0] = math.nan
    with pytest.raises(ValueError, match="x in batch 1 of the DataLoader contains 1 NaN"):
        list(make_loader(DataLoader(TensorDataset(x, y), batch_size=8)))
    with pytest.raises(ValueError, match="x and y in batch 1 .*same length"):
        BatchCheck()(x[4:8], y[4:7], "batch 1 of the DataLoader")


def test_integer_inputs_only_for_models_that_take_them():
    tokens = torch.randint(0, 20, (6, 3))
    BatchCheck()(tokens)  # without a model: cannot tell, accepted
    embedding = pb.BNN(torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Flatten(), torch.nn.Linear(12, 3)),
                       stochastic=["net.2.weight", "net.2.bias"])
    BatchCheck(embedding)(tokens)  # token ids for nn.Embedding
    with pytest.raises(TypeError, match=r"has dtype torch.int64; expected floating-point inputs"):
        BatchCheck(_model())(tokens)


def test_checking_loader_batches_does_not_move_the_random_streams():
    model = _model()
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    states = []
    for check in (BatchCheck(), BatchCheck(model)):  # model-free, and one that runs the network
        torch.manual_seed(5)
        list(make_loader(loader, check=check))  # (a DataLoader draws its own base seed)
        states.append(torch.get_rng_state())
    assert torch.equal(*states)


def test_output_shape_is_computed_once():
    model = _model()
    calls = []
    handle = model.net[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        x, y = _data()
        list(make_loader(DataLoader(TensorDataset(x, y), batch_size=8), check=BatchCheck(model)))
    finally:
        handle.remove()
    assert len(calls) == 1


# ------------------------------------------------------------------ pb.fit end to end
def test_fit_with_ignore_index_labels_from_a_loader_raises():
    model = _model()
    x, y = _data()
    y[::2] = -100
    with pytest.raises(ValueError, match=r"y in batch 1 of the DataLoader: labels must lie in \[0, 2\].*-100"):
        _fit(model, DataLoader(TensorDataset(x, y), batch_size=8))


def test_fit_checks_loader_batches():
    x, y = _data()
    x[20, 1] = math.nan
    with pytest.raises(ValueError, match="x in batch 3 of the DataLoader contains 1 NaN"):
        _fit(_model(), DataLoader(TensorDataset(x, y), batch_size=8))
    x = x.nan_to_num()
    with pytest.raises(TypeError, match=r"x in batch 1 of the DataLoader has dtype torch.float64 but the "
                                        r"model's weights are torch.float32"):
        _fit(_model(), DataLoader(TensorDataset(x.double(), y), batch_size=8))
    with pytest.raises(TypeError, match=r"x in batch 1 of the DataLoader has dtype torch.uint8.*x.float\(\)"):
        _fit(_model(), DataLoader(TensorDataset((x > 0).to(torch.uint8), y), batch_size=8))
    with pytest.raises(TypeError, match=r"y in batch 1 of the DataLoader: .*int64.*y.long\(\)"):
        _fit(_model(), DataLoader(TensorDataset(x, y.int()), batch_size=8))



@pytest.mark.parametrize("data, pattern", [
    (lambda x, y: (x[:0], y[:0]), r"data is empty: x has shape \(0, 8\)"),
    (lambda x, y: DataLoader(TensorDataset(x[:0], y[:0]), batch_size=8), r"yielded no batch \(0 examples"),
    (lambda x, y: DataLoader(TensorDataset(x[:5], y[:5]), batch_size=8, drop_last=True),
     r"yielded no batch \(5 examples, batch_size=8, drop_last=True\)"),
    (lambda x, y: _Empty(), "data is empty: the _Empty has 0 examples"),
])
def test_empty_data_is_named(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        _fit(_model(), data(*_data()))


class _Empty(Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, k):
        raise IndexError(k)


@pytest.mark.parametrize("make_x, error, pattern", [
    (lambda x: (x * 10).long(), TypeError, r"x has dtype torch.int64; expected floating-point.*x.float\(\)"),
    (lambda x: (x > 0).to(torch.uint8), TypeError, r"x has dtype torch.uint8.*/ 255"),
    (lambda x: x.double(), TypeError,
     r"x has dtype torch.float64 but the model's weights are torch.float32; convert the inputs with "
     r"x.to\(torch.float32\) or build the network in torch.float64"),
])
def test_fit_names_the_input_dtype_problem(make_x, error, pattern):
    x, y = _data()
    with pytest.raises(error, match=pattern):
        _fit(_model(), (make_x(x), y))


def test_fit_names_the_label_dtype_problem():
    x, y = _data()
    with pytest.raises(TypeError, match=r"int64 \(torch.long\), got torch.int32; convert them with y.long\(\)"):
        _fit(_model(), (x, y.int()))


def test_float64_model_trains_on_float64_data(float64):
    model = _model()
    assert pb.data.model_dtype(model) == torch.float64
    x, y = _data()
    _fit(model, (x.double(), y))
    with pytest.raises(TypeError, match="torch.float32 but the model's weights are torch.float64"):
        _fit(model, (x.float(), y))



def test_check_inputs():
    check_inputs(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"x is empty \(shape \(0, 3\)\)"):
        check_inputs(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="batch dimension"):
        check_inputs(torch.tensor(1.0))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        check_inputs([[1.0]])


# ------------------------------------------------------------------ the likelihood fast path
def test_categorical_log_likelihood_equals_cross_entropy_and_rejects_ignore_index():
    lik = pb.likelihoods.Categorical()
    f = torch.randn(32, 5, requires_grad=True)
    y = torch.randint(0, 5, (32,))
    ours = log_likelihood(lik, f, y)
    ref = -F.cross_entropy(f, y, reduction="none")
    g_ours, = torch.autograd.grad(ours.sum() * 1.7, f)
    g_ref, = torch.autograd.grad(ref.sum() * 1.7, f)
    assert torch.equal(ours, ref) and torch.equal(g_ours, g_ref)  # bit-identical
    assert torch.equal(log_likelihood(lik, f, y.to(torch.uint8)), ref)
    y[7] = -100  # F.cross_entropy returns 0 for it: a silently dropped example
    assert float(F.cross_entropy(f.detach(), y, reduction="none")[7]) == 0.0
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\].*\[-100, 4\]"):
        log_likelihood(lik, f, y)
    with pytest.raises(TypeError, match="integer class labels"):
        log_likelihood(lik, f, y.float())


# ------------------------------------------------------------------ priors
@pytest.mark.parametrize("make, error, pattern", [
    (lambda: pb.priors.IIDNormal(math.inf), ValueError, "IIDNormal scale must be a finite number, got inf"),
    (lambda: pb.priors.IIDNormal(math.nan), ValueError, "IIDNormal scale must be a finite number, got nan"),
    (lambda: pb.priors.IIDNormal(-1.0), ValueError, r"IIDNormal scale must be > 0, got -1.0"),
    (lambda: pb.priors.IIDNormal(0.0), ValueError, r"IIDNormal scale must be > 0"),
    (lambda: pb.priors.IIDNormal(1.0, loc=-math.inf), ValueError, "IIDNormal loc must be a finite number"),
    (lambda: pb.priors.IIDNormal("1"), TypeError, "IIDNormal scale must be a real number, got str"),
    (lambda: pb.priors.IIDNormal(torch.ones(3)), TypeError, r"one-element tensor.*shape \(3,\)"),
    (lambda: pb.priors.FanInNormal(math.inf), ValueError, "FanInNormal gain must be a finite number"),
    (lambda: pb.priors.ScaleMixture(0.5, math.inf, 1e-3), ValueError, "ScaleMixture sigma1 must be a finite"),
    (lambda: pb.priors.ScaleMixture(0.5, 1.0, 0.0), ValueError, "ScaleMixture sigma2 must be > 0"),
    (lambda: pb.priors.ScaleMixture(math.nan), ValueError, "ScaleMixture pi must be a finite number"),
    (lambda: pb.priors.ScaleMixture(1.0), ValueError, r"ScaleMixture pi must be in \(0, 1\)"),
])
def test_invalid_prior_hyperparameters(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()


def test_prior_hyperparameters_as_tensors_and_ints():
    assert float(pb.priors.IIDNormal(torch.tensor(0.5)).scale) == 0.5
    assert float(pb.priors.FanInNormal(2).gain) == 2.0


def test_prior_dict_keys_must_name_sites():
    wide, narrow = pb.priors.IIDNormal(1.0), pb.priors.IIDNormal(0.1)
    with pytest.raises(ValueError, match=r"'net.0.wieght' \(did you mean 'net.0.weight'\?\) match no random"):
        pb.BNN(mlp(8, 6, 3), prior={"*": wide, "net.0.wieght": narrow})
    with pytest.raises(ValueError, match=r"'2.bias' \(did you mean 'net.2.bias'\?\)"):
        pb.BNN(mlp(8, 6, 3), prior={"*": wide, "2.bias": narrow})
    with pytest.raises(ValueError, match=r"'net.0.wieght' \(did you mean"):  # no '*': same message
        pb.BNN(mlp(8, 6, 3), prior={"net.0.wieght": narrow, "net.0.bias": wide,
                                    "net.2.weight": wide, "net.2.bias": wide})
    model = pb.BNN(mlp(8, 6, 3), prior={"*": wide, "net.0.weight": narrow})
    assert model.site_normal_prior("net.0.weight")[1] == pytest.approx(0.1)
    assert model.site_normal_prior("net.0.bias")[1] == pytest.approx(1.0)
    wn = pb.BNN(mlp(8, 6, 3), weight_norm=True, prior={"*": wide, "net.0.weight_g": narrow})
    assert wn.site_normal_prior("net.0.weight_g")[1] == pytest.approx(0.1)


# ------------------------------------------------------------------ MNIST files
def _idx_bytes(arr: np.ndarray, dtype_code: int = 8) -> bytes:
    header = struct.pack(">HBB", 0, dtype_code, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def _mnist_folder(tmp_path, images: bytes, labels: bytes, gz: bool = False):
    suffix = ".gz" if gz else ""
    for stem, data in (("t10k-images-idx3-ubyte", images), ("t10k-labels-idx1-ubyte", labels)):
        with (gzip.open if gz else open)(tmp_path / (stem + suffix), "wb") as fh:
            fh.write(data)
    return tmp_path


_RNG = np.random.default_rng(0)
_IMAGES = _RNG.integers(0, 256, (10, 28, 28))
_LABELS = _RNG.integers(0, 10, 10)


@pytest.mark.parametrize("images, labels, pattern", [
    (_idx_bytes(_IMAGES), _idx_bytes(_LABELS[:9]), "10 images in t10k-images-idx3-ubyte but 9 labels"),
    (_idx_bytes(_IMAGES.reshape(10, 784)), _idx_bytes(_LABELS), r"3 dimension\(s\).*got 2 \(magic 00000802\)"),
    (_idx_bytes(_LABELS), _idx_bytes(_IMAGES), r"3 dimension\(s\).*got 1"),
    (_idx_bytes(_IMAGES, dtype_code=0x0D), _idx_bytes(_LABELS), "not an unsigned-byte IDX file: magic number 00000d03"),
    (_idx_bytes(_RNG.integers(0, 256, (10, 32, 32))), _idx_bytes(_LABELS), r"28x28 pixels, got shape \(10, 32, 32\)"),
    (_idx_bytes(_IMAGES)[:-100], _idx_bytes(_LABELS), r"truncated: header says shape \(10, 28, 28\) \(7840 values\), "
                                                       "the file holds 7740"),
    (_idx_bytes(_IMAGES) + b"\0", _idx_bytes(_LABELS), "longer than its header says"),
    (_idx_bytes(_IMAGES)[:10], _idx_bytes(_LABELS), r"truncated IDX header: 10 bytes, expected 16"),
    (b"\0\0\x08", _idx_bytes(_LABELS), "truncated IDX file: 3 bytes"),
    (_idx_bytes(_IMAGES), _idx_bytes(_LABELS + 10), "expected digit labels 0-9, got labels up to 1"),
])
def test_mnist_reader_rejects_bad_files(tmp_path, images, labels, pattern):
    with pytest.raises(ValueError, match=pattern):
        pb.datasets.mnist(_mnist_folder(tmp_path, images, labels), "test")


def test_mnist_reader_rejects_a_truncated_gzip_stream(tmp_path):
    root = _mnist_folder(tmp_path, _idx_bytes(_IMAGES), _idx_bytes(_LABELS), gz=True)
    path = root / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="damaged or truncated gzip file"):
        pb.datasets.mnist(root, "test")


def test_mnist_reader_reads_good_files(tmp_path):
    x, y = pb.datasets.mnist(_mnist_folder(tmp_path, _idx_bytes(_IMAGES), _idx_bytes(_LABELS)), "test")
    assert x.shape == (10, 784) and torch.equal(y, torch.from_numpy(_LABELS).long())


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_shuffled_tensor_batches_are_the_indexed_rows(layout):
    """``TensorBatches`` yields ``x[perm[batch]]`` exactly (values, strides) whatever the layout
    (contiguous data takes ``index_select``, other layouts ``x[idx]``)."""
    from pyro_bnn.data.batches import TensorBatches

    x = torch.randn(10, 3, 4, 5)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = torch.randn(3, 10).t()
    y = torch.arange(10)
    gen = torch.Generator().manual_seed(0)
    batches = list(TensorBatches(x, y, 4, generator=gen))
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    assert len(batches) == 3
    for i, (xb, yb) in enumerate(batches):
        idx = perm[4 * i:4 * (i + 1)]
        assert torch.equal(xb, x[idx]) and xb.stride() == x[idx].stride()
        assert torch.equal(yb, y[idx])
