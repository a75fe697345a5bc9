"""The README and the documentation say what the code does.

Every Python block parses, the quickstarts of the README, the landing page and Get started train, every link between
pages resolves (on GitHub and on the site, whose built links docs/check_links.py checks in CI), the pages are grouped
by the reader's level, the API reference covers ``lightning_mp.__all__``, no page tells history (that is
CHANGELOG.md's job), and the tables of TensorBoard tags, notebooks and loss-scaler settings are checked against the
code.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_mp
from lightning_mp import LossScaler, MixedPrecision
from lightning_mp.arguments.setting_docs import setting_doc_disagreements, with_setting_docs
from lightning_mp.callbacks import (
    AdvisorCallback,
    GradientHealthMonitor,
    LayerDtypeMonitor,
    LossScaleMonitor,
    PrecisionSentinel,
)
from lightning_mp.fp8.convert import fp8_unavailable
from lightning_mp.scaling.rules import ScalerSettings
from lightning_mp.settings import PluginSettings
from lightning_mp.tasks import example_task
from tests.helpers import TinyRegressor, loader, make_trainer, read_events

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SITE = "https://lightning-mp.readthedocs.io"
"""The rendered documentation; README links to its pages under ``/en/latest/``."""
REPOSITORY = "https://github.com/lightning-mp/lightning_mp"
# The GPU reports under docs/gpu-results/ are written by the benchmark, not by hand; the build output is not a page.
PAGES = [README, *sorted(path for path in DOCS.rglob("*.md") if not {"_build", "gpu-results"} & set(path.parts))]
NOT_CHECKED = "<!-- not-checked -->"
NOT_RUN = re.compile(r"^<!-- not-run: (?P<reason>.+) -->$")
"""The marker on the line before a Python block that parses but cannot run here, with the reason (a GPU, several
processes, a user's own model class)."""


def docs_script(name: str) -> Any:
    """The module ``docs/<name>.py`` (the docs' scripts are no package: each is loaded from its file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def markdown_table(page: Path, header: str) -> list[list[str]]:
    """The cells of the Markdown table on ``page`` under the header row that starts with ``header``."""
    return markdown_table_rows(page.read_text(), header)


def markdown_table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table in ``text`` under the header row that starts with ``header``."""
    lines = text.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def python_blocks(page: Path, runnable: bool = False) -> list[tuple[int, str]]:
    """Each fenced Python block of ``page`` with its first line number, except those marked not checked (and, with
    ``runnable``, those marked not run)."""
    lines = page.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        fence = re.match(r"^(\s*)(`{3,})\s*([^`\s]*)", lines[index])
        if not fence:
            index += 1
            continue
        indent, ticks, language = fence.groups()
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == ticks)
        before = lines[index - 1].strip() if index > 0 else ""
        exempt = before == NOT_CHECKED or (runnable and NOT_RUN.match(before) is not None)
        if language in ("python", "py") and not exempt:
            body = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end])
            blocks.append((index + 2, body))
        index = end + 1
    return blocks


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub and MyST give the headings of ``page`` (lower case, punctuation dropped, spaces to -).

    Only the headings of levels 1 to 3 count: the site makes anchors down to ``myst_heading_anchors = 3``. A ``#``
    line inside a code block is a comment, not a heading."""
    anchors = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,3}\s+(.*)$", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def labels() -> set[str]:
    """Every MyST target, ``(name)=``, declared on a docs page."""
    return {label for page in PAGES for label in re.findall(r"^\((\S+)\)=$", page.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_python_block_on_the_page_parses(page: Path) -> None:
    """A reader who copies a Python block from the README or the docs gets code that at least parses."""
    for line, body in python_blocks(page):
        try:
            ast.parse(body)
        except SyntaxError as error:
            pytest.fail(f"{page_name(page)}:{line + (error.lineno or 1) - 1}: {error.msg}")


QUICKSTARTS = [README, DOCS / "index.md", DOCS / "get-started.md"]


@pytest.mark.slow  # trains the quickstarts
@pytest.mark.parametrize("page", QUICKSTARTS, ids=page_name)
def test_the_quickstarts_train(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each quickstart block runs as written, in a fresh namespace (it makes its own tiny model and data): a reader's
    first run works."""
    monkeypatch.chdir(tmp_path)  # the blocks write logs and checkpoints into the working directory
    blocks = python_blocks(page)
    assert len(blocks) == 2, "one Trainer and one Fabric quickstart"
    for line, body in blocks:
        torch.manual_seed(0)
        namespace: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(body, f"{page_name(page)}:{line}", "exec"), namespace)
        assert namespace["plugin"].stats.optimizer_steps > 0, f"{page_name(page)}:{line} trained no step"


