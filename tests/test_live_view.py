"""The live view (nanoengine/instruments/live_view/): frames against the engine, the step gate,
trace files, and the page in headless Chromium, offline and on ``nanoengine serve``.

Every number the page shows is checked against the engine's own at the same
step: blocks free / cached / held (walked off the block pool here, not taken
from the frame's code), requests per state (the scheduler's requests),
tokens scheduled (the ``SchedulerOutput`` of that step). A single-step click
must advance exactly one ``EngineCore.step()``; a prefix hit and a preemption
must show on the page at the step the tracer says they happened.
Screenshots of the live page and of a replay are written to
``$NANOENGINE_ARTIFACTS`` (default: pytest's temporary folder) for review.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser_helpers import Browser, serving_folder, wait_for_js
from engine_helpers import add, make_engine, prompt_ids
from server_helpers import API_KEY, running_server

from nanoengine import LLM, SamplingParams
from nanoengine.engine.core import EngineCore
from nanoengine.instruments.live_view.feed import StepGate
from nanoengine.instruments.live_view.frames import check_trace_document, trace_document
from nanoengine.instruments.live_view.offline import record_frames, save_trace
from nanoengine.instruments.method_taps import tap

BLOCKS = 14  # 13 usable blocks of 16 tokens: three long prompts must preempt
ENGINE_ARGS: dict[str, Any] = {"num_gpu_blocks_override": BLOCKS, "max_model_len": 128,
                               "max_num_batched_tokens": 48, "enable_prefix_caching": True, "dtype": "float32"}
SHARED_PREFIX = prompt_ids(48, start=7)


def engine_numbers(core: EngineCore) -> dict[str, Any]:
    """What the engine itself holds right now, counted block by block."""
    pool = core.scheduler.kv_cache_manager.block_pool
    usable = [block for block in pool.blocks if block is not pool.null_block]
    held = sum(1 for block in usable if block.ref_cnt > 0)
    cached = sum(1 for block in usable if block.ref_cnt == 0 and block.block_hash is not None)
    return {"free": len(usable) - held - cached, "cached": cached, "held": held,
            "states": Counter(request.status.name for request in core.scheduler.requests.values())}


def scheduled_tokens_per_step(core: EngineCore) -> list[int]:
    """Tokens each ``schedule()`` handed out, from its SchedulerOutput, in step order."""
    counts: list[int] = []
    tap(core.scheduler, "schedule", after=lambda output: counts.append(output.total_num_scheduled_tokens))
    return counts


def add_workload(engine: Any, step: int) -> None:
    """Arrivals by step: a shared prefix twice (the second hits), then long prompts (preemption)."""
    arrivals = {0: [("a", SHARED_PREFIX + [300, 301])], 3: [("b", SHARED_PREFIX + [302, 303, 304])],
                4: [("c", prompt_ids(60, start=20)), ("d", prompt_ids(60, start=90))]}
    for request_id, prompt in arrivals.get(step, []):
        add(engine, request_id, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))


def test_each_frame_matches_the_engine_at_its_step(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama, **ENGINE_ARGS)
    core = engine.engine_core.get_engine_core()
    scheduled = scheduled_tokens_per_step(core)
    with record_frames(core) as feed:
        step = 0
        while step == 0 or engine.has_unfinished_requests():
            add_workload(engine, step)
            engine.step()
            frame = feed.frames[-1]
            expected = engine_numbers(core)
            assert {k: frame["counts"][k] for k in ("free", "cached", "held")} == \
                {k: expected[k] for k in ("free", "cached", "held")}, f"step {frame['step']}"
            live_states = {s: n for s, n in frame["counts"]["states"].items()
                           if n and not s.startswith("FINISHED")}
            assert live_states == dict(expected["states"]), f"step {frame['step']}"
            assert sum(c["num_tokens"] for c in frame["scheduled"]) == scheduled[frame["step"]]
            step += 1
    frames = list(feed.frames)
    assert [f["step"] for f in frames] == list(range(len(frames)))
    assert frames[-1]["counts"]["states"]["FINISHED_LENGTH_CAPPED"] == 4
    assert any(f["preemptions"] for f in frames), "the workload must preempt"
    hit = next(c for f in frames for c in f["scheduled"] if c["request_id"] == "b" and c["num_cached_tokens"])
    assert hit["num_cached_tokens"] == 48  # three full blocks of a's prompt
    # A frame is plain JSON, and a trace of frames passes the viewer's checks.
    assert check_trace_document(json.loads(json.dumps(trace_document(frames, {})))) == frames


@pytest.mark.parametrize(("document", "message"), [
    ({"format": "something-else", "version": 1, "frames": [{}]}, "not a nanoengine step trace"),
    ({"format": "nanoengine-step-trace", "version": 99, "frames": [{}]}, "trace version 99"),
    ({"format": "nanoengine-step-trace", "version": 1, "frames": []}, "no frames"),
    ({"format": "nanoengine-step-trace", "version": 1, "frames": [{"step": 0}]}, "frame 0 lacks blocks"),
])
def test_a_bad_trace_is_refused_saying_why(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_trace_document(document)


def test_the_gate_lets_exactly_one_step_through_per_click(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama, **ENGINE_ARGS)
    core = engine.engine_core.get_engine_core()
    gate = StepGate(core)
    gate.control("pause")
    add(engine, "a", prompt_ids(20))
    assert engine.step() == [] and core.scheduler.requests["a"].num_computed_tokens == 0
    gate.control("step")
    engine.step()
    assert core.scheduler.requests["a"].num_computed_tokens == 20 and gate.steps_taken == 1
    engine.step()  # no credit left: nothing moves
    assert core.scheduler.requests["a"].num_output_tokens == 1
    with pytest.raises(ValueError, match="unknown action 'jump'"):
        gate.control("jump")
    gate.control("resume")
    while engine.has_unfinished_requests():
        engine.step()
    assert gate.steps_taken > 2


def test_a_forgotten_pause_ends_by_itself(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama, **ENGINE_ARGS)
    gate = StepGate(engine.engine_core.get_engine_core(), max_pause_s=0.2)
    gate.control("pause")
    add(engine, "a", prompt_ids(20))
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    assert not engine.has_unfinished_requests() and not gate.paused


# ---------------------------------------------------------------- in the browser
def artefacts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("NANOENGINE_ARTIFACTS") or tmp_path_factory.mktemp("live-view-artefacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


PAGE_NUMBERS_JS = """(() => { const root = document.querySelector('.ne-view');
  const k = key => { const e = root.querySelector(`[data-k="${key}"]`); return e ? e.textContent : null; };
  const states = {}; root.querySelectorAll('[data-state]').forEach(e => { states[e.dataset.state] = Number(e.textContent); });
  return {step: Number(root.dataset.step), free: Number(k('free')), cached: Number(k('cached')),
          held: Number(k('held')), scheduled: Number(k('scheduled')), states,
          preemptions: root.querySelectorAll('[data-k=preemption]').length,
          hits: root.querySelectorAll('[data-k=hit]').length,
          paused: root.dataset.paused, cells: root.querySelectorAll('[data-block]').length}; })()"""


@pytest.fixture(scope="module")
def offline_llm(tiny_llama: str) -> Iterator[LLM]:
    yield LLM(tiny_llama, block_size=16, **ENGINE_ARGS)


def test_single_steps_in_the_browser_show_the_engines_numbers(
        offline_llm: LLM, browser: Browser, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Pause, then click "Step" through a whole run: after each click the page shows the step the
    engine just ran, with the engine's blocks, states and tokens; the hit and the preemption where they were."""
    core = offline_llm.llm_engine.engine_core.get_engine_core()
    scheduled = scheduled_tokens_per_step(core)
    with offline_llm.serve_ui() as ui:
        assert browser.open(ui.url) == []
        browser.evaluate("document.querySelector('[data-k=pause]').click()")
        wait_for_js(browser, "document.querySelector('.ne-view').dataset.paused === 'true'", "the pause")
        prompts = [{"prompt_token_ids": SHARED_PREFIX + [300, 301]}, {"prompt_token_ids": SHARED_PREFIX + [302]},
                   {"prompt_token_ids": prompt_ids(60, start=20)}, {"prompt_token_ids": prompt_ids(60, start=90)}]
        done = threading.Event()
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        runner = threading.Thread(target=lambda: (offline_llm.generate(prompts, params, use_tqdm=False), done.set()),
                                  daemon=True)
        runner.start()
        seen_preemption = seen_hit = False
        for click in range(400):
            if done.is_set():
                break
            before = len(scheduled)
            browser.evaluate("document.querySelector('[data-k=step-once]').click()")
            if not wait_for_js_or_done(browser, f"Number(document.querySelector('.ne-view').dataset.step) === {before}",
                                       done, before):
                continue
            page = browser.evaluate(PAGE_NUMBERS_JS)
            expected = engine_numbers(core)
            assert len(scheduled) == before + 1, "one click, one step"
            assert {k: page[k] for k in ("free", "cached", "held")} == \
                {k: expected[k] for k in ("free", "cached", "held")}, f"step {before}"
            assert page["scheduled"] == scheduled[before]
            assert {s: n for s, n in page["states"].items() if n and not s.startswith("FINISHED")} == \
                dict(expected["states"])
            step_trace = feed_frame(core, before)
            assert page["preemptions"] == len(step_trace["preemptions"])
            assert page["hits"] == sum(1 for c in step_trace["scheduled"] if c["num_cached_tokens"])
            seen_preemption |= page["preemptions"] > 0
            seen_hit |= page["hits"] > 0
            if page["preemptions"] and not (artefacts_dir(tmp_path_factory) / "live-view.png").exists():
                browser.screenshot(artefacts_dir(tmp_path_factory) / "live-view.png")
        runner.join(timeout=30)
        assert done.is_set(), "the run did not finish under single steps"
        assert seen_preemption and seen_hit
        assert page["cells"] == BLOCKS


