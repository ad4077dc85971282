"""The control side of a cluster: the router and its policies, the nodes' state and health, the
supervisor, metrics and traces, and the in-process backend."""
