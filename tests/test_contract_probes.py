"""The contract is declared once: no module outside ``pyro_bnn/contract/`` probes a guide, and none
outside ``pyro_bnn/model/`` probes a model for a member that has a reader there.

Every attribute a tool reads of a guide is a member of :class:`~pyro_bnn.contract.BNNGuide`
(with its documented default) reached through :func:`~pyro_bnn.contract.guide_contract`, whose
adapter answers for Pyro's own guides; an optional member of a model is read through the
:class:`~pyro_bnn.model.BayesianNetwork` protocol's helpers in ``pyro_bnn/model/``.  So a
``getattr``/``hasattr`` call outside ``pyro_bnn/contract/`` is flagged when

* its object is a guide by name (``guide``, ``self.guide``, ``base_guide``, ...), or
* the attribute it asks for is a member of the guide contract that the model protocol does
  not share (``getattr(q, "default_predictive", "sample")``);

and outside ``pyro_bnn/model/`` when its object is a model by name (``model``, ``self.base_model``)
and the attribute is one of :data:`MODEL_READERS` (read through the function named there).

The rule is tested on synthetic sources too, so it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pyro_bnn.contract.guide import BNNGuide
from pyro_bnn.model.bnn import BayesianNetwork

ROOT = Path(__file__).resolve().parents[1] / "pyro_bnn"
#: the contract's own modules: the one place that answers for any guide (its Pyro adapter included)
CONTRACT = ROOT / "contract"
#: the model layer: the one place that reads a model's optional members
MODEL = ROOT / "model"
#: optional model members and the function of ``pyro_bnn.model.bnn`` that reads each (with its default)
MODEL_READERS = {"likelihood": "model_likelihood", "weight_norm": "weight_norm_of",
                 "site_normal_prior": "normal_prior_params", "initial_values": "initial_values_of",
                 "net": "network_of", "augmentation": "augmentation_of", "_input_spec": "example_input",
                 "priors": "site_prior_modules", "function": "network_function_of"}


def contract_members() -> frozenset[str]:
    """Public members of the guide contract that are not also members of the model protocol
    (``site_names`` is both: a model's list and a guide's method)."""
    guide = {n for n in dir(BNNGuide) if not n.startswith("_")}
    model = {n for n in dir(BayesianNetwork) if not n.startswith("_")} | set(BayesianNetwork.__annotations__)
    return frozenset(guide - model)


def _last_name(node: ast.expr) -> str:
    """``guide`` of ``guide``, ``self.guide``; ``base_model`` of ``guide.base_model``."""
    return (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else "").lower()


def _names_a_guide(node: ast.expr) -> bool:
    """``guide``, ``base_guide``, ``self.guide``: the last name of the expression says guide."""
    return "guide" in _last_name(node)


def _probes(source: str):
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            yield node, node.args[0], node.args[1]


def model_probes(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of each ``getattr``/``hasattr`` of a model for a member of
    :data:`MODEL_READERS`."""
    return [(node.lineno, ast.unparse(node)) for node, obj, attr in _probes(source)
            if "model" in _last_name(obj) and isinstance(attr, ast.Constant) and attr.value in MODEL_READERS]


def guide_probes(source: str, members=None) -> list[tuple[int, str]]:
    """``(line, call)`` of each ``getattr``/``hasattr`` call in ``source`` that probes a guide."""
    members = contract_members() if members is None else members
    out = []
    for node, obj, attr in _probes(source):
        member = isinstance(attr, ast.Constant) and attr.value in members
        if _names_a_guide(obj) or member:
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_module_outside_the_contract_probes_a_guide():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if CONTRACT in path.parents:
            continue
        found += [f"{path.relative_to(ROOT.parent)}:{line}: {call}"
                  for line, call in guide_probes(path.read_text())]
    assert not found, ("declare these on BNNGuide (with a default) and read them through "
                       "guide_contract(guide):\n" + "\n".join(found))


def test_no_module_outside_the_model_layer_probes_a_model_for_a_member_with_a_reader():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if MODEL in path.parents:
            continue
        found += [f"{path.relative_to(ROOT.parent)}:{line}: {call}" for line, call in model_probes(path.read_text())]
    assert not found, ("read these through " + ", ".join(f"{k}: {v}" for k, v in MODEL_READERS.items())
                       + ":\n" + "\n".join(found))


def test_each_model_reader_exists_and_gives_its_default():
    import pyro_bnn.model.bnn as bnn
    assert bnn.model_likelihood(object()) is None
    assert bnn.weight_norm_of(object()) is None
    assert bnn.normal_prior_params(object(), "net.0.weight") is None
    assert bnn.initial_values_of(object()) == {}
    assert bnn.network_of(object()) is None
    assert bnn.augmentation_of(object()) is None
    assert bnn.site_prior_modules(object()) == {}
    assert bnn.network_function_of(object()) is None
    with pytest.raises(ValueError, match="example input"):
        bnn.example_input(object())
    assert set(MODEL_READERS.values()) <= set(bnn.__all__)


@pytest.mark.parametrize("source, flagged", [
    ('getattr(model, "likelihood", None)\n', True),
    ('getattr(self.base_model, "weight_norm", False)\n', True),
    ('getattr(model, "forward", model)\n', False),               # no reader for it
    ('getattr(check.likelihood, "name", None)\n', False),        # not a model by name
])
def test_the_model_rule_flags_members_with_a_reader_only(source, flagged):
    assert bool(model_probes(source)) is flagged


def test_the_contract_declares_what_the_tools_read():
    members = contract_members()
    for name in ("default_predictive", "normal_per_site", "loc_and_scale", "log_evidence",
                 "num_variational_parameters", "settings_description", "fit_fingerprint", "training_bound"):
        assert name in members


@pytest.mark.parametrize("source, flagged", [
    ('getattr(guide, "log_evidence", None)\n', True),
    ('hasattr(self.guide, "anything")\n', True),
    ('getattr(base_guide, name)\n', True),
    ('getattr(q, "default_predictive", "sample")\n', True),          # a contract member by name
    ('hasattr(g, "loc_and_scale")\n', True),
    ('getattr(guide.base_model, "likelihood", None)\n', False),    # a probe of the model
    ('getattr(model, "site_names", None)\n', False),               # a protocol member too
    ('getattr(loader, "dataset", None)\n', False),
    ('guide_contract(guide).log_evidence()\n', False),
])
def test_the_rule_flags_probes_of_guides_only(source, flagged):
    assert bool(guide_probes(source)) is flagged
