"""The counting rule of ``benchmarks/count_step_ops.py`` (issue 27's CPU stand-in for GPU kernel
launches) on operations whose kernel count is known."""

from __future__ import annotations

import importlib
import pathlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def counter(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("count_step_ops")


def _count(counter, fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops, reads = counter.compute_ops(prof)
    return dict(ops), reads


def test_views_scalars_and_reduction_fills_are_not_counted(counter):
    a, w = torch.randn(8, 5), torch.randn(5, 3)
    ops, reads = _count(counter, lambda: float(((a @ w) * 2.0 + 1.0).view(-1).sum()))
    # mm, mul, add, sum: one kernel each; the view, the wrapped 2.0 / 1.0 and sum's zero fill are not
    assert ops == {"aten::mm": 1, "aten::mul": 1, "aten::add": 1, "aten::sum": 1}, ops
    assert reads == 1


def test_a_multi_tensor_operator_counts_once_and_a_loop_per_tensor(counter):
    tensors = [torch.zeros(4) for _ in range(5)]
    ops, _ = _count(counter, lambda: torch._foreach_add_(tensors, 1.0))
    assert ops == {"aten::_foreach_add_": 1}, ops
    ops, _ = _count(counter, lambda: [t.add_(1.0) for t in tensors])
    assert ops == {"aten::add_": 5}, ops


def test_a_composite_operator_counts_its_kernels_not_itself(counter):
    x, layer = torch.randn(6, 4), torch.nn.Linear(4, 3)
    ops, _ = _count(counter, lambda: layer(x))
    # linear -> addmm (its bias copied into the output first): counted once, not linear and addmm
    assert sum(ops.values()) == 1 and "aten::linear" not in ops, ops
