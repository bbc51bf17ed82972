"""Old module paths of modules that moved, kept importable.

The package layout groups modules by role (``docs/DEVELOPING.md``, "Layout"); a module
that moved stays importable under its old name, e.g. ``import pyro_bnn.symmetry`` gives
``pyro_bnn.guides.symmetry`` (the same module object, not a copy).
"""

from __future__ import annotations

import importlib
import sys

#: old dotted name -> the module's current dotted name
MOVED: dict[str, str] = {
    "pyro_bnn.flows": "pyro_bnn.guides.hypernet_flows",
    "pyro_bnn.made": "pyro_bnn.guides.made",
    "pyro_bnn.symmetry": "pyro_bnn.guides.symmetry",
    **{f"pyro_bnn.{name}": f"pyro_bnn.analysis.{name}"
       for name in ("active", "adversarial", "corruption", "ood", "pruning", "tool_support",
                    "uncertainty_plots")},
}


def install() -> None:
    """Register every moved module under its old name in ``sys.modules``."""
    for old, new in MOVED.items():
        sys.modules.setdefault(old, importlib.import_module(new))
