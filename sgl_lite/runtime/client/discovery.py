"""From an HTTP URL to the runtime's ZeroMQ endpoint, and what a ZeroMQ address must look like.

`sgl-lite serve --port P` serves HTTP on P; its /server_info names the ZeroMQ endpoint that DSL programs
use (`zmq_address`), so `sgl.RuntimeEndpoint("http://host:P")` needs nothing else. The named address is
the server's own view: a loopback or wildcard host in it is replaced by the host of the URL the client
used, so a server reached from another machine is reached there over ZeroMQ too.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from sgl_lite.runtime.client.errors import RuntimeRequestError, RuntimeUnavailableError

_LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::", "")
# The server_info key naming the ZeroMQ endpoint (sgl_lite's own; SGLang has no such endpoint).
ZMQ_ADDRESS_KEY = "zmq_address"


def check_zmq_address(address: str) -> None:
    """ValueError naming the mistake for anything but tcp://host:port or ipc://path, at once (an address
    ZeroMQ cannot parse would otherwise fail later, inside the client's I/O thread)."""
    if not isinstance(address, str):
        raise ValueError(f"runtime address must be a string like tcp://127.0.0.1:30001; got {address!r}")
    if address.startswith(("http://", "https://")):
        raise ValueError(f"{address!r} is an HTTP URL, but this client speaks ZeroMQ: use sgl.RuntimeEndpoint(url) "
                         "(which finds the ZeroMQ endpoint from the URL), or the tcp:// address the server printed")
    if "://" not in address:
        raise ValueError(f"runtime address {address!r} has no scheme: write tcp://{address} "
                         "(or ipc:///path/to/socket)")
    scheme, rest = address.split("://", 1)
    if scheme == "ipc" and rest:
        return
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return
        raise ValueError(f"runtime address {address!r} must be tcp://host:port with a port in 1..65535")
    raise ValueError(f"runtime address {address!r}: the scheme must be tcp:// or ipc://; got {scheme}://")


def discover_zmq_address(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The ZeroMQ address of the sgl_lite server whose HTTP API is at `base_url`."""
    info = http_json(base_url.rstrip("/") + "/server_info", api_key, timeout=timeout)
    address = info.get(ZMQ_ADDRESS_KEY) if isinstance(info, dict) else None
    if not isinstance(address, str):
        raise RuntimeUnavailableError(
            f"the HTTP server at {base_url} names no ZeroMQ endpoint in /server_info: it is not an sgl_lite "
            "server (or it is the router of --dp-size, which routes HTTP only); the ZeroMQ client needs an "
            "sgl_lite server's URL or its tcp:// address (sgl.RuntimeEndpoint(url) speaks HTTP to the others)")
    return reachable_address(address, base_url)


def reachable_address(address: str, base_url: str) -> str:
    """`address` as seen from a client that reached the server at `base_url`."""
    if not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://"):].rpartition(":")
    if host.strip("[]") not in _LOCAL_HOSTS:
        return address
    url_host = urllib.parse.urlsplit(base_url).hostname or "127.0.0.1"
    return f"tcp://{'[' + url_host + ']' if ':' in url_host else url_host}:{port}"


def http_json(url: str, api_key: str | None, body: Any = None, timeout: float = 60.0) -> Any:
    """GET (or POST `body` as JSON) and decode the JSON answer (None for an empty one); errors name the server and
    its message."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = response.read()
            return json.loads(answer) if answer else None
    except urllib.error.HTTPError as e:
        raise RuntimeRequestError(f"{url} answered {e.code}: {_error_message(e)}",
                                  "unauthorized" if e.code == 401 else "bad_request") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RuntimeUnavailableError(f"no HTTP server answers at {url}: {reason}") from None
    except ValueError as e:
        raise RuntimeUnavailableError(f"{url} did not answer JSON: {e}") from None


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        payload = json.loads(error.read())
        return str(payload.get("error", {}).get("message") or payload)
    except (ValueError, AttributeError, OSError):
        return error.reason or "error"
