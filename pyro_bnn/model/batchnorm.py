"""BatchNorm layers of a network, the warning when a prediction runs them in train mode, and
the weight layers whose scale a normalisation layer divides out.

A ``BatchNorm`` layer in train mode normalises with the statistics of the batch it sees and
writes them into ``running_mean`` / ``running_var``.  During training that is what it should do;
at prediction it makes an input's output depend on the other inputs of its batch and overwrites
the statistics learnt in training with those of the inputs predicted.  ``pb.predict`` runs in
eval mode itself; plain ``pyro.infer.Predictive`` calls the model in whatever mode it is in, and
:func:`pyro_bnn.fit` leaves a new network in train mode.
"""

from __future__ import annotations

import contextlib
import operator
import signal
import threading
import warnings

import pyro
import pyro.poutine as poutine
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["batchnorm_layers", "warn_batchnorm_in_train_mode", "BatchNormTrainModeWarning",
           "warn_running_statistics_of_random_affine",
           "layers_feeding_normalization", "convolutions_without_normalization", "random_convolutions",
           "NORMALIZATION_LAYERS", "short_list"]

#: Layers that divide their input's scale out: BatchNorm / InstanceNorm (per channel), LayerNorm
#: and GroupNorm (per example, so at least a whole layer's common scale).
NORMALIZATION_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)

#: Modules that commute with a positive scale of their input, so the scale reaches the next layer.
_SCALE_COMMUTING = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.MaxPool1d, nn.MaxPool2d,
                    nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
                    nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
                    nn.AdaptiveMaxPool3d, nn.Flatten)
#: The same operations as functions and tensor methods, as they appear in a traced ``forward``.
_SCALE_COMMUTING_FUNCTIONS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.max_pool1d, F.max_pool2d,
                              F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                              F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
                              F.adaptive_max_pool2d, F.adaptive_max_pool3d, torch.flatten, torch.reshape,
                              operator.getitem)
_SCALE_COMMUTING_METHODS = ("flatten", "view", "reshape", "contiguous", "squeeze", "unsqueeze")
#: Positively homogeneous activations: they commute with a positive scale of the whole layer
#: (weight *and* bias), not with one of its weight alone.
_HOMOGENEOUS = (nn.ReLU, nn.LeakyReLU)
_HOMOGENEOUS_FUNCTIONS = (F.relu, torch.relu, F.leaky_relu)
_HOMOGENEOUS_METHODS = ("relu",)
_WEIGHT_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)
#: Kept whole in a traced graph (their own ``forward`` is not read).
_LEAVES = _WEIGHT_LAYERS + NORMALIZATION_LAYERS + _SCALE_COMMUTING
#: Each normalisation module's functional form, as a traced ``forward`` may call it.
_FUNCTIONAL_FORMS = ((nn.modules.batchnorm._BatchNorm, F.batch_norm), (nn.modules.instancenorm._InstanceNorm,
                     F.instance_norm), (nn.LayerNorm, F.layer_norm), (nn.GroupNorm, F.group_norm))


class BatchNormTrainModeWarning(UserWarning):
    """A model predicted (a ``pb.BNN`` called with ``y=None``, or any model run by Pyro's
    ``Predictive`` with a pyro_bnn guide) with BatchNorm layers in train mode."""