def wait_for_js_or_done(browser: Browser, condition: str, done: threading.Event, step: int) -> bool:
    """Wait for the page to show ``step``; False when the run ended without another step."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if browser.evaluate(condition):
            return True
        if done.is_set():
            return False
        time.sleep(0.03)
    raise TimeoutError(f"the page did not show step {step} within 20 s")


def feed_frame(core: EngineCore, step: int) -> dict[str, Any]:
    from nanoengine.instruments.plugin import live_feed

    return next(f for f in live_feed(core).frames if f["step"] == step)


def test_a_read_only_page_has_no_buttons_and_control_is_refused(offline_llm: LLM) -> None:
    with offline_llm.serve_ui(allow_control=False) as ui:
        page = httpx.get(ui.url, timeout=10).text
        assert "allowControl: false" in page
        refused = httpx.post(ui.url + "/api/control", json={"action": "pause"}, timeout=10)
        assert refused.status_code == 403 and "--enable-ui-control" in refused.json()["error"]["message"]


@pytest.fixture(scope="module")
def long_trace(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 500-step trace of a real run, written as the docs site writes its replays."""
    engine = make_engine(tiny_llama, **ENGINE_ARGS)
    core = engine.engine_core.get_engine_core()
    with record_frames(core) as feed:
        for index in range(12):
            add(engine, f"r{index}", prompt_ids(20 + 7 * index, start=index),
                SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        while len(feed.frames) < 500:
            if not engine.has_unfinished_requests():
                add(engine, f"x{len(feed.frames)}", prompt_ids(30), SamplingParams(max_tokens=40, ignore_eos=True))
            engine.step()
    folder = tmp_path_factory.mktemp("replay")
    save_trace(feed, folder / "trace.json", {"scenario": "test"})
    (folder / "broken.json").write_text('{"format": "nanoengine-step-trace", "version": 2, "frames": []}')
    static = Path(__file__).resolve().parents[1] / "nanoengine/instruments/live_view/static"
    (folder / "index.html").write_text(
        # An empty icon: the browser would otherwise ask this folder for a favicon.ico and log the 404.
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><link rel='icon' href='data:,'>"
        "<link rel='stylesheet' href='viewer.css'>"
        "</head><body><div class='ne-trace' id='good' data-trace='trace.json'></div>"
        "<div class='ne-trace' id='bad' data-trace='broken.json'></div>"
        "<script src='viewer.js'></script></body></html>")
    for name in ("viewer.js", "viewer.css"):
        (folder / name).write_text((static / name).read_text())
    return folder / "index.html"


def test_a_500_step_replay_paints_fast_and_scrubs_to_each_frame(
        long_trace: Path, browser: Browser, tmp_path_factory: pytest.TempPathFactory) -> None:
    frames = json.loads((long_trace.parent / "trace.json").read_text())["frames"]
    with serving_folder(long_trace.parent) as base_url:
        assert browser.open(base_url + "index.html") == []
        first_paint = float(wait_for_js(browser, "document.getElementById('good').dataset.firstPaintMs",
                                        "the replay's first paint"))
        print(f"\n500-step replay: first paint {first_paint:.0f} ms in headless Chromium")
        assert first_paint <= 1000
        error = wait_for_js(browser, "document.getElementById('bad').dataset.error", "the broken trace's message")
        assert "trace version 2, but this viewer reads version 1" in error
        started = time.perf_counter()
        for index in (0, 137, 250, 499):
            browser.evaluate(f"(() => {{ const s = document.querySelector('#good [data-k=scrub]'); s.value = {index};"
                             " s.dispatchEvent(new Event('input')); })()")
            shown = browser.evaluate(PAGE_NUMBERS_JS)
            frame = frames[index]
            assert shown["step"] == frame["step"]
            assert {k: shown[k] for k in ("free", "cached", "held")} == \
                {k: frame["counts"][k] for k in ("free", "cached", "held")}
            assert shown["scheduled"] == sum(c["num_tokens"] for c in frame["scheduled"])
        print(f"four scrubs: {(time.perf_counter() - started) * 1e3 / 4:.0f} ms each, browser round trip included")
        browser.screenshot(artefacts_dir(tmp_path_factory) / "replay.png")


# ------------------------------------------------------------- on nanoengine serve
def test_the_served_page_wants_the_key_streams_frames_and_survives_a_hang_up(
        tiny_llama: str, browser: Browser) -> None:
    with running_server(tiny_llama, "--enable-ui-control", "--max-model-len", "256") as (url, _):
        assert httpx.get(f"{url}/ui", timeout=10).status_code == 200  # the page holds no data
        refused = httpx.get(f"{url}/ui/api/state", timeout=10)
        assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
        # The schema tells the truth about the page's routes too (issue 41).
        paths = httpx.get(f"{url}/openapi.json", timeout=10).json()["paths"]
        documented = {path: list(paths[path]["get"]["responses"]["200"].get("content", {}))
                      for path in ("/ui", "/ui/viewer.js", "/ui/viewer.css", "/ui/api/feed", "/ui/api/state")}
        assert documented == {"/ui": ["text/html"], "/ui/viewer.js": ["text/javascript"],
                              "/ui/viewer.css": ["text/css"], "/ui/api/feed": ["text/event-stream"],
                              "/ui/api/state": ["application/json"]}
        control = paths["/ui/api/control"]["post"]
        assert {"400", "401", "403"} <= set(control["responses"]) and "422" not in control["responses"]
        auth = {"Authorization": f"Bearer {API_KEY}"}
        # A feed read for one frame, then dropped mid-stream while a request runs.
        completion = threading.Thread(target=lambda: httpx.post(
            f"{url}/v1/completions", headers=auth, timeout=60,
            json={"model": tiny_llama, "prompt": "hello engine", "max_tokens": 30, "ignore_eos": True}))
        with httpx.stream("GET", f"{url}/ui/api/feed", headers=auth, timeout=30) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            completion.start()
            events = []
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
                if "frame" in events:
                    break
        assert events[0] == "hello"
        completion.join(60)
        answer = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60,
                            json={"model": tiny_llama, "prompt": "still serving?", "max_tokens": 5})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] is not None
        # In the browser: refused until the key is typed, then live.
        errors = browser.open(f"{url}/ui")
        assert all("401" in error for error in errors), errors  # the feed's refusal, and nothing else
        wait_for_js(browser, "document.querySelector('.ne-view').dataset.auth === 'refused'", "the key prompt")
        assert "refused the API key" in browser.evaluate("document.querySelector('[data-k=message]').textContent")
        browser.evaluate(f"(() => {{ document.querySelector('[data-k=api-key]').value = '{API_KEY}';"
                         " document.querySelector('[data-k=connect]').click(); })()")
        wait_for_js(browser, "document.querySelector('.ne-view').dataset.step !== undefined", "a frame")
        state = httpx.get(f"{url}/ui/api/state", headers=auth, timeout=10).json()
        assert browser.evaluate("Number(document.querySelector('.ne-view').dataset.step)") == state["frame"]["step"]
        browser.open("about:blank")  # the page's feed closes, so the server stops at once


