"""Typed errors raised at backfill's edges.

Every error a user can cause derives from BackfillError so the CLI and the HTTP server can
turn it into a clear message (or a 4xx) instead of a traceback from deep inside torch.
"""


class BackfillError(Exception):
    """Base class of every error backfill raises on purpose."""


class ModelLoadError(BackfillError):
    """The model path does not exist or is not a model backfill can read."""


class CorruptModelError(ModelLoadError):
    """The model file exists but its contents are malformed or inconsistent."""


class InvalidRequestError(BackfillError, ValueError):
    """A request is malformed: bad sampling values, empty prompt, unknown fields."""


class InvalidSamplingError(InvalidRequestError):
    """A sampling parameter is out of range."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context."""


class OutOfBlocksError(BackfillError):
    """The KV block pool cannot satisfy an allocation."""


class EngineStoppedError(BackfillError):
    """A request was submitted to an engine that is not running."""


class TraceFormatError(BackfillError, ValueError):
    """A workload trace file is malformed; the message names the line."""
