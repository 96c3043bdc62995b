"""Graded exercises: which function of the reference code each one removes, and its stub.

An exercise id such as ``4.1`` ties four things together:

* one function or method of the reference code, named in ``EXERCISE_TARGETS``
  below by its module and qualified name (``async def`` too: exercise 8.2 is a
  coroutine method). The engine's sources carry nothing for the exercises;
  their docstrings describe the code, the task is on the docs page;
* the student stub ``chapters/exercises/ex4_1.py``, written by
  ``scripts/make_exercises.py``: same signature and docstring, body replaced by
  ``raise NotImplementedError``;
* the pytest marker ``exercise_4_1`` on its grading test (tests/test_exercises.py);
* the docs page ``docs/exercises/4.1.md`` (task, hints, what the grader checks).

Adding an exercise means adding a line here, a page and its checks in
``chapters/grade_checks/``. No line number is stored anywhere: every location
is found again in the current source, by name, as the docs do for
``{{ code("nanoengine.engine.core.EngineCore.step") }}``.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
EXERCISES_DIR = Path(__file__).resolve().parent
# Each exercise and the function (or method) it asks for: "module:qualified name".
EXERCISE_TARGETS: dict[str, str] = {
    "1.1": "chapters.ex01_engine_by_hand:run_to_completion",
    "2.1": "nanoengine.model_executor.layers.quantization.gguf_blocks:dequantize",
    "3.1": "nanoengine.core.sched.step_plan:StepPlan.add",
    "3.2": "nanoengine.core.sched.utils:select_preemption_victim",
    "4.1": "nanoengine.core.kv_cache_manager:KVCacheManager.allocate_slots",
    "4.2": "nanoengine.core.kv_cache_utils:hash_block_tokens",
    "4.3": "nanoengine.core.kv_cache_utils:FreeKVCacheBlockQueue.remove",
    "4.4": "nanoengine.core.kv_cache_coordinator:KVCacheCoordinator.get_num_blocks_to_allocate",
    "4.5": "nanoengine.core.kv_cache_groups:align_hybrid_block_size",
    "4.6": "nanoengine.core.single_type_kv_cache_manager:SingleTypeKVCacheManager.remove_skipped_blocks",
    "5.1": "nanoengine.request:RequestStatus.is_finished",
    "5.2": "nanoengine.core.sched.scheduler:Scheduler._handle_blocked_waiting_request",
    "6.1": "nanoengine.core.kv_cache_sizing:num_blocks_from_budget",
    "6.2": "nanoengine.model_executor.layers.linear:QKVParallelLinear.weight_loader",
    "7.1": "nanoengine.worker.input_batch:compute_slot_mapping",
    "8.1": "nanoengine.engine.core_client:SyncMPClient.get_output",
    "8.2": "nanoengine.engine.async_llm:AsyncLLM._run_output_handler",
    "9.1": "nanoengine.sample.rejection_sampler:_verify_greedy",
    "10.1": "nanoengine.distributed.kv_transfer.zmq.scheduler:ZmqConnectorScheduler.update_state_after_alloc",
}
# A marked definition: a plain function or method, or a coroutine one (``async def``).
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Exercise:
    """One exercise as the markers define it (``qualname`` is ``Class.method`` for methods)."""

    exercise_id: str  # "4.1"
    path: Path  # the reference source file
    module: str  # "nanoengine.core.kv_cache_manager"
    qualname: str  # "KVCacheManager.allocate_slots"
    node: FunctionNode  # the marked definition, parsed from the current source

    @property
    def slug(self) -> str:
        """``4_1``: the id as it appears in module names and pytest markers."""
        return self.exercise_id.replace(".", "_")

    @property
    def stub_module(self) -> str:
        return f"chapters.exercises.ex{self.slug}"

    @property
    def stub_path(self) -> Path:
        return EXERCISES_DIR / f"ex{self.slug}.py"

    @property
    def marker(self) -> str:
        return f"exercise_{self.slug}"

    @property
    def docs_page(self) -> str:
        """Where the task is explained, relative to the repository root."""
        return f"docs/exercises/{self.exercise_id}.md"

    @property
    def function_name(self) -> str:
        return self.qualname.rpartition(".")[2]

    @property
    def class_name(self) -> str | None:
        owner = self.qualname.rpartition(".")[0]
        return owner or None


def module_file(module: str) -> Path:
    """The source file of a module of this repository (a package: its ``__init__.py``)."""
    base = REPO_ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise ValueError(f"no module {module!r} under {REPO_ROOT}")


def _definitions(tree: ast.Module) -> list[tuple[str, FunctionNode]]:
    """Every function and method (``async def`` included) with its qualified name (classes may nest)."""
    found: list[tuple[str, FunctionNode]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((prefix + node.name, node))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return found


def _exercise(exercise_id: str, target: str) -> Exercise:
    """The exercise whose target is ``"module:qualname"``, parsed from the current source."""
    module, _, qualname = target.partition(":")
    path = module_file(module)
    definitions = dict(_definitions(ast.parse(path.read_text(encoding="utf-8"), str(path))))
    if qualname not in definitions:
        raise ValueError(f"exercise {exercise_id}: {path.relative_to(REPO_ROOT)} defines no function {qualname!r}.")
    return Exercise(exercise_id, path, module, qualname, definitions[qualname])


def find_exercises() -> dict[str, Exercise]:
    """Every exercise, by id, in id order, found by name in today's source."""
    ordered = sorted(EXERCISE_TARGETS.items(), key=lambda item: tuple(map(int, item[0].split("."))))
    return {exercise_id: _exercise(exercise_id, target) for exercise_id, target in ordered}
