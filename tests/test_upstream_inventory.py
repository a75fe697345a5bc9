"""The upstream inventory (``tests/upstream_inventory/``) stays true to the five modules that adapt upstream tests."""

from __future__ import annotations

import ast
import functools
from collections import Counter
from pathlib import Path

import pytest

from tests.upstream_inventory import INVENTORY, UpstreamTest

MODULES = (
    "scaling/test_scaler_upstream.py",
    "scaling/test_scaler_upstream_side_by_side.py",
    "plugin/test_plugin_upstream.py",
    "engine/test_fabric_upstream.py",
    "distributed/test_fsdp_upstream.py",
)
LISTED = [entry for entry in INVENTORY if entry.status != "skipped"]


@functools.cache
def _tests_of(module_file: str) -> dict[str, str]:
    """The module's test functions and their docstrings, read from its source (importing it would load Lightning)."""
    tree = ast.parse((Path(__file__).parent / module_file).read_text())
    return {
        node.name: ast.get_docstring(node) or ""
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def _entry_id(entry: UpstreamTest) -> str:
    return f"{entry.source.split(' ', 1)[1].removeprefix('tests/')}::{entry.name}"


@pytest.mark.parametrize("entry", LISTED, ids=_entry_id)
def test_every_adapted_or_differing_upstream_test_names_local_tests_that_name_it(entry):
    """Each adapted or differing entry names existing tests, whose docstrings name the upstream file and test."""
    assert entry.local, "an adapted or differing entry names the tests that adapt it"
    upstream_path = entry.source.split(" ", 1)[1].removeprefix("tests/")
    for local in entry.local:
        module_file, name = local.split("::")
        assert module_file in MODULES, local
        tests = _tests_of(module_file)
        assert name in tests, f"{local} does not exist"
        docstring = " ".join(tests[name].split())
        assert upstream_path in docstring, f"{local}'s docstring does not name {upstream_path}"
        if entry.name.startswith("test_"):  # a "_helper" entry is named in the reason, not in every docstring
            assert entry.name in docstring, f"{local}'s docstring does not name {entry.name}"


def test_every_test_of_the_upstream_modules_is_listed():
    """No test in the five modules is missing from the inventory, so each says which upstream test it adapts."""
    listed = {local for entry in LISTED for local in entry.local}
    present = {f"{module_file}::{name}" for module_file in MODULES for name in _tests_of(module_file)}
    assert present - listed == set()


def test_each_upstream_test_is_listed_once_and_every_difference_and_skip_says_why():
    """One entry per upstream test; skipped entries name no local test; 'differs' and 'skipped' give a reason."""
    counts = Counter((entry.source, entry.name) for entry in INVENTORY)
    assert [key for key, count in counts.items() if count > 1] == []
    for entry in INVENTORY:
        assert entry.status in ("adapted", "differs", "skipped")
        if entry.status == "skipped":
            assert entry.local == (), _entry_id(entry)
        if entry.status != "adapted":
            assert entry.reason.strip(), _entry_id(entry)