class QuietTrainer(L.Trainer):
    """The Trainer a guide block builds, trained for 2 steps on one CPU without checkpoints, progress bar or summary
    (its TensorBoard logs go to the test's working directory)."""

    def __init__(self, **options: Any) -> None:
        quiet = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
        quiet["max_steps"] = 2
        super().__init__(**{**quiet, **options, "accelerator": "cpu", "devices": 1})


GUIDE_PAGES = [page for page in sorted((DOCS / "guide").glob("*.md")) if python_blocks(page, runnable=True)]


@pytest.mark.slow  # runs the guide's code
@pytest.mark.parametrize("page", GUIDE_PAGES, ids=page_name)
def test_every_guide_page_runs_as_written(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each page's Python blocks run as written, in order, in one fresh namespace, as a reader pastes them: nothing is
    given but what the page's own setup block makes. A Trainer a page builds then trains two steps with its plugin
    and callbacks (the harness caps every Trainer at two steps, without checkpoints or a progress bar)."""
    if page.name == "fp8.md" and (missing := fp8_unavailable()):
        pytest.skip(f"the FP8 guide's blocks need the fp8 extra: {missing}")
    monkeypatch.chdir(tmp_path)  # blocks write checkpoints and logs into the working directory
    monkeypatch.setattr(L, "Trainer", QuietTrainer)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for line, body in python_blocks(page, runnable=True):
        exec(compile(body, f"{page_name(page)}:{line}", "exec"), namespace)
    trainer = namespace.get("trainer")
    if isinstance(trainer, L.Trainer) and trainer.global_step == 0:
        model, _, loader, _ = example_task()
        trainer.fit(model, loader)
        assert trainer.global_step == 2, f"{page_name(page)}: its Trainer trained no step"


def test_few_guide_blocks_are_not_run() -> None:
    """Blocks left unrun each say why, and stay few: the guide's examples are checked by running them."""
    reasons = [
        match["reason"]
        for page in PAGES
        for text_line in page.read_text().splitlines()
        if (match := NOT_RUN.match(text_line.strip()))
    ]
    assert len(reasons) <= 5
    assert all(len(reason.split()) >= 2 for reason in reasons)
    assert sum(len(python_blocks(page, runnable=True)) for page in GUIDE_PAGES) >= 10


CODE_WIDTH = 88
"""The widest code line a page shows without a horizontal scroll bar in the site's theme."""
LONGEST_PARAGRAPH = 150


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of running text of a Markdown page: no code, table, heading, list item or directive."""
    paragraphs, current, fenced = [], [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        plain = not fenced and line.strip() and not re.match(r"^(\s*([-*]|\d+\.)\s|#|\||<!--|  |```|:)", line)
        if plain:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return [*paragraphs, " ".join(current)] if current else paragraphs


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_the_pages_read_well(page: Path) -> None:
    """Code lines fit the page (no horizontal scrolling) and no paragraph runs past 150 words."""
    text = page.read_text()
    wide, fence = [], None
    for line in text.splitlines():
        opening = re.match(r"^\s*(`{3,})(\S*)", line)
        if fence is None and opening:
            fence = opening.group(2)
        elif fence is not None and line.strip().startswith("```"):
            fence = None
        elif fence not in (None, "text") and not fence.startswith("{") and len(line) > CODE_WIDTH:
            wide.append(line)
    assert wide == []
    long_paragraphs = [p[:60] for p in prose_paragraphs(text) if len(p.split()) > LONGEST_PARAGRAPH]
    assert long_paragraphs == []


def test_the_pages_have_python_blocks_and_few_are_exempt() -> None:
    """The check above has something to check, and the not-checked marker stays the exception."""
    assert sum(len(python_blocks(page)) for page in PAGES) >= 15
    assert sum(page.read_text().count(NOT_CHECKED) for page in PAGES) <= 3


def link_targets(text: str) -> list[str]:
    """The targets of a page's Markdown links and images, inline (``[text](target)``) and by reference
    (``[name]: target``)."""
    return re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s+(\S+)", text, re.MULTILINE)


def linked_file(page: Path, target: str) -> Path | None:
    """The file a link of ``page`` names, as GitHub and the site both read it; None for an address elsewhere.

    An address on the documentation site names its page's source (``guide/o2.html`` is docs/guide/o2.md); one in the
    repository names the file at that path. A path that starts with ``/`` is read from the repository's root on
    GitHub and from docs/ on the site: the two agree only for the notebooks, which the site copies into
    docs/notebooks/. Any other path is relative to the page.
    """
    path = target.partition("#")[0]
    if path.startswith(f"{SITE}/"):
        page_path = path.removeprefix(f"{SITE}/").removeprefix("en/latest/").removesuffix(".html") or "index"
        if page_path.startswith("notebooks/"):
            return ROOT / f"{page_path}.ipynb"
        return DOCS / f"{page_path}.md"
    if path.startswith(f"{REPOSITORY}/blob/main/"):
        return ROOT / path.removeprefix(f"{REPOSITORY}/blob/main/")
    if re.match(r"^[a-z]+:", path):
        return None
    if path.startswith("/"):
        return ROOT / path.lstrip("/") if path.startswith("/notebooks/") else ROOT / "no such path on the site"
    return (page.parent / path).resolve() if path else page


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_link_between_pages_resolves(page: Path) -> None:
    """Each relative Markdown link, and each link to the documentation site or the repository, names a file that
    exists (and a heading on it), each {doc} a page, each {ref} a target, each ``[text][name]`` a definition."""
    text = page.read_text()
    broken = []
    for target in link_targets(text):
        linked = linked_file(page, target)
        if linked is None:
            continue
        anchor = target.partition("#")[2]
        anchored = not anchor or linked.suffix != ".md" or anchor in heading_anchors(linked) | labels()
        if not (linked.exists() and anchored):
            broken.append(target)
    for target in re.findall(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`", text):
        base = DOCS if target.startswith("/") else page.parent
        if not (base / f"{target.lstrip('/')}.md").resolve().exists():
            broken.append(f"{{doc}}`{target}`")
    for target in re.findall(r"\{ref\}`(?:[^`<]*<)?([^`>]+)>?`", text):
        if target not in labels():
            broken.append(f"{{ref}}`{target}`")
    defined = set(re.findall(r"^\[([^\]]+)\]:\s", text, re.MULTILINE))
    broken += [f"[{name}] (not defined)" for name in re.findall(r"\]\[([^\]]+)\]", text) if name not in defined]
    assert broken == [], page_name(page)


def test_the_link_checker_finds_the_broken_links_of_a_built_site(tmp_path: Path) -> None:
    """CI's check of the built site (docs/check_links.py) reports a link to a missing page or a missing anchor, and
    passes a site whose links all resolve."""
    check_links = docs_script("check_links")
    (tmp_path / "guide").mkdir()
    (tmp_path / "index.html").write_text(
        '<a href="guide/o2.html#masters">ok</a> <a href="#top">ok</a> <img src="_static/a.png">'
        '<a href="https://example.org/x.html">external</a> <h1 id="top">lightning_mp</h1>'
    )
    (tmp_path / "guide" / "o2.html").write_text('<h2 id="masters">O2</h2><a href="../index.html">home</a>')
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "a.png").write_bytes(b"\x89PNG")
    assert check_links.broken_links(tmp_path) == []
    lean = '<a href="o2.html#master">a typo</a> <a href="lean-exact.html">a page not built</a>'
    (tmp_path / "guide" / "lean.html").write_text(lean)
    assert check_links.broken_links(tmp_path) == [
        "guide/lean.html: o2.html#master (no such anchor)",
        "guide/lean.html: lean-exact.html (no such file)",
    ]
    assert check_links.main([str(tmp_path)]) == 1


def test_ci_checks_the_links_of_the_built_site() -> None:
    """.ci/run builds the site with warnings as errors, then runs the link checker over what it built."""
    ci = (ROOT / ".ci" / "run").read_text()
    build = ci.index("sphinx-build -W --keep-going -b html docs docs/_build/html\n")
    assert build < ci.index("\npython docs/check_links.py docs/_build/html\n")


def test_the_hosted_site_is_built_as_ci_builds_it() -> None:
    """.readthedocs.yaml builds docs/ with the CPU torch CI pins, the docs extra, warnings as errors and the link
    check, so the hosted site fails where CI's build does."""
    import yaml

    hosting = yaml.safe_load((ROOT / ".readthedocs.yaml").read_text())
    ci = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r"^pip_install (torch==\S+)$", ci, re.MULTILINE)
    assert torch_pin and any(torch_pin.group(1) in line for line in hosting["build"]["jobs"]["pre_install"])
    assert hosting["python"]["install"] == [{"method": "pip", "path": ".", "extra_requirements": ["docs"]}]
    assert hosting["sphinx"] == {"configuration": "docs/conf.py", "fail_on_warning": True}
    assert any("docs/check_links.py" in line for line in hosting["build"]["jobs"]["post_build"])


