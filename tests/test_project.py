"""The project's habits: CI gates on the linters and the type checker, a fast loop, one set of test helpers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_mp
from tests.helpers import read_events, scalars, texts

PACKAGE = Path(lightning_mp.__file__).parent  # the package as installed: the source tree, or a wheel's copy
ROOT = Path(__file__).parents[1]


def readme_line(prefix: str) -> str:
    return next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(prefix))


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_ci_runs_the_readme_gate_of_linters_and_type_checker_before_the_tests() -> None:
    """.ci/run runs ruff check, ruff format --check and mypy (the README's gate line) before the test line."""
    gate = readme_line("ruff check")
    assert "ruff format --check" in gate and re.search(r"\bmypy\b", gate)
    script = (ROOT / ".ci" / "run").read_text()
    assert script.index('run_readme_line "$gate_line"') < script.index('run_readme_line "$test_line"')
    assert "grep -m1 '^ruff check' README.md" in script


def test_the_dev_extra_installs_everything_the_gate_runs() -> None:
    """`pip install -e ".[dev]"` brings ruff and mypy, so the README's install line is enough for the gate."""
    dev = " ".join(pyproject()["project"]["optional-dependencies"]["dev"])
    assert re.search(r"\bruff\b", dev) and re.search(r"\bmypy\b", dev)


def test_the_slow_marker_is_registered_and_doctests_run_with_the_tests() -> None:
    """`pytest -m "not slow"` is a known marker, and plain `pytest` collects lightning_mp's doctests."""
    options = pyproject()["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("slow:") for marker in options["markers"])
    assert "--doctest-modules" in options["addopts"] and "lightning_mp" in options["testpaths"]


def test_read_events_gives_back_the_scalars_and_texts_a_logger_wrote(tmp_path: Path) -> None:
    """The shared TensorBoard reader returns what a TensorBoardLogger wrote, by step; an unknown tag is empty."""
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"precision/loss_scale": 256.0}, step=3)
    logger.experiment.add_text("precision/overflow", "first.weight", global_step=4)
    logger.experiment.add_histogram("precision/magnitudes", torch.arange(4.0), global_step=4)
    logger.finalize("success")
    events = read_events(logger.log_dir)
    assert scalars(events, "precision/loss_scale") == {3: 256.0}
    assert texts(events, "precision/overflow") == {4: "first.weight"}
    assert len(events.Histograms("precision/magnitudes")) == 1
    assert scalars(events, "never/logged") == {} and texts(events, "never/logged") == {}


def third_party_imports(package: Path) -> set[str]:
    """The top-level names of every module the package imports that is neither its own nor the standard library."""
    names: set[str] = set()
    for source in package.rglob("*.py"):
        names |= third_party_imports_of_file(source)
    return names


def third_party_imports_of_file(source: Path) -> set[str]:
    """:func:`third_party_imports` for one source file."""
    names = set()
    if source.suffix == ".py":
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "lightning_mp"}


def _names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("-", "_") for requirement in requirements
    }


@pytest.mark.slow
def test_every_direct_import_of_the_package_is_a_declared_dependency() -> None:
    """`pip install lightning_mp` brings every library the package imports itself, not only through another one;
    the FP8 mode's torchao comes with the `fp8` extra, and only the FP8 package imports it."""
    project = pyproject()["project"]
    declared = _names(project["dependencies"])
    fp8_extra = _names(project["optional-dependencies"]["fp8"])
    assert third_party_imports(PACKAGE) <= declared | fp8_extra
    outside_fp8 = {path for path in PACKAGE.iterdir() if path.name != "fp8"}
    for path in outside_fp8:
        names = third_party_imports(path) if path.is_dir() else third_party_imports_of_file(path)
        assert not names & (fp8_extra - declared), f"{path.name} imports the fp8 extra's {names & fp8_extra}"


def test_every_type_ignore_says_why() -> None:
    """Each `# type: ignore` in the package carries a reason: on its line, or in a comment just above its block."""
    unexplained = []
    for source in PACKAGE.rglob("*.py"):
        lines = source.read_text().splitlines()
        for number, line in enumerate(lines):
            if "# type: ignore" not in line or "#" in line.split("# type: ignore", 1)[1]:
                continue
            above = number - 1
            while above >= 0 and ("# type: ignore" in lines[above] or lines[above].lstrip().startswith("@")):
                above -= 1
            if above < 0 or not lines[above].lstrip().startswith("#"):
                unexplained.append(f"{source.relative_to(ROOT)}:{number + 1}")
    assert not unexplained


def test_ci_runs_the_whole_suite_at_the_floors_without_extras_and_on_the_newest_torch() -> None:
    """Each runtime floor, torch's included, is a full version; .ci/run installs exactly them and no optional extra,
    then the README's whole test line; so does its newest-torch run."""
    ci = (ROOT / ".ci" / "run").read_text()
    for dependency in pyproject()["project"]["dependencies"]:
        _, _, floor = dependency.partition(">=")
        assert re.fullmatch(r"\d+\.\d+\.\d+", floor), f"{dependency}: the floor must be a full version"
    assert 'd.replace(">=", "==")' in ci and "pip_install $floors" in ci
    floors = ci.index("pip_install $floors")
    newest = ci.index('pip_install "torch==$NEWEST_TORCH"')
    floors_run = ci[floors:newest]
    assert floors_run.index('run_readme_line "$install_line"') < floors_run.index('run_readme_line "$test_line"')
    assert "torchao" not in floors_run  # the floors run has no optional extra
    assert 'run_readme_line "$test_line"' in ci[newest:]
    assert readme_line('pytest -m "not slow"')


def test_ci_reads_the_readme_install_command_whole_across_its_continued_lines() -> None:
    """CI runs the README's install command as the reader pastes it: torch first, then the package and the demo."""
    script = (ROOT / ".ci" / "run").read_text()
    reader = re.search(r"install_line=\$\((awk '.*' README\.md)\)", script)
    assert reader is not None
    command = subprocess.run(
        ["bash", "-c", reader.group(1)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert command.startswith("pip install torch --index-url") and "\\" not in command
    assert command.endswith('pip install -e ".[dev]" && python -m lightning_mp.demo')
