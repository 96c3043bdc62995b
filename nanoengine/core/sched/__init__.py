"""The scheduler and the messages it exchanges with the worker (chapter 3)."""