def test_the_readme_links_to_the_rendered_pages() -> None:
    """A reader of the README on GitHub or on the package index lands on the rendered site: no link into a page's
    Markdown source under docs/."""
    sources = [target for target in link_targets(README.read_text()) if re.match(r"^docs/.+\.md", target)]
    assert sources == ["docs/index.md"]  # the one link to the site's sources, named as such
    assert f"[docs]: {SITE}/en/latest/" in README.read_text()


def test_the_project_addresses_agree() -> None:
    """pyproject.toml's project.urls, the README and the site's edit links name one site and one repository."""
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls == {
        "Documentation": SITE,
        "Source": REPOSITORY,
        "Changelog": f"{REPOSITORY}/blob/main/CHANGELOG.md",
        "Issues": f"{REPOSITORY}/issues",
    }
    assert f'REPOSITORY = "{REPOSITORY}"' in (DOCS / "conf.py").read_text()
    addresses = re.findall(r"https://[^\s)>\]]+", README.read_text())
    ours = [address for address in addresses if "lightning-mp" in address or "lightning_mp" in address]
    assert ours and all(address.startswith((SITE, REPOSITORY)) for address in ours)


LEVELS = ("Start here", "Everyday training", "Going further", "Reference")
"""The landing page's toctrees, by the reader's level: the sidebar's sections, in this order."""
LEVEL_LINE = re.compile(r"^\*\*(?P<level>[^*]+)\*\* · For: \S.* · Assumes: \S.*$")


