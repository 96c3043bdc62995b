"""Turning logits into tokens: greedy, temperature, top-k, top-p, seeds (chapter 7);
logit_bias, penalties, min_p and logprobs (chapter 8).
"""
