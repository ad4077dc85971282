"""Speculative decoding at run time: the worker, its round plans, verify and acceptance, the draft
runners and extends, draft trees, and the state a request carries."""
