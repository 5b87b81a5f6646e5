"""The endpoints sglang-router calls on its workers, with SGLang's response shapes.

What the router (sglang-router 0.3.2, observed on loopback with debug logs) calls on a worker:
at registration GET /health, then GET /server_info and GET /model_info (falling back to the
/get_server_info and /get_model_info names on a 404); periodically GET /health (or the endpoint
given by --health-check-endpoint, e.g. /health_generate); GET /get_load for load-aware policies and
the router's /get_loads; POST /flush_cache; and it forwards /generate, /v1/chat/completions,
/v1/completions and /v1/models. /get_load answers SGLang's list of per-DP-rank loads: the router
reads and sums `num_tokens`; any other shape reads as load -1 (unknown).

The server_info and model_info answers name the model the same way on every replica
(served_model_name), because the router labels each worker with it and, in multi-model mode,
routes by it. model_info has SGLang 0.5.23's keys, plus the model's chat template and its bos/eos
tokens (SGLang reports none; its clients ignore keys they do not read): the router passes a worker's
/get_model_info on, so a DSL client behind it reads the runtime's own template from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Response
from fastapi.params import Depends

import sgl_lite
from sgl_lite.http.model_context import ModelContextCache
from sgl_lite.runtime.client.discovery import ZMQ_ADDRESS_KEY

# server_info keys that describe the runtime's state rather than its configuration.
_INTERNAL_STATE_KEYS = ("num_waiting", "num_running", "num_chunked", "slots_total", "slots_free",
                        "slots_evictable", "slots_protected", "cached_tokens_total", "prompt_tokens_total",
                        "cache_hit_rate", "num_forward_steps", "new_token_ratio")


def sglang_server_info(info: dict[str, Any], served_model_name: str, runtime_address: str) -> dict[str, Any]:
    """The runtime's server_info in SGLang's shape: server args flattened to the top level (as SGLang's
    ServerArgs are), the scheduler's state under internal_states, and the fields the router reads;
    plus the ZeroMQ address of the runtime, from which DSL clients given this server's URL connect."""
    server_args = info.get("server_args") or {}
    out: dict[str, Any] = {**server_args, **info}
    out.update({
        "served_model_name": served_model_name,
        "tp_size": int(server_args.get("tp_size") or 1),
        "dp_size": 1,  # each worker is one replica; the router does the data parallelism
        "max_total_tokens": info.get("slots_total"),
        "max_running_requests": info.get("max_running_requests"),
        "max_prefill_tokens": server_args.get("max_prefill_tokens"),
        "version": sgl_lite.__version__,
        ZMQ_ADDRESS_KEY: runtime_address,
        "internal_states": [{key: info[key] for key in _INTERNAL_STATE_KEYS if key in info}],
    })
    return out


def sglang_model_info(info: dict[str, Any], served_model_name: str) -> dict[str, Any]:
    """SGLang's /model_info: paths, names, parsers, is_generation, and model_type/architectures when the
    model's config.json is readable from this process (the HTTP front may run on another machine); then
    the runtime's chat template, bos_token and eos_token (see the module docstring)."""
    model_path = info.get("model_path")
    server_args = info.get("server_args") or {}
    config = _read_model_config(model_path)
    return {
        "model_path": model_path,
        "served_model_name": served_model_name,
        "tokenizer_path": server_args.get("tokenizer_path") or model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": server_args.get("reasoning_parser"),
        "tool_call_parser": server_args.get("tool_call_parser"),
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "chat_template": info.get("chat_template"),
        "bos_token": info.get("bos_token"),
        "eos_token": info.get("eos_token"),
    }


def sglang_load(info: dict[str, Any]) -> list[dict[str, Any]]:
    """SGLang's /get_load: one entry per DP rank (one here). num_tokens counts the KV slots that
    requests hold (neither free nor merely cached), the quantity SGLang reports."""
    held = (info.get("slots_total") or 0) - (info.get("slots_free") or 0) - (info.get("slots_evictable") or 0)
    waiting = int(info.get("num_waiting") or 0)
    return [{"dp_rank": 0, "num_reqs": int(info.get("num_running") or 0) + waiting,
             "num_waiting_reqs": waiting, "num_tokens": max(0, held)}]


def _read_model_config(model_path: str | None) -> dict[str, Any]:
    if not model_path:
        return {}
    config_file = Path(model_path) / "config.json"
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def add_worker_routes(app: FastAPI, *, server_info: Callable[[], Awaitable[dict[str, Any]]],
                      contexts: ModelContextCache, health_generate: Callable[[], Awaitable[None]],
                      protected: list[Depends], runtime_address: str) -> None:
    """Register SGLang's worker routes on `app`.

    `server_info` is the runtime's server_info (runtime errors already mapped to HttpError);
    `health_generate` runs a one-token generation and raises when the runtime cannot serve one.
    """

    @app.get("/health_generate", dependencies=protected)
    async def health_generate_route() -> Response:
        await health_generate()
        return Response(status_code=200)

    @app.get("/server_info", dependencies=protected)
    @app.get("/get_server_info", dependencies=protected)
    async def server_info_route() -> dict[str, Any]:
        context = await contexts.get()
        return sglang_server_info(await server_info(), context.served_model_name, runtime_address)

    @app.get("/model_info", dependencies=protected)
    @app.get("/get_model_info", dependencies=protected)
    async def model_info_route() -> dict[str, Any]:
        context = await contexts.get()
        return sglang_model_info(context.model_info, context.served_model_name)

    @app.get("/get_load", dependencies=protected)
    @app.get("/load", dependencies=protected)
    async def load_route() -> list[dict[str, Any]]:
        return sglang_load(await server_info())

