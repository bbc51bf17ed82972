"""Which weight layers feed a normalisation layer: read from nn.Sequential containers and from a
hand-written ``forward`` traced by torch.fx (a ResNet's), with the fallbacks where fx cannot trace.

The answer decides ``Laplace(subset="unnormalized")``, the warning when the evidence tunes layers
before a normalisation layer, and the warning for weight norm before BatchNorm.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
import torchvision
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch import nn

import pyro_bnn as pb
from pyro_bnn.model.batchnorm import layers_feeding_normalization
from pyro_bnn.model.dataflow import recording_normalization_feeding


def paths(net, **kw):
    return [path for path, _ in layers_feeding_normalization(net, **kw)]


class HandWritten(nn.Module):
    """conv → BatchNorm (fed), conv → ReLU → pool (not), fc → LayerNorm (fed), out (not)."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3)
        self.fc, self.ln, self.out = nn.Linear(4 * 5 * 5, 10), nn.LayerNorm(10), nn.Linear(10, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = torch.flatten(F.relu(self.c2(x)), 1)
        return self.out(F.relu(self.ln(self.fc(x))))


def test_hand_written_forward_is_read():
    assert paths(HandWritten()) == ["c1", "fc"]
    # inside a pb.BNN (converted to PyroModules, weights PyroSample sites): the same, with its path
    assert paths(pb.BNN(HandWritten(), "categorical")) == ["net.c1", "net.fc"]


def test_scale_commuting_operations_between_are_followed():
    class PooledView(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(8, 12), nn.BatchNorm1d(6)
            self.conv, self.gn = nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4)

        def forward(self, x):
            h = F.dropout(self.fc(x[:, :8]), 0.1, self.training).view(x.shape[0], 6, 2)
            g = F.avg_pool2d(self.conv(x[:, :64].reshape(-1, 1, 8, 8)), 2)
            return self.bn(h).sum((1, 2)) + self.gn(g).sum((1, 2, 3))

    assert paths(PooledView()) == ["fc", "conv"]

    class Functional(nn.Module):          # the functional forms divide the scale out as well
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.b(F.layer_norm(self.a(x), (6,)))

    assert paths(Functional()) == ["a"]
    assert paths(Functional(), kinds=(nn.modules.batchnorm._BatchNorm,)) == []


def test_an_output_used_elsewhere_too_does_not_feed():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.bn = nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            h = self.a(x)                       # to the BatchNorm and to the sum: its scale survives
            return self.bn(h) + h + self.bn(F.relu(self.b(x)))   # b: a ReLU after the bias

    assert paths(Residual()) == []

    class CalledTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.a(x)) + self.a(x)   # the second call's scale survives

    assert paths(CalledTwice()) == []
    # a ReLU commutes with a positive scale of the whole layer (weight and bias: a Laplace posterior
    # over the layer), not with one of its weight alone (weight norm's g)
    assert paths(Residual(), whole_layer=True) == ["b"]
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2))
    assert paths(seq) == [] and paths(seq, whole_layer=True) == ["0"]


def test_torchvision_resnet_every_convolution():
    net = torchvision.models.resnet18(num_classes=10)
    convs = [name for name, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 20 and paths(net) == convs           # every conv feeds a BatchNorm; fc none
    assert paths(pb.BNN(torchvision.models.resnet18(num_classes=10), "categorical")) == [f"net.{c}" for c in convs]


def test_untraceable_forward_is_read_through_its_children():
    class Branching(nn.Module):                # data-dependent control flow: fx cannot trace it
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
            self.block = HandWritten()
            self.head = nn.Linear(6, 2)

        def forward(self, x):
            h = self.body(x[:, :4])
            return self.head(h) if h.sum() > 0 else -self.head(h) + self.block(x[:, :256].view(-1, 1, 16, 16)).sum()

    assert paths(Branching()) == ["body.0", "block.c1", "block.fc"]


def test_tracing_draws_nothing_and_leaves_the_param_store():
    class ReadsItsOwnSites(PyroModule):        # a traced forward that reads a PyroSample and a PyroParam
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(3, 3), nn.BatchNorm1d(4)
            self.w = PyroSample(dist.Normal(0.0, 1.0).expand([4, 3]).to_event(2))
            self.c = PyroParam(torch.ones(4))

        def forward(self, x):
            return self.bn(F.linear(self.lin(x), self.w)) * self.c

    net = ReadsItsOwnSites()
    pyro.clear_param_store()
    state = torch.get_rng_state()
    assert paths(net) == []                    # lin feeds F.linear, not the BatchNorm
    assert torch.equal(state, torch.get_rng_state()) and list(pyro.get_param_store().keys()) == []


def test_laplace_unnormalized_on_a_hand_written_forward():
    def stochastic(name, module, param):
        return isinstance(module, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm))

    model = pb.BNN(HandWritten(), "categorical", stochastic=stochastic)
    guide = pb.guides.Laplace(model, "kron", subset="unnormalized")
    x, y = torch.randn(32, 1, 16, 16), torch.randint(0, 3, (32,))
    model.eval()
    guide.fit_curvature((x, y))
    assert guide.laplace_sites == ["net.b1.weight", "net.b1.bias", "net.c2.weight", "net.c2.bias",
                                   "net.ln.weight", "net.ln.bias", "net.out.weight", "net.out.bias"]
    assert guide.fixed_sites == ["net.c1.weight", "net.c1.bias", "net.fc.weight", "net.fc.bias"]