def toctree_levels() -> dict[str, str]:
    """Each page the landing page's toctrees list, with the caption (the reader's level) of its toctree."""
    levels = {}
    index = (DOCS / "index.md").read_text()
    for block in re.findall(r"^```\{toctree\}\n(.*?)^```$", index, re.MULTILINE | re.DOTALL):
        caption = re.search(r"^:caption: (.+)$", block, re.MULTILINE)
        assert caption, block
        for entry in re.findall(r"^([\w/\-]+)$", block, re.MULTILINE):
            assert entry not in levels, f"{entry} is listed twice"
            levels[entry] = caption.group(1)
    return levels


def test_the_table_of_contents_groups_every_page_by_level() -> None:
    """The sidebar's sections are the reader's levels, in order, and every page under docs/ sits in one of them (a
    page no toctree lists would be built but unreachable)."""
    levels = toctree_levels()
    assert list(dict.fromkeys(levels.values())) == list(LEVELS)
    pages = {page.relative_to(DOCS).with_suffix("").as_posix() for page in PAGES if page != README}
    assert pages - {"index"} == set(levels)


LEVELLED_PAGES = sorted(
    set((DOCS / "guide").glob("*.md"))
    | {DOCS / f"{entry}.md" for entry, level in toctree_levels().items() if level != "Reference"}
)


@pytest.mark.parametrize("page", LEVELLED_PAGES, ids=page_name)
def test_each_page_says_who_it_is_for(page: Path) -> None:
    """Under its title each guide page says in one line its level, who it is for and what it assumes, and that
    level is the sidebar section the page sits in."""
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    level_line = LEVEL_LINE.match(lines[2])
    assert level_line, f"{page_name(page)}: line 3 is not '**Level** · For: ... · Assumes: ...'"
    assert level_line["level"] == toctree_levels()[page.relative_to(DOCS).with_suffix("").as_posix()]


