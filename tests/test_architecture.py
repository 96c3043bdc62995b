"""Architecture rules: nanoengine's imports point downwards.

The layers are ``entrypoints -> engine -> core``, with the executor, worker, model and
attention code below the engine on the device side. A layer may import the layers under
it, never the ones above: the worker and the model code never call up into the engine,
and ``nanoengine/core`` (scheduler, KV cache manager, block pool) is pure bookkeeping
that chapters 3 and 4 run and test without torch, numpy or a model. README.md,
docs/index.md and ``nanoengine/core/__init__.py`` state these rules; nothing else enforces
them, and one convenient import is all it takes to break them. Checked here:

1. ``nanoengine/core`` imports no torch, no numpy and no worker/model code, transitively
   over nanoengine's own modules (a helper that imports torch is as bad as importing it).
2. Nothing in ``nanoengine/`` imports ``chapters``: the walkthroughs import the engine,
   never the reverse.
3. ``nanoengine/worker``, ``nanoengine/model_executor`` and ``nanoengine/attention`` never
   import the engine layer (``nanoengine.engine``, ``nanoengine.entrypoints``).
4. The teaching instruments (``nanoengine/instruments``: tracer, timers, memory report,
   invariants, component tree, taps) attach from outside: no engine module imports them.
   The one exception is the offline facade ``LLM`` (``nanoengine/entrypoints/llm.py``),
   where a learner's ``print(llm)`` and ``llm.trace`` meet them; the engine core reaches
   them only through the plugin entry point (``nanoengine/plugins``), which names no
   module. And ``rich`` (tables, trees) is imported by the instruments alone, so
   ``nanoengine/core`` in particular never loads it.

The checker reads the sources with ``ast`` and imports nothing it checks: importing would
only tell what one code path loaded, and would pay for torch to find out. Each rule has a
self-test that feeds it a small synthetic package and expects a violation, so a checker
that can no longer fail shows up as a failing test.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT_PACKAGE = "nanoengine"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / ROOT_PACKAGE

CORE = "nanoengine.core"
# Device-side and model-side code: it needs torch, so core must not reach it.
WORKER_AND_MODEL_CODE = (
    "nanoengine.worker",
    "nanoengine.model_executor",
    "nanoengine.attention",
    "nanoengine.sample",
    "nanoengine.executor",
    "nanoengine._custom_ops",
)
CORE_FORBIDDEN = ("torch", "numpy", "rich", *WORKER_AND_MODEL_CODE)
ENGINE_LAYER = ("nanoengine.engine", "nanoengine.entrypoints")
WORKER = "nanoengine.worker"
BELOW_THE_ENGINE = (WORKER, "nanoengine.model_executor", "nanoengine.attention")
INSTRUMENTS = "nanoengine.instruments"
# Where the instruments meet the engine from outside (see rule 4).
INSTRUMENT_USERS = ("nanoengine.entrypoints.llm",)


@dataclass(frozen=True)
class SourceModule:
    name: str
    is_package: bool  # an __init__.py: relative imports resolve against the module itself
    source: str
    path: str  # for messages only


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # an absolute dotted module name
    line: int
    type_checking_only: bool  # under ``if TYPE_CHECKING:``: never runs


@dataclass(frozen=True)
class Violation:
    module: SourceModule
    imp: Import
    via: tuple[str, ...]  # the import chain from a checked module to ``module``

    def __str__(self) -> str:
        where = f"{self.module.path}:{self.imp.line} ({self.module.name}) imports {self.imp.target!r}"
        if len(self.via) > 1:
            where += f", reached via {' -> '.join(self.via)}"
        return where


def in_package(name: str, packages: Iterable[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def module_name_for(path: Path, package_dir: Path) -> str:
    relative = path.relative_to(package_dir.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def load_package(package_dir: Path) -> dict[str, SourceModule]:
    modules: dict[str, SourceModule] = {}
    for path in sorted(package_dir.rglob("*.py")):
        name = module_name_for(path, package_dir)
        modules[name] = SourceModule(
            name=name,
            is_package=path.name == "__init__.py",
            source=path.read_text(encoding="utf-8"),
            path=str(path.relative_to(package_dir.parent)),
        )
    return modules


def synthetic_package(sources: Mapping[str, str]) -> dict[str, SourceModule]:
    """Modules from source text; a name ending in ``.__init__`` is a package."""
    modules: dict[str, SourceModule] = {}
    for raw_name, source in sources.items():
        is_package = raw_name.endswith(".__init__")
        name = raw_name.removesuffix(".__init__")
        modules[name] = SourceModule(name, is_package, source, f"<synthetic {raw_name}>")
    return modules


def is_type_checking_guard(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def resolve_relative(module: SourceModule, level: int, name: str | None) -> str:
    package_parts = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if level > len(package_parts):
        raise ValueError(f"{module.path}: relative import of level {level} goes above the top package")
    base = package_parts[: len(package_parts) - (level - 1)]
    return ".".join([*base, name] if name else base)


class _ImportCollector(ast.NodeVisitor):
    # Walks the whole tree, function bodies included: an import inside a function runs
    # the first time it is called, which is as real as an import at the top.
    def __init__(self, module: SourceModule, known_modules: Collection[str]) -> None:
        self.module = module
        self.known_modules = known_modules
        self.imports: list[Import] = []
        self._type_checking_depth = 0

    def _add(self, target: str, line: int) -> None:
        self.imports.append(Import(self.module.name, target, line, self._type_checking_depth > 0))

    def visit_If(self, node: ast.If) -> None:
        if not is_type_checking_guard(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._type_checking_depth += 1
        for statement in node.body:
            self.visit(statement)
        self._type_checking_depth -= 1
        for statement in node.orelse:  # the else branch of ``if TYPE_CHECKING`` is what runs
            self.visit(statement)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = resolve_relative(self.module, node.level, node.module) if node.level else node.module or ""
        self._add(base, node.lineno)
        # ``from pkg import name`` loads the submodule pkg.name when there is one.
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in self.known_modules:
                self._add(submodule, node.lineno)


def collect_imports(module: SourceModule, known_modules: Collection[str]) -> list[Import]:
    collector = _ImportCollector(module, known_modules)
    collector.visit(ast.parse(module.source, filename=module.path))
    return collector.imports


def modules_run_by(target: str, known_modules: Collection[str]) -> list[str]:
    """The project's modules that importing ``target`` executes: every package on the way
    down, then the module itself.

    The top-level ``nanoengine/__init__.py`` is left out on purpose: it imports ``LLM``
    and with it the whole engine, to offer the public API. Counting it would make every
    module reach everything and every rule meaningless; importing a submodule is what the
    code does, and the rules are about what those submodules pull in.
    """
    parts = target.split(".")
    run = [".".join(parts[:depth]) for depth in range(2, len(parts) + 1)]
    return [name for name in run if name in known_modules]


class ImportGraph:
    def __init__(self, modules: Mapping[str, SourceModule]) -> None:
        self.modules = dict(modules)
        self.imports = {name: collect_imports(module, self.modules) for name, module in self.modules.items()}

    def under(self, package: str) -> list[str]:
        return sorted(name for name in self.modules if in_package(name, [package]))

    def _counted(self, name: str, count_type_checking: bool) -> list[Import]:
        return [imp for imp in self.imports[name] if count_type_checking or not imp.type_checking_only]

    def reachable(
        self, roots: Iterable[str], count_type_checking: bool, stop_at: Sequence[str] = ()
    ) -> dict[str, tuple[str, ...]]:
        """Every project module the roots load, each with the import chain that first reaches it.

        Modules in ``stop_at`` are not entered: the import that reaches one is the
        violation, and what that module imports in turn would only bury it in noise.
        """
        chains: dict[str, tuple[str, ...]] = {root: (root,) for root in roots}
        queue = deque(chains)
        while queue:
            name = queue.popleft()
            for imp in self._counted(name, count_type_checking):
                for reached in modules_run_by(imp.target, self.modules):
                    if reached not in chains and not in_package(reached, stop_at):
                        chains[reached] = (*chains[name], reached)
                        queue.append(reached)
        return chains

    def violations(
        self,
        roots: Sequence[str],
        forbidden: Sequence[str],
        *,
        transitive: bool,
        count_type_checking: bool,
    ) -> list[Violation]:
        checked = (
            self.reachable(roots, count_type_checking, stop_at=forbidden)
            if transitive
            else {root: (root,) for root in roots}
        )
        return [
            Violation(self.modules[name], imp, via)
            for name, via in checked.items()
            for imp in self._counted(name, count_type_checking)
            if in_package(imp.target, forbidden)
        ]


def report(rule: str, violations: Sequence[Violation]) -> str:
    return f"{rule} is broken:\n" + "\n".join(f"  {violation}" for violation in violations)


# -- the rules, shared by the real tree and the self-tests ---------------------------


def core_purity_violations(graph: ImportGraph) -> list[Violation]:
    # Imports under ``if TYPE_CHECKING:`` never run, so they cost core nothing.
    return graph.violations(graph.under(CORE), CORE_FORBIDDEN, transitive=True, count_type_checking=False)


def chapters_violations(graph: ImportGraph) -> list[Violation]:
    # Even an annotation-only import of the walkthroughs has no reason to exist.
    return graph.violations(sorted(graph.modules), ["chapters"], transitive=False, count_type_checking=True)


def engine_layer_violations(graph: ImportGraph, package: str) -> list[Violation]:
    """The worker is checked on its own imports, the model and attention code transitively.

    The worker cannot be checked transitively: it reaches ``nanoengine.engine`` today, and
    legitimately, along ``worker.model_runner -> distributed.kv_transfer -> request`` (the
    KV connector's shared metadata takes ``BlockHash`` from ``nanoengine/request.py``; the
    worker's ``core.sched.output`` import leads there too), and ``nanoengine/request.py``
    imports the engine <-> core message types (``EngineCoreRequest``, ``EngineCoreEvent``,
    ``FinishReason``) that live in ``nanoengine/engine/__init__.py``, as they do in vLLM's
    ``vllm/v1/engine/__init__.py``.
    That package is shared vocabulary, not engine logic, so for the worker the rule is
    about what its own modules import. The model and attention code need none of it, so
    for them nothing they load may reach the engine layer either.

    TYPE_CHECKING imports count (and are followed): code that needs the engine's types to
    describe itself already knows too much about the layer above.
    """
    transitive = package != WORKER
    return graph.violations(
        graph.under(package), ENGINE_LAYER, transitive=transitive, count_type_checking=True
    )


def instruments_violations(graph: ImportGraph) -> list[Violation]:
    """Direct imports of the instruments (or of rich) by engine modules; annotations count."""
    engine_modules = [
        name for name in graph.modules if not in_package(name, [INSTRUMENTS, *INSTRUMENT_USERS])
    ]
    return graph.violations(engine_modules, [INSTRUMENTS, "rich"], transitive=False, count_type_checking=True)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(load_package(PACKAGE_DIR))


# -- the real tree ------------------------------------------------------------------


def test_core_imports_no_torch_numpy_or_device_code(graph: ImportGraph) -> None:
    # Enough files that a wrong path or glob cannot pass this by finding nothing.
    assert len(graph.under(CORE)) >= 10, f"found only {graph.under(CORE)} under {PACKAGE_DIR / 'core'}"
    violations = core_purity_violations(graph)
    assert not violations, report(
        "nanoengine/core must not reach torch, numpy or worker/model code", violations
    )


def test_nanoengine_never_imports_chapters(graph: ImportGraph) -> None:
    assert len(graph.modules) >= 50, f"found only {len(graph.modules)} modules under {PACKAGE_DIR}"
    violations = chapters_violations(graph)
    assert not violations, report("nanoengine must not import chapters", violations)


@pytest.mark.parametrize(("package", "min_modules"), [(p, 5) for p in BELOW_THE_ENGINE])
def test_device_side_never_imports_engine_layer(graph: ImportGraph, package: str, min_modules: int) -> None:
    modules = graph.under(package)
    assert len(modules) >= min_modules, f"found only {modules} for {package}"
    violations = engine_layer_violations(graph, package)
    assert not violations, report(f"{package} must not import the engine layer", violations)


def test_engine_never_imports_the_instruments_or_rich(graph: ImportGraph) -> None:
    assert len(graph.under(INSTRUMENTS)) >= 10, f"found only {graph.under(INSTRUMENTS)}"
    violations = instruments_violations(graph)
    assert not violations, report("only the instruments (and the LLM facade) may import them", violations)


# -- the checker can fail -------------------------------------------------------------


def test_instruments_rule_reports_an_engine_import() -> None:
    graph = ImportGraph(
        synthetic_package(
            {
                "nanoengine.instruments.__init__": "import rich\n",
                "nanoengine.instruments.trace": "from nanoengine.core import scheduler\n",
                "nanoengine.core.__init__": "",
                "nanoengine.core.scheduler": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rich\n",
                "nanoengine.engine.core": "def attach():\n    from nanoengine.instruments import trace\n",
                "nanoengine.entrypoints.llm": "from nanoengine.instruments import trace\n",
            }
        )
    )
    assert sorted((v.module.name, v.imp.target) for v in instruments_violations(graph)) == [
        ("nanoengine.core.scheduler", "rich"),
        ("nanoengine.engine.core", "nanoengine.instruments"),
        ("nanoengine.engine.core", "nanoengine.instruments.trace"),
    ]


def test_core_rule_reports_a_transitive_torch_import() -> None:
    # core -> (relative, from-package-import-submodule) helpers.gpu -> torch, inside a function.
    graph = ImportGraph(
        synthetic_package(
            {
                "nanoengine.core.__init__": "",
                "nanoengine.core.blocks": "from ..helpers import gpu\n",
                "nanoengine.helpers.__init__": "",
                "nanoengine.helpers.gpu": "def to_device():\n    import torch\n",
                "nanoengine.typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n",
                "nanoengine.core.annotated": "import nanoengine.typed\n",
            }
        )
    )
    violations = core_purity_violations(graph)
    assert [(v.module.name, v.imp.target, v.via) for v in violations] == [
        ("nanoengine.helpers.gpu", "torch", ("nanoengine.core.blocks", "nanoengine.helpers.gpu"))
    ]
    assert "nanoengine.core.blocks -> nanoengine.helpers.gpu" in report("core", violations)


def test_chapters_rule_reports_a_nested_import() -> None:
    graph = ImportGraph(
        synthetic_package(
            {
                "nanoengine.__init__": "",
                "nanoengine.engine.__init__": "",
                "nanoengine.engine.core": (
                    "from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from chapters import _common\n"
                    "class C:\n    def run(self):\n        import chapters.ch03_scheduler as ch\n"
                ),
            }
        )
    )
    violations = chapters_violations(graph)
    assert [(v.module.name, v.imp.target, v.imp.line) for v in violations] == [
        ("nanoengine.engine.core", "chapters", 3),
        ("nanoengine.engine.core", "chapters.ch03_scheduler", 6),
    ]


def test_engine_layer_rule_reports_a_worker_import() -> None:
    graph = ImportGraph(
        synthetic_package(
            {
                "nanoengine.engine.__init__": "",
                "nanoengine.engine.core": "",
                "nanoengine.worker.__init__": "",
                "nanoengine.worker.runner": "from nanoengine.engine import core\n",
                # Indirect: allowed for the worker, not for the model code.
                "nanoengine.worker.ok": "import nanoengine.request\n",
                "nanoengine.request": "from nanoengine.engine import EngineCoreRequest\n",
                "nanoengine.model_executor.__init__": "",
                "nanoengine.model_executor.llama": "from nanoengine import request\n",
            }
        )
    )
    worker = engine_layer_violations(graph, "nanoengine.worker")
    assert {(v.module.name, v.imp.target) for v in worker} == {
        ("nanoengine.worker.runner", "nanoengine.engine"),
        ("nanoengine.worker.runner", "nanoengine.engine.core"),
    }
    model = engine_layer_violations(graph, "nanoengine.model_executor")
    assert [(v.module.name, v.imp.target, v.via) for v in model] == [
        ("nanoengine.request", "nanoengine.engine", ("nanoengine.model_executor.llama", "nanoengine.request"))
    ]
