"""Every runtime flag in one dataclass, shared by the Engine, the server and the CLI.

Names and defaults follow SGLang's `ServerArgs` wherever SGLang has the flag, so that users can
switch without relearning (`--schedule-policy`, `--max-prefill-tokens`, ...). Flags that SGLang
lacks are marked as sgl_lite's own in their help text.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import typing
from dataclasses import dataclass, field
from typing import Any

from sgl_lite.runtime.protocol import MAX_API_KEY_BYTES

logger = logging.getLogger(__name__)

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch_native", "cpu_kernel", "flashinfer")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
# Tool-call output formats the HTTP front parses (http/tool_parsers/), named as SGLang names them.
TOOL_CALL_PARSERS = ("qwen25", "llama3", "mistral", "hermes")
# Reasoning formats the HTTP front splits from answers (http/openai_api/reasoning_parser.py), SGLang's names.
REASONING_PARSERS = ("qwen3", "deepseek-r1")
# CPU quantization (runtime/layers/quantization; kept equal to its QUANTIZATION_METHODS by a test).
QUANTIZATIONS = ("w8a16_int8", "w4a16_int4", "w8a8_int8", "w4a8_int4")
# Where a child process (runtime, HTTP front, router) finds its API key: never on a command line (`ps`).
API_KEY_ENV = "SGL_LITE_API_KEY"
ADMIN_API_KEY_ENV = "SGL_LITE_ADMIN_API_KEY"


@dataclass
class ServerArgs:
    # Model and device.
    model_path: str = field(default="smollm2-135m", metadata={"help": "HF folder, .gguf file, or the alias smollm2-135m (default).", "aliases": ("--model",)})
    tokenizer_path: str | None = field(default=None, metadata={"help": "Tokenizer folder; defaults to the model's."})
    dtype: str = field(default="auto", metadata={"help": "auto picks bfloat16 on CUDA, where the CPU has native bf16 matmuls (amx_bf16 or avx512_bf16 in /proc/cpuinfo) or where sgl_lite's AVX2 kernels serve bf16 (AVX2 + FMA and the C++ ops built), else float32.", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, or auto (cuda when available).", "choices": DEVICES})
    attention_backend: str = field(default="auto", metadata={"help": "torch_native (plain torch, any device), cpu_kernel (sgl_lite: a C++ paged decode kernel, built on first use; falls back to torch_native if it cannot be built) or flashinfer (CUDA); auto picks flashinfer on CUDA, cpu_kernel on CPU.", "choices": ATTENTION_BACKENDS})
    cuda_graph_max_bs: int | None = field(default=None, metadata={"help": "CUDA: decode batches of up to this many requests replay CUDA graphs captured at start-up, one per batch-size bucket (1, 2, 4, 8, then every 8), padded to their bucket; larger ones run eagerly (default: --max-running-requests, at most 256)."})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "CUDA: run every decode step eagerly instead of replaying the CUDA graphs captured at start-up."})
    quantization: str | None = field(default=None, metadata={"help": "Quantization on CPU. Weight-only, for steps with few rows (decode at small batch; larger steps keep the dense weights): w8a16_int8 (per-row int8) or w4a16_int4 (groups of 32; a GGUF model's own Q4_0/Q4_1 blocks where it has them). w8a8_int8 (SGLang's): int8 weights per output channel and int8 activations per token, integer products on AVX512-VNNI (torch._int_mm elsewhere), every step (prefill too); the LM head in int8 with 16-bit activations. w4a8_int4: w4a16_int4's 4-bit weights by int8 activations per token for steps of up to 4 rows (AVX512-VNNI; torch's int4 kernel, up to 2, elsewhere), and those values in int8 with w8a8_int8's kernels for larger steps (prefill too), w8a8_int8's LM head, no dense copy (~1.6 bytes a weight). None: dense.", "choices": QUANTIZATIONS})
    context_length: int | None = field(default=None, metadata={"help": "Max tokens per request (prompt + output); defaults to the model's."})
    tp_size: int = field(default=1, metadata={"help": "Tensor parallelism: shard the model's heads and MLP over this many processes (gloo on CPU, NCCL on CUDA).", "aliases": ("--tp",)})
    random_seed: int | None = field(default=None, metadata={"help": "Seed for sampling of requests that give no seed of their own."})
    disable_adaptive_threads: bool = field(default=False, metadata={"help": "sgl_lite, CPU: run every forward on all of torch's threads (OMP_NUM_THREADS) instead of choosing 1 or all per batch size by measuring both (a busy core stalls multi-threaded decode; see docs/performance.md, 'Threads')."})
    chat_template: str | None = field(default=None, metadata={"help": "Chat template used instead of the tokenizer's: a file path, or a built-in name (smollm2-tools: SmolLM2's ChatML with tool calling, Qwen 2.5's format)."})

    # Tool calling (the HTTP front's /v1/chat/completions `tools`).
    tool_call_parser: str | None = field(default=None, metadata={"help": "Format of the model's tool calls, parsed into OpenAI tool_calls; requests with `tools` are refused without it.", "choices": TOOL_CALL_PARSERS})
    disable_tool_call_constraint: bool = field(default=False, metadata={"help": "sgl_lite: do not constrain tool calls with xgrammar (by default tool_choice required/named allows only schema-valid calls, and auto lets a started call be only schema-valid)."})
    reasoning_parser: str | None = field(default=None, metadata={"help": "Format of the model's reasoning (<think>...</think>), split from the answer into reasoning_content on chat completions and reasoning items on /v1/responses.", "choices": REASONING_PARSERS})

    # KV memory.
    mem_fraction_static: float | None = field(default=None, metadata={"help": "Fraction of the device memory left after the weights and a prefill chunk's activations (CPU: MemAvailable) given to the KV pool; default 0.5 on CPU, 0.85 on CUDA (model_executor/kv_budget.py)."})
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens; overrides --mem-fraction-static."})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV pool storage: auto (the model's dtype) or an 8-bit float, fp8_e4m3 / fp8_e5m2 (scale 1.0): half the bytes per token, twice the slots.", "choices": KV_CACHE_DTYPES, "hints": {d: "the KV cache is kept in the model's dtype (auto) or in 8 bits (fp8_e4m3, fp8_e5m2)" for d in ("bf16", "bfloat16")}})
    disable_radix_cache: bool = field(default=False, metadata={"help": "Turn prefix reuse off (every request prefills its whole prompt)."})

    # The disk tier under the radix tree (mem_cache/hicache/; docs/hierarchical-cache.md).
    enable_hierarchical_cache: bool = field(default=False, metadata={"help": "Keep KV the pool cannot hold in a disk tier: written when a turn ends (write_through) or when evicted (write_back), loaded back when a prompt continues it; kept across restarts of the same model in --hicache-storage-dir."})
    hicache_size: float = field(default=0.0, metadata={"help": "GiB of disk the tier may fill (least recently used blocks dropped first); 0: half the free space of --hicache-storage-dir's disk, at most 64 GiB."})
    hicache_write_policy: str = field(default="write_through", metadata={"help": "write_through: a request's KV goes to disk when it leaves the batch; write_back: when the radix tree evicts it.", "choices": HICACHE_WRITE_POLICIES})
    hicache_storage_backend: str | None = field(default=None, metadata={"help": "The tier's storage: file (the only one here, also the default), one file per block of KV.", "choices": ("file",)})
    hicache_storage_dir: str | None = field(default=None, metadata={"help": "sgl_lite: where the tier's files live (a folder per model fingerprint); default ~/.cache/sgl_lite/hicache."})

    # Batching and admission (SGLang's PrefillAdder budgets).
    max_running_requests: int | None = field(default=None, metadata={"help": "Max requests in the running batch (default: derived from the pool, at most 256)."})
    max_queued_requests: int | None = field(default=None, metadata={"help": "Max waiting requests; new ones are rejected when full (None: unbounded)."})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "Max new tokens in one prefill batch."})
    prefill_max_requests: int | None = field(default=None, metadata={"help": "Max requests in one prefill batch (None: unbounded)."})
    max_prefill_tokens_per_request: int | None = field(default=None, metadata={"help": "sgl_lite: a request whose prompt holds more tokens than this is refused (bad_request) before it is queued (None: the context length is its only bound)."})
    disable_fair_prefill: bool = field(default=False, metadata={"help": "sgl_lite: turn off prefill interleaving, as in SGLang: a prompt being chunked then takes every prefill round until it is done, and running requests decode only when no prefill is left (by default, while a prompt is chunked, every other prefill round first admits the waiting requests whose whole prompt fits it, and the running requests decode between the rounds of a prompt longer than a chunk; docs/scheduling.md)."})
    chunked_prefill_size: int | None = field(default=None, metadata={"help": "Prompts longer than this are prefilled in chunks (None: 2048 on CPU, 8192 on CUDA; -1 disables)."})
    enable_mixed_chunk: bool = field(default=False, metadata={"help": "Run the running requests' decode tokens in the same forward as a prefill batch, so a prefill does not pause decoding (their tokens come out of the chunk and prefill budgets; a failed forward then aborts them too)."})
    schedule_conservativeness: float = field(default=1.0, metadata={"help": "Larger reserves more room for future output tokens (fewer retractions, smaller batches)."})

    # Queue policy.
    schedule_policy: str = field(default="fcfs", metadata={"help": "Waiting-queue order (priority order is --enable-priority-scheduling, over any policy).", "choices": SCHEDULE_POLICIES, "hints": {"priority": "priority is not a queue policy here: add --enable-priority-scheduling (it orders by priority first, over any --schedule-policy)"}})
    lpm_fallback_threshold: int | None = field(default=None, metadata={"help": "sgl_lite: LPM/DFS-weight fall back to FCFS above this many waiting requests (SGLang hard-codes 128 because it re-matches the whole queue each step; sgl_lite orders incrementally, so the default None never falls back)."})
    disable_incremental_ordering: bool = field(default=False, metadata={"help": "sgl_lite: order the queue by sorting it (and, for LPM/DFS-weight, re-matching every waiting request) each step, SGLang's way, O(queue), instead of reading the incremental waiting index, O(admitted). Priority scheduling always sorts."})
    lpm_max_wait: float | None = field(default=None, metadata={"help": "sgl_lite: under LPM/DFS-weight, requests waiting longer than this many seconds go first (oldest first), so cache-cold requests cannot starve (None: no bound, SGLang's behaviour)."})
    in_batch_prefix_caching_check_threshold: int = field(default=32, metadata={"help": "sgl_lite: in-batch prefix de-duplication applies to requests whose cached prefix is shorter than this."})
    in_batch_prefix_caching_deprioritize_threshold: int = field(default=32, metadata={"help": "sgl_lite: such a request waits a round when it shares at least this many tokens with one admitted this round."})
    disable_in_batch_prefix_sharing: bool = field(default=False, metadata={"help": "sgl_lite: turn off in-batch prefix sharing, so every request of a prefill batch computes the prefix it shares with others, as in SGLang (by default a request reads the KV that an earlier request of the same batch computes for their common prefix, and reports those tokens as cached)."})

    # Priority scheduling.
    enable_priority_scheduling: bool = field(default=False, metadata={"help": "Order by request priority first, with threshold preemption of running requests."})
    schedule_low_priority_values_first: bool = field(default=False, metadata={"help": "Smaller priority values are more urgent (default: larger values are)."})
    priority_scheduling_preemption_threshold: int = field(default=10, metadata={"help": "Preempt a running request only when a waiting one is more urgent by more than this."})
    priority_aging_rate: float = field(default=0.0, metadata={"help": "sgl_lite: priority units a request gains per second since arrival (in the urgent direction), for ordering and preemption. A request at most D units less urgent than a stream of new arrivals overtakes them after D / rate seconds, so its queue wait is bounded by D / rate plus the time to drain what was ahead (0: SGLang's static priority)."})
    abort_on_priority_when_disabled: bool = field(default=False, metadata={"help": "Reject requests that carry a priority when priority scheduling is off."})

    # Constrained decoding (grammar compiles run on daemon worker threads, never on the scheduler's).
    max_grammar_chars: int = field(default=65536, metadata={"help": "sgl_lite: a regex, EBNF, JSON schema or structural tag longer than this many characters is refused (compile time and memory grow with it)."})
    max_json_schema_depth: int = field(default=64, metadata={"help": "sgl_lite: a JSON schema or structural tag nested deeper than this (JSON levels) is refused (its conversion grows super-linearly with depth)."})
    grammar_compile_workers: int = field(default=2, metadata={"help": "sgl_lite: worker processes compiling grammars (at most this many compiles at once); the smallest waiting spec is compiled first, and a free worker goes to the client with the fewest compiles running."})
    grammar_compile_timeout: float = field(default=60.0, metadata={"help": "sgl_lite: a request whose grammar is not compiled after this many seconds is refused (and its compile's worker process killed); a worker also stops a compile past this much CPU time."})
    disable_regex_jump_forward: bool = field(default=False, metadata={"help": "Turn jump-forward decoding off: by default text a request's grammar forces (fixed JSON keys, enum tails, a tool call's frame) is appended in one step, retokenized with the output's last tokens, instead of decoded token by token (docs/jump-forward.md).", "aliases": ("--disable-jump-forward",)})

    # Speculative decoding (SGLang's flag names; only the n-gram drafter, which needs no draft model).
    speculative_algorithm: str | None = field(default=None, metadata={"help": "ngram: draft tokens by looking the last tokens up in the request's own prompt and output, and verify every draft in the decode forward (greedy output unchanged, sampled output keeps its distribution). Default: off."})
    speculative_num_draft_tokens: int | None = field(default=None, metadata={"help": "Max draft tokens per request per step (default: --speculative-ngram-max-match-window-size, as in SGLang); each request drafts only as many as its acceptance history says are worth verifying at the current batch size."})
    speculative_ngram_min_match_window_size: int = field(default=1, metadata={"help": "Shortest suffix of a request's tokens looked up to draft."})
    speculative_ngram_max_match_window_size: int = field(default=12, metadata={"help": "Longest suffix looked up (the longest one found wins)."})
    speculative_ngram_capacity: int = field(default=16384, metadata={"help": "Tokens of recent requests' outputs kept in a shared pool that a request drafts from where it matches more of the request's last tokens than the request's own context does (oldest outputs dropped first; every drafting request scans it each step, ~6-40 us at 16k tokens). 0: no pool. SGLang's default is 10M trie entries."})

    # Server process.
    host: str = field(default="127.0.0.1", metadata={"help": "Bind address of the HTTP API and the ZeroMQ endpoint (loopback by default). An ipc:///path puts the ZeroMQ endpoint on an owner-only unix socket (HTTP then binds loopback)."})
    port: int = field(default=30000, metadata={"help": "HTTP port: the OpenAI-compatible and SGLang-native API (0 picks a free one)."})
    zmq_port: int | None = field(default=None, metadata={"help": "sgl_lite: port of the ZeroMQ endpoint that DSL programs use; clients find it from the HTTP server (/server_info names it), so sgl.RuntimeEndpoint('http://host:PORT') is enough. Default: --port + 1 (a free port when --port is 0); 0 picks a free one."})
    api_key: str | None = field(default=None, metadata={"help": "Refuse requests that do not carry this key."})
    admin_api_key: str | None = field(default=None, metadata={"help": "The key of administrative requests on the HTTP API: /abort_request with abort_all, or for a request another caller started, needs 'Authorization: Bearer <admin key>' (without this flag nobody may make those)."})
    max_message_bytes: int = field(default=64 * 1024 * 1024, metadata={"help": "sgl_lite: incoming messages larger than this are refused."})
    max_queued_replies_per_client: int = field(default=65536, metadata={"help": "sgl_lite: replies queued for one ZeroMQ client that does not read them (the socket's SNDHWM); past it the client is dropped and its requests aborted."})
    # HTTP front (`serve`, `sgl-lite http`).
    max_request_body_bytes: int = field(default=32 * 1024 * 1024, metadata={"help": "sgl_lite: HTTP request bodies larger than this get 413."})
    max_chat_messages: int = field(default=4096, metadata={"help": "sgl_lite: a chat request with more messages than this gets 400."})
    max_request_fanout: int = field(default=256, metadata={"help": "sgl_lite: one HTTP request may ask for at most this many generations (prompts x n); more get 400 before anything runs."})
    split_special_tokens_in_messages: bool = field(default=True, metadata={"help": "sgl_lite: a special-token string (e.g. <|im_start|>) that a chat message's text, name or tool call holds is tokenized as plain text, so a message cannot forge a turn; off, it becomes that control token, as transformers' apply_chat_template (and vLLM and SGLang) tokenize it. transformers calls the plain-text way split_special_tokens. Needs the HTTP front to read the model's tokenizer.json."})
    reuse_answer_ids: bool = field(default=True, metadata={"help": "sgl_lite: a chat whose text continues an earlier chat's prompt and answer (an agent's history: the answer sent back as an assistant message) gets the ids the model generated for that answer, not the answer's text tokenized again, which can split it otherwise (\\n\\n as one token where the model wrote two; sampled answers often do) and miss the prefix cache from there on. Off, chats get exactly transformers' ids. Needs the HTTP front to read the model's tokenizer.json (byte-level BPE)."})
    log_level: str = field(default="info", metadata={"help": "Logging level.", "choices": ("debug", "info", "warning", "error")})

    # SGLang flags its users type: implemented, or accepted saying what they mean on this build.
    trust_remote_code: bool = field(default=False, metadata={"help": "Accepted for SGLang compatibility; sgl_lite never runs code from a model folder (its Llama-family models are built in)."})
    page_size: int = field(default=1, metadata={"help": "Tokens per KV page: only 1 is supported (the radix tree and the KV pool index single tokens)."})
    grammar_backend: str = field(default="xgrammar", metadata={"help": "Constrained decoding backend: xgrammar, the one sgl_lite has.", "choices": ("xgrammar",)})
    stream_interval: int = field(default=1, metadata={"help": "A stream sends its first token at once, then its new text whenever this many tokens are unsent (and at its end); a request's sampling_params.stream_interval wins."})
    watchdog_timeout: float = field(default=300.0, metadata={"help": "A scheduler step running longer than this many seconds ends the server process (so a supervisor can restart it) instead of hanging."})
    disable_overlap_schedule: bool = field(default=False, metadata={"help": "Accepted for SGLang compatibility: sgl_lite has no overlap scheduler yet (each step is scheduled, run and processed in turn), so there is nothing to turn off."})
    enable_metrics: bool = field(default=False, metadata={"help": "Accepted for SGLang compatibility: the HTTP front always serves Prometheus metrics on /metrics (SGLang's sglang:* names and ours)."})

    # Logs, metrics and reproducibility (SGLang's flags).
    decode_log_interval: int = field(default=40, metadata={"help": "Log a 'Decode batch' line (running, tokens, usage, gen throughput, queue) every this many decode steps."})
    log_requests: bool = field(default=False, metadata={"help": "Log every finished request: its id, finish reason, token counts, and its input and output text (each cut to 512 tokens); the HTTP front's access line of each request then holds its body too (the first 2048 characters)."})
    enable_deterministic_inference: bool = field(default=False, metadata={"help": "Greedy results independent of the prefix cache and of batching (attention computes every row in fixed-size tiles and chunks, in float32, in a fixed order); slower, see README."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag when a value is out of range."""
        if self.api_key == "":  # an empty bearer token or PLAIN password is no secret
            raise ValueError("--api-key must not be empty (leave it out to serve without a key)")
        if self.api_key is not None and len(self.api_key.encode()) > MAX_API_KEY_BYTES:
            raise ValueError(f"--api-key is {len(self.api_key.encode())} bytes long; at most {MAX_API_KEY_BYTES} "
                             "(the ZeroMQ handshake carries it with a one-byte length)")
        if self.admin_api_key is not None and (self.admin_api_key == "" or self.admin_api_key == self.api_key):
            raise ValueError("--admin-api-key must not be empty nor equal to --api-key (every caller would be admin)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}; got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}; got {self.reasoning_parser!r}")
        for name in ("schedule_policy", "dtype", "device", "attention_backend", "kv_cache_dtype", "grammar_backend",
                     "hicache_write_policy"):
            choices = _FIELDS[name].metadata["choices"]
            hint = _FIELDS[name].metadata.get("hints", {}).get(getattr(self, name))
            if hint is not None:
                raise ValueError(f"{flag_of(name)} {getattr(self, name)}: {hint}")
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag_of(name)} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.speculative_algorithm is not None:
            self.speculative_algorithm = self.speculative_algorithm.lower()  # SGLang spells it NGRAM
            if self.speculative_algorithm != "ngram":
                raise ValueError(f"--speculative-algorithm must be ngram (the only drafter without a draft model); got {self.speculative_algorithm!r}")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1; got {self.speculative_num_draft_tokens}")
        if self.speculative_ngram_capacity < 0:
            raise ValueError(f"--speculative-ngram-capacity must be >= 0; got {self.speculative_ngram_capacity}")
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError("--speculative-ngram-min-match-window-size must be >= 1 and <= --speculative-ngram-max-match-window-size")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1; got {self.tp_size}")
        positive = ("decode_log_interval", "context_length", "max_total_tokens", "max_running_requests", "max_queued_requests",
                    "max_prefill_tokens", "prefill_max_requests", "max_prefill_tokens_per_request", "lpm_fallback_threshold", "max_message_bytes",
                    "max_queued_replies_per_client", "max_grammar_chars", "max_json_schema_depth",
                    "grammar_compile_workers", "max_request_body_bytes", "max_chat_messages", "max_request_fanout", "cuda_graph_max_bs")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{flag_of(name)} must be positive; got {value}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking; got 0")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1); got {self.mem_fraction_static}")
        if self.schedule_conservativeness <= 0:
            raise ValueError(f"--schedule-conservativeness must be positive; got {self.schedule_conservativeness}")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("--priority-scheduling-preemption-threshold must be >= 0")
        if self.priority_aging_rate < 0:
            raise ValueError(f"--priority-aging-rate must be >= 0; got {self.priority_aging_rate}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be positive; got {self.grammar_compile_timeout}")
        for name in ("port", "zmq_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{flag_of(name)} must be in 0..65535; got {value}")
        if self.port and self.resolved_zmq_port() == self.port:
            raise ValueError(f"--zmq-port must differ from --port (the HTTP port); both are {self.port}")
        if self.port == 65535 and self.zmq_port is None:
            raise ValueError("--port 65535 leaves no room for the default ZeroMQ port --port + 1: give --zmq-port")
        if self.page_size != 1:
            raise ValueError(f"--page-size {self.page_size}: only 1 is supported (the radix tree and the KV pool "
                             "index single tokens)")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1; got {self.stream_interval}")
        if self.watchdog_timeout <= 0:
            raise ValueError(f"--watchdog-timeout must be positive; got {self.watchdog_timeout}")
        if self.hicache_size < 0:
            raise ValueError(f"--hicache-size must be >= 0 GiB; got {self.hicache_size}")
        if self.hicache_storage_backend not in (None, "file"):
            raise ValueError(f"--hicache-storage-backend must be file; got {self.hicache_storage_backend!r}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache keeps the radix cache's KV on disk; it needs the radix cache "
                             "(drop --disable-radix-cache)")
        if self.enable_hierarchical_cache and self.tp_size > 1:
            raise ValueError("--enable-hierarchical-cache runs with --tp-size 1 (each rank's pool holds only its heads)")
        if self.lpm_max_wait is not None and self.lpm_max_wait < 0:
            raise ValueError(f"--lpm-max-wait must be >= 0; got {self.lpm_max_wait}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any unknown one (Engine(**server_args) uses this)."""
        unknown = sorted(set(kwargs) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def resolved_zmq_port(self) -> int:
        """The ZeroMQ port to bind: --zmq-port, else --port + 1; 0 (a free port) when --port is 0."""
        if self.zmq_port is not None:
            return self.zmq_port
        return self.port + 1 if self.port else 0

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def flag_of(name: str, negated: bool = False) -> str:
    """The command-line flag of a field, SGLang's rule: `max_running_requests` -> `--max-running-requests`
    (`--no-...` for a negated boolean). The CLI, the Runtime launcher and the benchmark all use this."""
    return ("--no-" if negated else "--") + name.replace("_", "-")


def field_base_type(annotation: Any) -> Any:
    """`int | None` -> int; plain types unchanged: the type a flag's value is parsed as."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else annotation


_FIELDS = {f.name: f for f in dataclasses.fields(ServerArgs)}


def warn_if_exposed(host: str, api_key: str | None, what: str) -> None:
    """Log a warning when `what` listens beyond this machine without an API key."""
    if api_key or host.startswith("ipc://") or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a host name: it may resolve to any interface
    if not loopback:
        logger.warning("%s listens on %s without an API key: anyone who can reach it can use it "
                       "(give --api-key, or bind 127.0.0.1)", what, host)
