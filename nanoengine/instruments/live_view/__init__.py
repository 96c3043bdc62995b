"""The live view: a running engine drawn in a browser, and step traces replayed on the docs site.

Chapters 3 (scheduler), 4 (KV cache manager), 5 (engine skeleton) and 9
(speculative decoding). A page shows the block pool as a grid (free, free but
cached with its hash, held by a request, shared through a prefix hit), the
requests in each of the 12 states, each step's tokens against the budget
(prefill chunks, decodes, drafts, preemptions) and plots of KV usage, queue
lengths and throughput over time. Modules:

* ``frames``: one step as JSON data, and the trace-file envelope;
* ``feed``: frames built in the engine core's process while a page reads
  them, and the gate that pauses and single-steps ``EngineCore.step()``;
* ``app``: the HTTP routes (page, server-sent events, clicks);
* ``server_plugin``: the routes on ``nanoengine serve`` (``/ui``);
* ``offline``: ``llm.serve_ui()`` for an offline ``LLM``, and
  ``record_trace`` for the docs site's replays;
* ``static/``: the page and its viewer (plain JavaScript drawing SVG: no
  library to fetch, so it works with no network, in the docs site too).

vLLM 0.32 counterpart: none; vLLM exposes these facts as metrics and KV cache
events, with no page of its own.
"""
