"""Wire contracts shared by the Tracker-side producer and the worker-side consumer."""

from .activations import Activations
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
from .errors import ActivationError, DgrError, EngineError, ProducerError, TransportError, WireError
from .keys import GROUP, PREFIX, WorkerKeys, parse_input_stream
from .limits import SCHEMA_VERSION, WIRE_VERSION
from .reasons import Reason, Status
from .session import RouteHop, Sampling, SessionSpec
from .signing import Signer
from .step import Accounting, StepJob, StepResult, TokenLogprobs
from .wire import (
    Charges,
    ResultRecord,
    cancel_from_fields,
    cancel_to_fields,
    decode_record,
    job_from_fields,
    job_to_fields,
    results_from_fields,
    results_to_fields,
)

__all__ = [
    "GROUP",
    "PHASES",
    "PREFIX",
    "SCHEMA_VERSION",
    "WIRE_VERSION",
    "Accounting",
    "ActivationError",
    "Activations",
    "BoundarySchema",
    "Charges",
    "CompatibilityKey",
    "DgrError",
    "EngineError",
    "EngineIdentity",
    "Phase",
    "ProducerError",
    "Reason",
    "Recipe",
    "ResultRecord",
    "RouteHop",
    "Sampling",
    "SessionSpec",
    "Signer",
    "StateLayout",
    "Status",
    "StepJob",
    "StepResult",
    "TokenLogprobs",
    "TransportError",
    "WireError",
    "WorkerKeys",
    "cancel_from_fields",
    "cancel_to_fields",
    "decode_record",
    "job_from_fields",
    "job_to_fields",
    "parse_input_stream",
    "results_from_fields",
    "results_to_fields",
    "whole_model_boundary",
]
