"""Data: user data (tensors, a ``Dataset`` or a ``DataLoader``) as checked minibatches
(:mod:`.batches`; inputs that look like unscaled 8-bit pixels are warned,
:mod:`pyro_bnn.model.input_scale`), the test data of ``pb.evaluate``/``predict``/``to_arviz``
(tensors or a ``DataLoader`` read once, :mod:`.prediction_data`), and the data sets
(:mod:`.datasets`).

May import: :mod:`pyro_bnn.model`, :mod:`pyro_bnn.contract`, :mod:`pyro_bnn.arguments`.
"""

from . import datasets
from .batches import (
    BatchCheck,
    CheckedBatches,
    TensorBatches,
    as_labels,
    as_targets,
    as_tensors,
    check_data,
    check_finite,
    check_inputs,
    check_targets,
    checked_source,
    dataset_size,
    make_loader,
    model_dtype,
    split_batch,
    validate_data,
)
from .prediction_data import prediction_data, read_loader

__all__ = ["as_tensors", "make_loader", "TensorBatches", "CheckedBatches", "BatchCheck", "check_finite",
           "check_inputs", "validate_data", "check_data", "checked_source", "check_targets", "as_labels",
           "as_targets", "model_dtype", "dataset_size", "split_batch", "prediction_data", "read_loader", "datasets"]
