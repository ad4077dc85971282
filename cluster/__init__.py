"""The control plane of pdcluster, by job:

- cluster/frontend: the OpenAI-compatible HTTP API, its schemas, admission, streaming, and the
  API processes;
- cluster/control: the router and its policies, the nodes' state and health, the supervisor,
  metrics and traces, and the in-process backend;
- cluster/deploy: the configuration, Ray, placement and the node actors;
- cluster/commands: the ``pdcluster`` command line;
- cluster/client.py: the Python client SDK; cluster/bench_serving: ``pdcluster bench serving``.

It sits at the top of the dependency order:
cluster -> prefill_node, decode_node -> spec, metadata -> engine.
"""

from cluster.client import APIConnectionError, APIError, APITimeoutError, AsyncClient, Client

__all__ = ["APIConnectionError", "APIError", "APITimeoutError", "AsyncClient", "Client"]