def test_the_api_reference_documents_every_public_name() -> None:
    """Every name in the __all__ of the package and of each subpackage has its entry in docs/api.md: the reference
    covers what the package exports, and the internals are not exported."""
    api = (DOCS / "api.md").read_text()
    entries = re.findall(r"^\.\. (?:auto\w+|py:\w+):: ((?:lightning_mp\.)?[\w.]+)\s*$", api, re.MULTILINE)
    documented = {entry if entry.startswith("lightning_mp") else f"lightning_mp.{entry}" for entry in entries}
    packages = [
        "lightning_mp",
        *(m.name for m in pkgutil.iter_modules(lightning_mp.__path__, "lightning_mp.") if m.ispkg),
    ]
    missing = []
    for package in packages:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            where = {f"{package}.{name}", f"lightning_mp.{name}"}
            if isinstance(value, type) or callable(value):
                where.add(f"{value.__module__}.{value.__qualname__}")
            if not where & documented:
                missing.append(f"{package}.{name}")
    assert missing == []


def test_the_setting_texts_are_written_out_in_the_source_docstrings() -> None:
    """A reader of plugin.py and scaler.py sees each setting's own text, not a ``<setting>`` placeholder: the
    text help(), the API reference and LightningCLI's --help show."""
    for documented in (MixedPrecision, LossScaler):
        source = inspect.getsource(documented)
        assert "<setting>" not in source, documented.__name__
        assert documented.__doc__ and documented.__doc__ in source, documented.__name__
        for name in ("init_scale", "hysteresis", "on_min_scale"):
            assert re.search(rf"^\s+{name}: \S", documented.__doc__, re.MULTILINE), (documented.__name__, name)


def test_the_docstrings_and_the_setting_texts_agree() -> None:
    """Each setting's entry in MixedPrecision's and LossScaler's Args: is the setting's one text."""
    assert setting_doc_disagreements(MixedPrecision, PluginSettings, ScalerSettings) == []
    assert setting_doc_disagreements(LossScaler, ScalerSettings) == []


def test_a_docstring_that_drifts_from_its_setting_fails_at_class_definition() -> None:
    """Editing a setting's text in one place only is caught at class definition, naming it and both texts."""
    wrong = MixedPrecision.__doc__.replace("hysteresis: overflows tolerated", "hysteresis: overflows allowed")

    with pytest.raises(TypeError, match=r"hysteresis: the docstring says .overflows allowed.*the setting's text is"):

        @with_setting_docs(PluginSettings, ScalerSettings)
        class Drifted(MixedPrecision):
            __doc__ = wrong

    stale_default = re.sub(r"None means\s+65536\.", "None means 1024.", MixedPrecision.__doc__)
    assert stale_default != MixedPrecision.__doc__
    with pytest.raises(TypeError, match=r"init_scale: the docstring says None means 1024, the default is 65536"):

        @with_setting_docs(PluginSettings, ScalerSettings)
        class StaleDefault(MixedPrecision):
            __doc__ = stale_default


def generated_tables() -> Any:
    """``docs/generated_tables.py``, which the Sphinx build uses to fill the pages' ``<!-- generated: NAME -->``."""
    return docs_script("generated_tables")


def table_headers(markdown: str) -> list[str]:
    """The header row of each Markdown table in ``markdown`` (the row above a ``|---`` row)."""
    lines = markdown.splitlines()
    return [lines[i - 1] for i in range(1, len(lines)) if lines[i].startswith("|---") and lines[i - 1].startswith("|")]


def test_the_performance_page_and_the_private_names_are_generated_not_typed() -> None:
    """Each measured table of the performance page, and the private-names table, is a marker that the build fills
    from its source (the benchmark's result files, the registry); no page types one of those tables by hand."""
    tables = generated_tables()
    performance, contributing = (DOCS / "performance.md").read_text(), (DOCS / "contributing.md").read_text()
    distributed = (DOCS / "guide" / "distributed.md").read_text()
    on_performance = tables.MARKER.findall(performance)
    assert set(on_performance) == set(tables.RENDERERS) - {"private-names", "support-matrix"}
    assert tables.MARKER.findall(contributing) == ["private-names"]
    assert tables.MARKER.findall(distributed) == ["support-matrix"]
    assert {path.stem for path in tables.RESULTS.glob("*.json")} <= {*on_performance, "support-matrix"}
    generated = {header for name in tables.RENDERERS for header in table_headers(tables.render(name))}
    assert len(generated) >= 6
    for page in PAGES:
        typed = set(table_headers(page.read_text())) & generated
        assert typed == set(), f"{page_name(page)} types a generated table by hand: {typed}"


