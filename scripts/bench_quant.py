"""What --quantization changes in the output: greedy agreement and perplexity against bf16, same run.

For each system (bf16 dense = the reference; w8a16_int8 and w4a16_int4 on bf16 activations; w8a8_int8,
whose activations are quantized per token too; w4a8_int4, 4-bit weights and 8-bit activations; fp32 dense, to show how far bf16 itself is from fp32):
- greedy agreement over --num-prompts prompts: each prompt is a window of a fixed English text, continued
  greedily for --new-tokens tokens; reported: the share of prompts whose continuation equals bf16's
  exactly, the share whose first token does, and the mean length of the common prefix;
- perplexity of --ppl-windows windows of --ppl-len tokens of the same text (scored in one prefill each).

The served model picks the weight-only kernels only for steps of at most QUANTIZED_MAX_ROWS rows
(layers/linear.py), so a prompt's prefill and large decode batches stay dense. Here every matmul is
forced onto the quantized kernels: the numbers bound what any request can see (a single stream's decode).
w8a8_int8 takes every call anyway (its LM head in int8 x 16-bit activations, W8A16Int8); forced, w4a8_int4
computes every call with 4-bit weights and 8-bit activations (served, its calls of many rows take the same
values rounded to int8).

`--kernels` instead times the matmul kernels alone at the model's shapes (fused qkv, o, gate_up, down,
LM head) for several row counts: the dense oneDNN-packed bf16 kernel vs the small-row bf16 kernel, int8,
int4, w8a8_int8, the int8 x 16-bit kernel of w8a8's LM head and w4a8_int4's kernel of few rows, interleaved, best of --kernel-repeats
calls each (the same weight every call: what fits in the caches reads from them); this is what
QUANTIZED_MAX_ROWS is chosen from.

The text is Python's own documentation (pydoc_data.topics: the language reference, ~460 kB of English),
so it is fixed for a given Python version and needs no download.
Usage: nice python scripts/bench_quant.py [--model smollm2-135m] [--num-prompts 200] [--out bench_quant.json]
       python scripts/bench_quant.py --kernels [--rows 1,2,4,8,32] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from runner_bench import RunnerBench  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file  # noqa: E402
from sgl_lite.runtime.layers.linear import GemvLinear, QuantizedLinear, gemv_kernel, linear, quantize_linear  # noqa: E402
from sgl_lite.runtime.layers.quantization.w8a8 import W8A16Int8  # noqa: E402
from sgl_lite.runtime.managers.request import Req  # noqa: E402
from sgl_lite.runtime.model_executor.loader import load_tokenizer, resolve_model_path  # noqa: E402
from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.protocol import SamplingParams  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

SYSTEMS = {"bf16": ("bfloat16", None), "w8a16_int8": ("bfloat16", "w8a16_int8"),
           "w4a16_int4": ("bfloat16", "w4a16_int4"), "w8a8_int8": ("bfloat16", "w8a8_int8"),
           "w4a8_int4": ("bfloat16", "w4a8_int4"), "fp32": ("float32", None)}


def fixed_text_ids(tokenizer) -> list[int]:
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    return tokenizer.encode(text, add_special_tokens=False)


def force_quantized(runner: ModelRunner) -> None:
    for module in [*runner.model.layers, runner.model]:
        packed = module.packed.values() if hasattr(module, "packed") else [module.packed_lm_head]
        for linear in packed:
            if isinstance(linear, QuantizedLinear):
                linear.max_rows = None


def greedy(bench: RunnerBench, prompts: list[list[int]], new_tokens: int, batch: int) -> list[list[int]]:
    outs: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        reqs = bench._reqs(prompts[start : start + batch])
        bench._step(reqs, [len(r.input_ids) for r in reqs])
        for _ in range(new_tokens - 1):
            bench._step(reqs, [1] * len(reqs))
        outs += [list(r.output_ids) for r in reqs]
        bench._release(reqs)
    return outs


def perplexity(bench: RunnerBench, windows: list[list[int]]) -> float:
    total, count = 0.0, 0
    for ids in windows:
        req = Req(rid="ppl", input_ids=ids, sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
                  return_logprob=True, logprob_start_len=0)
        req.req_pool_idx = bench.runner.req_to_token.alloc()
        bench._step([req], [len(ids)])
        total -= sum(req.input_token_logprobs)
        count += len(req.input_token_logprobs)
        bench._release([req])
    return math.exp(total / count)


def kernel_table(model_dir: Path, rows: list[int], repeats: int) -> None:
    from sgl_lite.runtime.model_executor.loader import load_config

    config = load_config(model_dir)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
              "lm_head": (config.vocab_size, hidden)}
    g = torch.Generator().manual_seed(0)
    print(f"\n{model_dir.name}, bf16 activations, {torch.get_num_threads()} threads, best of {repeats} (microseconds)\n")
    print("| weight | [N, K] | rows | dense bf16 (oneDNN) | small-row bf16 | w8a16_int8 | w4a16_int4 | w8a8_int8 | int8 x 16-bit (w8a8's LM head) | w4a8_int4 (few rows) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
        dense = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        small_rows = GemvLinear.pack(weight, None) if gemv_kernel(weight) is not None else None
        kernels = {"dense": lambda x: linear(x, weight, None, dense)}
        if small_rows is not None:
            kernels["small-row"] = lambda x: small_rows(x, weight, None)
        for method in ("w8a16_int8", "w4a16_int4", "w8a8_int8", "w4a8_int4"):
            kernels[method] = quantize_linear(method, weight, None).quantized.matmul
        kernels["w8a16_vnni"] = W8A16Int8(weight).matmul
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            best = dict.fromkeys(kernels, math.inf)
            for _ in range(repeats):  # interleaved: a disturbance hits all three alike
                for key, fn in kernels.items():
                    start = time.perf_counter()
                    fn(x)
                    best[key] = min(best[key], time.perf_counter() - start)
            base = best["dense"]
            cells = " | ".join(f"{best[key] * 1e6:.0f} ({base / best[key]:.2f}x)" if key in best else "-"
                               for key in ("small-row", "w8a16_int8", "w4a16_int4", "w8a8_int8", "w8a16_vnni", "w4a8_int4"))
            print(f"| {name} | [{n}, {k}] | {m} | {base * 1e6:.0f} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--ppl-len", type=int, default=512)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", default=artifact_path("bench_quant.json"))
    parser.add_argument("--kernels", action="store_true", help="time the matmul kernels alone (see above)")
    parser.add_argument("--rows", default="1,2,4,8,32")
    parser.add_argument("--kernel-repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    if args.kernels:
        kernel_table(model_dir, [int(r) for r in args.rows.split(",")], args.kernel_repeats)
        return
    ids = fixed_text_ids(load_tokenizer(model_dir))
    ppl_span = args.ppl_windows * args.ppl_len
    windows = [ids[i * args.ppl_len : (i + 1) * args.ppl_len] for i in range(args.ppl_windows)]
    stride = (len(ids) - ppl_span - args.prompt_len) // args.num_prompts
    if stride < args.prompt_len:
        raise SystemExit(f"the text has {len(ids)} tokens: too few for {args.num_prompts} prompts of {args.prompt_len}")
    prompts = [ids[ppl_span + i * stride : ppl_span + i * stride + args.prompt_len] for i in range(args.num_prompts)]
    pool = args.batch * (args.prompt_len + args.new_tokens) + args.ppl_len + 64

    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name in tqdm(args.systems.split(","), desc="bench_quant"):
        dtype, quantization = SYSTEMS[name]
        runner = ModelRunner(ServerArgs(model_path=str(model_dir), dtype=dtype, device="cpu", quantization=quantization,
                                        max_total_tokens=pool, max_running_requests=args.batch + 1), model_dir=model_dir)
        force_quantized(runner)
        bench = RunnerBench(runner)
        start = time.perf_counter()
        outputs[name] = greedy(bench, prompts, args.new_tokens, args.batch)
        results[name] = {"perplexity": perplexity(bench, windows), "seconds": time.perf_counter() - start}
        del bench, runner

    reference = outputs.get("bf16")
    print(f"\nmodel {model_dir.name}; {args.num_prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} greedy "
          f"tokens each; perplexity over {ppl_span} tokens (pydoc_data.topics, Python {sys.version.split()[0]})\n")
    print("| system | greedy = bf16 (whole continuation) | first token = bf16 | mean common prefix (tokens) | perplexity |")
    print("|---|---:|---:|---:|---:|")
    for name, row in results.items():
        if reference is not None:
            pairs = list(zip(outputs[name], reference))
            row["exact_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
            row["first_token_agreement"] = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
            row["mean_common_prefix"] = sum(_common_prefix(a, b) for a, b in pairs) / len(pairs)
            cells = f"{row['exact_agreement']:.1%} | {row['first_token_agreement']:.1%} | {row['mean_common_prefix']:.1f}"
        else:
            cells = "- | - | -"
        print(f"| {name} | {cells} | {row['perplexity']:.3f} |")
    output_file(args.out).write_text(json.dumps({"model": str(model_dir), "args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {args.out}")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
