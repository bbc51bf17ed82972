"""Which weight layers feed a normalisation layer, read from a run of the network.

:func:`~pyro_bnn.model.batchnorm.layers_feeding_normalization` reads a network without running
it: ``nn.Sequential`` containers and a ``forward`` that ``torch.fx`` can trace.  A ``PyroModule``
model's own ``forward`` (``pyro.sample`` in a plate) cannot be traced, so what it wires by hand
is not seen there.  :func:`recording_normalization_feeding` reads the same thing from a call the
caller makes anyway (a guide's first, set-up call of the model): every Linear / Conv output is
followed through the torch functions that use it, and the layer counts when every use, through
operations that commute with its scale, ends as the input of a normalisation function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .batchnorm import _WEIGHT_LAYERS, NORMALIZATION_LAYERS, _Reading

__all__ = ["FeedingRecord", "recording_normalization_feeding"]


class FeedingRecord:
    """The reading of one recorded run: :meth:`layers` once the run is over.

    ``failed`` is set when the run could not be read (then :meth:`layers` is ``None`` and the
    caller falls back on the static reading)."""

    def __init__(self, root: nn.Module):
        self._layers = {id(m): (path, m) for path, m in root.named_modules() if isinstance(m, _WEIGHT_LAYERS)}
        self.reached: set[int] = set()       # layers whose output reached a normalisation input
        self.escaped: set[int] = set()       # ... and those with a use that is anything else
        self.failed = False

    def layers(self) -> list[tuple[str, nn.Module]] | None:
        """``(path, layer)`` of the layers whose every use ended in a normalisation layer, in
        module order; ``None`` if the run could not be read."""
        if self.failed:
            return None
        feeding = self.reached - self.escaped
        return [layer for key, layer in self._layers.items() if key in feeding]


def _tensors(value) -> list:
    """The tensors in a call's arguments or result (nested in tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


class _Recorder(TorchFunctionMode):
    """Tags each weight layer's output with the layer, carries the tag through operations that
    commute with the layer's scale, and records where each tagged tensor ends."""

    def __init__(self, record: FeedingRecord, reading: _Reading):
        super().__init__()
        self.record, self.reading = record, reading
        self.tags: dict[int, tuple[torch.Tensor, frozenset[int]]] = {}   # the tensor is kept: ids stay unique
        self.methods = {getattr(torch.Tensor, name) for name in reading.commuting_methods
                        if hasattr(torch.Tensor, name)} | {torch.Tensor.__getitem__}

    def tag(self, tensor, layers: frozenset[int]) -> None:
        if isinstance(tensor, torch.Tensor):
            _, old = self.tags.get(id(tensor), (None, frozenset()))
            self.tags[id(tensor)] = (tensor, old | layers)

    def origins(self, value) -> frozenset[int]:
        entry = self.tags.get(id(value)) if isinstance(value, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is value else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._read(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a reading that fails must not break the user's run
            self.record.failed = True
        return out

    def _read(self, func, args, kwargs, out) -> None:
        leaves = _tensors((args, kwargs))
        if not any(self.origins(leaf) for leaf in leaves):
            return
        if func is torch.Tensor.__setitem__:    # written into another tensor (returns None): a use
            for leaf in leaves:
                self.record.escaped |= self.origins(leaf)
            return
        if not _tensors(out):
            return                          # metadata (x.dim(), x.shape, x.size(0)): not a use
        first = args[0] if args else None
        normalizes = func in self.reading.functions
        commutes = func in self.reading.commuting_functions or func in self.methods
        for leaf in leaves:
            origins = self.origins(leaf)
            if not origins:
                continue
            if leaf is first and normalizes:
                self.record.reached |= origins
            elif leaf is first and commutes and isinstance(out, torch.Tensor):
                self.tag(out, origins)
            else:
                self.record.escaped |= origins


@contextlib.contextmanager
def recording_normalization_feeding(root: nn.Module, kinds: tuple = NORMALIZATION_LAYERS, *,
                                    whole_layer: bool = False) -> Iterator[FeedingRecord]:
    """Record, during the body, which Linear / Conv layers of ``root`` feed a layer of ``kinds``.

    The body runs the network (or a model that calls it) as the caller would anyway; nothing
    is drawn or changed by the recording.  The rule is that of
    :func:`~pyro_bnn.model.batchnorm.layers_feeding_normalization` (``whole_layer`` as there),
    applied to the torch functions the run called: a layer feeds a normalisation layer when
    every use of its output goes, through pooling, reshapes, Dropout (and with
    ``whole_layer=True`` ReLU / LeakyReLU), into a normalisation function as its input.  Only
    the layers that ran are read.

    Yields
    ------
    FeedingRecord
        ``record.layers()`` after the body: ``(path, layer)`` pairs, or ``None`` where the run
        could not be read.
    """
    record = FeedingRecord(root)
    recorder = _Recorder(record, _Reading(kinds, whole_layer))

    def tag_output(module, inputs, output):
        recorder.tag(output, frozenset((id(module),)))

    handles = [m.register_forward_hook(tag_output) for m in root.modules() if isinstance(m, _WEIGHT_LAYERS)]
    try:
        with recorder:
            yield record
    finally:
        for handle in handles:
            handle.remove()
        recorder.tags.clear()
