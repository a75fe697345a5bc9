"""Settings fields that carry their own documentation and check, and the docstrings written from them.

A knob is a field of a frozen settings dataclass (:class:`~lightning_mp._scale_rules.ScalerSettings`,
:class:`~lightning_mp.settings.PluginSettings`) whose ``metadata`` is :func:`knob`'s: the one text that documents it
and the one ``check(owner, name, value)`` that validates it (returning the value as a plain Python value, or raising
a ``ValueError`` that names ``owner``, the argument, the value and what is allowed). The classes that take the knobs
as keyword arguments (:class:`~lightning_mp.MixedPrecision`, :class:`~lightning_mp.LossScaler`) write
``name: <knob>`` in their ``Args:`` section, and :func:`with_knob_docs` puts the knob's text there, so the docstrings
cannot disagree. The texts are in the class's ``__doc__`` at run time, where ``help()``, Sphinx and LightningCLI's
``--help`` read them.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from lightning_mp._validation import exact

__all__ = ["knob", "knob_doc", "with_knob_docs"]

Check = Callable[[str, str, Any], Any]
_Documented = TypeVar("_Documented", bound=type)
_PLACEHOLDER = re.compile(r"^(?P<indent> +)(?P<name>\w+): <knob>(?P<rest>.*)$")


def knob(doc: str, check: Check | None = None) -> dict[str, Any]:
    """The metadata of a settings field: its one ``doc`` and its one ``check(owner, name, value)``.

    Example:
        >>> from dataclasses import dataclass, field
        >>> @dataclass(frozen=True)
        ... class Settings:
        ...     steps: int = field(default=10, metadata=knob("how many steps to run."))
        >>> knob_doc(Settings, "steps")
        'how many steps to run.'

    """
    return {"doc": doc} if check is None else {"doc": doc, "check": check}


def knob_doc(settings: type, name: str) -> str:
    """The one documentation of the knob ``name`` of the settings dataclass ``settings``."""
    return next(field.metadata["doc"] for field in fields(settings) if field.name == name)


def knob_default(settings: type, name: str) -> Any:
    """The default of the knob ``name`` of the settings dataclass ``settings``."""
    return next(field.default for field in fields(settings) if field.name == name)


def with_knob_docs(*settings: type) -> Callable[[_Documented], _Documented]:
    """Class decorator: fill each ``name: <knob>`` line of the class docstring with the knob's documentation.

    Text after ``<knob>`` on the line is appended, with ``{default}`` replaced by the knob's default (written as
    :func:`~lightning_mp._validation.exact` writes numbers). The first of ``settings`` that declares ``name`` wins.
    """

    def document(cls: _Documented) -> _Documented:
        lines = []
        for line in (cls.__doc__ or "").splitlines():
            placeholder = _PLACEHOLDER.match(line)
            if placeholder is None:
                lines.append(line)
                continue
            indent, name = placeholder["indent"], placeholder["name"]
            owner = next(s for s in settings if name in {field.name for field in fields(s)})
            default = knob_default(owner, name)
            shown = exact(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else default
            text = f"{name}: {knob_doc(owner, name)}{placeholder['rest'].replace('{default}', str(shown))}"
            # A range such as ``[1, 2**31 - 1]`` is kept on one line.
            wrapped = textwrap.fill(
                text.replace(" - ", "\0-\0"), 120, initial_indent=indent, subsequent_indent=indent + "    "
            )
            lines.append(wrapped.replace("\0", " "))
        cls.__doc__ = "\n".join(lines)
        return cls

    return document
