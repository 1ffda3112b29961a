"""Domain exceptions that cross service boundaries.

Domain modules raise these (they never import grpc); the gRPC layer turns each class into its
status code with one table (``services.common.grpc_server.STATUS_FOR_ERROR``) and the HTTP
front door into 400/429/503/401/404/409. Raise the most specific subclass and put the expected and
actual values in the message: the message is what the client sees.
"""

from __future__ import annotations


class ShardlineError(Exception):
    """Base of every error a client may be shown. Never raised itself."""


class InvalidArgument(ShardlineError, ValueError):
    """A request field is wrong (empty prompt, top_p outside (0, 1], prompt beyond the context).

    Also a ValueError, so code that validates with ``except ValueError`` keeps working.
    """


class ResourceExhausted(ShardlineError):
    """The request is valid but cannot be taken now: queue full, or deadline passed in queue."""


class Unavailable(ShardlineError):
    """No healthy replica group (or backing service) can serve the request; retrying may work."""


class Unauthenticated(ShardlineError):
    """The API key is missing or wrong."""


class NotFound(ShardlineError, LookupError):
    """The named thing does not exist: unknown model, manifest, replica group."""


class AlreadyExists(ShardlineError):
    """The thing a request would create exists already: a replica group id, a manifest URI."""


class FailedPrecondition(ShardlineError):
    """The system is not in a state that allows the operation, e.g. a checkpoint whose layout
    does not match the plan, or an illegal replica-group status transition."""
