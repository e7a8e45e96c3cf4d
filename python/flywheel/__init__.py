"""Python clients of flywheel: the publisher's push API (docs/PUSH_API.md) and the training
service with its rollout workers (docs/TRAINING_API.md).

    import flywheel
    client = flywheel.Client("http://trainer:7080", token=open("push.token").read().strip())
    row = client.push(model.state_dict(), metadata={"step": 12}, wait=1.0)

    trainer = flywheel.ServiceClient("http://trainer:7300", token).create_session()
    sampler = flywheel.SamplingClient(["http://worker:7280"], token)
"""

from . import rl
from ._version import __version__
from ._wire import WireError
from .client import DEFAULT_PART_SIZE, Client
from .errors import (ApiError, BadRequest, BodyHashMismatch, Conflict, ConnectionFailed,
                     DeltaError, Expired, FlywheelError, Forbidden, Incomplete,
                     InsufficientStorage, InternalError, InvalidCheckpoint, InvalidContent,
                     InvalidDelta, MethodNotAllowed, NameTaken, NotFound,
                     Pinned, PushDisabled, SeqReplayed, SeqTimeout, SessionConflict,
                     StaleSample, TooLarge, TooManySessions, Unauthorized, Unavailable,
                     UnknownBase, VersionConflict, WaitTimeout)
from .safetensors import SafetensorsError, checkpoint_files, write_state_dict
from .sampling import Sample, SamplingClient
from .training import (Answer, Datum, ForwardResult, ServiceClient, TrainingClient,
                       torch_loss_fn)

__all__ = [
    "__version__", "Client", "DEFAULT_PART_SIZE",
    "ServiceClient", "TrainingClient", "Datum", "ForwardResult", "Answer", "torch_loss_fn",
    "SamplingClient", "Sample", "rl",
    "FlywheelError", "ConnectionFailed", "DeltaError", "WaitTimeout", "StaleSample",
    "WireError", "ApiError",
    "BadRequest", "Unauthorized", "Forbidden", "PushDisabled", "NotFound", "VersionConflict",
    "UnknownBase", "Pinned", "Expired", "TooLarge", "Incomplete", "BodyHashMismatch",
    "InvalidCheckpoint", "InvalidDelta", "InsufficientStorage",
    "SeqTimeout", "SessionConflict", "SeqReplayed", "NameTaken", "TooManySessions",
    "MethodNotAllowed", "Conflict", "InvalidContent", "InternalError", "Unavailable",
    "SafetensorsError", "checkpoint_files", "write_state_dict",
]