def test_the_rendered_tables_are_the_committed_results() -> None:
    """The performance tables are drawn from docs/performance/*.json, each stamped with its command, date, machine and
    versions; every row of a result file is a row of its table."""
    tables = generated_tables()
    for name in ("parity", "counts", "opt-levels", "memory"):
        result = tables.load(name)
        assert {"cpu", "cores", "threads", "torch", "lightning", "python"} <= result["machine"].keys(), name
        assert result["command"] == f"python docs/generate.py performance --only {name}"
        rendered = tables.render(name)
        assert tables.stamp(result) in rendered
        rows = [line for line in rendered.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
        expected = len(result["rows"]) if "rows" in result else len(result["counts"])
        assert len(rows) == expected + 1, name  # the header and one row per result
    o2 = next(row for row in tables.load("opt-levels")["counts"] if row["opt_level"] == "O2")
    assert f"| O2 | {o2['precision']} |" in tables.render("opt-levels")


def test_the_private_names_table_is_the_registry() -> None:
    """The contributing page's table is built from lightning_mp/_private_names.py: one row per record, with its
    modules and reason, under a sentence that counts the records and the names they cover."""
    from lightning_mp._private_names import PRIVATE_NAMES

    rendered = generated_tables().render("private-names")
    rows = markdown_table_rows(rendered, "| private name | owner | used in | why |")
    assert rows == [
        [f"`{record.name}`", record.owner, ", ".join(f"`{m}`" for m in record.used_in), record.reason]
        for record in PRIVATE_NAMES
    ]
    owners = [record.owner for record in PRIVATE_NAMES]
    assert f"holds {len(owners)} records ({owners.count('torch')} torch, {owners.count('lightning')} Lightning)" in (
        rendered
    )


@pytest.mark.slow  # counts in a fresh process
def test_the_committed_opt_level_counts_are_what_the_benchmark_counts_today() -> None:
    """Recounting O2 in bf16 gives the committed row, on the versions the file was stamped with: the figures on the
    performance page are measured, not typed (counts are deterministic).

    The recount runs in a fresh process, as ``docs/generate.py`` does: once anything in a process has used
    ``torch.compile``, torch routes a few of the step's calls through its compiler's wrappers, so a count taken
    after the suite's compiled tests would include calls that no fresh training process makes.
    """
    import lightning

    result = generated_tables().load("opt-levels")
    if (result["machine"]["torch"], result["machine"]["lightning"]) != (torch.__version__, lightning.__version__):
        pytest.skip("the committed counts were measured on other torch/Lightning versions")
    committed = next(row for row in result["counts"] if (row["opt_level"], row["precision"]) == ("O2", "bf16-mixed"))
    recount = (
        "import dataclasses, json\n"
        "from lightning_mp.bench.opt_level_counts import count_opt_level\n"
        "print(json.dumps(dataclasses.asdict(count_opt_level('O2', 'bf16-mixed'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", recount], capture_output=True, text=True, timeout=120, check=True)
    recounted = json.loads(done.stdout.strip().splitlines()[-1])
    assert {key: recounted[key] for key in committed} == committed


