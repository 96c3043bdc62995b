"""Entry points: the offline ``LLM`` class (chapters 1, 5-7); an HTTP server comes with chapter 8."""
