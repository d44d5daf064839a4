"""The errors moe-proxy raises on bad input. Each message names the problem and what to do."""


class MoeProxyError(Exception):
    """Base class: the CLI prints these as one clear line and exits non-zero."""


class UnsupportedArchitecture(MoeProxyError):
    """config.json names an architecture moe-proxy has no description for."""


class NotMoE(MoeProxyError):
    """The checkpoint has no routed experts (a dense model)."""


class InvalidExpertCount(MoeProxyError):
    """The requested experts per layer cannot be kept (too many, too few, breaks grouped routing)."""


class InvalidOptions(MoeProxyError):
    """Options that cannot work together (or a value out of range), refused before anything is read."""


class CannotMerge(InvalidOptions):
    """A build --merge cannot do (its options, or a model's expert layout)."""


class CorruptCheckpoint(MoeProxyError):
    """A file of the checkpoint is malformed, truncated, or missing."""


class DestinationExists(MoeProxyError):
    """The destination cannot take this proxy: it holds a different one (pass --overwrite to
    replace it), files that are not a moe-proxy output, or it overlaps the source."""


class StorageError(MoeProxyError):
    """Object storage refused or failed a request (missing object, access denied, unreachable)."""


class InvalidReproConfig(MoeProxyError):
    """A reproduction-run setting is out of range or inconsistent (repro, --fail-on, faults)."""


class MalformedMetrics(MoeProxyError):
    """A run's metrics.jsonl cannot be read (not JSON, no step, missing file)."""


class MetricsShrank(MalformedMetrics):
    """A followed metrics file got shorter than what was read of it (truncated, or replaced by a
    shorter one: a run restarted over the same file). A follower of it cannot go on; a caller that
    expects restarts reads the run again from the start."""


class ObjectNotFound(StorageError):
    """The bucket or the object does not exist."""


class AccessDenied(StorageError):
    """The store refused the credentials (denied, unknown key, wrong secret) or none were found."""


class EndpointUnreachable(StorageError):
    """The object store did not answer (wrong endpoint URL, network down), even after retries."""


class BaselineFailed(RuntimeError):
    """diagnose / bisect: the failing run itself could not run (not bad input: exit 1)."""


class ProbeFailed(BaselineFailed):
    """bisect: a probe's build, calibration or every run failed; `failure` says which, with its log."""

    def __init__(self, message: str, failure: dict):
        super().__init__(message)
        self.failure = failure


class BisectStopped(BaselineFailed):
    """bisect: a probe failed and the bisection ended before an answer; `report` is the partial
    report it wrote."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


class TooFewCheckpoints(MoeProxyError):
    """A bisection's prefix (or range) holds fewer than 2 complete checkpoints with a step."""


class InvalidRange(MoeProxyError):
    """A bisection's --good / --bad step at which there is no complete checkpoint."""


class WatchTimeout(MoeProxyError):
    """The run neither failed as asked nor ended within the watch's time limit."""


class BadDataset(MoeProxyError):
    """The calibration dataset is missing, empty or malformed."""


class CalibrationError(MoeProxyError):
    """Statistics that cannot be used: incomplete, another format, or of another checkpoint."""


class CannotReconstruct(MoeProxyError):
    """A checkpoint whose experts cannot be written back in their own format."""


class FidelityTargetNotMet(InvalidExpertCount):
    """`--experts auto`: no allowed expert count reaches the KL target."""
