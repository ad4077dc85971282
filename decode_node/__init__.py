"""The decode node (a Ray actor in the cluster): receives KV, generates, streams tokens."""

from decode_node.node import DecodeNode

__all__ = ["DecodeNode"]
