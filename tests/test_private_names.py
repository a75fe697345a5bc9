"""The registry of private torch and Lightning names is complete and current, checked against the package's source.

The registry is the one list: the contributing page's table is built from it (``docs/generated_tables.py``).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import torch

import lightning_mp
from lightning_mp._private_names import PRIVATE_NAMES, PrivateName

PACKAGE = Path(lightning_mp.__file__).parent  # the package as installed: the source tree, or a wheel's copy
SOURCES = {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
UPSTREAM = ("torch", "lightning")


def is_private(name: str) -> bool:
    """``_name`` but not ``__dunder__`` nor a bare ``_``."""
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def name_parts(name: str) -> list[str]:
    """The parts of a dotted name that the source spells: the private ones, else the last one."""
    parts = [part for part in name.split(".") if is_private(part)]
    return parts or [name.split(".")[-1]]


def private_parts(record: PrivateName) -> list[str]:
    """The parts the source spells of a record's name, or of every member of a family record."""
    if record.members:
        return [part for member in record.members for part in name_parts(member)]
    return name_parts(record.name)


def spells(module: str, parts: list[str]) -> bool:
    """Whether ``module``'s source spells every one of ``parts``."""
    return all(re.search(rf"(?<![\w]){re.escape(part)}\b", SOURCES.get(module, "")) for part in parts)


def is_override(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "override" for d in function.decorator_list)


def private_uses() -> tuple[dict[str, set[str]], set[str]]:
    """Every private name the package's code spells, with the modules that spell it; and the package's own ones.

    A name is the package's own when the package defines it: a module-level function, class or variable, a method
    that overrides nothing, or an attribute the package assigns on ``self``.
    """
    used: dict[str, set[str]] = defaultdict(set)
    own: set[str] = set()
    for module, source in SOURCES.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    if isinstance(node.ctx, ast.Store):
                        own.add(node.attr)
                    continue
                used[node.attr].add(module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                base = node.module if isinstance(node, ast.ImportFrom) else ""
                for alias in node.names:
                    path = f"{base}.{alias.name}" if base else alias.name
                    if path.split(".")[0] in UPSTREAM:
                        for part in path.split("."):
                            if is_private(part):
                                used[part].add(module)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                if is_private(node.value):
                    used[node.value].add(module)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and is_private(node.name):
                if isinstance(node, ast.ClassDef) or not is_override(node):
                    own.add(node.name)
                else:
                    used[node.name].add(module)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                own.update(t.id for t in targets if isinstance(t, ast.Name) and is_private(t.id))
    return used, own


def test_every_private_upstream_name_the_package_uses_is_registered():
    """A private torch or Lightning name in the package's code has a record saying why, in every module using it."""
    used, own = private_uses()
    registered: dict[str, set[str]] = defaultdict(set)
    for record in PRIVATE_NAMES:
        for part in private_parts(record):
            registered[part].update(record.used_in)
    missing = {name: modules for name, modules in used.items() if name not in own and name not in registered}
    assert not missing, f"private names used without a record in lightning_mp/_private_names.py: {missing}"
    unlisted = {
        name: modules - registered[name] for name, modules in used.items() if name in registered and name not in own
    }
    assert not any(unlisted.values()), f"modules missing from a record's used_in: {unlisted}"


def test_every_record_is_still_used_where_it_says():
    """A record names only modules whose code still spells the name (a family: one of its members), and a family
    lists only members some module still spells, so the registry cannot outlive its uses."""
    stale = [
        (record.name, module)
        for record in PRIVATE_NAMES
        for module in record.used_in
        if not (
            any(spells(module, name_parts(member)) for member in record.members)
            if record.members
            else spells(module, private_parts(record))
        )
    ]
    assert not stale
    unused_members = [
        member
        for record in PRIVATE_NAMES
        for member in record.members
        if not any(spells(module, name_parts(member)) for module in record.used_in)
    ]
    assert not unused_members


def test_family_records_group_only_ops_torch_documents():
    """The two family records hold what their reason says: torch's foreach ops and Core ATen IR ops of this torch."""
    families = {record.name: record.members for record in PRIVATE_NAMES if record.members}
    assert set(families) == {"torch._foreach_*", "torch.ops.aten._*"}
    for member in families["torch._foreach_*"]:
        assert member.startswith("torch._foreach_") and callable(getattr(torch, member.removeprefix("torch.")))
    for member in families["torch.ops.aten._*"]:
        assert torch.Tag.core in getattr(torch.ops.aten, member.removeprefix("aten.")).default.tags


def test_records_are_unique_and_complete():
    """Each name has one record, with an owner, a reason and the versions it was checked on."""
    names = [record.name for record in PRIVATE_NAMES]
    assert len(names) == len(set(names))
    assert all(record.owner in UPSTREAM and record.reason and record.used_in for record in PRIVATE_NAMES)
    assert all("torch" in record.checked_on and "Lightning" in record.checked_on for record in PRIVATE_NAMES)


def test_no_module_keeps_its_own_list_of_private_names():
    """Module docstrings point to the registry instead of keeping lists that drift."""
    listing = re.compile(r"^Private (torch |Lightning )?names? used", re.MULTILINE)
    assert [module for module, source in SOURCES.items() if listing.search(source)] == []


def test_the_records_cover_at_most_twenty_names():
    """With their members the records cover at most 20 private names: each is an upgrade waiting to break."""
    assert sum(len(record.members) or 1 for record in PRIVATE_NAMES) <= 20
