"""Runtime processes default OpenMP to the passive wait policy, before torch loads, unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = ("from sgl_lite.runtime.openmp_env import prefer_passive_wait; before = prefer_passive_wait(); import torch, os; "
         "print(before, os.environ['OMP_WAIT_POLICY'], prefer_passive_wait())")


def _probe(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.split()


def test_passive_by_default_and_in_time():
    # True before torch is imported (the policy takes effect), False once it is (too late to matter)
    assert _probe() == ["True", "passive", "False"]


def test_user_choice_wins():
    assert _probe(OMP_WAIT_POLICY="active") == ["True", "active", "False"]
