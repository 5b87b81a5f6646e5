"""Test hooks that make forward passes fail or take long on purpose, to exercise failure handling.

    SGL_LITE_FAULT_INJECT=forward:N               every Nth forward pass raises InjectedFault (before the model runs)
    SGL_LITE_FAULT_INJECT=slow_forward:SECONDS    every forward pass first sleeps SECONDS (a long step)
    SGL_LITE_FAULT_INJECT=disk_io:N               every Nth read or write of the disk KV tier fails (OSError)

`RuntimeCore.from_args` reads the variable once; when it is unset (always, outside tests) nothing is
wrapped and this module costs nothing. The server subprocess started by `Runtime` inherits the
caller's environment, so a test or scripts/soak.py sets it around the launch. What a failed forward
must cost is the scheduler's contract: only that batch's requests end (aborted, the message naming
the cause), their KV is released, and the runtime keeps serving. What a slow one must cost is time
only: a client waiting through it must not declare the runtime dead (tests/test_client_liveness.py).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any, Callable

logger = logging.getLogger(__name__)

ENV_VAR = "SGL_LITE_FAULT_INJECT"
_FORMS = ("'forward:N' (N >= 1: every Nth forward pass fails), 'slow_forward:SECONDS' (every forward pass sleeps "
          "first) or 'disk_io:N' (every Nth disk tier read or write fails)")


class InjectedFault(RuntimeError):
    """Raised by a forward pass that the fault-injection hook chose to fail."""


def parse_fault_spec(spec: str) -> int:
    """`forward:N` -> N (>= 1); ValueError naming the variable for anything else."""
    kind, _, every = spec.partition(":")
    if kind != "forward" or not every.isdigit() or int(every) < 1:
        raise ValueError(f"{ENV_VAR} must be {_FORMS}; got {spec!r}")
    return int(every)


def parse_slow_forward_spec(spec: str) -> float:
    """`slow_forward:SECONDS` -> SECONDS (finite, >= 0); ValueError naming the variable for anything else."""
    kind, _, seconds = spec.partition(":")
    try:
        delay = float(seconds)
    except ValueError:
        delay = math.nan
    if kind != "slow_forward" or not math.isfinite(delay) or delay < 0:
        raise ValueError(f"{ENV_VAR} must be {_FORMS}; got {spec!r}")
    return delay


def install_fault_injection(runner: Any, environ: Mapping[str, str] = os.environ) -> str | None:
    """Wrap `runner.forward` per the environment; returns the spec installed, or None when there is none."""
    spec = environ.get(ENV_VAR)
    if not spec or spec.startswith("disk_io:"):
        return None
    real_forward: Callable[[Any], Any] = runner.forward
    if spec.startswith("slow_forward:"):
        delay = parse_slow_forward_spec(spec)

        def forward(batch: Any) -> Any:
            time.sleep(delay)
            return real_forward(batch)

        logger.warning("TEST HOOK %s=%s: every forward pass sleeps %g s first", ENV_VAR, spec, delay)
    else:
        every = parse_fault_spec(spec)
        calls = itertools.count(1)

        def forward(batch: Any) -> Any:
            call = next(calls)
            if call % every == 0:
                raise InjectedFault(f"injected fault in forward pass {call} ({ENV_VAR}={spec})")
            return real_forward(batch)

        logger.warning("TEST HOOK %s=%s: every %d. forward pass will fail", ENV_VAR, spec, every)
    runner.forward = forward
    return spec


def disk_fault_hook(environ: Mapping[str, str] = os.environ) -> Callable[[str, str], None] | None:
    """For `disk_io:N`, the DiskKVStore fault hook that fails every Nth read or write; else None."""
    spec = environ.get(ENV_VAR)
    if not spec or not spec.startswith("disk_io:"):
        return None
    every = parse_fault_spec(spec.replace("disk_io:", "forward:", 1))
    calls = itertools.count(1)

    def fault(op: str, key: str) -> None:
        call = next(calls)
        if call % every == 0:
            raise OSError(f"injected disk fault in {op} {call}, block {key} ({ENV_VAR}={spec})")

    logger.warning("TEST HOOK %s=%s: every %d. disk tier read or write will fail", ENV_VAR, spec, every)
    return fault
