"""Small helpers that serve the whole engine rather than one chapter.

vLLM 0.32 counterpart: ``vllm/utils/`` (a grab bag of helpers). The teaching
instruments (the component tree, source locations, method taps) have a package
of their own, ``nanoengine/instruments/``.

``math_utils`` (``cdiv``: how many blocks a prompt needs, chapter 4) and
``mem_utils`` (``format_bytes``: chapter 6's memory figures) are named after
their vLLM counterparts and import nothing, so ``nanoengine/core`` may use them;
``system_utils`` starts and watches the processes of chapters 6 and 8;
``deadlines`` holds what every wait of chapter 8 shares (a late answer dropped,
a critical thread's death told, a slow machine on purpose).

The package stays empty on purpose: importing ``nanoengine.utils.<module>`` should
pay only for that module.
"""
