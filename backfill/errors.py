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


class PolicyInputError(BackfillError, ValueError):
    """A policy got an invalid config, an inconsistent snapshot, or events out of time order."""


class NodeError(BackfillError):
    """An error of the node runtime that colocates several engines on one device."""


class MemoryPoolError(NodeError):
    """The shared memory pool refused an operation."""


class UnknownOwnerError(MemoryPoolError):
    """An operation names an owner (engine) the pool does not know."""


class DoubleFreeError(MemoryPoolError):
    """An owner released a handle it does not hold (already released, or never granted)."""


class OverAllocationError(MemoryPoolError):
    """An allocation exceeds the owner's grant or what the pool can provide."""


class NodeProtocolError(NodeError):
    """A node-runtime IPC message is malformed, unexpected, or the peer went away."""


class SuspendError(NodeError):
    """A process could not be stopped or continued at the OS level."""


class WorkloadError(BackfillError, ValueError):
    """A benchmark workload spec (arrival process, length distribution, DISB file) is invalid."""


class TargetError(BackfillError):
    """A benchmark target (e.g. an OpenAI-compatible server) answered a request with an error."""


class RealtimeError(BackfillError):
    """A real-time/best-effort DNN serving input (REEF) is invalid: model, metadata, request or config."""
