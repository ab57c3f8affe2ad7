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


class UnsupportedModelError(ModelLoadError):
    """The model is well-formed but uses an architecture or option backfill does not run; the
    message names it."""


class ClusterError(BackfillError):
    """An error of the cluster layer (scheduler, placer, fleet simulator, Ray cluster)."""


class ClusterInputError(ClusterError, ValueError):
    """A cluster job, profile, snapshot, placement problem or config is malformed."""


class JobRejectedError(ClusterError):
    """No node of the cluster can give an offline job the throughput its SLA asks for."""


class SharedMemoryError(BackfillError):
    """Memory shared between processes (a host segment, a CUDA IPC handle, CUDA virtual memory)
    could not be made, exported, attached or mapped."""


class OffloadError(BackfillError):
    """An elastic tensor or the offload coordinator (AQUA §6) refused an operation."""


class UnknownTensorError(OffloadError, KeyError):
    """An elastic tensor key that the store does not hold (never put, or freed)."""


class CoordinatorError(OffloadError):
    """The offload coordinator answered with an error, or could not be reached."""


class LeaseExpiredError(CoordinatorError):
    """A lease or offer named in a coordinator call has expired or does not exist."""


class LatencyProfileError(BackfillError, ValueError):
    """A saved latency profile is unreadable, malformed or of a format this backfill cannot use."""


class FinetuneError(BackfillError):
    """A finetuning job (HARLI) cannot be created, resumed or run."""


class FinetuneConfigError(FinetuneError, ValueError):
    """A finetuning hyperparameter is out of range (e.g. a LoRA rank of 0)."""


class SimDeviceError(FinetuneError, ValueError):
    """The simulated device of `backfill sim finetune` is misconfigured: a stated parameter out of range, an SM
    share outside (0, 1], or a profile or model-shape file that cannot be read."""


class TrainingFileError(FinetuneError, ValueError):
    """A fine-tuning training file is malformed; the message names the line."""


class CheckpointError(FinetuneError):
    """A finetuning checkpoint is missing, unreadable or does not match the job."""


class AdapterLoadError(BackfillError, ValueError):
    """A LoRA adapter directory is missing, malformed, or does not fit the served model."""


class UnknownAdapterError(InvalidRequestError):
    """A request names a LoRA adapter (or fine-tuned model) the engine has not loaded."""


class ServerConfigError(BackfillError, ValueError):
    """A server option (CLI flag, config file key or environment variable) is invalid."""


class RealtimeError(BackfillError):
    """A real-time/best-effort DNN serving input (REEF) is invalid: model, metadata, request or config."""


class NodeConfigError(NodeError, ValueError):
    """A node config file (`backfill serve --config node.toml`) is malformed; the message names the key."""
