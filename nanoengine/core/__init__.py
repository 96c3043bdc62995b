"""Pure bookkeeping: the scheduler, the KV cache manager and the block pool.

Nothing here imports torch or knows about a device: it counts tokens and blocks,
and decides who runs. Chapters 3 and 4 explain it.
"""
