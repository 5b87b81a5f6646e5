"""The torch-free client of a runtime process: RuntimeClient over a ZeroMQ DEALER transport."""

from sgl_lite.runtime.client.client import RuntimeClient
from sgl_lite.runtime.client.errors import RuntimeRequestError, RuntimeUnavailableError
from sgl_lite.runtime.client.wire import use_api_key

__all__ = ["RuntimeClient", "RuntimeRequestError", "RuntimeUnavailableError", "use_api_key"]
