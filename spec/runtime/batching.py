"""ForwardBatch from explicit spans (row, first position, tokens, slots): verify and the draft
depths feed tokens that are not a Request's committed tokens, into pools of their choosing.
The builder is the engine's (engine.executor.forward_batch.extend_batch)."""

from engine.executor.forward_batch import Span, extend_batch

__all__ = ["Span", "extend_batch"]
