"""Sphinx configuration: MyST Markdown pages, the notebooks, the API reference from the docstrings, the furo theme.

Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (CI does, warnings as errors).

The notebooks live in ``notebooks/``, outside the site's sources: each is copied into ``docs/notebooks/`` (ignored by
git) when the site is configured, and MyST-NB renders it as stored, without executing it (CI executes them with
``pytest --nbmake notebooks``). A page links to one as ``/notebooks/NAME.ipynb``: the repository's file on GitHub,
the rendered page on the site.
"""

from __future__ import annotations

import importlib
import inspect
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs"))

import generated_tables  # noqa: E402

import lightning_mp  # noqa: E402

project = "lightning_mp"
author = "the lightning_mp developers"
copyright = "2026, the lightning_mp developers"
release = lightning_mp.__version__
version = release

extensions = [
    # MyST-NB reads the Markdown pages with MyST's parser, and the notebooks.
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    # Each documented object links to its source lines on GitHub (linkcode_resolve, below).
    "sphinx.ext.linkcode",
    "sphinx_copybutton",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
# The GPU reports are pulled into gpu-results.md (below), not built as pages of their own.
exclude_patterns = ["_build", "gpu-results/**"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# The notebooks are shown as stored (without outputs); executing them is CI's job, not the site's.
nb_execution_mode = "off"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True, "show-inheritance": True}
# The docstrings are Google style (Args:, Returns:, Raises:, Example:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The offline build resolves no external inventory; cross-references to torch and Lightning render as plain text.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
nitpicky = False

REPOSITORY = "https://github.com/lightning-mp/lightning_mp"
PACKAGE_ROOT = Path(lightning_mp.__file__).resolve().parents[1]


def linkcode_resolve(domain: str, info: dict[str, str]) -> str | None:
    """The GitHub address of the lines that define a documented object, or None (a constant, an inherited member).

    Args:
        domain: the Sphinx domain of the object; only Python objects have a source.
        info: the object's ``module`` and its ``fullname`` within it.
    """
    if domain != "py" or not info.get("module"):
        return None
    found: Any = importlib.import_module(info["module"])
    for part in info["fullname"].split("."):
        found = getattr(found, part, None)
    if isinstance(found, property):
        found = found.fget
    try:
        source = Path(inspect.getsourcefile(inspect.unwrap(found)) or "").resolve()
        lines, first = inspect.getsourcelines(inspect.unwrap(found))
    except (TypeError, OSError):
        return None
    if PACKAGE_ROOT not in source.parents:
        return None  # a member inherited from torch or Lightning
    path = source.relative_to(PACKAGE_ROOT).as_posix()
    return f"{REPOSITORY}/blob/main/{path}#L{first}-L{first + len(lines) - 1}"


html_theme = "furo"
html_title = f"lightning_mp {release}"
# furo's "edit this page" link, and the source link beside each page.
html_theme_options = {
    "source_repository": f"{REPOSITORY}/",
    "source_branch": "main",
    "source_directory": "docs/",
}
# The copy button leaves out shell prompts and Python's interactive prompts.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
html_static_path = ["_static"]

NOTEBOOKS = ROOT / "notebooks"
NOTEBOOK_PAGES = Path(__file__).resolve().parent / "notebooks"


def copy_notebooks() -> None:
    """Mirror ``notebooks/*.ipynb`` into ``docs/notebooks/``, where Sphinx finds its sources.

    Each copy keeps its file's time, so an unchanged notebook is not read again; a copy whose notebook is gone is
    removed, so no stale page is built.
    """
    NOTEBOOK_PAGES.mkdir(exist_ok=True)
    notebooks = {notebook.name: notebook for notebook in NOTEBOOKS.glob("*.ipynb")}
    for stale in NOTEBOOK_PAGES.glob("*.ipynb"):
        if stale.name not in notebooks:
            stale.unlink()
    for name, notebook in notebooks.items():
        copy = NOTEBOOK_PAGES / name
        if not copy.exists() or copy.read_bytes() != notebook.read_bytes():
            shutil.copy2(notebook, copy)


copy_notebooks()

GPU_RESULTS = Path(__file__).resolve().parent / "gpu-results"
GPU_REPORTS_MARKER = "<!-- gpu-reports -->"


def unmeasured_targets_markdown() -> str:
    """The GPU proof's targets, each figure's in a row, every one marked not yet measured (no report is committed)."""
    from lightning_mp.bench.proof_figures import FIGURES

    rows = ["| figure | target | result |", "|---|---|---|"]
    for figure in FIGURES:
        for index, target in enumerate(figure.targets):
            rows.append(f"| {figure.title if index == 0 else ''} | {target.describe()} | not yet measured |")
    return "\n".join(rows)


def gpu_reports_markdown() -> str:
    """MyST that includes every committed GPU report (``docs/gpu-results/*.md``), newest name first.

    Without one, it lists the proof's targets, each not yet measured.
    """
    # The folder's README.md says what belongs there; it is no report.
    found = sorted(GPU_RESULTS.glob("*.md"), reverse=True) if GPU_RESULTS.is_dir() else []
    reports = [report for report in found if report.name != "README.md"]
    if not reports:
        return (
            "**No GPU report committed yet.** The command above writes the first one; until then every GPU figure\n"
            "is not yet measured:\n\n" + unmeasured_targets_markdown()
        )
    blocks = []
    for report in reports:
        relative = report.relative_to(GPU_RESULTS.parent).as_posix()
        blocks.append(f"```{{include}} {relative}\n:heading-offset: 1\n:relative-images:\n:relative-docs: ..\n```")
    return "\n\n".join(blocks)


GENERATED_PAGES = ["gpu-results", "performance", "contributing", "guide/distributed"]
"""The pages whose tables are generated at build time, from files other than the page itself."""


def include_generated(app: object, docname: str, source: list[str]) -> None:
    """Fill the generated parts of a page, so that no figure and no registry row is typed by hand.

    The committed GPU reports go into gpu-results.md, and each ``<!-- generated: NAME -->`` marker becomes its table
    (``docs/generated_tables.py``: the performance results under ``docs/performance/``, the private-names registry).
    """
    if docname == "gpu-results":
        source[0] = source[0].replace(GPU_REPORTS_MARKER, gpu_reports_markdown())
    source[0] = generated_tables.fill(source[0])


def reread_generated(app: object, env: object, added: set[str], changed: set[str], removed: set[str]) -> list[str]:
    """Read the generated pages on every build: a new report, result file or registry record changes them."""
    return GENERATED_PAGES


def notebook_source_links(
    app: object, pagename: str, templatename: str, context: dict[str, Any], doctree: object
) -> None:
    """Point a notebook page's "edit" and "view source" links at ``notebooks/NAME.ipynb``, not at its build copy."""
    if pagename.startswith("notebooks/"):
        context["theme_source_directory"] = ""


def setup(app: object) -> None:
    """Register the hooks that fill the generated pages and fix the notebook pages' source links."""
    app.connect("source-read", include_generated)  # type: ignore[attr-defined]
    app.connect("env-get-outdated", reread_generated)  # type: ignore[attr-defined]
    app.connect("html-page-context", notebook_source_links)  # type: ignore[attr-defined]
