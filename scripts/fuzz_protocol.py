"""Long property-based fuzz of the wire protocol, request validation and a live server process.

    python scripts/fuzz_protocol.py                       # 10000 server messages (+ decoder and validation runs)
    python scripts/fuzz_protocol.py --server-messages 50000 --seed 3 --output fuzz.json

Three hypothesis runs with the strategies of sgl_lite/testing/fuzz.py:
1. decoder: every payload decodes to a request/reply or raises msgspec's ValidationError/DecodeError;
2. validation: generated GenerateReqs go through RuntimeCore.make_req + Scheduler.add_request on an
   in-process Engine; whatever is accepted must run to completion without a failed forward pass;
3. server: raw frames to a `sgl-lite serve` subprocess over a DEALER socket, each followed by a health
   probe; every --valid-every messages a valid greedy request from another socket must get the
   unloaded answer; no reply may be undecodable or report an internal error; at the end the process
   is alive, idle, and its KV accounting holds.
Exit status 0 when every property held; a JSON report goes to --output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.lang.launcher import Runtime  # noqa: E402
from sgl_lite.runtime import protocol  # noqa: E402
from sgl_lite.runtime.server.engine import Engine  # noqa: E402
from sgl_lite.testing.fuzz import FuzzSession, frame_lists, payloads, request_dicts, run_fuzzed_request  # noqa: E402
from sgl_lite.testing.kv_accounting import accounting_problems  # noqa: E402
from sgl_lite.testing.tiny_model import make_tiny_model  # noqa: E402

VALID_PROMPT = "The quick brown fox"
VALID_PARAMS = {"max_new_tokens": 4, "temperature": 0.0}
SERVER_ARGS = dict(dtype="float32", device="cpu", context_length=96, max_total_tokens=1024, max_message_bytes=1024,
                   log_level="error")


def hypothesis_settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz_decoders(n: int, rng_seed: int) -> int:
    count = 0

    @seed(rng_seed)
    @hypothesis_settings(n)
    @given(payloads())
    def check(payload: bytes) -> None:
        nonlocal count
        count += 1
        for decode in (protocol.decode_request, protocol.decode_reply):
            try:
                decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass

    check()
    return count


def fuzz_validation(engine: Engine, n: int, rng_seed: int) -> dict[str, int]:
    core = engine.core
    outcomes = {"refused": 0, "ran": 0, "not_generate": 0}

    @seed(rng_seed)
    @hypothesis_settings(n)
    @given(request_dicts())
    def check(fields: dict) -> None:
        outcomes[run_fuzzed_request(core, fields)] += 1

    check()
    return outcomes


def _idle(info: dict) -> bool:
    return info["num_running"] + info["num_waiting"] + info["num_chunked"] + info["num_grammar_pending"] == 0


def fuzz_server(rt: Runtime, expected: list[int], n: int, valid_every: int, rng_seed: int) -> tuple[FuzzSession, list[str]]:
    session = FuzzSession(rt.address, VALID_PROMPT, VALID_PARAMS, expected, valid_every=valid_every)

    @seed(rng_seed)
    @hypothesis_settings(n)
    @given(frame_lists())
    def check(frames: list[bytes]) -> None:
        session.send(frames)
        assert rt.process.poll() is None, "the server process died"

    problems: list[str] = []
    try:
        check()
        session.check_valid()
        session.settle(lambda: _idle(rt.client.server_info()))
        if rt.process.poll() is not None:
            problems.append(f"the server exited with {rt.process.returncode}")
        else:
            problems += accounting_problems(rt.client.server_info())
    finally:
        session.close()
    return session, problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="Default: a tiny random model written to a temp dir.")
    p.add_argument("--decoder-examples", type=int, default=20000)
    p.add_argument("--validation-examples", type=int, default=2000)
    p.add_argument("--server-messages", type=int, default=10000)
    p.add_argument("--valid-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=artifact_path("fuzz_report.json"))
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = args.model_path or str(make_tiny_model(Path(tmp.name) / "model"))
    report: dict = {"seed": args.seed}
    problems: list[str] = []

    started = time.monotonic()
    report["decoder_examples"] = fuzz_decoders(args.decoder_examples, args.seed)
    report["decoder_s"] = round(time.monotonic() - started, 1)
    print("decoder:", report["decoder_examples"], "payloads", flush=True)

    engine_args = {k: v for k, v in SERVER_ARGS.items() if k != "max_message_bytes"}
    with Engine(model_path=model, **engine_args) as engine:
        started = time.monotonic()
        report["validation"] = fuzz_validation(engine, args.validation_examples, args.seed)
        report["validation_s"] = round(time.monotonic() - started, 1)
        print("validation:", report["validation"], flush=True)
        expected = engine.generate(VALID_PROMPT, dict(VALID_PARAMS))["output_ids"]

    started = time.monotonic()
    with Runtime(model_path=model, startup_timeout=600, client_timeout=120, **SERVER_ARGS) as rt:
        session, server_problems = fuzz_server(rt, expected, args.server_messages, args.valid_every, args.seed)
        rt.shutdown()
        if rt.process.returncode != 0:
            server_problems.append(f"the server exited with {rt.process.returncode} on SIGTERM")
    stats = session.stats
    report["server"] = {"messages": stats.messages, "replies": stats.replies, "error_replies": stats.errors,
                        "valid_checks": stats.valid_checks, "lost_probes": stats.lost_probes,
                        "seconds": round(time.monotonic() - started, 1)}
    problems += stats.problems + server_problems
    report["num_problems"] = len(problems)
    report["problems"] = problems[:50]
    output_file(args.output).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "problems"}), flush=True)
    for problem in problems[:20]:
        print("PROBLEM:", problem, flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
