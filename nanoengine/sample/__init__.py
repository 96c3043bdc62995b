"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeds (chapter 7)."""
