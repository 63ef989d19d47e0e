"""Wire contracts shared by the Tracker-side producer and the worker-side consumer."""

from .activations import ActivationError, Activations
from .compat import (
    PHASES,
    BoundarySchema,
    CompatibilityKey,
    EngineIdentity,
    Phase,
    Recipe,
    StateLayout,
    whole_model_boundary,
)
from .keys import GROUP, PREFIX, WorkerKeys, parse_input_stream
from .limits import SCHEMA_VERSION
from .session import RouteHop, Sampling, SessionSpec
from .signing import Signer
from .step import Accounting, Reason, Status, StepJob, StepResult
from .wire import (
    WireError,
    cancel_from_fields,
    cancel_to_fields,
    job_from_fields,
    job_to_fields,
    result_from_fields,
    result_to_fields,
)

__all__ = [
    "GROUP",
    "PHASES",
    "PREFIX",
    "SCHEMA_VERSION",
    "Accounting",
    "ActivationError",
    "Activations",
    "BoundarySchema",
    "CompatibilityKey",
    "EngineIdentity",
    "Phase",
    "Reason",
    "Recipe",
    "RouteHop",
    "Sampling",
    "SessionSpec",
    "Signer",
    "StateLayout",
    "Status",
    "StepJob",
    "StepResult",
    "WireError",
    "WorkerKeys",
    "cancel_from_fields",
    "cancel_to_fields",
    "job_from_fields",
    "job_to_fields",
    "parse_input_stream",
    "result_from_fields",
    "result_to_fields",
    "whole_model_boundary",
]