HISTORY = re.compile(
    r"\bissue \d+|\bprevious (?:O2|version|release)|\bwhat changed\b|\bsince (?:v?\d+\.\d+|issue)"
    r"|\bused to\b|\bthe first release\b|\b(?:target|targets)\b[^.\n]*\b(?:met|missed)\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_no_page_tells_history(page: Path) -> None:
    """History lives in CHANGELOG.md: no page speaks of issues, earlier versions, or targets met or missed."""
    assert HISTORY.findall(page.read_text()) == []


def documented_tags() -> dict[str, set[str]]:
    """The TensorBoard tags the telemetry page lists, by the kind of event TensorBoard files them under."""
    tags: dict[str, set[str]] = {"scalars": set(), "tensors": set(), "histograms": set(), "images": set()}
    for _, tag_cell, _ in markdown_table(DOCS / "guide" / "telemetry.md", "| callback | tag |"):
        kind = "tensors" if "(text)" in tag_cell else "histograms" if "(histogram)" in tag_cell else "scalars"
        kind = "images" if "(image)" in tag_cell else kind
        tags[kind].update(re.findall(r"`([^`]+)`", tag_cell))
    return tags


@pytest.mark.slow  # trains with every monitor
def test_every_tensorboard_tag_the_docs_list_is_what_a_real_run_writes(tmp_path: Path) -> None:
    """A user who looks for a documented tag in TensorBoard finds it under that name, and every written tag is
    listed."""
    logger = TensorBoardLogger(tmp_path)
    callbacks = [
        AdvisorCallback(batches=1),
        LossScaleMonitor(),
        GradientHealthMonitor(),
        LayerDtypeMonitor(),
        PrecisionSentinel(every_n_steps=1),
    ]
    trainer = make_trainer(
        MixedPrecision("16-mixed", init_scale=2.0**8, growth_interval=1),
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        max_steps=3,
    )
    # An overflow at step 1 writes the overflow text; growth_interval=1 grows the scale on the clean steps.
    with pytest.warns(RuntimeWarning, match="first.weight"):
        trainer.fit(TinyRegressor(inject_at=(1,)), loader(batch_size=4))
    written = read_events(logger.log_dir).Tags()
    listed = documented_tags()
    dtype_tag = "precision/layers/<dtype>"
    assert dtype_tag in listed["scalars"]
    per_dtype = {tag for tag in written["scalars"] if re.fullmatch(r"precision/layers/\w+", tag)}
    assert per_dtype, "no precision/layers/<dtype> scalar was written"
    # Lightning's own scalars (epoch) are not the package's.
    ours = {tag for tag in written["scalars"] if tag.startswith("precision")} - per_dtype
    assert ours == listed["scalars"] - {dtype_tag}
    for kind in ("tensors", "histograms", "images"):
        assert set(written[kind]) == listed[kind], kind


def test_the_gallery_shows_every_notebook_and_the_set_up_lines_count_them() -> None:
    """The notebook gallery links each notebook in notebooks/ (rendered on the site from its toctree's glob), each
    notebook is linked from a guide page it illustrates, and the README and Get started say how many CI runs."""
    gallery = DOCS / "notebooks.md"
    on_disk = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "notebooks").glob("*.ipynb"))
    table = markdown_table(gallery, "| notebook |")
    listed = sorted(re.findall(r"\(/(notebooks/[^)]+\.ipynb)\)", " ".join(row[0] for row in table)))
    assert listed == on_disk
    assert re.search(r"^:glob:\n\nnotebooks/\*$", gallery.read_text(), re.MULTILINE)
    guide = " ".join(page.read_text() for page in PAGES if page != gallery)
    assert [notebook for notebook in on_disk if f"(/{notebook})" not in guide] == []
    counts = {3: "three", 4: "four", 5: "five", 6: "six"}
    for page in (README, DOCS / "get-started.md"):
        assert f"executes the {counts[len(on_disk)]} notebooks" in " ".join(page.read_text().split()), page.name


LOSS_SCALER = DOCS / "guide" / "loss-scaler.md"
SETTINGS_TABLE = "| argument | default | allowed | meaning |"


def test_the_setting_table_gives_the_defaults_the_plugin_uses() -> None:
    """Each default in the loss-scaler page's settings table is what MixedPrecision("16-mixed") really uses."""
    plugin = MixedPrecision("16-mixed")
    plugin.setup_for_device("cpu")
    scaler = plugin.scaler
    assert scaler is not None
    effective = {
        "init_scale": scaler.get_scale(),
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
    }
    signature = inspect.signature(MixedPrecision.__init__).parameters
    rows = markdown_table(LOSS_SCALER, SETTINGS_TABLE)
    assert len(rows) == 13
    for argument_cell, default_cell, _, _ in rows:
        argument = argument_cell.strip("`")
        documented = ast.literal_eval(default_cell.strip("`").replace("2**16", "65536").replace("2**24", "16777216"))
        actual = effective.get(argument, signature[argument].default)
        assert documented == actual, argument


