"""Old module paths of modules that moved, kept importable.

The package layout groups modules by role (``docs/DEVELOPING.md``, "Layout"); a module
that moved stays importable under its old name, e.g. ``import pyro_bnn.symmetry`` gives
``pyro_bnn.guides.symmetry`` (the same module object, not a copy).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old dotted name -> the module's current dotted name
MOVED: dict[str, str] = {
    "pyro_bnn.flows": "pyro_bnn.guides.hypernet_flows",
    "pyro_bnn.made": "pyro_bnn.guides.made",
    "pyro_bnn.symmetry": "pyro_bnn.guides.symmetry",
    **{f"pyro_bnn.{name}": f"pyro_bnn.analysis.{name}"
       for name in ("active", "adversarial", "corruption", "ood", "pruning", "tool_support",
                    "uncertainty_plots")},
    "pyro_bnn.compare": "pyro_bnn.reporting.comparison",
    **{f"pyro_bnn.guides.laplace_{name}": f"pyro_bnn.guides.laplace.{name}"
       for name in ("objective", "online", "prior", "state")},
    **{f"pyro_bnn.{name}": f"pyro_bnn.reporting.{name}" for name in ("report", "cli", "staged_folder")},
}


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module, on first use, under its old name (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        """Nothing to run: the module was executed under its current name."""

    def get_code(self, fullname):
        """For ``python -m <old name>``: run the module under its current name."""
        source = f"import runpy\nrunpy.run_module({MOVED[fullname]!r}, run_name='__main__', alter_sys=True)\n"
        return compile(source, f"<moved module {fullname}>", "exec")


def install() -> None:
    """Make every moved module importable under its old name.

    Modules that ``import pyro_bnn`` has loaded already are registered at once; the others
    (the command line, plots) are found lazily, so that ``python -m pyro_bnn.reporting.cli``
    does not import its own module before running it.
    """
    for old, new in MOVED.items():
        if new in sys.modules:
            sys.modules.setdefault(old, sys.modules[new])
    if not any(isinstance(finder, _OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())
