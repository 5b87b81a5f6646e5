"""The `sgl-lite` command: serve, http, generate, bench, fetch-model, demo, simulate.

`serve` has one option per ServerArgs field, generated from the dataclass (flag name, type, choices,
default and help all come from the field), so the CLI can never fall behind the runtime's flags.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
import shlex
import sys
import typing
from typing import Any, Callable

import click

from sgl_lite.cluster import ROUTER_POLICIES  # stdlib only; the processes start when the command runs
from sgl_lite.runtime.server_args import ADMIN_API_KEY_ENV, API_KEY_ENV, ServerArgs, field_base_type, flag_of

_FLAG_IN_MESSAGE = re.compile(r"(--[a-z0-9-]+)")
_PARENT_DEATH_GRACE_S = 5.0
# Flags read from the environment when not given: a secret on a command line is visible in `ps`.
_ENV_VARS = {"api_key": API_KEY_ENV, "admin_api_key": ADMIN_API_KEY_ENV}


def _server_arg_option(f: dataclasses.Field, annotation: Any) -> Callable[[Any], Any]:
    flag = flag_of(f.name)
    aliases = list(f.metadata.get("aliases", ()))  # SGLang's short spellings (--model, --tp)
    help_text = f.metadata.get("help", "")
    base = field_base_type(annotation)
    if base is bool:
        decls = [f"{flag}/{flag_of(f.name, negated=True)}"] if f.default else [flag, *aliases]
        return click.option(*decls, f.name, is_flag=True, default=f.default, show_default=True, help=help_text)
    choices = f.metadata.get("choices")
    click_type: Any = _HintedChoice(choices, f.metadata.get("hints", {})) if choices else base
    envvar = _ENV_VARS.get(f.name)
    if envvar:
        help_text += f" Default: ${envvar}; prefer it to the flag on a shared machine (`ps` shows command lines)."
    return click.option(flag, *aliases, f.name, type=click_type, default=f.default, show_default=True, help=help_text,
                        envvar=envvar)


class _HintedChoice(click.Choice):
    """A choice whose likely wrong values (e.g. SGLang habits) get a hint instead of the bare list."""

    def __init__(self, choices: Any, hints: dict[str, str]) -> None:
        super().__init__(choices)
        self.hints = hints

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value in self.hints:
            self.fail(self.hints[value], param, ctx)
        return super().convert(value, param, ctx)


def server_arg_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `command` with one click option per ServerArgs field, in declaration order."""
    hints = typing.get_type_hints(ServerArgs)
    for f in reversed(dataclasses.fields(ServerArgs)):
        command = _server_arg_option(f, hints[f.name])(command)
    return command


def build_server_args(values: dict[str, Any]) -> ServerArgs:
    """ServerArgs from parsed options; a validation error becomes a click error naming the flag."""
    try:
        return ServerArgs(**values)
    except ValueError as e:
        match = _FLAG_IN_MESSAGE.search(str(e))
        raise click.BadParameter(str(e), param_hint=match.group(1) if match else None) from None


