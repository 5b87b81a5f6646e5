"""A test hook that makes forward passes fail on purpose, to exercise the runtime's failure handling.

    SGL_LITE_FAULT_INJECT=forward:N    every Nth forward pass raises InjectedFault (before the model runs)

`RuntimeCore.from_args` reads the variable once; when it is unset (always, outside tests) nothing is
wrapped and this module costs nothing. The server subprocess started by `Runtime` inherits the
caller's environment, so a test or scripts/soak.py sets it around the launch. What a failed forward
must cost is the scheduler's contract: only that batch's requests end (aborted, the message naming
the cause), their KV is released, and the runtime keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

ENV_VAR = "SGL_LITE_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised by a forward pass that the fault-injection hook chose to fail."""


def parse_fault_spec(spec: str) -> int:
    """`forward:N` -> N (>= 1); ValueError naming the variable for anything else."""
    kind, _, every = spec.partition(":")
    if kind != "forward" or not every.isdigit() or int(every) < 1:
        raise ValueError(f"{ENV_VAR} must be 'forward:N' with N >= 1 (every Nth forward pass fails); got {spec!r}")
    return int(every)


def install_fault_injection(runner: Any, environ: Mapping[str, str] = os.environ) -> int | None:
    """Wrap `runner.forward` per the environment; returns N, or None when no fault is injected."""
    spec = environ.get(ENV_VAR)
    if not spec:
        return None
    every = parse_fault_spec(spec)
    real_forward = runner.forward
    calls = itertools.count(1)

    def forward(batch: Any) -> Any:
        call = next(calls)
        if call % every == 0:
            raise InjectedFault(f"injected fault in forward pass {call} ({ENV_VAR}={spec})")
        return real_forward(batch)

    runner.forward = forward
    logger.warning("TEST HOOK %s=%s: every %d. forward pass will fail", ENV_VAR, spec, every)
    return every
