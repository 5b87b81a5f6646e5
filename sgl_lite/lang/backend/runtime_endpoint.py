"""RuntimeEndpoint: the frontend backend of a runtime server, over ZeroMQ or SGLang's HTTP protocol.

It takes the server's HTTP URL, as SGLang's does (`http://host:30000`, the server's --port), or a
ZeroMQ address itself (tcp://, ipc://). Given a URL it asks the server's /get_server_info which way to
talk (`transport="auto"`): an sgl_lite server names its ZeroMQ endpoint there, and programs then speak
ZeroMQ to the runtime directly (zmq_runtime.py); a server that names none (sglang-router in front of
`serve --dp-size N`, a real SGLang server) is spoken to in SGLang's HTTP protocol (http_runtime.py),
as is a named endpoint that cannot be reached. `transport="http"` always speaks HTTP, `"zmq"` never.
Both ways serve the same features: gen (regex, JSON, streaming), select scoring, prefix hints, fork,
run_batch, cached-token meta_info. This class only chooses; the transports do the talking.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Protocol, Union

from sgl_lite.lang.backend.base import BaseBackend, PrefillRequest
from sgl_lite.lang.backend.http_runtime import HttpRuntime
from sgl_lite.lang.backend.model_files import served_model_facts
from sgl_lite.lang.backend.zmq_runtime import ZmqRuntime
from sgl_lite.lang.chat_template import CHATML, LLAMA3, ChatTemplate, chat_template_from_model_info
from sgl_lite.lang.ir import SglSamplingParams
from sgl_lite.runtime.client import RuntimeUnavailableError
from sgl_lite.runtime.client.discovery import ZMQ_ADDRESS_KEY, reachable_address

logger = logging.getLogger(__name__)

_NAMED_TEMPLATES = {"chatml": CHATML, "llama-3-instruct": LLAMA3}
TRANSPORTS = ("auto", "zmq", "http")


class RuntimeTransport(Protocol):
    """What ZmqRuntime and HttpRuntime both do for the endpoint."""

    address: str

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]: ...

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]: ...

    def prefill(self, requests: list[PrefillRequest]) -> list[dict[str, Any]]: ...

    def flush_cache(self) -> bool: ...

    def server_info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class RuntimeEndpoint(BaseBackend):
    def __init__(self, base_url: str, api_key: Optional[str] = None, chat_template_name: Optional[str] = None,
                 timeout: float = 600.0, *, transport: str = "auto", verify: Union[bool, str, None] = None) -> None:
        """`transport`: "auto" (ZeroMQ where the server names its endpoint, else HTTP), "zmq" or "http".
        `verify` (SGLang's name): TLS verification of an https:// server, or the path of a CA bundle."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
        if chat_template_name is not None and chat_template_name not in _NAMED_TEMPLATES:
            raise ValueError(f"chat_template_name must be one of {', '.join(_NAMED_TEMPLATES)}; "
                             f"got {chat_template_name!r}")
        self.base_url = base_url
        self.api_key = api_key
        self.runtime, facts = _connect(base_url, api_key, timeout, transport, True if verify is None else verify)
        self.transport = "http" if isinstance(self.runtime, HttpRuntime) else "zmq"
        self.address = self.runtime.address
        self.model_info = facts
        if chat_template_name is not None:
            self.chat_template = _NAMED_TEMPLATES[chat_template_name]
        else:
            if not facts.get("chat_template"):
                logger.warning("the server at %s reports no chat template for %s and none was found in the "
                               "model's files; roles use a fallback (pass chat_template_name= to choose one)",
                               base_url, facts.get("model_path"))
            self.chat_template = chat_template_from_model_info(facts)

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path", ""))

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        return self.runtime.generate(text, params)

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.runtime.generate_stream(text, params)

    def prefill(self, requests: list[PrefillRequest]) -> list[dict[str, Any]]:
        return self.runtime.prefill(requests)

    def flush_cache(self) -> bool:
        return self.runtime.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.runtime.server_info()

    def close(self) -> None:
        self.runtime.close()


def _connect(base_url: str, api_key: Optional[str], timeout: float, transport: str,
             verify: Union[bool, str]) -> tuple[RuntimeTransport, dict[str, Any]]:
    """The transport to use, and the model facts (model_path, chat template, bos/eos) it reports."""
    if not base_url.startswith(("http://", "https://")):
        if transport == "http":
            raise ValueError(f"transport='http' needs the server's http:// URL; got {base_url!r}")
        zmq = ZmqRuntime(base_url, api_key, timeout)
        return zmq, zmq.model_facts()
    http = HttpRuntime(base_url, api_key, timeout, verify)
    try:
        server_info = http.server_info()
        address = server_info.get(ZMQ_ADDRESS_KEY) if isinstance(server_info, dict) else None
        if transport != "http" and isinstance(address, str):
            try:
                zmq = ZmqRuntime(reachable_address(address, base_url), api_key, timeout)
            except RuntimeUnavailableError as e:
                if transport == "zmq":
                    raise
                logger.warning("%s; speaking HTTP to %s instead", e, base_url)
            else:
                http.close()
                return zmq, zmq.model_facts()
        if transport == "zmq":
            raise RuntimeUnavailableError(
                f"the HTTP server at {base_url} names no ZeroMQ endpoint in /get_server_info (sglang-router and "
                "SGLang servers have none): use transport='auto' or 'http', or the runtime's tcp:// address")
        model_info = http.model_info()
        if not isinstance(model_info, dict) or not model_info.get("model_path"):
            raise RuntimeUnavailableError(
                f"the HTTP server at {base_url} names no ZeroMQ endpoint in /get_server_info and no model_path in "
                "/get_model_info: it is neither an sgl_lite server nor an SGLang-compatible one (server or router)")
        return http, served_model_facts(server_info if isinstance(server_info, dict) else {}, model_info)
    except BaseException:
        http.close()
        raise
