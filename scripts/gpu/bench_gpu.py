"""Decode speed on the GPU against its memory roofline, and against transformers' `generate` on the same weights.

For each model shape (random weights, the default model's tokenizer: sgl_lite/runtime/model_executor/model_shapes.py) and
batch size: sgl_lite's decode tok/s from a ModelRunner driven directly (scripts/runner_bench.py, the
steps a served decode batch runs), eager and (CUDA) replayed from CUDA graphs, the bytes one step reads (weights + every request's KV), the device
bandwidth measured in the same run (a device-to-device copy), and so the roofline tok/s = batch /
(bytes / bandwidth); then transformers' greedy `generate` on the same folder at batch 1 and 8 (its tok/s
include its prefill, which is short next to the decode). Prints a table and writes JSON.

    python scripts/gpu/bench_gpu.py --tokenizer-dir DIR --models-dir DIR [--shapes 135m,1.7b] [--batches 1,8,64,256]
    python scripts/gpu/bench_gpu.py --device cpu --shapes 135m --batches 1,2 --steps 4    # a smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from runner_bench import RunnerBench  # noqa: E402

from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.model_executor.model_shapes import SHAPES, parameter_count, random_model_dir  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

CONTEXT = 512  # tokens of each request's prompt before the timed decode steps


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bandwidth(device: str) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (CPU: 256 MiB), best of 5."""
    n = (1 << 28) if device == "cuda" else (1 << 26)
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


def step_bytes(shape: str, batch: int, context: int) -> int:
    s = SHAPES[shape]
    kv_per_token = 2 * int(s["num_hidden_layers"]) * int(s["num_key_value_heads"]) * (int(s["hidden_size"]) // int(s["num_attention_heads"])) * 2
    return 2 * parameter_count(shape) + batch * context * kv_per_token


def decode_tok_s(model_dir: Path, device: str, batches: list[int], steps: int, repeats: int, graphs: bool) -> dict[int, float]:
    """sgl_lite's decode tok/s at each batch size, from one runner (CUDA graphs captured up to the largest batch,
    or off)."""
    largest = max(batches)
    args = ServerArgs(model_path=str(model_dir), device=device, dtype="bfloat16", log_level="warning",
                      max_total_tokens=largest * (CONTEXT + steps * (repeats + 2) + 8) + 64, max_running_requests=max(largest, 2),
                      context_length=4096, disable_cuda_graph=not graphs)
    runner = ModelRunner(args)
    out = {}
    try:
        for batch in batches:
            g = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(1000, 40000, (CONTEXT,), generator=g).tolist() for _ in range(batch)]
            out[batch] = RunnerBench(runner).decode(prompts, steps, repeats)
            print(f"  {model_dir.name} batch {batch:>4}, CUDA graphs {'on' if graphs else 'off'}: {out[batch]:9.1f} tok/s", flush=True)
    finally:
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def transformers_generate(model_dir: Path, device: str, batch: int, steps: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1000, 40000, (batch, CONTEXT), generator=g).to(device)
    kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **dict(kwargs, max_new_tokens=2, min_new_tokens=2))  # warm-up
        sync(device)
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        sync(device)
    del model
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", default="135m,1.7b")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--hf-batches", default="1,8", help="batch sizes for transformers' generate (empty: skip it)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer-dir", required=True, help="a model folder with the default model's config and tokenizer")
    parser.add_argument("--models-dir", required=True, help="where the random-weight models are written (reused when present)")
    parser.add_argument("--out", default="artifacts/bench_gpu.json")
    args = parser.parse_args()
    bw = bandwidth(args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    for shape in args.shapes.split(","):
        model_dir = random_model_dir(shape, args.tokenizer_dir, Path(args.models_dir) / f"random-{shape}")
        hf = {int(b): transformers_generate(model_dir, args.device, int(b), args.steps) for b in filter(None, args.hf_batches.split(","))}
        eager = decode_tok_s(model_dir, args.device, batches, args.steps, args.repeats, graphs=False)
        graphs: dict[int, float] = {}
        if args.device == "cuda":
            try:
                graphs = decode_tok_s(model_dir, args.device, batches, args.steps, args.repeats, graphs=True)
            except Exception:  # noqa: BLE001 - the eager figures stand; the log says why graphs did not run
                traceback.print_exc()
        for batch in batches:
            best = max(eager[batch], graphs.get(batch, 0.0))
            roofline = batch / (step_bytes(shape, batch, CONTEXT) / bw)
            rows.append(dict(shape=shape, batch=batch, eager_tok_s=eager[batch], graphs_tok_s=graphs.get(batch), roofline_tok_s=roofline,
                             of_roofline=best / roofline, transformers_tok_s=hf.get(batch)))
            versus = f", {best / hf[batch]:.1f}x transformers" if batch in hf else ""
            print(f"{shape:>5} batch {batch:>4}: eager {eager[batch]:9.1f} tok/s, graphs {graphs.get(batch, float('nan')):9.1f}, "
                  f"roofline {roofline:9.1f} ({best / roofline:5.1%}){versus}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=name, bandwidth_bytes_s=bw, context=CONTEXT, steps=args.steps, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
