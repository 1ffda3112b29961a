"""Domain exceptions that cross service boundaries.

Domain modules raise these (they never import grpc). Each class names, once, what a client is
told: its gRPC status (``grpc_status``, a ``grpc.StatusCode`` name, turned into the code by
``services.common.grpc_server``) and its HTTP status and OpenAI error type (the router's front
door). A subclass inherits them. Raise the most specific subclass and put the expected and actual
values in the message: the message is what the client sees.
"""

from __future__ import annotations


class ShardlineError(Exception):
    """Base of every error a client may be shown. Never raised itself. A subclass may set what
    clients are told in its class statement: ``class X(ShardlineError, grpc_status=..., ...)``."""

    grpc_status = "INTERNAL"
    http_status = 500
    openai_type = "server_error"

    def __init_subclass__(cls, *, grpc_status: str | None = None, http_status: int | None = None,
                          openai_type: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.grpc_status = grpc_status or cls.grpc_status
        cls.http_status = http_status or cls.http_status
        cls.openai_type = openai_type or cls.openai_type


class InvalidArgument(ShardlineError, ValueError, grpc_status="INVALID_ARGUMENT", http_status=400,
                      openai_type="invalid_request_error"):
    """A request field is wrong (empty prompt, top_p outside (0, 1], prompt beyond the context).

    Also a ValueError, so code that validates with ``except ValueError`` keeps working.
    """


class PayloadTooLarge(InvalidArgument, http_status=413):
    """The request body is larger than the server takes (the router's --max-body-bytes)."""


class UnsupportedMediaType(InvalidArgument, http_status=415):
    """The request body is not in a format the endpoint reads (JSON endpoints: application/json)."""


class ResourceExhausted(ShardlineError, grpc_status="RESOURCE_EXHAUSTED", http_status=429,
                        openai_type="rate_limit_error"):
    """The request is valid but cannot be taken now: queue full, or deadline passed in queue."""


# how a worker's refusal of a request whose KV claim does not fit begins (services/worker/engine/
# kv_budget.py): a router that reads it tries another group instead of failing the request
KV_BUDGET_FULL = "KV budget full"


class Unavailable(ShardlineError, grpc_status="UNAVAILABLE", http_status=503,
                  openai_type="service_unavailable_error"):
    """No healthy replica group (or backing service) can serve the request; retrying may work."""


class Unauthenticated(ShardlineError, grpc_status="UNAUTHENTICATED", http_status=401,
                      openai_type="authentication_error"):
    """The API key is missing or wrong."""


class NotFound(ShardlineError, LookupError, grpc_status="NOT_FOUND", http_status=404,
               openai_type="not_found_error"):
    """The named thing does not exist: unknown model, manifest, replica group."""


class AlreadyExists(ShardlineError, grpc_status="ALREADY_EXISTS", http_status=409,
                    openai_type="conflict_error"):
    """The thing a request would create exists already: a replica group id, a manifest URI."""


class FailedPrecondition(ShardlineError, grpc_status="FAILED_PRECONDITION", http_status=400,
                         openai_type="invalid_request_error"):
    """The system is not in a state that allows the operation, e.g. a checkpoint whose layout
    does not match the plan, or an illegal replica-group status transition."""


class Unimplemented(ShardlineError, grpc_status="UNIMPLEMENTED", http_status=501,
                    openai_type="not_implemented_error"):
    """This server does not do what was asked (a feature it was built without)."""


# Every class a client may be shown, most general first.
ERROR_CLASSES: tuple[type[ShardlineError], ...] = (
    InvalidArgument, ResourceExhausted, Unavailable, Unauthenticated, NotFound, AlreadyExists, FailedPrecondition,
    Unimplemented)
