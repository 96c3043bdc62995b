"""Wrong answers to the chapter-8 exercises (see ``__init__.py``).

Two of them block for ever (8.1: a ``get_output`` that waits with no timeout;
8.2: a handler that blocks its event loop): the grader's watchdog
(``run_with_deadline`` in chapters/grade.py) must fail the check after its
deadline and name it, and the test run goes on.
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

MUTANTS: list[Mutant] = [
    # ------------------------------------------------- 8.1 SyncMPClient.get_output
    Mutant(
        "8.1",
        "does not wait: get_nowait() instead of get(timeout=_OUTPUT_WAIT_S)",
        mutate("8.1", ("self.outputs_queue.get(timeout=_OUTPUT_WAIT_S)", "self.outputs_queue.get_nowait()")),
        caught_by="waits for a batch that arrives during the wait",
    ),
    Mutant(
        "8.1",
        "waits for ever: get() with no timeout (the grader must not hang)",
        mutate("8.1", ("self.outputs_queue.get(timeout=_OUTPUT_WAIT_S)", "self.outputs_queue.get()")),
        caught_by="nothing within the wait: an empty EngineCoreOutputs, not None, not a hang",
    ),
    Mutant(
        "8.1",
        "returns None instead of an empty batch when nothing comes",
        mutate("8.1", ("return EngineCoreOutputs()", "return None")),
        caught_by="nothing within the wait: an empty EngineCoreOutputs, not None, not a hang",
    ),
    Mutant(
        "8.1",
        "returns the queued EngineDeadError instead of raising it",
        mutate("8.1", ("raise outputs", "return outputs")),
        caught_by="raises the EngineDeadError that comes out of the queue",
    ),
    Mutant(
        "8.1",
        "swallows the queued EngineDeadError (an empty batch instead)",
        mutate("8.1", ("raise outputs", "return EngineCoreOutputs()")),
        caught_by="raises the EngineDeadError that comes out of the queue",
    ),
    Mutant(
        "8.1",
        "never looks at self._dead: a dead engine returns empty batches for ever",
        mutate("8.1", ("        if self._dead is not None:\n            raise self._dead from None\n", "")),
        caught_by="dead and nothing queued: raises self._dead after the wait",
    ),
    Mutant(
        "8.1",
        "checks self._dead before the queue, losing the batches sent before the death",
        mutate("8.1", ("    try:\n", "    if self._dead is not None:\n        raise self._dead\n    try:\n")),
        caught_by="the batches queued before the death come out before the error",
    ),
    # -------------------------------------------- 8.2 AsyncLLM._run_output_handler
    Mutant(
        "8.2",
        "every output goes to the first request's queue",
        mutate("8.2", ("queue = self.collectors.get(output.request_id)",
                       "queue = next(iter(self.collectors.values()), None)")),
        caught_by="each output goes to its own request's queue",
    ),
    Mutant(
        "8.2",
        "an output with no queue is a KeyError (collectors[id] instead of .get)",
        mutate("8.2", ("queue = self.collectors.get(output.request_id)",
                       "queue = self.collectors[output.request_id]")),
        caught_by="an output with no queue (consumer gone) is skipped",
    ),
    Mutant(
        "8.2",
        "reqs_to_abort ignored: a stopped request runs on in the core",
        mutate("8.2", ("self.client.abort_requests(processed.reqs_to_abort)", "pass")),
        caught_by="requests that hit a stop string are aborted in the core",
    ),
    Mutant(
        "8.2",
        "aborts with self.abort_request (the consumer's call) instead of self.client.abort_requests",
        mutate("8.2", ("self.client.abort_requests(processed.reqs_to_abort)",
                       "self.abort_request(processed.reqs_to_abort)")),
        caught_by="requests that hit a stop string are aborted in the core",
    ),
    Mutant(
        "8.2",
        "calls the blocking client.get_output() inside the async handler",
        mutate("8.2", ("await self.client.get_output_async()", "self.client.get_output()")),
        caught_by="each output goes to its own request's queue",
    ),
    Mutant(
        "8.2",
        "blocks the event loop (a synchronous sleep before each await): the grader must not hang",
        mutate("8.2", ("core_outputs = await self.client.get_output_async()",
                       "core_outputs = __import__('time').sleep(3600) or await self.client.get_output_async()")),
        caught_by="each output goes to its own request's queue",
    ),
    Mutant(
        "8.2",
        "finished listeners never called",
        mutate("8.2", ("listener(output)", "pass")),
        caught_by="every finished output goes to every finished listener, once",
    ),
    Mutant(
        "8.2",
        "finished listeners called for every output, finished or not",
        mutate("8.2", ("if output.finished:", "if True:")),
        caught_by="every finished output goes to every finished listener, once",
    ),
    Mutant(
        "8.2",
        "finished listeners called only for requests that still have a queue",
        mutate("8.2", ("if output.finished:", "if output.finished and queue is not None:")),
        caught_by="every finished output goes to every finished listener, once",
    ),
    Mutant(
        "8.2",
        "dead_error never set",
        mutate("8.2", ("self.dead_error = error", "pass")),
        caught_by="an exception sets dead_error and reaches every waiting request",
    ),
    Mutant(
        "8.2",
        "the death is not put into the waiting requests' queues",
        mutate("8.2", ("queue.put_nowait(error)", "pass")),
        caught_by="an exception sets dead_error and reaches every waiting request",
    ),
    Mutant(
        "8.2",
        "only EngineDeadError is caught: any other error kills the handler silently",
        mutate("8.2",
               ("    try:\n        while True:",
                ("    from nanoengine.engine.exceptions import EngineDeadError\n\n"
                 "    try:\n        while True:")),
               ("except Exception as error:", "except EngineDeadError as error:")),
        caught_by="an exception sets dead_error and reaches every waiting request",
    ),
    Mutant(
        "8.2",
        "catches BaseException: the shutdown's cancellation is taken for a death",
        mutate("8.2", ("except Exception as error:", "except BaseException as error:")),
        caught_by="cancelled (shutdown) is no death: the task ends, no request is told",
    ),
]
