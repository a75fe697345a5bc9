"""``fp8/`` hangs below the plugin: it imports only itself and the core, no import circle passes through it, and the
plugin reaches it through its mode and its settings only. Read from the source, as Python would import it."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import lightning_mp

PACKAGE = Path(lightning_mp.__file__).parent
FP8 = "lightning_mp.fp8"
CORE = {
    "lightning_mp._compat",
    "lightning_mp._private_names",
    "lightning_mp.arguments",
    "lightning_mp.errors",
    "lightning_mp.front_ends",
    "lightning_mp.measuring",
    "lightning_mp.overrides",
    "lightning_mp.policies",
    "lightning_mp.scaling",
}
"""What ``fp8/`` may build on: packages and modules that import neither the plugin nor anything above it."""
PLUGIN_INTERFACE = {"lightning_mp.fp8.mode", "lightning_mp.fp8.settings"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imported(module: str) -> Iterator[tuple[str, int]]:
    """The package's modules that ``module`` imports, at its top and inside its functions, with the line."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [str(node.args[0].value)]
        for name in names:
            if name.startswith("lightning_mp.") and _resolve(name) != module:
                yield _resolve(name), node.lineno


def _graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: those it names, and the packages above them (their ``__init__``),
    short of the root package, which every import runs first."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        for target, _ in _imported(module):
            graph[module].add(target)
            parent = target.rpartition(".")[0]
            while parent.count(".") >= 1:
                if not module.startswith(parent + "."):
                    graph[module].add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(component)
    return circles


def _within(name: str, packages: set[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def test_fp8_imports_only_itself_and_the_core() -> None:
    """No module of lightning_mp.fp8 imports the plugin, the callbacks, the advisor or anything else above it, not
    even inside a function: FP8 builds on the core."""
    upward = [
        f"{module}:{line} imports {target}"
        for module in MODULES
        if _within(module, {FP8})
        for target, line in _imported(module)
        if not _within(target, CORE | {FP8})
    ]
    assert upward == []


def test_no_import_circle_passes_through_fp8() -> None:
    """Importing any module of lightning_mp.fp8 never comes back to it: no import circle holds an FP8 module."""
    circles = [sorted(circle) for circle in _circles(_graph()) if any(_within(module, {FP8}) for module in circle)]
    assert circles == []


def test_the_checker_finds_a_circle_and_an_upward_import() -> None:
    """The two checks above can fail: a circle of three modules is found, and a plugin import is upward."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert not _within("lightning_mp.plugin.mixed_precision", CORE | {FP8})


def test_the_plugin_reaches_fp8_through_its_mode_and_settings_only() -> None:
    """The plugin's modules import FP8's mode and settings, and no other module of lightning_mp.fp8."""
    reached = {
        target
        for module in MODULES
        if _within(module, {"lightning_mp.plugin"})
        for target, _ in _imported(module)
        if _within(target, {FP8})
    }
    assert reached == PLUGIN_INTERFACE


def test_fp8_monitor_imports_with_the_other_callbacks_without_torchao() -> None:
    """`from lightning_mp import FP8Monitor` works where torchao is not installed, as the other callbacks do, and
    lightning_mp.callbacks and lightning_mp.fp8 give the same class; nothing imports torchao before FP8 runs."""
    script = textwrap.dedent(
        """
        import sys

        class NoTorchao:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "torchao":
                    raise ModuleNotFoundError("No module named 'torchao'", name="torchao")

        sys.meta_path.insert(0, NoTorchao())
        from lightning_mp import FP8Monitor, LossScaleMonitor, MixedPrecision
        from lightning_mp.callbacks import FP8Monitor as FromCallbacks
        from lightning_mp.fp8 import FP8Monitor as FromFp8

        assert FP8Monitor is FromCallbacks is FromFp8
        FP8Monitor(every_n_steps=10), LossScaleMonitor()
        assert not any(name.startswith("torchao") for name in sys.modules)
        print("imported")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"
