"""The `sgl-lite` command line: generated server flags, validation, one-shot commands."""

from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

from sgl_lite.cli import build_server_args, main, server_arg_options
from sgl_lite.lang.launcher import server_flags
from sgl_lite.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(120)


@click.command()
@server_arg_options
def parse_only(**values):
    """Parses the serve flags exactly like `sgl-lite serve`, without starting anything."""
    click.echo(repr(dataclasses.asdict(build_server_args(values))))


def test_serve_help_lists_every_server_arg():
    result = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in result.output, f.name
    assert "fcfs|lpm|dfs-weight|lof|random" in result.output
    assert "[default: 30000]" in result.output


def test_top_level_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("serve", "generate", "fetch-model", "demo"):
        assert command in result.output


def test_flags_round_trip_through_the_launcher_and_the_cli():
    args = ServerArgs(model_path="/models/x", dtype="float32", context_length=512, max_total_tokens=4096,
                      disable_radix_cache=True, schedule_policy="lpm", mem_fraction_static=0.25,
                      api_key="secret", port=0, enable_priority_scheduling=True, log_level="warning")
    result = CliRunner().invoke(parse_only, server_flags(args))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == repr(dataclasses.asdict(args))


def test_defaults_match_server_args():
    result = CliRunner().invoke(parse_only, [])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == repr(dataclasses.asdict(ServerArgs()))


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--max-total-tokens", "-5"], "--max-total-tokens"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (["--schedule-policy", "bogus"], "--schedule-policy"),
        (["--port", "abc"], "--port"),
        (["--dtype", "int3"], "--dtype"),
    ],
)
def test_bad_values_are_rejected_naming_the_flag(argv, named):
    result = CliRunner().invoke(main, ["serve", *argv])
    assert result.exit_code == 2, result.output
    assert named in result.output


def test_generate_against_nothing_fails_clearly():
    result = CliRunner().invoke(main, ["generate", "--address", "tcp://127.0.0.1:9", "--prompt", "hi", "--timeout", "1"])
    assert result.exit_code == 1
    assert "not responding" in result.output


def test_generate_rejects_negative_max_new_tokens():
    result = CliRunner().invoke(main, ["generate", "--address", "tcp://127.0.0.1:9", "--prompt", "hi",
                                       "--max-new-tokens", "-3"])
    assert result.exit_code == 2 and "--max-new-tokens" in result.output


def test_fetch_model_prints_a_local_folder(tiny_llama_dir):
    folder = tiny_llama_dir
    result = CliRunner().invoke(main, ["fetch-model", str(folder)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(folder)


def test_fetch_model_names_a_missing_path(tmp_path):
    missing = tmp_path / "does-not-exist"
    result = CliRunner().invoke(main, ["fetch-model", str(missing)])
    assert result.exit_code == 1
    assert str(missing) in result.output


def test_serve_dp_router_args_reach_the_router_and_override_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sglang_router")
    from sglang_router.launch_router import parse_router_args

    import sgl_lite.cluster as cluster

    seen: dict = {}

    def fake_launch(args, dp, router_policy="cache_aware", **kw):  # stands in for the processes
        seen.update(dp=dp, policy=router_policy, router_args=kw["router_args"], port=args.port)
        return 0

    monkeypatch.setattr(cluster, "launch_cluster", fake_launch)
    result = CliRunner().invoke(main, ["serve", "--dp-size", "2", "--port", "18000",
                                       "--router-args=--balance-abs-threshold 64 --cache-threshold 0.5"])
    assert result.exit_code == 0, result.output
    assert seen["port"] == 18000  # the router listens on --port, SGLang's HTTP port
    assert seen["dp"] == 2 and seen["router_args"] == ["--balance-abs-threshold", "64", "--cache-threshold", "0.5"]
    # The command Cluster runs: sgl_lite's default first, the user's flags after it, as the router parses them.
    cmd = cluster.router_command(["http://127.0.0.1:1"], "127.0.0.1", 18000, seen["policy"])
    default = parse_router_args(cmd[3:])
    assert default.balance_abs_threshold == 1
    overridden = parse_router_args(cmd[3:] + seen["router_args"])
    assert overridden.balance_abs_threshold == 64 and overridden.cache_threshold == 0.5
    plain = parse_router_args(cluster.router_command(["http://127.0.0.1:1"], "127.0.0.1", 18000, "round_robin")[3:])
    assert plain.balance_abs_threshold == 64  # sglang-router's own default when not cache_aware
