"""Errors a caller can catch by kind. A remote failure names the role, method and cause."""

from __future__ import annotations


class LaminarError(Exception):
    """Base class of Laminar's own errors."""


class StartInterrupted(BaseException):
    """A stop signal (SIGTERM, SIGINT) that ended a role's start while the start blocked its
    event loop (vLLM's engine start: ``laminar.engines.vllm_engine``), so that the loop could not
    hear it. A ``BaseException``, as ``KeyboardInterrupt`` is, so that the code it interrupts
    does not take it for an error of its own; :class:`laminar.runtime.service.ServiceHost` ends the
    role
    quietly on it, as a stop."""


class ConfigError(LaminarError, ValueError):
    """A configuration file or override is invalid; the message names key, value and expectation."""


class EndpointDefinitionError(LaminarError, TypeError):
    """An @endpoint method has a signature the RPC layer cannot carry."""


class RpcError(LaminarError):
    """Base class of failures of a remote call."""


class PeerUnavailable(RpcError, ConnectionError):
    """The peer could not be reached, or the connection dropped while the call was pending."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"peer {address} unavailable: {reason}")
        self.address = address
        self.reason = reason


class CallTimeout(RpcError, TimeoutError):
    """No answer within the call's timeout; the server was told to cancel the call."""

    def __init__(self, address: str, method: str, timeout: float) -> None:
        super().__init__(f"{method} on {address} timed out after {timeout:g} s")
        self.address = address
        self.method = method
        self.timeout = timeout


class RemoteError(RpcError):
    """The remote endpoint raised. ``cause_type`` is the remote exception's class name."""

    def __init__(
        self,
        role: str,
        instance: str,
        method: str,
        cause_type: str,
        cause: str,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(f"{role} ({instance}).{method} raised {cause_type}: {cause}")
        self.role = role
        self.instance = instance
        self.method = method
        self.cause_type = cause_type
        self.cause = cause
        self.remote_traceback = remote_traceback


class BadRequest(RemoteError):
    """The server rejected the request as malformed (validation failed) before running it."""


class UnknownMethod(RemoteError):
    """The server has no endpoint of that name."""


#: wire name of the error class -> class, for the client side to re-raise the right kind
REMOTE_ERROR_KINDS: dict[str, type[RemoteError]] = {
    "remote": RemoteError,
    "bad_request": BadRequest,
    "unknown_method": UnknownMethod,
}

#: The errors a call may escape by trying again, perhaps at another address: the peer went away
#: or went silent. A ``RemoteError`` is the peer's answer; asking again asks the same question.
RETRYABLE: tuple[type[Exception], ...] = (PeerUnavailable, CallTimeout)

#: A subscription that may work if opened again: the peer went away, went silent, or its stream
#: raised (a restarting peer may refuse before it is ready); ``ConnectionError`` covers the
#: transport's own errors where a stream runs over a raw connection.
STREAM_ERRORS: tuple[type[Exception], ...] = (*RETRYABLE, RemoteError, ConnectionError)
