"""The decode node (a Ray actor in the cluster): receives KV, generates, streams tokens; and the
aggregated node, which prefills its own prompts instead."""

from decode_node.aggregated import AggregatedNode
from decode_node.node import DecodeNode

__all__ = ["AggregatedNode", "DecodeNode"]
