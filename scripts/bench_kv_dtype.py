"""What an 8-bit KV cache changes: greedy agreement with the model-dtype cache on the same prompts.

For each --kv-cache-dtype (auto, fp8_e4m3, fp8_e5m2) the default model greedy-decodes the same prompts (a
fixed set of English instructions through the chat template, one batch) with the cpu_kernel backend;
every fp8 output is compared token by token with the `auto` output: the share of prompts whose
continuation is identical, and the mean length of the common prefix. The prompt's own attention is
unquantized (a prefill without a cached prefix reads its new K/V directly); every decode step reads
the rounded cache.

Usage: python scripts/bench_kv_dtype.py [--model smollm2-135m] [--dtype auto] [--new-tokens 48] [--prompts 40]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.runtime.managers.request import Req  # noqa: E402
from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator  # noqa: E402
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch  # noqa: E402
from sgl_lite.runtime.model_executor.loader import resolve_model_path  # noqa: E402
from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.protocol import SamplingParams  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

SUBJECTS = ["the moon", "a bicycle", "photosynthesis", "the Roman empire", "a compiler", "rain", "chess", "bread",
            "volcanoes", "the internet", "a violin", "honey bees", "glaciers", "a lighthouse", "coffee", "electric cars",
            "the printing press", "octopuses", "black holes", "a marathon"]
TASKS = ["Explain {} to a child in three sentences.", "Write a short poem about {}."]


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    alloc = SlotAllocator(runner.num_slots)
    reqs = []
    for i, ids in enumerate(prompts):
        req = Req(rid=str(i), input_ids=ids, sampling_params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
        req.req_pool_idx = runner.req_to_token.alloc()
        reqs.append(req)
    extend = [len(p) for p in prompts]
    for _ in range(new_tokens):
        slots = alloc.alloc(sum(extend))
        offset = 0
        for req, n in zip(reqs, extend):
            runner.req_to_token.table[req.req_pool_idx, req.kv_len : req.kv_len + n] = slots[offset : offset + n]
            offset += n
        out = runner.forward(ForwardBatch(reqs=reqs, prefix_lens=[r.kv_len for r in reqs], extend_lens=extend, out_cache_loc=slots,
                                          sample=[True] * len(reqs), is_decode=all(n == 1 for n in extend)))
        for req, n, tok in zip(reqs, extend, out.next_token_ids):
            req.kv_len += n
            req.output_ids.append(tok)
        extend = [1] * len(reqs)
    return [r.output_ids for r in reqs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=40, help=f"at most {len(SUBJECTS) * len(TASKS)}")
    parser.add_argument("--out", default=artifact_path("bench_kv_dtype.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [task.format(subject) for task in TASKS for subject in SUBJECTS][: args.prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True) for t in texts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    slots = sum(len(p) for p in prompts) + len(prompts) * args.new_tokens + 64
    outputs = {}
    for kv in ("auto", "fp8_e4m3", "fp8_e5m2"):
        runner = ModelRunner(ServerArgs(model_path=str(model_dir), dtype=args.dtype, device="cpu", attention_backend="cpu_kernel",
                                        kv_cache_dtype=kv, max_total_tokens=slots, max_running_requests=len(prompts) + 1), model_dir=model_dir)
        with torch.inference_mode():
            outputs[kv] = greedy(runner, prompts, args.new_tokens)
        dtype_name = str(runner.dtype).removeprefix("torch.")
        del runner
    results = {}
    print(f"model {model_dir.name}, dtype {dtype_name}, {len(prompts)} prompts x {args.new_tokens} greedy tokens, cpu_kernel\n")
    print("| KV cache | identical continuations | mean common prefix (tokens) |")
    print("|---|---:|---:|")
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        same = sum(a == b for a, b in zip(outputs[kv], outputs["auto"]))
        prefix = sum(common_prefix(a, b) for a, b in zip(outputs[kv], outputs["auto"])) / len(prompts)
        results[kv] = {"identical": same, "prompts": len(prompts), "mean_common_prefix": prefix}
        print(f"| {kv} vs auto ({dtype_name}) | {same}/{len(prompts)} | {prefix:.1f} of {args.new_tokens} |")
    output_file(args.out).write_text(json.dumps({"model": str(model_dir), "dtype": dtype_name, "args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
