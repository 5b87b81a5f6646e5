"""The extend (prefill) attention kernel at two versions of the code, timed in one process, interleaved.

As scripts/ab_attention_builds.py does for decode attention: builds `kernels/csrc/attention/extend_attention.cpp`
with its headers as they are at git revision --base and as they are in the working tree, each as a
library of its own name (scripts/ab_matmul_builds.py's `base_and_tree`), and times one layer's attention
per case, the two builds alternating (each first in every other round), best of --repeats per round.
Heads as the 1.7B shape has them (32 query and 32 KV heads of 64, bf16); each case keeps --layers pools
and calls them in turn, so that K/V come from memory as in a served step rather than from cache:

- 3000 + 500, 6000 + 200, 3000 + 2000: an agent's observation or tool result over a long conversation;
- 450 + 90 x 8: eight sessions' turns in one step;
- 3000 + 500 scattered: the prefix's slots in random order, as after eviction.

Prints a table (ms per layer, the ratio base / working tree, and the largest difference between the two
builds' outputs) and writes JSON; the baseline is the --base build, measured in the same run.

Usage: python scripts/ab_extend_builds.py [--base HEAD] [--rounds 3] [--repeats 3] [--layers 4]
       [--out artifacts/ab_extend_builds.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from ab_matmul_builds import base_and_tree, in_turn, timing_cells  # noqa: E402
from bench_decode_kernels import best_seconds  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402

HEADS, DIM = 32, 64
CASES = {  # name: (prefix, new tokens per request, requests, scattered slots)
    "3000 + 500": (3000, 500, 1, False),
    "6000 + 200": (6000, 200, 1, False),
    "3000 + 2000": (3000, 2000, 1, False),
    "450 + 90 x 8": (450, 90, 8, False),
    "3000 + 500 scattered": (3000, 500, 1, True),
}


def make_case(prefix: int, new: int, requests: int, scattered: bool, layers: int, g: torch.Generator) -> dict:
    """One layer's inputs for `requests` extends of `new` tokens over `prefix` cached, with `layers` pools."""
    context = prefix + new
    slots = requests * context
    pools = [(torch.randn(slots, HEADS, DIM, generator=g).bfloat16(), torch.randn(slots, HEADS, DIM, generator=g).bfloat16())
             for _ in range(layers)]
    indices = torch.randperm(slots, generator=g) if scattered else torch.arange(slots)
    table = torch.tensor([[i * new, new, i * context, context] for i in range(requests)], dtype=torch.int64)
    q = torch.randn(requests * new, HEADS, DIM, generator=g).bfloat16()
    return {"q": q, "pools": pools, "requests": table, "indices": indices.to(torch.int64)}


def ms_per_layer(op, case: dict, repeats: int) -> tuple[float, torch.Tensor]:
    """The fastest pass over the case's pools (ms per layer), and the output of the last call."""
    out = torch.zeros_like(case["q"])
    args = (case["requests"], case["indices"], DIM**-0.5, out)

    def one_pass() -> None:
        for k, v in case["pools"]:
            op(case["q"], k, v, *args)
    return 1e3 * best_seconds(one_pass, repeats) / len(case["pools"]), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="pools per case, called in turn")
    parser.add_argument("--out", default=artifact_path("ab_extend_builds.json"))
    args = parser.parse_args()
    ops = base_and_tree("extend_attention", args.base)
    g = torch.Generator().manual_seed(0)
    cases = {name: make_case(*shape, args.layers, g) for name, shape in CASES.items()}
    ms: dict[str, dict[str, list[float]]] = {name: {build: [] for build in ops} for name in cases}
    diff: dict[str, float] = {}
    with tqdm(total=args.rounds * len(cases) * len(ops), desc="extend attention, two builds") as bar:
        for round_ in range(args.rounds):
            for name, case in cases.items():
                outs = {}
                for build, op in in_turn(ops, round_):
                    t, outs[build] = ms_per_layer(op, case, args.repeats)
                    ms[name][build].append(t)
                    bar.update()
                diff[name] = (outs["base"].float() - outs["working tree"].float()).abs().max().item()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, extend_attention: --base {args.base} against the working tree, one layer "
          f"({HEADS} query / {HEADS} KV heads of {DIM}, bf16), ms, best of {args.repeats} per round, {args.rounds} rounds interleaved\n")
    print("| case | base | working tree | base / working tree (best rounds) | largest output difference |\n|---|---|---|---:|---:|")
    for name in cases:
        print(f"| {name} | {timing_cells(ms[name])} | {diff[name]:.3g} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"time": time.time(), "args": vars(args), "threads": torch.get_num_threads(), "ms": ms,
                               "max_abs_diff": diff}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
