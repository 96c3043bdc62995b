"""AsyncScheduler: schedule step N+1 while step N's forward pass still runs.

Chapter 7 (the engine loop). With ``LLM(..., async_scheduling=True)``,
``EngineCore.step_with_batch_queue`` calls ``schedule()`` for the next step
before ``update_from_output()`` has seen the tokens of the step in flight. The
plain ``Scheduler`` already counts scheduled tokens as computed when it
schedules them; what it cannot know is the token each running request is
about to sample. This subclass books that token as an *output placeholder*:

* after scheduling, every request whose scheduled tokens reach the end of its
  tokens -- known ones plus placeholders -- will sample, so it gets
  ``num_output_placeholders += 1``;
* the next ``schedule()`` counts placeholders as tokens to compute: a decode
  whose input is still a placeholder is scheduled for 1 token (its blocks
  cover the placeholder slot); the model runner feeds in the token it sampled
  itself for that request, which the scheduler has not seen yet;
* ``update_from_output`` replaces placeholders by real tokens as they arrive;
  a token for a request that already ended (stopped by the previous step's
  output, or aborted) is dropped, since the request is gone;
* a request whose placeholders already reach ``max_tokens`` or
  ``max_model_len`` will end once they arrive, so it is not scheduled again.

A request preempted while its token is in flight keeps that token when it
arrives (the step that sampled it read valid KV): it then waits with only real
tokens and recomputes from them, exactly as the synchronous loop would have.
Pure Python, no torch.

vLLM 0.32 counterpart: ``vllm/v1/core/sched/async_scheduler.py``
(``AsyncScheduler._update_after_schedule``, ``_update_request_with_output``);
the max_tokens check sits in ``Scheduler.schedule()`` there.
"""

from __future__ import annotations

from nanoengine.core.sched.output import SchedulerOutput
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.request import Request


class AsyncScheduler(Scheduler):
    """A ``Scheduler`` whose ``schedule()`` may run one step ahead of the outputs."""

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """As ``Scheduler._num_new_tokens``, with placeholders as tokens to compute.

        Placeholders are already counted in ``num_computed_tokens`` but not in
        ``num_tokens``; seen from the known tokens, the request has computed
        ``num_computed_tokens - num_output_placeholders``, so the gap to close
        is its placeholders' inputs plus any known tokens not yet computed.
        """
        if self._ends_with_placeholders(request):
            return 0
        return super()._num_new_tokens(
            request, num_computed_tokens - request.num_output_placeholders, token_budget
        )

    def _ends_with_placeholders(self, request: Request) -> bool:
        """True when the tokens in flight will end ``request`` by length.

        Scheduling it again would compute a position whose token is dropped,
        or one past ``max_model_len``, which has no KV slot.
        """
        if request.num_output_placeholders == 0:
            return False
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        max_tokens = request.max_tokens
        return (max_tokens is not None and num_outputs >= max_tokens) or (
            request.num_tokens + request.num_output_placeholders >= self.max_model_len
        )

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            # Reaching the end of the tokens (placeholders included) means this
            # step samples; a prefill chunk that stops short does not.
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        # A request ended by an earlier token never reaches here (it left
        # ``requests``), so every token that arrives settles one placeholder.
        request.num_output_placeholders -= len(new_token_ids)
        if request.num_output_placeholders < 0:
            raise RuntimeError(f"{request.request_id!r} got a token no step was scheduled to sample.")
        return super()._update_request_with_output(request, new_token_ids)