def table_number(text: str) -> float:
    """A bound as the setting table writes it: ``2**-24``, ``2147483647``, ``3.4028234663852886e+38``, or the default
    of another setting that bounds this one (``min_scale`` is the floor ``2**-24``, ``max_scale`` its default)."""
    defaults = {"min_scale": 2.0**-24, "max_scale": 2.0**24}
    if text in defaults:
        return defaults[text]
    power = re.fullmatch(r"2\*\*(-?\d+)", text)
    return 2.0 ** int(power.group(1)) if power else ast.literal_eval(text)


def plugin_with(argument: str, value: float) -> MixedPrecision:
    """``MixedPrecision("16-mixed", argument=value)``, with the first scale moved inside a probed ``min_scale`` or
    ``max_scale`` (it must lie in ``[min_scale, max_scale]``)."""
    room = {
        "min_scale": {"init_scale": min(max(value, 2.0**16), 2.0**24)},
        "max_scale": {"init_scale": min(value, 2.0**16)},
    }
    return MixedPrecision("16-mixed", **{argument: value, **room.get(argument, {})})


def test_the_setting_table_gives_the_bounds_the_plugin_enforces() -> None:
    """Each bound in the "allowed" column is exact: the bound is accepted (or refused, if strict) and the next number
    past it is refused with a ValueError that prints the bound as the table does."""
    probes = 0
    for argument_cell, _, allowed_cell, _ in markdown_table(LOSS_SCALER, SETTINGS_TABLE):
        argument = argument_cell.strip("`")
        integer = "an integer" in allowed_cell
        for low, low_op, high_op, high in re.findall(r"`(\S+) (<=?) x (<=?) (\S+)`", allowed_cell):
            bounds = [(low, low_op, -1), (high, high_op, +1)]
            for text, op, outward in bounds:
                bound = table_number(text)
                past = bound + outward if integer else math.nextafter(bound, outward * math.inf)
                inside = bound - outward if integer else math.nextafter(bound, -outward * math.inf)
                accepted, refused = (bound, past) if op == "<=" else (inside, bound)
                plugin_with(argument, int(accepted) if integer else accepted)
                message = rf"{argument}=.* not allowed: .*{re.escape(text) if text[0].isdigit() else ''}"
                with pytest.raises(ValueError, match=message):
                    plugin_with(argument, int(refused) if integer else refused)
                probes += 1
        for op, text in re.findall(r"`x (>) (\S+)`", allowed_cell):
            bound = table_number(text)
            MixedPrecision("16-mixed", **{argument: math.nextafter(bound, math.inf)})
            with pytest.raises(ValueError, match=rf"{argument}=.* must be a finite number {op} {re.escape(text)}"):
                MixedPrecision("16-mixed", **{argument: bound})
            probes += 1
    assert probes == 17


def generate_script() -> Any:
    """``docs/generate.py``, the script that draws the documentation's pictures from a run's TensorBoard events."""
    return docs_script("generate")


@pytest.mark.slow  # trains and draws
def test_the_layer_dtype_picture_is_drawn_from_the_monitors_tensorboard_table(tmp_path: Path) -> None:
    """The telemetry page's dtype grid reads the LayerDtypeMonitor's text event of a real run: under fp16 O1 a linear
    layer shows fp32 parameters and gradients beside an fp16 output, and the picture is a PNG."""
    generate = generate_script()
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = make_trainer(
        MixedPrecision("16-mixed"), callbacks=[LayerDtypeMonitor(every_n_steps=1)], logger=logger, max_steps=2
    )
    trainer.fit(TinyRegressor(), loader())
    events = generate.read_events(Path(logger.log_dir))
    tag = next(tag for tag in events.Tags()["tensors"] if tag.startswith(generate.LAYER_DTYPES))
    rows, columns, cells = generate.layer_dtype_grid(events.Tensors(tag)[-1].tensor_proto.string_val[0].decode())
    assert columns == ["parameters", "output", "gradients"]
    linear_rows = [cell for row, cell in zip(rows, cells, strict=True) if row.endswith("(Linear)")]
    assert linear_rows and all(cell == ["float32", "float16", "float32"] for cell in linear_rows)
    picture = tmp_path / "dtypes.png"
    assert generate.plot_layer_dtypes(events, picture)
    assert picture.read_bytes().startswith(b"\x89PNG")
