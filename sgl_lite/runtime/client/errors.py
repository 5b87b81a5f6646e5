"""What a request to the runtime can fail with, as the client raises it (torch-free)."""

from __future__ import annotations


class RuntimeRequestError(Exception):
    """The runtime answered with an error (`code`: bad_request, unauthorized, queue_full, aborted, ...)."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class RuntimeUnavailableError(ConnectionError):
    """The runtime is gone (its process exited or is stopped), cannot be reached, or did not answer a
    request within the client's `timeout`."""
