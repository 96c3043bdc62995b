"""Executors: how the engine core reaches its worker(s) (chapter 5)."""
