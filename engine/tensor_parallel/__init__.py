"""Tensor parallelism inside one engine: the model split over ranks on one host, rank 0 the
engine the caller holds, ranks 1..N-1 processes that follow its forwards (docs/tensor-parallel.md).

`layout` says which heads, MLP features and vocabulary rows each rank holds; `layers` wraps a
rank's model where the ranks' partial results meet; `forward_plan` is what rank 0 sends before
each forward; `leader` and `follower` are the two sides' runners and processes."""
