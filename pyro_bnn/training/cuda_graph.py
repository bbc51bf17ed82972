"""``fit(cuda_graph=True)``: the training step captured in a CUDA graph and replayed.

A small BNN's step on a GPU is bound by kernel launches and Python, not arithmetic
(``docs/results/cuda.md``): hundreds of small kernels, each launched from Python through Pyro's
trace.  A CUDA graph records the whole step once — the objective's forward pass, ``backward``,
the divergence guard's device-side check and the fused Adam step — and replays it with one
launch per step; the batch is copied into the graph's input tensors first.

What is replayed is what the Python code did *when it was captured*: every tensor is read
again at each replay, but Python numbers and Python control flow are frozen.  So

* the graph is captured afresh at the start of every epoch (after the guide's epoch hooks,
  which may change Python settings such as a KL-annealing weight or an evidence-tuned prior),
  and the learning rate, which the schedule changes every step, reaches the captured
  optimiser step through a tensor filled before each replay;
* the first step of an epoch whose state awaits confirmation, the last partial batch, and the
  first :data:`WARMUP_STEPS` steps of the fit run eagerly (the warm-up on a side stream, as
  torch's capture needs);
* a step that cannot be captured (it reads a tensor into Python, e.g. a check that
  synchronises) makes the fit train eagerly from then on and warn
  :class:`CudaGraphFallbackWarning` (``pb.CudaGraphFallbackWarning``): the same training,
  without the speed-up.  Pyro's ELBOs read every site's log-density into Python, so a Pyro
  autoguide under them falls back at once (its objective says so: ``cuda_graph_unsafe``).

A user's ``objective=`` is called when a graph is captured (once per epoch), not at every step.
Distribution-argument validation is off while capturing (its checks read tensors into Python);
a non-finite loss or gradient is still caught on the device by the divergence guard.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings

import pyro
import torch

__all__ = ["CudaGraphFallbackWarning", "CudaGraphStep", "WARMUP_STEPS", "check_cuda_graph_device",
           "check_cuda_graph_fit"]

#: eager steps on a side stream before the first capture (lazy initialisation of cuBLAS
#: handles, optimiser state and autograd's streams must not happen during a capture)
WARMUP_STEPS = 3


class CudaGraphFallbackWarning(UserWarning):
    """``fit(cuda_graph=True)`` could not capture the step and trains eagerly."""


def check_cuda_graph_device(device: torch.device) -> None:
    """``cuda_graph=True`` needs a CUDA fit (checked before the fit changes anything).

    Raises
    ------
    ValueError
        The fit trains elsewhere.
    """
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA fit (device='cuda'); this fit trains on {device}")


def check_cuda_graph_fit(device: torch.device, deferred: bool, optimizer) -> None:
    """``cuda_graph=True`` needs a CUDA fit whose guard checks the steps on the device (one
    process, a fused optimiser: :func:`pyro_bnn.training.divergence.can_defer_checks`).

    Raises
    ------
    ValueError
        Naming what is missing.
    """
    check_cuda_graph_device(device)
    if not deferred:
        raise ValueError(
            "cuda_graph=True needs an optimiser whose every parameter group steps in torch's fused kernel "
            f"(the default optimiser, or e.g. torch.optim.Adam(params, fused=True)); got "
            f"{type(optimizer).__name__} with fused={[g.get('fused') for g in optimizer.param_groups]}")


class CudaGraphStep:
    """The replayed training step of one fit.

    Parameters
    ----------
    loss_module : torch.nn.Module
        ``loss_module(x, y) -> loss`` or ``(loss, extras)``.
    optimizer : torch.optim.Optimizer
        A fused optimiser (see :func:`check_cuda_graph_fit`).
    guard : pyro_bnn.training.divergence.DivergenceGuard
        A ``deferred`` guard: its device-side check is captured with the step.
    device : torch.device
        The CUDA device.
    objective : callable, optional
        The fit's objective; one with a true ``cuda_graph_unsafe`` attribute (a string: why) is
        not captured (the fit falls back at its first graph step, without attempting a capture).

    Attributes
    ----------
    replays : int
        Steps run through a graph so far.
    """

    def __init__(self, loss_module, optimizer, guard, device: torch.device, objective=None):
        self.loss_module = loss_module
        #: why the objective cannot be captured (its ``cuda_graph_unsafe`` attribute), else None
        self.unsafe = getattr(objective, "cuda_graph_unsafe", None)
        self.optimizer = optimizer
        self.guard = guard
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.warmup_left = WARMUP_STEPS
        self.failed = False
        self.replays = 0
        self._graph = None
        self._inputs = None     # the graph's input tensors (x, y or None)
        self._extras = {}       # the graph's extras outputs
        self._lrs = []          # (param group, lr tensor, value filled)

    # ------------------------------------------------------------ per epoch
    def begin_epoch(self) -> None:
        """Drop the graph: the epoch hooks that ran since may have changed what Python reads."""
        self._graph, self._inputs, self._extras, self._lrs = None, None, {}, []

    # ------------------------------------------------------------ per step
    def accepts(self, xb: torch.Tensor, yb: torch.Tensor | None) -> bool:
        """Whether this step can go through a graph (else the caller runs it eagerly)."""
        if self.failed or self.guard.pending or self.warmup_left > 0:
            return False
        if self._graph is None:
            return True
        x, y = self._inputs
        return _same_layout(x, xb) and ((y is None and yb is None) or (y is not None and _same_layout(y, yb)))

    def warming_up(self) -> contextlib.AbstractContextManager:
        """Context for an eager step: the side stream while warming up, else nothing."""
        if self.failed or self.warmup_left <= 0 or self.guard.pending:
            return contextlib.nullcontext()
        self.warmup_left -= 1
        return _side_stream(self.stream)

    def step(self, xb: torch.Tensor, yb: torch.Tensor | None, step: int) -> dict | None:
        """Run one step through the graph (captured first if there is none this epoch); return
        the step's extras (tensors of the graph, valid until the next replay), or ``None`` if
        the capture failed (the caller runs the step eagerly)."""
        if self.unsafe:   # known not to capture: say so without trying (a failed capture is costly)
            self._fall_back(self.unsafe)
            return None
        self.guard.activate_device_flags(step, xb.device)
        if self._graph is None and not self._capture(xb, yb):
            return None
        x, y = self._inputs
        x.copy_(xb, non_blocking=True)
        if y is not None:
            y.copy_(yb, non_blocking=True)
        for i, (group, lr, filled) in enumerate(self._lrs):
            if group["lr"] != filled:   # the schedule moved it: one fill, no copy from the host
                lr.fill_(group["lr"])
                self._lrs[i] = (group, lr, group["lr"])
        self._graph.replay()
        self.replays += 1
        return self._extras

    # ------------------------------------------------------------ capture
    def _capture(self, xb, yb) -> bool:
        inputs = (xb.detach().clone(), None if yb is None else yb.detach().clone())
        groups = self.optimizer.param_groups
        saved = [(g["lr"], g.get("capturable", False)) for g in groups]
        lrs = [(g, torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device), g["lr"]) for g in groups]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.current_stream(self.device).synchronize()
        generator = torch.cuda.default_generators[self.device.index or 0]
        before = generator.clone_state()   # a failed capture leaves the generator in capture mode
        stream = torch.cuda.current_stream(self.device)   # ... and the capture stream current
        try:
            for g, lr, _ in lrs:
                g["lr"], g["capturable"] = lr, True
            self.optimizer.zero_grad(set_to_none=True)   # backward allocates the grads in the graph's pool
            with _validation_off(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)   # torch's capture notes (e.g. an empty graph)
                with torch.cuda.graph(graph, stream=self.stream):
                    out = self.loss_module(*inputs)
                    loss, extras = out if isinstance(out, tuple) else (out, {})
                    loss.backward()
                    self.guard.record_on_device(loss)
                    self.optimizer.step()
        except Exception as exc:  # noqa: BLE001 -- anything the capture refuses: train eagerly
            generator.graphsafe_set_state(before)   # the random streams as before the attempt
            torch.cuda.set_stream(stream)
            self._fall_back(_root_cause(exc))
            return False
        finally:
            for g, (lr, capturable) in zip(groups, saved):
                g["lr"], g["capturable"] = lr, capturable
            self.optimizer.zero_grad(set_to_none=True)
        self._graph, self._inputs, self._lrs = graph, inputs, lrs
        self._extras = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in extras.items()}
        return True

    def _fall_back(self, reason: str) -> None:
        self.failed = True
        self.begin_epoch()
        torch.cuda.synchronize(self.device)
        warnings.warn(f"fit(cuda_graph=True): the training step could not be captured in a CUDA graph "
                      f"({reason}); training continues eagerly (the same steps, without the speed-up)",
                      CudaGraphFallbackWarning, stacklevel=6)


def _root_cause(exc: BaseException) -> str:
    """The first error of the chain (the capture's own end fails after it), its first line and
    the innermost frame outside torch where it was raised (e.g. a ``.item()`` in the step)."""
    while exc.__context__ is not None:
        exc = exc.__context__
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    where = f" in {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {line}{where}"


def _same_layout(static: torch.Tensor, t: torch.Tensor) -> bool:
    return (isinstance(t, torch.Tensor) and t.shape == static.shape and t.dtype == static.dtype
            and t.device == static.device)


@contextlib.contextmanager
def _side_stream(stream):
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(stream.device).wait_stream(stream)


@contextlib.contextmanager
def _validation_off():
    """Pyro's and torch's distribution-argument validation off (it reads tensors into Python,
    which a capture forbids), restored after."""
    before = torch.distributions.Distribution._validate_args
    try:
        with pyro.validation_enabled(False):
            yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)
