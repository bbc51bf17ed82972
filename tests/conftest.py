import os

import pyro
import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(1)  # tiny nets: one thread avoids thread hand-off overhead

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _seed():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    yield


@pytest.fixture
def float64():
    """Float64 as the default dtype for comparisons at ~1e-9; the old default is restored."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="session")
def digits_small():
    import pyro_bnn as pb

    d = pb.datasets.digits()
    return d.x_train[:300], d.y_train[:300], d.x_test[:100], d.y_test[:100]