def test_pages_that_give_up_on_a_slow_core_stall_nothing(tiny_llama: str, browser: Browser,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a slow machine on purpose (each utility answer 0.3 s late, each step 20 ms longer):
    while 8 completions run, readers of the feed and of ``/ui/api/state`` give up before the
    core answers (the late answers once killed the client's output thread, and with it every
    request). Every completion finishes, the page shows the engine's steps, a feed asking
    past the int64 steps gets a 400 naming ``after``, and SIGTERM stops the server with the
    page still open."""
    monkeypatch.setenv("NANOENGINE_INJECT_DELAY", "step=0.02,utility=0.3")
    with running_server(tiny_llama, "--max-model-len", "256", api_key=None) as (url, server):
        body = {"model": tiny_llama, "prompt": "hello engine", "max_tokens": 40, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            completions = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120) for _ in range(8)]
            for _ in range(4):  # each gives up long before the 0.3 s answer
                with pytest.raises(httpx.ReadTimeout):
                    httpx.get(f"{url}/ui/api/state", timeout=0.05)
                with httpx.stream("GET", f"{url}/ui/api/feed", timeout=30) as feed:
                    lines = feed.iter_lines()  # kept: a dropped iterator would close the stream at once
                    next(lines)  # the hello
                    time.sleep(0.25)  # then the page closes mid-read (POLL_S 0.1 s, then a 0.3 s answer)
            answers = [completion.result(timeout=120) for completion in completions]
        assert [answer.status_code for answer in answers] == [200] * 8
        assert all(answer.json()["usage"]["completion_tokens"] == 40 for answer in answers)
        too_far = httpx.get(f"{url}/ui/api/feed", params={"after": 214380331320480716077111680434176}, timeout=10)
        assert too_far.status_code == 400 and too_far.json()["error"]["param"] == "query.after", too_far.text
        browser.open(f"{url}/ui")
        wait_for_js(browser, "document.querySelector('.ne-view').dataset.step !== undefined", "a frame")
        state = httpx.get(f"{url}/ui/api/state", timeout=10).json()
        assert state["frame"]["step"] > 8
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)  # the page's feed is still open
        server.wait(15)
        assert time.monotonic() - start < 5.0, f"SIGTERM took {time.monotonic() - start:.1f} s with a page open"
    browser.open("about:blank")


# ------------------------------------------------------------- the docs site's replays
def test_the_replays_show_what_their_pages_say(tmp_path: Path) -> None:
    """The facts the chapter pages point at in their replays (docs/chapters/ch03-ch05)."""
    from chapters.step_traces import record

    def frames(name: str) -> list[dict[str, Any]]:
        return check_trace_document(json.loads(record(name, tmp_path).read_text()))

    ch03 = frames("ch03")
    assert [f["step"] for f in ch03 if f["preemptions"]] == [6, 8]
    assert [c["num_tokens"] for c in ch03[0]["scheduled"]] == [32]
    assert {c["request_id"] for f in ch03[13:15] for c in f["scheduled"] if c["kind"] == "recompute"} == {"3", "4"}
    ch04 = frames("ch04")
    hits = {(f["step"], c["request_id"]): c["num_cached_tokens"] for f in ch04 for c in f["scheduled"]
            if c["num_cached_tokens"]}
    assert hits == {(3, "b"): 48, (5, "c"): 48, (22, "e"): 48}
    assert [f["step"] for f in ch04 if f["evicted"]] == [18]
    assert set(ch04[3]["blocks"]["shared"].values()) == {2}
    ch05 = frames("ch05")
    seen = {r["state"] for f in ch05 for r in f["requests"]}
    assert "WAITING_FOR_STREAMING_REQ" in seen
    finished = {k: v for k, v in ch05[-1]["counts"]["states"].items() if v}
    assert finished == {"FINISHED_STOPPED": 1, "FINISHED_LENGTH_CAPPED": 2, "FINISHED_ABORTED": 1}


def test_the_disaggregated_replays_show_what_chapter_ten_says(tmp_path: Path) -> None:
    """docs/chapters/ch10: blocks held on the producer after its requests end, then freed;
    the consumer's requests in WAITING_FOR_REMOTE_KVS; ``p2``'s shared prefix a local hit."""
    from chapters.step_traces import record_disaggregated

    producer, consumer = (check_trace_document(json.loads(path.read_text()))
                          for path in record_disaggregated(tmp_path))
    held_alone = [f for f in producer if f["counts"]["held"] and not f["requests"]]
    assert held_alone and held_alone[0]["finished"] == {"p1": "FINISHED_LENGTH_CAPPED"}
    assert producer[-1]["counts"]["held"] == 0 and producer[-1]["counts"]["cached"] == 3
    waited = {r["id"] for f in consumer for r in f["requests"] if r["state"] == "WAITING_FOR_REMOTE_KVS"}
    assert waited == {"p1", "p2", "p3"}
    assert consumer[-1]["prefix_cache"] == {"queries": 111, "hits": 32}
    assert consumer[-1]["counts"]["states"]["FINISHED_LENGTH_CAPPED"] == 3
