"""The prefill actor: admission, batched prefill of prompts, draft extend for prefill, and sending
each request's KV cache and metadata row to its decode node.

Not built yet: a later milestone fills this package.
"""
