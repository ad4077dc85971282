"""The decode actor: preallocation of KV slots and metadata rows, receiving what prefill sends, the
running batch with speculative decoding, and streaming tokens back to the router.

Not built yet: a later milestone fills this package.
"""