def test_evidence_warning_names_layers_of_a_hand_written_forward():
    model = pb.BNN(HandWritten(), "categorical")
    guide = pb.guides.Laplace(model, "kron")
    x, y = torch.randn(32, 1, 16, 16), torch.randint(0, 3, (32,))
    model.eval()
    guide.fit_curvature((x, y))
    with pytest.warns(UserWarning, match=r"feed a normalisation layer \(net\.c1, net\.fc\)"):
        guide.optimize_prior_precision(steps=2)


def test_weight_norm_warning_on_a_hand_written_forward():
    with pytest.warns(UserWarning, match=r"weight_norm=True on layers that feed BatchNorm \(net\.c1\)"):
        pb.BNN(HandWritten(), "categorical", weight_norm=True)


def test_laplace_unnormalized_excludes_a_layer_whose_relu_feeds_batchnorm():
    """(W, b) → c (W, b) leaves BatchNorm(ReLU(W x + b)) unchanged: the layer's evidence is as
    ill-posed as a layer feeding BatchNorm directly, so it stays a point estimate."""
    net = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 10))
    model = pb.BNN(net, "categorical", stochastic=lambda name, module, param: True)
    guide = pb.guides.Laplace(model, "kron", subset="unnormalized")
    d = pb.datasets.digits()
    model.eval()
    guide.fit_curvature((d.x_train[:32], d.y_train[:32]))
    assert guide.fixed_sites == ["net.0.weight", "net.0.bias"]


def test_a_resnet_warning_lists_a_few_layers_and_counts_the_rest():
    with pytest.warns(UserWarning, match=r"feed BatchNorm \(net\.conv1, net\.layer1\.0\.conv1, net\.layer1\.0\.conv2, "
                                         r"net\.layer1\.1\.conv1, net\.layer1\.1\.conv2 and 15 more\)"):
        pb.BNN(torchvision.models.resnet18(num_classes=10), "categorical", weight_norm=True)


def test_a_ctrl_c_during_tracing_leaves_torch_as_it_was(monkeypatch):
    """fx patches nn.Module.__call__ / __getattr__ while it traces; an interrupt in the middle left
    them patched for the whole process (1 in ~20 timed interrupts). A SIGINT is held back until the
    trace is over (then delivered to the handler that was there), and the two methods are put back
    whatever happens."""
    import os
    import signal

    from pyro_bnn.model import batchnorm

    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__

    def interrupted_trace(self, root):
        nn.Module.__call__ = lambda *a, **k: None           # as fx's patcher does
        os.kill(os.getpid(), signal.SIGINT)                 # held back: nothing raised here
        raise KeyboardInterrupt                             # an interrupt from elsewhere, mid-trace

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # Python's own, whatever ran before
    monkeypatch.setattr(batchnorm._LayerTracer, "trace", interrupted_trace)
    with pytest.raises(KeyboardInterrupt):
        batchnorm._traced_graph(HandWritten())
    assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_
    try:
        with pytest.raises(KeyboardInterrupt):             # the held-back Ctrl-C arrives after the body
            with batchnorm._sigint_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):                      # bytecode boundaries: a handler would run here
                    pass
                delivered_inside = False
        assert delivered_inside is False
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------- read from a run of the network

def run_paths(net, *inputs, **kw):
    with recording_normalization_feeding(net, **kw) as record:
        net(*inputs)
    return [path for path, _ in record.layers()]


def test_a_run_is_read_as_the_graph_is():
    """The run-time reading (what pb.guides.Laplace uses from its set-up call) gives what the
    static reading gives wherever both can read the network."""
    x = torch.randn(8, 1, 16, 16)
    assert run_paths(HandWritten(), x) == paths(HandWritten()) == ["c1", "fc"]
    net = torchvision.models.resnet18(num_classes=10)
    assert run_paths(net, torch.randn(2, 3, 32, 32)) == paths(net)
    for whole_layer in (False, True):
        seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2))
        assert run_paths(seq, torch.randn(8, 4), whole_layer=whole_layer) == paths(seq, whole_layer=whole_layer)


