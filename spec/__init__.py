"""Speculative decoding (multi-layer EAGLE): the draft layers, one DraftRunner per depth with
its own token pool and KV pool, the draft -> verify -> draft-extend loop, and the acceptance rules.

Not built yet: a later milestone fills this package.
"""