class LazyGroup(click.Group):
    """A group whose heavier commands are imported only when invoked (or listed), so that
    `sgl-lite generate` does not pay for torch, FastAPI or the simulator at start-up."""

    lazy_commands = {
        "http": "sgl_lite.http.launch:http_command",
        "simulate": "sgl_lite.sim.cli:simulate_command",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            module, attr = self.lazy_commands[name].split(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
def main() -> None:
    """sgl-lite: an SGLang-style LLM runtime (RadixAttention, continuous batching) and prompt DSL."""


@main.command()
@server_arg_options
@click.option("--served-model-name", default=None, help="Model name reported by the HTTP API (default: --model-path).")
@click.option("--dp-size", "--dp", "dp_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data parallelism: N runtime replicas (each on its share of the CPUs, with its HTTP API on a free "
                   "loopback port) behind sglang-router on --host/--port (needs sglang-router installed).")
@click.option("--router-policy", type=click.Choice(ROUTER_POLICIES), default="cache_aware", show_default=True,
              help="sglang-router's routing policy when --dp-size > 1.")
@click.option("--router-args", default="", show_default=True,
              help="sgl_lite: extra sglang-router flags when --dp-size > 1, one shell-quoted string (they override "
                   "sgl_lite's router defaults, e.g. --router-args='--balance-abs-threshold 64').")
@click.option("--parent-pid", type=int, default=None, hidden=True)
def serve(served_model_name: str | None, dp_size: int, router_policy: str, router_args: str,
          parent_pid: int | None, **values: Any) -> None:
    """Run the server until SIGINT/SIGTERM: the HTTP API (OpenAI-compatible and SGLang-native) on
    --host/--port, and the ZeroMQ endpoint of DSL programs on --zmq-port (named by /server_info, so
    sgl.RuntimeEndpoint("http://HOST:PORT") finds it); with --dp-size N, N replicas behind sglang-router."""
    args = build_server_args(values)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from sgl_lite.runtime.server.ports import PortUnavailableError

    try:
        if dp_size > 1:
            sys.exit(_serve_cluster(args, dp_size, router_policy, served_model_name, shlex.split(router_args)))
        _serve_one(args, served_model_name, parent_pid)
    except PortUnavailableError as e:
        raise click.ClickException(str(e)) from None


def _serve_one(args: ServerArgs, served_model_name: str | None, parent_pid: int | None) -> None:
    """One runtime and its HTTP front; every setup mistake ends here as one line (SetupError)."""
    import os
    import signal

    from sgl_lite.http.guards.limits import HttpLimits
    from sgl_lite.http.launch import HttpFront
    from sgl_lite.runtime.free_port import connect_host, url_host
    from sgl_lite.runtime.model_executor.loader import LoaderError
    from sgl_lite.runtime.server.parent_watch import exit_with_parent
    from sgl_lite.runtime.server.ports import claim_ports
    from sgl_lite.runtime.server.preflight import SetupError, check_setup
    from sgl_lite.runtime.server.process import run_server

    if parent_pid is not None:  # started by sgl.Runtime() or a cluster: do not outlive it
        exit_with_parent(parent_pid, lambda: _stop_self(os.getpid(), signal.SIGTERM))
    claimed = claim_ports(args)  # first: a taken port is found at once, before the model is even read
    args = claimed.args
    try:
        check_setup(args)
    except SetupError as e:
        claimed.close()
        raise click.ClickException(str(e)) from None
    zmq_address = args.host if args.host.startswith("ipc://") else f"tcp://{url_host(connect_host(args.host))}:{args.zmq_port}"
    limits = HttpLimits(args.max_request_body_bytes, args.max_chat_messages, args.max_request_fanout)
    front = HttpFront(zmq_address, claimed.http_socket, api_key=args.api_key, admin_api_key=args.admin_api_key,
                      served_model_name=served_model_name, log_level=args.log_level, limits=limits,
                      log_requests=args.log_requests)
    claimed.http_socket.close()  # the front holds it now; a dead front must refuse connections, not queue them

    def after_bind(request_shutdown: Callable[[], None]) -> list[str]:
        try:
            return [front.wait_ready(on_exit=request_shutdown)]
        except RuntimeError as e:
            raise SetupError(str(e)) from None

    try:
        run_server(args, after_bind, zmq_fd=claimed.take_zmq_fd())
    except (SetupError, LoaderError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        claimed.close()
        front.stop()


def _stop_self(pid: int, signum: int) -> None:
    """Parent gone: stop like on SIGTERM (in-flight requests get an error), or hard after a grace period."""
    import os
    import threading

    os.kill(pid, signum)
    timer = threading.Timer(_PARENT_DEATH_GRACE_S, lambda: os._exit(1))
    timer.daemon = True
    timer.start()


def _serve_cluster(args: ServerArgs, dp_size: int, router_policy: str, served_model_name: str | None,
                   router_args: list[str]) -> int:
    from sgl_lite.cluster import ClusterError, launch_cluster

    try:
        return launch_cluster(args, dp_size, router_policy, served_model_name=served_model_name,
                              router_args=router_args)
    except ClusterError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.option("--address", default="http://127.0.0.1:30000", show_default=True,
              help="The server's URL (its --port; the ZeroMQ endpoint is found from it) or its ZeroMQ address "
                   "(tcp://host:port, ipc://path).")
@click.option("--prompt", required=True, help="Prompt text (sent as is, no chat template).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--api-key", envvar=API_KEY_ENV, default=None,
              help=f"Key the server was started with (--api-key). Default: ${API_KEY_ENV}.")
@click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=600.0, show_default=True,
              help="Seconds to wait for the runtime before giving up.")
def generate(address: str, prompt: str, max_new_tokens: int, temperature: float, stream: bool,
             api_key: str | None, timeout: float) -> None:
    """Send one generate request to a running server and print the answer."""
    from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError, RuntimeUnavailableError
    from sgl_lite.runtime.client.discovery import discover_zmq_address

    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    try:
        if address.startswith(("http://", "https://")):
            address = discover_zmq_address(address, api_key, timeout=min(timeout, 10.0))
        client = RuntimeClient(address, api_key=api_key, timeout=timeout)
    except (ValueError, RuntimeRequestError, RuntimeUnavailableError) as e:
        raise click.ClickException(str(e)) from None
    with client:
        try:
            if stream:
                for chunk in client.generate_stream(prompt, sampling_params=params):
                    click.echo(chunk.text, nl=False)
                click.echo()
            else:
                click.echo(client.generate(prompt, sampling_params=params).text)
        except RuntimeRequestError as e:
            raise click.ClickException(f"{e.code}: {e.message}") from None
        except RuntimeUnavailableError as e:
            raise click.ClickException(str(e)) from None


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
def bench(bench_args: tuple[str, ...]) -> None:
    """Serving benchmark: workloads, baselines, table/JSON/plots (see `sgl-lite bench --help`)."""
    from sgl_lite.bench.driver import main as bench_main

    sys.exit(bench_main(list(bench_args), prog="sgl-lite bench"))


@main.command("fetch-model")
@click.argument("model", default="smollm2-135m")
def fetch_model(model: str) -> None:
    """Resolve MODEL (alias, .gguf file or HF folder) into a cached HF folder and print its path."""
    from sgl_lite.runtime.model_executor.loader import LoaderError, resolve_model_path

    try:
        click.echo(str(resolve_model_path(model)))
    except LoaderError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.option("--model-path", default="smollm2-135m", show_default=True, help="Model to run the demo on.")
def demo(model_path: str) -> None:
    """Start a runtime and run the multi-turn ReAct agent, printing its turns and the cache hit rate."""
    from sgl_lite.demo_agent import main as run_agent_demo

    run_agent_demo(model_path)




if __name__ == "__main__":
    main()
