"""The worker side: one device, its model runner and KV cache tensors (chapters 6 and 7)."""
