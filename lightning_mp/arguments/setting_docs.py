"""Settings fields that carry their own documentation and check, and the docstrings written from them.

A setting is a field of a frozen settings dataclass (:class:`~lightning_mp.scaling.rules.ScalerSettings`,
:class:`~lightning_mp.settings.PluginSettings`) whose ``metadata`` is :func:`setting`'s: the one text that documents it
and the one ``check(name, value)`` that validates it (returning the value as a plain Python value, or raising a
``ValueError`` that names the caller, the argument, the value and what is allowed). The classes that take the settings
as keyword arguments (:class:`~lightning_mp.MixedPrecision`, :class:`~lightning_mp.LossScaler`) give the setting's text
in their ``Args:`` section, written out in the source so that it reads well there, in ``help()``, in Sphinx and in
LightningCLI's ``--help``; :func:`with_setting_docs` checks, when the class is defined, that each entry is the setting's
text word for word, so the docstrings cannot disagree.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

from lightning_mp.arguments.checks import exact

__all__ = ["setting", "setting_doc", "setting_doc_disagreements", "with_setting_docs"]

Check = Callable[[str, Any], Any]
_Documented = TypeVar("_Documented", bound=type)
_ENTRY = re.compile(r"^(?P<name>\w+): (?P<text>.*)$")


def setting(doc: str, check: Check | None = None) -> dict[str, Any]:
    """The metadata of a settings field: its one ``doc`` and its one ``check(name, value)``.

    Example:
        >>> from dataclasses import dataclass, field
        >>> @dataclass(frozen=True)
        ... class Settings:
        ...     steps: int = field(default=10, metadata=setting("how many steps to run."))
        >>> setting_doc(Settings, "steps")
        'how many steps to run.'

    """
    return {"doc": doc} if check is None else {"doc": doc, "check": check}


def setting_doc(settings: type, name: str) -> str:
    """The one documentation of the setting ``name`` of the settings dataclass ``settings``."""
    return next(field.metadata["doc"] for field in fields(settings) if field.name == name)


def setting_default(settings: type, name: str) -> Any:
    """The default of the setting ``name`` of the settings dataclass ``settings``."""
    return next(field.default for field in fields(settings) if field.name == name)


def _args_entries(doc: str) -> dict[str, str]:
    """The ``name: text`` entries of the ``Args:`` section of a Google docstring, each text on one line."""
    lines = doc.splitlines()
    start = next((index for index, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return {}
    section_indent = len(lines[start]) - len(lines[start].lstrip())
    entries: dict[str, str] = {}
    entry_indent, name = None, None
    for line in lines[start + 1 :]:
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent <= section_indent:
            break
        entry = _ENTRY.match(line.strip())
        if entry is not None and indent == (entry_indent or indent):
            entry_indent, name = indent, entry["name"]
            entries[name] = entry["text"]
        elif name is not None:
            entries[name] += " " + line.strip()
    return entries


def setting_doc_disagreements(cls: type, *settings: type) -> list[str]:
    """Where ``cls``'s docstring does not give a setting's one documentation; empty where it does.

    Each argument of ``cls.__init__`` that is a field of one of ``settings`` (the first that declares it wins) must
    have an entry in the ``Args:`` section whose text, whitespace aside, is the setting's documentation, optionally
    followed by a sentence of the class's own; where that sentence reads ``None means X.``, ``X`` must be the setting's
    default as :func:`~lightning_mp.arguments.checks.exact` writes it. A class without a docstring (``python -OO``)
    has nothing to disagree.
    """
    if cls.__doc__ is None:
        return []
    entries = _args_entries(cls.__doc__)
    arguments = inspect.signature(cls).parameters
    problems = []
    for name in arguments:
        owner = next((s for s in settings if name in {f.name for f in fields(s) if "doc" in f.metadata}), None)
        if owner is None:
            continue
        expected = " ".join(setting_doc(owner, name).split())
        given = entries.get(name)
        if given is None:
            problems.append(f"{cls.__name__}: the Args: section has no entry for the setting {name!r}")
            continue
        if not (given == expected or given.startswith(expected + " ")):
            problems.append(f"{cls.__name__}: {name}: the docstring says {given!r}, the setting's text is {expected!r}")
            continue
        default = setting_default(owner, name)
        shown = exact(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else default
        none_means = re.search(r"None means (\S+)\.$", given.removeprefix(expected))
        if none_means is not None and none_means[1] != str(shown):
            problems.append(
                f"{cls.__name__}: {name}: the docstring says None means {none_means[1]}, the default is {shown}"
            )
    return problems


def with_setting_docs(*settings: type) -> Callable[[_Documented], _Documented]:
    """Class decorator: check that the class docstring gives each setting's documentation, word for word.

    The docstring is written out in the source, so that a reader of the source, ``help()``, Sphinx and LightningCLI's
    ``--help`` read the same text; this check (:func:`setting_doc_disagreements`) keeps it the setting's one
    documentation.

    Raises:
        TypeError: when the class is defined, if its docstring and a setting's documentation disagree, naming both.

    """

    def check(cls: _Documented) -> _Documented:
        problems = setting_doc_disagreements(cls, *settings)
        if problems:
            raise TypeError("the docstring disagrees with the settings' documentation: " + "; ".join(problems))
        return cls

    return check
