"""The control plane of pdcluster.

Config and CLI (the ``pdcluster`` command), the Ray launcher and node placement, the router and its
policies, the OpenAI-compatible HTTP server, the Python client SDK, and metrics and tracing. It sits
at the top of the dependency order:
cluster -> prefill_node, decode_node -> spec, metadata -> engine.
"""

from cluster.client import APIConnectionError, APIError, APITimeoutError, AsyncClient, Client

__all__ = ["APIConnectionError", "APIError", "APITimeoutError", "AsyncClient", "Client"]
