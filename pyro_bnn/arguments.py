"""Argument checks shared by the public functions: unknown keywords and numeric ranges.

Every message names the argument, what was expected and what was received.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable

import numpy as np

__all__ = ["reject_unknown_keywords", "check_int", "check_positive", "check_bool", "check_choice", "check_names",
           "did_you_mean"]


def reject_unknown_keywords(function: str, unknown: dict, valid: Iterable[str]) -> None:
    """Raise ``TypeError`` for the first key of ``unknown``, naming the closest valid one.

    For functions that take ``**kwargs`` only to give this better message than Python's own
    ("unexpected keyword argument").
    """
    if not unknown:
        return
    key = next(iter(unknown))
    hint = did_you_mean(key, valid)
    more = f" (and {len(unknown) - 1} more: {sorted(unknown)[1:]})" if len(unknown) > 1 else ""
    raise TypeError(f"{function}() got an unexpected keyword argument {key!r}{more}{hint}")


def did_you_mean(key: str, valid: Iterable[str], *, noun: str = "keywords") -> str:
    """``"; did you mean 'x'?"`` for the closest of ``valid`` to ``key``, else
    ``"; valid <noun>: a, b"``."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; valid {noun}: {', '.join(valid)}"


def check_int(name: str, value, minimum: int, *, optional: bool = False) -> int | None:
    """``value`` as an ``int >= minimum`` (``None`` allowed if ``optional``); bools and
    floats are rejected, so ``epochs=2.5`` or ``batch_size=True`` is an error."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got "
                        f"{value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


def check_positive(name: str, value, *, optional: bool = False) -> float | None:
    """``value`` as a finite real number ``> 0`` (``None`` allowed if ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number > 0{' or None' if optional else ''}, got "
                        f"{value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """``value`` as a ``bool``: only ``True``/``False`` (NumPy's ``np.bool_`` too), so that
    ``shuffle="no"`` or ``resume=1`` is an error instead of being read as true."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices`` (strings), else an error naming the closest one."""
    choices = list(choices)
    if isinstance(value, str) and value in choices:
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {value!r} ({type(value).__name__})")
    lowered = {c.lower(): c for c in choices}
    close = ([lowered[value.lower()]] if value.lower() in lowered
             else difflib.get_close_matches(value, choices, n=1, cutoff=0.6))
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{name} must be one of {choices}, got {value!r}{hint}")


def check_names(value, *, expected: str, element: str) -> list[str]:
    """``value`` as a list of names: one ``str`` is one name, else a collection of ``str``.

    ``expected`` and ``element`` open the ``TypeError`` for a value that is not a collection
    and for an element that is not a string (each message ends with what was given).
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Iterable):
        raise TypeError(f"{expected}, got {type(value).__name__}")
    names = list(value)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"{element}, got {bad[0]!r} ({type(bad[0]).__name__})")
    return names
