"""Sphinx configuration: MyST Markdown pages, the API reference from the package's docstrings, the furo theme.

Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (CI does, warnings as errors).
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# The GPU reports are pulled into gpu-results.md (below), not built as pages of their own.
exclude_patterns = ["_build", "gpu-results/**"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

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

html_theme = "furo"
html_title = f"lightning_mp {release}"
# furo's "edit this page" link, and the source link beside each page.
html_theme_options = {
    "source_repository": "https://github.com/lightning-mp/lightning_mp/",
    "source_branch": "main",
    "source_directory": "docs/",
}
# The copy button leaves out shell prompts and Python's interactive prompts.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
html_static_path = ["_static"]

GPU_RESULTS = Path(__file__).resolve().parent / "gpu-results"
GPU_REPORTS_MARKER = "<!-- gpu-reports -->"


def gpu_reports_markdown() -> str:
    """MyST that includes every committed GPU report (``docs/gpu-results/*.md``), newest name first, or says none is."""
    # The folder's README.md says what belongs there; it is no report.
    found = sorted(GPU_RESULTS.glob("*.md"), reverse=True) if GPU_RESULTS.is_dir() else []
    reports = [report for report in found if report.name != "README.md"]
    if not reports:
        return "**No GPU report committed yet.** The command above writes the first one."
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


def setup(app: object) -> None:
    """Register the hooks that fill the generated pages."""
    app.connect("source-read", include_generated)  # type: ignore[attr-defined]
    app.connect("env-get-outdated", reread_generated)  # type: ignore[attr-defined]