def _keeps_statistics(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats


def batchnorm_layers(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers of ``module`` that keep running statistics, in module order."""
    return [m for m in module.modules() if _keeps_statistics(m)]


def warn_batchnorm_in_train_mode(module: nn.Module, when: str = "the model predicts (y=None)",
                                 given: set | None = None) -> None:
    """Warn if a BatchNorm layer of ``module`` is in train mode (called when the model
    predicts, i.e. runs without observations; ``when`` says how the prediction was seen).
    ``given``: the messages already given to this caller (updated); one of them is not repeated
    (Pyro's ``Predictive`` runs the guide once per draw)."""
    names = [name for name, m in module.named_modules() if _keeps_statistics(m) and m.training]
    if names and _first_time(given, (when, *names)):
        warnings.warn(
            f"{when} with BatchNorm layers in train mode ({short_list(names, 3)}): each prediction is normalised with its own batch's "
            "statistics and overwrites the running statistics learnt in training with those of the "
            "inputs predicted; call model.eval() before Predictive (and model.train() before training "
            "again), or use pb.predict, which runs in eval mode itself",
            BatchNormTrainModeWarning, stacklevel=2)


def warn_running_statistics_of_random_affine(module: nn.Module, latent_names, when: str = "pb.predict",
                                             given: set | None = None) -> None:
    """Warn when a sampling predictive normalises a BatchNorm layer whose γ or β are random (sites
    among ``latent_names``) with training's running statistics (the layer in eval mode).

    Those statistics average over the weight draws of training and fit none of them; with γ, β
    random that costs much more than with point estimates (measured with MeanField on converged
    fits, ``docs/pyro.md``: digits BatchNorm MLP test NLL 0.391 against 0.144 per draw, point
    estimates 0.166 against 0.119; Fashion-MNIST BatchNorm CNN accuracy 0.836 / NLL 0.723 against
    0.911 / 0.241).  ``when`` names the caller; ``given`` as for :func:`warn_batchnorm_in_train_mode`.
    """
    names = set(latent_names)
    layers = {id(m) for m in batchnorm_layers(module)}
    random = [path for path, m in module.named_modules()
              if id(m) in layers and not m.training and {f"{path}.weight", f"{path}.bias"} & names]
    if random and _first_time(given, (when, *random)):
        warnings.warn(
            f"{when}: BatchNorm layers with random γ, β ({short_list(random, 3)}) predict with the running "
            "statistics of training, which average over the weight draws and fit no single draw; with random "
            "γ, β that costs much (Fashion-MNIST BatchNorm CNN, MeanField: accuracy 0.836, NLL 0.723 against "
            "0.911, 0.241 per draw). Use pb.predict / pb.evaluate with bn_data= (a few thousand training "
            "inputs) to re-estimate them under each draw", UserWarning, stacklevel=3)


def _first_time(given: set | None, key: tuple) -> bool:
    """Whether ``key`` is not in ``given`` (then added); always true without ``given``."""
    if given is None:
        return True
    new = key not in given
    given.add(key)
    return new


def short_list(names: list[str], limit: int = 5) -> str:
    """``"a, b, c"``, or the first ``limit`` names and how many more (a ResNet has dozens)."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def layers_feeding_normalization(root: nn.Module, kinds: tuple = NORMALIZATION_LAYERS, *,
                                 whole_layer: bool = False) -> list[tuple[str, nn.Module]]:
    """``(path, layer)`` of every Linear / Conv layer of ``root`` that feeds a layer of ``kinds``,
    in module order.

    A layer feeds a normalisation layer when its output goes to one and nowhere else, possibly
    through pooling, Flatten, Dropout, Identity or a reshape (they commute with a positive scale).
    With ``whole_layer=True`` (the scale of weight and bias together, as a Laplace posterior over
    the layer sees it) a ReLU or LeakyReLU between counts too: it commutes with that scale.  With
    the default (the scale of the weight alone, as weight norm's ``g``) it does not: it comes
    after the bias, which the weight's scale leaves in place.  Two readings are joined:

    * inside ``nn.Sequential`` containers, the layer's next modules;
    * a hand-written ``forward`` (a ResNet's, say), read from its ``torch.fx`` graph, with Linear,
      Conv and normalisation layers kept whole.  A ``forward`` that ``torch.fx`` cannot trace
      (data-dependent control flow; ``pyro.sample`` statements, as in a ``PyroModule`` model)
      is read through its child modules, each traced on its own; what only such a ``forward``
      connects is not seen.
    """
    reading = _Reading(kinds, whole_layer)
    found = dict(_in_sequentials(root, reading))
    found.update(_in_traced_forwards(root, "", reading))
    order = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(found.items(), key=lambda item: order[id(item[1])])


def convolutions_without_normalization(root: nn.Module, sites=None) -> list[str]:
    """Paths of the convolution layers of ``root`` whose output no normalisation layer divides
    out (:func:`layers_feeding_normalization` with ``whole_layer=True``: a ReLU between counts),
    in module order.

    ``sites``: the names of the model's sample sites (``"net.0.weight"``); given, only the
    convolutions with a parameter among them count (a frozen feature extractor does not).
    A model without any normalisation layer is not traced.
    """
    convolutions = random_convolutions(root, sites)
    if not convolutions:
        return []
    normalized = set()
    if any(isinstance(m, NORMALIZATION_LAYERS) for m in root.modules()):
        normalized = {id(m) for _, m in layers_feeding_normalization(root, whole_layer=True)}
    return [path for path in convolutions if id(root.get_submodule(path)) not in normalized]


def random_convolutions(root: nn.Module, sites=None) -> list[str]:
    """Paths of the convolution layers of ``root``, in module order; ``sites`` (the model's
    sample-site names), given: only those with a parameter among them (the random ones)."""
    random_layers = None if sites is None else {site.rpartition(".")[0] for site in sites}
    return [path for path, m in root.named_modules() if isinstance(m, nn.modules.conv._ConvNd)
            and (random_layers is None or path in random_layers)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Reading:
    """What counts on the way from a layer to a normalisation layer: the normalisation layers of
    ``kinds`` (modules, or their functional forms in a traced ``forward``) and the operations that
    commute with the scale in question."""

    def __init__(self, kinds: tuple, whole_layer: bool):
        self.kinds = kinds
        self.functions = tuple(f for kind, f in _FUNCTIONAL_FORMS if issubclass(kind, kinds))
        self.commuting_modules = _SCALE_COMMUTING + (_HOMOGENEOUS if whole_layer else ())
        self.commuting_functions = _SCALE_COMMUTING_FUNCTIONS + (_HOMOGENEOUS_FUNCTIONS if whole_layer else ())
        self.commuting_methods = _SCALE_COMMUTING_METHODS + (_HOMOGENEOUS_METHODS if whole_layer else ())

    def normalizes(self, node: torch.fx.Node, root: nn.Module) -> bool:
        if node.op == "call_module":
            return isinstance(root.get_submodule(node.target), self.kinds)
        return node.op == "call_function" and node.target in self.functions

    def commutes(self, node: torch.fx.Node, root: nn.Module) -> bool:
        if node.op == "call_module":
            return isinstance(root.get_submodule(node.target), self.commuting_modules)
        if node.op == "call_function":
            return node.target in self.commuting_functions
        return node.op == "call_method" and node.target in self.commuting_methods


def _in_sequentials(root: nn.Module, reading: _Reading) -> list[tuple[str, nn.Module]]:
    found = []
    for prefix, seq in root.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for i, (name, layer) in enumerate(children):
            if not isinstance(layer, _WEIGHT_LAYERS):
                continue
            following = [m for _, m in children[i + 1:]]
            while following and isinstance(following[0], reading.commuting_modules):
                following.pop(0)
            if following and isinstance(following[0], reading.kinds):
                found.append((_join(prefix, name), layer))
    return found


class _LayerTracer(torch.fx.Tracer):
    """Keeps weight and normalisation layers (and torch's own modules) whole in the graph."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _LEAVES) or super().is_leaf_module(m, module_qualified_name)


def _traced_graph(module: nn.Module) -> torch.fx.Graph | None:
    """``module``'s ``forward`` as a ``torch.fx`` graph, or ``None`` where fx cannot trace it.

    Tracing runs no layer; a ``PyroSample`` read by a traced ``forward`` itself would draw, so
    the random state, the param store and Pyro's effect handlers are isolated from the caller.
    fx patches ``nn.Module.__call__`` and ``__getattr__`` while it traces, and a Ctrl-C that
    lands in the middle can leave them patched for the whole process (measured: 1 in ~20
    interrupts): a SIGINT is held back until the trace is over, and the two methods are put back."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    try:
        with _sigint_deferred(), torch.random.fork_rng(devices=devices), pyro.get_param_store().scope(), \
                poutine.block(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return _LayerTracer().trace(module)
            except Exception:  # noqa: BLE001 - fx fails in many ways (TraceError, TypeError, pyro's checks, ...)
                return None
    finally:
        nn.Module.__call__, nn.Module.__getattr__ = call, getattr_


@contextlib.contextmanager
def _sigint_deferred():
    """Hold a Ctrl-C back during the body and deliver it on exit (to the handler that was there).

    A Python-level handler, not a signal mask: with other threads alive a masked SIGINT goes to
    one of them and Python still raises in the main thread.  Outside the main thread (where no
    handler can be set) the body runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if received:
            signal.raise_signal(signal.SIGINT)


def _in_traced_forwards(module: nn.Module, path: str, reading: _Reading) -> list[tuple[str, nn.Module]]:
    if isinstance(module, _LEAVES) or not any(isinstance(m, _WEIGHT_LAYERS) for m in module.modules()):
        return []
    # nn.Sequential's own forward is read exactly by _in_sequentials: only its children need reading
    graph = None if type(module).forward is nn.Sequential.forward else _traced_graph(module)
    if graph is None:
        return [item for name, child in module.named_children()
                for item in _in_traced_forwards(child, _join(path, name), reading)]
    calls: dict[str, list[torch.fx.Node]] = {}     # a layer called twice feeds only if every call does
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(module.get_submodule(node.target), _WEIGHT_LAYERS):
            calls.setdefault(node.target, []).append(node)
    return [(_join(path, target), module.get_submodule(target)) for target, nodes in calls.items()
            if all(_reaches_only_normalization(node, module, reading) for node in nodes)]


def _reaches_only_normalization(node: torch.fx.Node, root: nn.Module, reading: _Reading) -> bool:
    """Every use of ``node``'s output ends, through scale-commuting operations only, in a
    normalisation layer (as the operation's input, not as one of its other arguments)."""
    if not node.users:
        return False
    for user in node.users:
        if user.args[:1] != (node,):
            return False
        if not (reading.normalizes(user, root)
                or (reading.commutes(user, root) and _reaches_only_normalization(user, root, reading))):
            return False
    return True
