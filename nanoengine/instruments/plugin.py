"""How the instruments reach every engine core: one plugin, named in the package metadata.

Chapter 5 (engine skeleton). ``EngineCore.__init__`` ends by calling each engine
core plugin (``nanoengine/plugins/``) with itself; ``pyproject.toml`` names
``attach_to_engine_core`` below as the plugin ``instruments``. It runs wherever
a core is built: in this process for ``LLM(...)``, in the core's own process for
``multiprocess_mode=True`` and ``nanoengine serve`` (chapter 8). There it

* attaches the step tracer when the engine was built with ``trace=True``
  (chapters 3-4; ``llm.trace`` reads it through ``trace_of``);
* attaches the invariant checks when built with ``check_invariants=True``
  (every engine test turns them on);
* adds utility calls a client in another process may make
  (``EngineCoreProc``'s ``UTILITY_EXTENSIONS``): ``component_tree`` (the core's
  tree, for ``print(llm)`` across the process boundary), ``watch_finished`` and
  ``recently_finished`` (which requests ended, and how: chapter 8 shows a
  client hanging up), ``watch_kv_transfers`` and ``kv_transfer_journal``
  (what the engine did for requests that crossed engines: chapter 10),
  ``live_view_frames`` and ``live_view_control`` (the browser's live view of
  chapters 3-5 and 9: frames since a step, and pause / resume / step).

Each import happens only when its instrument is wanted, so a core with
nothing switched on pays for this module and nothing else.

vLLM 0.32 counterpart: none; a vLLM plugin is registered the same way
(``vllm.general_plugins`` entry points), with other contents.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoengine.engine.core import EngineCore
    from nanoengine.instruments.kv_transfer_journal import KVTransferJournal
    from nanoengine.instruments.live_view.feed import LiveFeed
    from nanoengine.request import Request

# How many ended requests ``recently_finished`` remembers per core.
RECENTLY_FINISHED_LEN = 32
# core -> (request id, FINISHED_* status) of its last requests to end, oldest first.
_FINISHED: weakref.WeakKeyDictionary[EngineCore, deque[tuple[str, str]]] = weakref.WeakKeyDictionary()
# core -> its KV transfer journal, once ``watch_kv_transfers`` was called.
_JOURNALS: weakref.WeakKeyDictionary[EngineCore, KVTransferJournal] = weakref.WeakKeyDictionary()
# core -> its live feed, once a page asked for frames.
_FEEDS: weakref.WeakKeyDictionary[EngineCore, LiveFeed] = weakref.WeakKeyDictionary()


def attach_to_engine_core(core: EngineCore) -> None:
    """The plugin: switch on what the core's configuration asks for; offer the utilities."""
    observability = core.engine_config.observability_config
    if observability.trace:
        from nanoengine.instruments.trace import record_steps_of

        record_steps_of(core)
    if observability.check_invariants:
        from nanoengine.instruments.invariants import check_invariants_after_each_update

        check_invariants_after_each_update(core.scheduler)
    from nanoengine.engine.core_proc import UTILITY_EXTENSIONS

    UTILITY_EXTENSIONS.update(
        component_tree=component_tree,
        watch_finished=watch_finished,
        recently_finished=recently_finished,
        watch_kv_transfers=watch_kv_transfers,
        kv_transfer_journal=kv_transfer_journal,
        live_view_frames=live_view_frames,
        live_view_control=live_view_control,
    )


def component_tree(core: EngineCore) -> dict[str, Any]:
    """The core's component tree as plain data, built in the core's process."""
    from nanoengine.instruments.component_tree import build_component_tree

    return build_component_tree(core).to_dict()


def watch_finished(core: EngineCore) -> None:
    """Start remembering which requests end, and how (a second call changes nothing)."""
    if core in _FINISHED:
        return
    from nanoengine.instruments.method_taps import tap

    ended = _FINISHED[core] = deque(maxlen=RECENTLY_FINISHED_LEN)

    def note(_: None, request: Request) -> None:
        ended.append((request.request_id, request.status.name))

    tap(core.scheduler, "_free_request", after=note)


def recently_finished(core: EngineCore) -> list[tuple[str, str]]:
    """(request id, FINISHED_* status) of the last requests to end since ``watch_finished``."""
    return list(_FINISHED.get(core, ()))


def watch_kv_transfers(core: EngineCore) -> None:
    """Start the KV transfer journal of this core (a second call changes nothing)."""
    if core not in _JOURNALS:
        from nanoengine.instruments.kv_transfer_journal import KVTransferJournal

        _JOURNALS[core] = KVTransferJournal.attach(core.scheduler)


def kv_transfer_journal(core: EngineCore) -> list[tuple[float, int, str, str, int]]:
    """(monotonic time, step, request id, what, KV blocks in use) for each moment since ``watch_kv_transfers``."""
    journal = _JOURNALS.get(core)
    return [] if journal is None else journal.as_rows()


def live_feed(core: EngineCore) -> LiveFeed:
    """The core's live feed, attached at the first call (the first page to connect)."""
    feed = _FEEDS.get(core)
    if feed is None:
        from nanoengine.instruments.live_view.feed import LiveFeed

        feed = _FEEDS[core] = LiveFeed(core)
    return feed


def live_view_frames(core: EngineCore, after_step: int) -> dict[str, Any]:
    """The pool's shape, the frames of the steps after ``after_step``, and the gate's state."""
    from nanoengine.instruments.live_view.app import read_feed

    return read_feed(live_feed(core), after_step)


def live_view_control(core: EngineCore, action: str) -> dict[str, Any]:
    """"pause", "resume" or "step"; the gate's state after it."""
    return live_feed(core).control(action)
