"""Python client of the flywheel publisher's push API (docs/PUSH_API.md).

    import flywheel
    client = flywheel.Client("http://trainer:7080", token=open("push.token").read().strip())
    row = client.push(model.state_dict(), metadata={"step": 12}, wait=1.0)
"""

from ._version import __version__
from .client import DEFAULT_PART_SIZE, Client
from .errors import (ApiError, BadRequest, BodyHashMismatch, ConnectionFailed, DeltaError,
                     Expired, FlywheelError, Forbidden, Incomplete, InsufficientStorage,
                     InvalidCheckpoint, InvalidDelta, NotFound, Pinned, PushDisabled, TooLarge,
                     Unauthorized, UnknownBase, VersionConflict, WaitTimeout)
from .safetensors import SafetensorsError, checkpoint_files, write_state_dict

__all__ = [
    "__version__", "Client", "DEFAULT_PART_SIZE",
    "FlywheelError", "ConnectionFailed", "DeltaError", "WaitTimeout", "ApiError",
    "BadRequest", "Unauthorized", "Forbidden", "PushDisabled", "NotFound", "VersionConflict",
    "UnknownBase", "Pinned", "Expired", "TooLarge", "Incomplete", "BodyHashMismatch",
    "InvalidCheckpoint", "InvalidDelta", "InsufficientStorage",
    "SafetensorsError", "checkpoint_files", "write_state_dict",
]
