"""The prefill node (a Ray actor in the cluster): prompts in, KV and first tokens out."""

from prefill_node.node import PrefillNode

__all__ = ["PrefillNode"]
