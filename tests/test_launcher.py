"""`sgl.Runtime(...)`: SGLang's `launch_timeout` works as our `startup_timeout`, and the API key
reaches the server process through its environment, never its command line (`ps` shows those)."""

from __future__ import annotations

from pathlib import Path

import pytest

import sgl_lite as sgl
from sgl_lite.lang.launcher import RuntimeLaunchError, api_key_env, serve_command
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError
from sgl_lite.runtime.server_args import API_KEY_ENV, ServerArgs

pytestmark = pytest.mark.timeout(120)

KEY = "launcher-test-key-51c2e8"
GREEDY = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
SERVER_ARGS = {"dtype": "float32", "log_level": "warning", "max_total_tokens": 1024}


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_launch_timeout_is_honoured_as_startup_timeout(tiny_llama_dir: Path) -> None:
    # No server loads a model in 10 ms: the error proves this timeout, not the 600 s default, was used.
    with pytest.raises(RuntimeLaunchError, match="not ready after 0.01 s"):
        sgl.Runtime(model_path=str(tiny_llama_dir), launch_timeout=0.01, **SERVER_ARGS)
    with pytest.raises(ValueError, match="not both"):
        sgl.Runtime(model_path=str(tiny_llama_dir), launch_timeout=60, startup_timeout=60, **SERVER_ARGS)
    with pytest.raises(ValueError, match="launch_timeout/startup_timeout must be > 0"):
        sgl.Runtime(model_path=str(tiny_llama_dir), launch_timeout=0, **SERVER_ARGS)


def test_runtime_with_launch_timeout_serves_and_keeps_the_key_off_its_command_line(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A different key in our own environment must not override the one the Runtime was given.
    monkeypatch.setenv(API_KEY_ENV, "a-key-the-child-must-not-use")
    with sgl.Runtime(model_path=str(tiny_llama_dir), launch_timeout=120, api_key=KEY, **SERVER_ARGS) as runtime:
        assert KEY not in command_line(runtime.pid)
        assert len(runtime.client.generate("hello", sampling_params=GREEDY).output_ids) == GREEDY["max_new_tokens"]
        for wrong_key in (None, "a-key-the-child-must-not-use"):
            with RuntimeClient(runtime.address, api_key=wrong_key, timeout=30) as client:
                with pytest.raises(RuntimeRequestError) as refused:
                    client.generate("hello", sampling_params=GREEDY)
                assert refused.value.code == "unauthorized"


def test_child_commands_and_environments_carry_exactly_the_given_key() -> None:
    args = ServerArgs(model_path="/models/x", api_key=KEY, port=0)
    command = serve_command(args)
    assert KEY not in command and "--api-key" not in command and "/models/x" in command
    inherited = {API_KEY_ENV: "inherited-key", "OTHER": "1"}
    assert api_key_env(inherited, KEY) == {API_KEY_ENV: KEY, "OTHER": "1"}
    assert api_key_env(inherited, None) == {"OTHER": "1"}  # a keyless child must not pick up ours
