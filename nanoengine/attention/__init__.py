"""Paged attention: the layer the models call and the backends that compute it (chapter 7)."""
