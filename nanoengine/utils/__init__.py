"""Small helpers that serve the whole engine rather than one chapter.

``component_tree`` makes the engine objects print as a tree of their components,
each with the file and line that define and create it: chapter 5's "source map",
computed from the running engine instead of typed into the notes by hand.
vLLM 0.32 counterpart: ``vllm/utils/`` (a grab bag of helpers); nothing there
draws such a tree.

``math_utils`` (``cdiv``) and ``mem_utils`` (``format_bytes``) are named after
their vLLM counterparts and import nothing, so ``nanoengine/core`` may use them.

The package stays empty on purpose: importing ``nanoengine.utils.<module>`` should
pay only for that module (``component_tree`` pulls in rich, others may pull torch).
"""