def test_a_run_follows_uses_elsewhere_and_second_calls():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.bn = nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            h = self.a(x)
            return self.bn(h) + h + self.bn(F.relu(self.b(x)))

    class CalledTwice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.unused = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

        def forward(self, x):
            return self.bn(self.a(x)) + self.a(x)

    class WrittenInto(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            h = self.a(x)
            buffer = torch.zeros(x.shape[0], 8)
            buffer[:, :4] = h                   # a use that returns nothing
            return self.bn(h).sum() + buffer.sum()

    x = torch.randn(8, 4)
    assert run_paths(Residual(), x) == [] and run_paths(Residual(), x, whole_layer=True) == ["b"]
    assert run_paths(CalledTwice(), x) == [] and run_paths(WrittenInto(), x) == []


class PyroCNN(PyroModule):
    """A user's own PyroModule: conv → BatchNorm wired by hand, the observation in a plate."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = PyroModule[nn.Conv2d](1, 4, 3), PyroModule[nn.BatchNorm2d](4)
        self.fc = PyroModule[nn.Linear](4 * 7 * 7, 3)
        for mod in (self.conv, self.bn, self.fc):
            for name, p in list(mod.named_parameters()):
                setattr(mod, name, PyroSample(dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())))

    def forward(self, x, y=None):
        h = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        logits = self.fc(h.flatten(1))
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Categorical(logits=logits), obs=y)


def test_a_pyro_module_forward_is_read_from_the_guides_set_up_run():
    torch.manual_seed(0)
    pyro.clear_param_store()
    model = PyroCNN()
    x, y = torch.randn(16, 1, 16, 16), torch.randint(0, 3, (16,))
    assert paths(model) == []                         # torch.fx cannot trace the plate
    model.eval()
    guide = pb.guides.Laplace(model, "kron", subset="unnormalized")
    guide.fit_curvature((x, y))
    assert guide.normalization_feeding == ("conv",)
    assert guide.laplace_sites == ["bn.weight", "bn.bias", "fc.weight", "fc.bias"]
    assert guide.fixed_sites == ["conv.weight", "conv.bias"]
    every = pb.guides.Laplace(model, "kron")
    every.fit_curvature((x, y))
    with pytest.warns(UserWarning, match=r"feed a normalisation layer \(conv\)"):
        every.optimize_prior_precision(steps=2)


def test_recording_leaves_the_run_as_it_was():
    """The set-up run under the recording draws the same values and leaves the same BatchNorm
    statistics as without it."""
    def set_up(record):
        torch.manual_seed(1)
        pyro.clear_param_store()
        model = PyroCNN()
        x = torch.randn(16, 1, 16, 16)
        if record:
            with recording_normalization_feeding(model):
                trace = pyro.poutine.trace(model).get_trace(x)
        else:
            trace = pyro.poutine.trace(model).get_trace(x)
        return trace.nodes["conv.weight"]["value"], model.bn.running_mean.clone(), torch.get_rng_state()

    for a, b in zip(set_up(True), set_up(False)):
        assert torch.equal(a, b)


def test_a_reading_that_fails_leaves_the_run_and_falls_back(monkeypatch):
    """An error inside the recording must not break the user's set-up run: the record says it
    failed and the Laplace guide reads the network statically instead."""
    from pyro_bnn.model import dataflow

    def broken(self, *args):
        raise RuntimeError("reading failed")

    monkeypatch.setattr(dataflow._Recorder, "_read", broken)
    x = torch.randn(8, 1, 16, 16)
    net = HandWritten()
    with recording_normalization_feeding(net) as record:
        out = net(x)
    assert out.shape == (8, 3) and record.failed and record.layers() is None

    def stochastic(name, module, param):
        return isinstance(module, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm))

    model = pb.BNN(HandWritten(), "categorical", stochastic=stochastic)
    guide = pb.guides.Laplace(model, "kron", subset="unnormalized")
    model.eval()
    guide.fit_curvature((torch.randn(32, 1, 16, 16), torch.randint(0, 3, (32,))))
    assert guide.normalization_feeding is None                     # the static reading decided
    assert guide.fixed_sites == ["net.c1.weight", "net.c1.bias", "net.fc.weight", "net.fc.bias"]


def test_a_pyro_module_is_read_when_plain_svi_sets_the_guide_up():
    """A Pyro user's own loop: the first ``SVI.step`` runs the guide's set-up, which reads the
    layer before BatchNorm from that run; the trained guide then selects the same sites."""
    torch.manual_seed(0)
    pyro.clear_param_store()
    model = PyroCNN()
    x, y = torch.randn(16, 1, 16, 16), torch.randint(0, 3, (16,))
    guide = pb.guides.Laplace(model, "kron", subset="unnormalized")
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), pyro.infer.Trace_ELBO())
    for _ in range(3):
        svi.step(x, y)
    assert guide.normalization_feeding == ("conv",)
    assert guide.fixed_sites == ["conv.weight", "conv.bias"]
