"""Model-level throughput: sgl_lite's ModelRunner vs transformers vs the machine's matmul and memory limits.

Measures, in one run on the same weights and dtype:
- prefill tokens/s for one long prompt (default 1024 tokens);
- decode tokens/s at several batch sizes (default 1, 8, 32), once per attention variant (default: the
  torch_native reference, the cpu_kernel C++ decode kernel, and that kernel over an fp8_e4m3 KV pool),
  the variants interleaved round by round so that load on a shared box hits them alike; a variant
  `backend+w8a16_int8` / `+w4a16_int4` also runs the matmuls as with that --quantization, and
  `backend+onednn` runs every matmul through oneDNN (without the small-row bf16 kernel, as before it);
next to transformers (a forward over the prompt; generate() with a KV cache for decode) and next to
two limits and the lower of them (the roofline):
- matmul limit: GFLOP/s of the variant's own matmul kernels (as the model picks them by row count: the
  small-row bf16 kernel, oneDNN-packed bf16, a --quantization's int8/int4 kernels, else F.linear) at the
  model's first layer's weights and LM head and the batch's row count, at 1 thread and at all (the better),
  one layer's weights timed over and over (so they sit in cache: an upper bound), divided by
  2 x (matmul parameters per token). Attention FLOPs are not part of it;
- memory limit: the bytes a decode step must read (every matmul weight and the LM head once, in the form
  the step's calls use - quantized bytes for a +quantization variant up to its row limit - plus each
  request's K and V over all layers at its mean context length during the timed steps, in the variant's
  KV dtype) divided by the read bandwidth measured here (sum over a 512 MiB float32 tensor with the same
  threads; measured before each batch size, the best of the run for every row). Activations and caches
  are ignored, so both limits are upper bounds, and where the matmul limit is the lower one a step cannot
  reach its memory limit whatever its reads cost.
  A shared host's read rate can move widely within a minute (other tenants' traffic), so a window measured
  in a slow minute set against the run's fastest probe says little about the step. Hence also a paired
  figure: each timed window is bracketed by two probes, set against the memory limit at the faster of
  those two, and the median of those ratios over the rounds is reported ("/ memory limit, paired").

Prints a markdown table, writes JSON (and a PNG when matplotlib is installed).
Usage: python scripts/bench_model.py [--model smollm2-135m] [--dtype auto|bf16|fp32] [--threads N]
       [--variants torch_native,cpu_kernel,cpu_kernel/fp8_e4m3,cpu_kernel+w4a16_int4] [--out artifacts/bench_model.json]
The machine's load average is printed with the table: on a shared box, other processes skew every column
(the variants' ratio within one run is the robust figure).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from runner_bench import DTYPE_FLAGS, RunnerBench  # noqa: E402
from tqdm import tqdm  # noqa: E402

from sgl_lite.bench.artifacts import artifact_path, output_file, pyplot, save_png  # noqa: E402
from sgl_lite.runtime.layers.attention import TorchNativeBackend, create_backend  # noqa: E402
from sgl_lite.runtime.layers.linear import (  # noqa: E402
    GemvLinear,
    QuantizedLinear,
    linear,
)
from sgl_lite.runtime.mem_cache.memory_pool import KVPool, kv_cache_dtype  # noqa: E402
from sgl_lite.runtime.model_executor.loader import resolve_model_path  # noqa: E402
from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

MATMUL_WEIGHTS = {"qkv": "qkv_weight", "o": "o_weight", "gate_up": "gate_up_weight", "down": "down_weight"}


def matmul_limit(runner: ModelRunner, forms: tuple[list[dict], object], rows: int, with_lm_head: bool,
                 repeats: int = 10, prefill: bool = False) -> dict:
    """Time a variant's own matmul kernels (`forms`: its packed forms per layer and the LM head's, as the
    model calls them, quantized ones included) at the model's first layer's weights for `rows` tokens, at
    1 thread and at all (the better of the two, as the thread governor picks), each the best of `repeats`
    runs; return GFLOP/s and the implied tokens/s. `prefill`: the calls of a forward with prefill rows
    (their row limits, layers/linear.py)."""
    layer = runner.model.layers[0]
    layer_forms, head_form = forms[0][0], forms[1]
    weights = [(getattr(layer, attr), layer_forms.get(name)) for name, attr in MATMUL_WEIGHTS.items()]
    head = runner.model.lm_head
    x = torch.randn(rows, max(w.shape[1] for w, _ in weights + [(head, None)]), dtype=runner.dtype)

    def timed(fn) -> float:
        fn()  # warm-up (packing, allocation)
        best = float("inf")
        for _ in range(repeats):  # the best run: a limit is what the kernels can do, not what neighbours allow
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    def step_time() -> float:
        # one set of layer weights timed, scaled to all layers (they share shapes)
        layer_time = timed(lambda: [linear(x[:, : w.shape[1]].contiguous(), w, None, f, prefill) for w, f in weights])
        head_time = timed(lambda: linear(x[:, : head.shape[1]].contiguous(), head, None, head_form)) if with_lm_head else 0.0
        return layer_time * runner.config.num_hidden_layers + head_time

    governor = runner.thread_governor
    current = torch.get_num_threads()
    counts = sorted({1, governor.max_threads}) if governor else [current]
    best = float("inf")
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            best = min(best, step_time())
    finally:
        torch.set_num_threads(current)
    params_per_token = (sum(w.numel() for w, _ in weights) * runner.config.num_hidden_layers
                        + (head.numel() if with_lm_head else 0))
    gflops = 2 * params_per_token * rows / best / 1e9
    return {"gflops": gflops, "params_per_token": params_per_token, "tokens_per_s": gflops * 1e9 / (2 * params_per_token)}


def read_bandwidth(repeats: int = 5, x: torch.Tensor | None = None) -> float:
    """Bytes/s that a sum over a 512 MiB float32 tensor (`x`, or a new one) reads with torch's current
    threads (best of `repeats`)."""
    if x is None:
        x = torch.ones(128 << 20)
    x.sum()  # page faults and thread start-up out of the timing
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - start))
    return best


def decode_bytes(runner: ModelRunner, batch: int, context: float, kv_dtype: torch.dtype, packed: tuple[list[dict], object]) -> float:
    """Bytes one decode step reads at least: the matmul weights and LM head in the form this batch's calls
    use (a quantized weight's own bytes when `packed` quantizes it for calls of `batch` rows), and every
    request's K and V."""
    layers, head = packed
    itemsize = runner.dtype.itemsize

    def weight_bytes(dense: torch.Tensor, form: object) -> int:
        if isinstance(form, QuantizedLinear) and form.takes(batch):
            return form.quantized.nbytes
        return dense.numel() * itemsize

    weights = sum(weight_bytes(getattr(layer, attr), forms.get(name))
                  for layer, forms in zip(runner.model.layers, layers) for name, attr in MATMUL_WEIGHTS.items())
    weights += weight_bytes(runner.model.lm_head, head)
    kv = batch * context * KVPool.bytes_per_slot(runner.config.num_hidden_layers, runner.model.num_kv_heads, runner.model.head_dim, kv_dtype)
    return weights + kv


def _without_gemv(form: object) -> object:
    return form.packed_dense if isinstance(form, GemvLinear) else form


class Variant:
    """One way to run a decode step: an attention backend (torch_native or cpu_kernel), the KV pool's
    dtype, and the matmul forms (the runner's own, a --quantization's, or oneDNN's alone)."""

    def __init__(self, runner: ModelRunner, spec: str) -> None:
        attention, _, quantization = spec.partition("+")
        backend, _, kv = attention.partition("/")
        self.name = spec
        self.kv_dtype = kv_cache_dtype(kv or "auto", runner.dtype)
        self.attn = create_backend(backend, runner.device, runner.model.num_heads, runner.model.num_kv_heads, runner.model.head_dim)
        if backend == "cpu_kernel" and type(self.attn) is TorchNativeBackend:
            raise SystemExit("the cpu_kernel variant fell back to torch_native (see the log line above)")
        self.pool = KVPool(runner.config.num_hidden_layers, runner.num_slots, runner.model.num_kv_heads, runner.model.head_dim,
                           self.kv_dtype, runner.device)
        # +quantization: the matmul forms of a runner started with that --quantization (same weights);
        # +onednn: oneDNN's matmuls at every row count (no small-row bf16 kernel), the path before it existed
        matmul = quantization
        quantization = None if matmul == "onednn" else matmul
        source = ModelRunner(runner.args.replace(quantization=quantization), model_dir=runner.model_dir).model \
            if quantization else runner.model
        self.packed = [dict(layer.packed) for layer in source.layers], source.packed_lm_head
        if matmul == "onednn":
            self.packed = [{name: _without_gemv(form) for name, form in forms.items()} for forms in self.packed[0]], \
                _without_gemv(self.packed[1])

    def install(self, runner: ModelRunner) -> None:
        runner.attn, runner.kv_pool = self.attn, self.pool
        for layer, packed in zip(runner.model.layers, self.packed[0]):
            layer.packed = packed
        runner.model.packed_lm_head = self.packed[1]


class TransformersBench:
    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.inference_mode()
    def prefill(self, prompt: list[int], repeats: int) -> float:
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            self.model(torch.tensor([prompt]), logits_to_keep=1)
            best = max(best, len(prompt) / (time.perf_counter() - start))
        return best

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int, repeats: int) -> float:
        """Decode tokens/s inside generate(): timestamps taken by a logits processor, which runs once
        after the prefill forward and once after each decode forward, so the span from its first to
        its last call is exactly `steps` decode steps. Best of `repeats`."""
        import transformers

        class Stamps(transformers.LogitsProcessor):
            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.times.append(time.perf_counter())
                return scores

        ids = torch.tensor(prompts)  # equal lengths: no padding needed
        best = 0.0
        for _ in range(repeats):
            stamps = Stamps()
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                                do_sample=False, pad_token_id=0, logits_processor=transformers.LogitsProcessorList([stamps]))
            best = max(best, len(prompts) * steps / (stamps.times[-1] - stamps.times[0]))
        return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPE_FLAGS))
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--decode-prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--variants", default="torch_native,cpu_kernel+onednn,cpu_kernel,cpu_kernel/fp8_e4m3,"
                        "cpu_kernel+w8a16_int8,cpu_kernel+w4a16_int4",
                        help="decode variants, backend[/kv-cache-dtype][+quantization or +onednn], measured interleaved")
    parser.add_argument("--repeats", type=int, default=2, help="each number is the best of this many runs")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default=artifact_path("bench_model.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model_path(args.model)
    pool = max(args.prefill_len, max(batch_sizes) * (args.decode_prompt_len + args.decode_steps + 2)) + 64
    runner = ModelRunner(ServerArgs(model_path=str(model_dir), dtype=DTYPE_FLAGS[args.dtype], device="cpu", attention_backend="torch_native",
                                    max_total_tokens=pool, max_running_requests=max(batch_sizes) + 1), model_dir=model_dir,
                         keep_dense_weights=True)  # the +onednn variant may call F.linear on them
    variants = [Variant(runner, spec) for spec in args.variants.split(",")]
    ours = RunnerBench(runner)
    ref = None if args.skip_transformers else TransformersBench(model_dir, runner.dtype)
    # the best read rate seen over the run (measured again before each batch size: a shared host's bandwidth
    # moves from minute to minute, and a limit is an upper bound)
    probes = [read_bandwidth()]
    g = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(3, vocab, (n, length), generator=g).tolist()

    rows: list[dict] = []
    variants[0].install(runner)
    ours.prefill(prompts(1, 32)[0], 1)  # warm-up
    prompt = prompts(1, args.prefill_len)[0]
    limit = matmul_limit(runner, variants[0].packed, args.prefill_len, with_lm_head=False, prefill=True)
    rows.append({"phase": f"prefill {args.prefill_len} tok", "batch": 1, "variant": variants[0].name,
                 "sgl_lite": ours.prefill(prompt, args.repeats),
                 "transformers": ref.prefill(prompt, args.repeats) if ref else None,
                 "matmul_gflops": limit["gflops"], "limit": limit["tokens_per_s"], "memory_limit": None})
    # mean context over a timed window: the prompt, the warm-up step, then the window
    context = args.decode_prompt_len + 1 + (args.decode_steps + 1) / 2
    decode_rows: list[tuple[dict, Variant]] = []
    probe = torch.ones(128 << 20)  # the paired probes' tensor, allocated once
    for batch in tqdm(batch_sizes, desc="bench_model"):
        probes.append(read_bandwidth())
        ps = prompts(batch, args.decode_prompt_len)
        best = {v.name: 0.0 for v in variants}
        paired: dict[str, list[float]] = {v.name: [] for v in variants}
        step_bytes = {v.name: decode_bytes(runner, batch, context, v.kv_dtype, v.packed) for v in variants}
        for _ in range(args.repeats):  # interleaved: every variant once per round
            for v in variants:
                v.install(runner)
                before = read_bandwidth(3, probe)
                tokens_per_s = ours.decode(ps, args.decode_steps, 1)
                bandwidth_near = max(before, read_bandwidth(3, probe))
                best[v.name] = max(best[v.name], tokens_per_s)
                paired[v.name].append(tokens_per_s * step_bytes[v.name] / (batch * bandwidth_near))
        hf = ref.decode(ps, args.decode_steps, args.repeats) if ref else None
        for v in variants:
            limit = matmul_limit(runner, v.packed, batch, with_lm_head=True)
            row = {"phase": "decode", "batch": batch, "variant": v.name, "sgl_lite": best[v.name], "transformers": hf,
                   "vs_first_variant": best[v.name] / best[variants[0].name],
                   "matmul_gflops": limit["gflops"], "limit": limit["tokens_per_s"],
                   "memory_limit_paired_ratios": paired[v.name], "memory_limit_paired": statistics.median(paired[v.name])}
            rows.append(row)
            decode_rows.append((row, v))
    bandwidth = max(probes)
    for row, v in decode_rows:  # at the run's best bandwidth
        row["memory_limit"] = row["batch"] * bandwidth / decode_bytes(runner, row["batch"], context, v.kv_dtype, v.packed)
        row["roofline"] = min(row["limit"], row["memory_limit"])

    dtype_name = str(runner.dtype).removeprefix("torch.")
    load = os.getloadavg()[0]
    print(f"\nload average {load:.1f} on {os.cpu_count()} CPUs; read bandwidth {bandwidth / 1e9:.1f} GB/s (the best of "
          f"{len(probes)} probes over the run; the lowest {min(probes) / 1e9:.1f})")
    governor = runner.thread_governor  # torch's count now is whatever the governor chose last
    threads = f"1-{governor.max_threads} (adaptive)" if governor else str(torch.get_num_threads())
    print(f"model {model_dir.name}, dtype {dtype_name}, threads {threads}, decode prompt "
          f"{args.decode_prompt_len} tok, {args.decode_steps} timed steps, best of {args.repeats} (tokens/s)\n")
    print("| phase | batch | attention | sgl_lite | vs " + variants[0].name + " | transformers | matmul limit | memory limit "
          "| / matmul limit | / memory limit | / memory limit, paired | / roofline | matmul GFLOP/s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hf = r["transformers"]
        mem = r["memory_limit"]
        print(f"| {r['phase']} | {r['batch']} | {r['variant']} | {r['sgl_lite']:.1f} | "
              f"{'-' if 'vs_first_variant' not in r else format(r['vs_first_variant'], '.2f') + 'x'} | "
              f"{'-' if hf is None else format(hf, '.1f')} | {r['limit']:.1f} | {'-' if mem is None else format(mem, '.1f')} | "
              f"{r['sgl_lite'] / r['limit']:.0%} | {'-' if mem is None else format(r['sgl_lite'] / mem, '.0%')} | "
              f"{'-' if mem is None else format(r['memory_limit_paired'], '.0%')} | "
              f"{'-' if mem is None else format(r['sgl_lite'] / r['roofline'], '.0%')} | {r['matmul_gflops']:.1f} |")
    out = output_file(args.out)
    out.write_text(json.dumps({"model": str(model_dir), "dtype": dtype_name, "threads": torch.get_num_threads(),
                               "load_average": load, "read_bandwidth": bandwidth,
                               "read_bandwidth_probes": probes, "args": vars(args), "results": rows}, indent=2))
    print(f"\nwrote {out}")
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{r['phase'].split()[0]} b{r['batch']}\n{r['variant']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows)), 4))
    for offset, key in ((-0.3, "sgl_lite"), (-0.1, "transformers"), (0.1, "limit"), (0.3, "memory_limit")):
        ax.bar([x + offset for x in xs], [r[key] or 0 for r in rows], width=0.2, label=key)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.legend()
    save_png(fig, out)


if __name__ == "__main__":
    main()
