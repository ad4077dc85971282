"""Which requests run each step and where their KV lives: the scheduler, the KV pools and slot
allocator, the prefix cache and chunked prefill."""
