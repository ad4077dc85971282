"""Typed errors raised at the engine's boundaries (weights, config, requests)."""


class PdclusterError(Exception):
    """Base class for every error pdcluster raises on purpose."""


class ModelLoadError(PdclusterError):
    """A model path is missing, incomplete or unreadable."""


class UnsupportedModelError(PdclusterError):
    """The model's architecture or one of its settings is not implemented."""


class RequestRejectedError(PdclusterError, ValueError):
    """A request can never be served (too long for the context or the KV pool, bad parameters).
    `param` names the request field at fault, where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TensorParallelError(PdclusterError, ValueError):
    """A tensor parallel engine cannot be built as asked: a model its ranks cannot split, or
    an option not supported with it. The message names the mismatch."""


class RankFailedError(PdclusterError):
    """A tensor parallel rank exited or lost its connection; the engine cannot run on."""
