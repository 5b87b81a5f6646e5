"""Benchmark settings: the BenchConfig dataclass, its command line, and the workload it describes.

Workload flag names follow SGLang's bench_serving (--gsp-*, --random-*, --num-prompts,
--request-rate, --max-concurrency) with defaults scaled down for a CPU. Every ServerArgs flag
except the ones the benchmark controls itself is accepted too and passed to each runtime started.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

from sgl_lite.bench.artifacts import artifact_path
from sgl_lite.bench.workloads import WORKLOAD_NAMES, Vocabulary, Workload, multiturn_agent, random_prompts, shared_prefix
from sgl_lite.cluster import ROUTER_POLICIES  # stdlib only: no process starts at import
from sgl_lite.runtime.server_args import ServerArgs, field_base_type, flag_of

SYSTEM_NAMES = ("sgl_lite", "no-cache", "hf")
# How --url is driven: SGLang's native /generate, or /v1/chat/completions (any OpenAI-compatible server).
URL_BACKENDS = ("sglang", "openai-chat")
# How an OpenAI chat system gets a multi-turn conversation: the whole history as one user message, or as
# alternating user and assistant messages.
CHAT_HISTORIES = ("one-message", "messages")
# How a token-id system gets a turn: the workload's ids, or the conversation as the HTTP front renders it
# (bench/chat_rendered.py).
PROMPT_FORMATS = ("ids", "chat")
# `router-dpN`: the benchmark starts N replicas behind sglang-router (sgl_lite.cluster) and drives
# the router over HTTP.
ROUTER_SYSTEM_PREFIX = "router-dp"
# Set by the benchmark itself, per system, so not passed through.
_OWN_SERVER_FIELDS = frozenset({"model_path", "host", "port", "disable_radix_cache", "api_key"})


@dataclass
class BenchConfig:
    model_path: str = "smollm2-135m"
    address: str | None = None  # a running runtime to use as the sgl_lite system (ZeroMQ)
    url: str | None = None  # a running HTTP server or router to use as the sgl_lite system
    backend: str = "sglang"
    chat_history: str = "one-message"  # how OpenAI chat systems get a multi-turn conversation
    prompt_format: str = "ids"  # how token-id systems get a turn: the workload's ids, or the chat-rendered conversation
    api_key: str | None = None
    systems: tuple[str, ...] = SYSTEM_NAMES
    openai_urls: tuple[str, ...] = ()  # NAME=URL: more systems, OpenAI-compatible servers already running
    router_policy: str = "cache_aware"
    router_args: str = ""  # extra sglang-router flags, one shell-style string
    workload: str = "multiturn-agent"
    seed: int = 1
    # multiturn-agent
    agent_num_sessions: int = 8
    agent_num_turns: int = 4
    agent_system_prompt_len: int = 256
    agent_task_len: int = 64
    agent_obs_len_min: int = 16
    agent_obs_len_max: int = 64
    agent_output_len: int = 32
    # shared-prefix (SGLang: 64 x 16, 2048 / 128, 256)
    gsp_num_groups: int = 8
    gsp_prompts_per_group: int = 8
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 64
    gsp_output_len: int = 32
    # random (SGLang: 1000 prompts, 1024 / 1024)
    num_prompts: int = 32
    random_input_len: int = 256
    random_output_len: int = 32
    # arrival
    request_rate: float = math.inf
    max_concurrency: int | None = None
    # baselines and output
    naive_batch_size: int = 8
    output_dir: str = artifact_path("bench")
    plots: bool = True
    progress: bool = True
    startup_timeout: float = 900.0
    server_args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEM_NAMES and router_dp_size(s) is None]
        if self.backend not in URL_BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(URL_BACKENDS)}; got {self.backend!r}")
        for entry in self.openai_urls:
            name, _, url = entry.partition("=")
            if not name or not url.startswith(("http://", "https://")):
                raise ValueError(f"--openai-urls takes NAME=http://host:port entries; got {entry!r}")
        if unknown or not (self.systems or self.openai_urls):
            raise ValueError(f"--systems must list some of {', '.join(SYSTEM_NAMES)}, {ROUTER_SYSTEM_PREFIX}N "
                             f"(N >= 1); got {','.join(self.systems) or 'nothing'}")
        if len(set(self.all_systems)) != len(self.all_systems):
            raise ValueError(f"--systems and --openai-urls name a system twice: {','.join(self.all_systems)}")
        if self.address and self.url:
            raise ValueError("give at most one of --address (ZeroMQ) and --url (HTTP) for the sgl_lite system")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://; got {self.url!r}")
        try:
            shlex.split(self.router_args)
        except ValueError as e:
            raise ValueError(f"--router-args is not a valid flag string ({e}): {self.router_args!r}") from None
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}; got {self.router_policy!r}")
        if self.chat_history not in CHAT_HISTORIES:
            raise ValueError(f"--chat-history must be one of {', '.join(CHAT_HISTORIES)}; got {self.chat_history!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}; got {self.prompt_format!r}")
        if self.workload not in WORKLOAD_NAMES:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOAD_NAMES)}; got {self.workload!r}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive (inf: all at once); got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be positive; got {self.max_concurrency}")
        if self.naive_batch_size < 1:
            raise ValueError(f"--naive-batch-size must be positive; got {self.naive_batch_size}")
        bad = sorted(set(self.server_args) & _OWN_SERVER_FIELDS)
        if bad:
            raise ValueError(f"server args set by the benchmark itself cannot be passed: {', '.join(bad)}")
        ServerArgs.from_kwargs(**self.server_args)  # names any bad value


    @property
    def openai_systems(self) -> dict[str, str]:
        """--openai-urls as name -> URL."""
        return dict(entry.partition("=")[::2] for entry in self.openai_urls)

    @property
    def all_systems(self) -> tuple[str, ...]:
        """What the run measures, in order: --systems, then the --openai-urls servers."""
        return (*self.systems, *(entry.partition("=")[0] for entry in self.openai_urls))


def router_dp_size(system: str) -> int | None:
    """N for a `router-dpN` system name, None for any other name."""
    suffix = system.removeprefix(ROUTER_SYSTEM_PREFIX)
    if suffix == system or not suffix.isdigit() or int(suffix) < 1:
        return None
    return int(suffix)


def make_workload(config: BenchConfig, vocab: Vocabulary) -> Workload:
    c = config
    if c.workload == "multiturn-agent":
        return multiturn_agent(vocab, num_sessions=c.agent_num_sessions, num_turns=c.agent_num_turns,
                               system_prompt_len=c.agent_system_prompt_len, task_len=c.agent_task_len,
                               obs_len_min=c.agent_obs_len_min, obs_len_max=c.agent_obs_len_max,
                               output_len=c.agent_output_len, seed=c.seed)
    if c.workload == "shared-prefix":
        return shared_prefix(vocab, num_groups=c.gsp_num_groups, prompts_per_group=c.gsp_prompts_per_group,
                             system_prompt_len=c.gsp_system_prompt_len, question_len=c.gsp_question_len,
                             output_len=c.gsp_output_len, seed=c.seed)
    if c.workload == "random":
        return random_prompts(vocab, num_prompts=c.num_prompts, input_len=c.random_input_len,
                              output_len=c.random_output_len, seed=c.seed)
    raise ValueError(f"--workload must be one of {', '.join(WORKLOAD_NAMES)}; got {c.workload!r}")


_HELP = {
    "model_path": "Model for started runtimes and the hf baseline (alias, .gguf or HF folder).",
    "address": "Use this running server as the sgl_lite system over ZeroMQ: its URL (http://host:PORT, the endpoint is found from it) or its tcp:// address (its cache is flushed first).",
    "url": "Use this running HTTP server or sglang-router (http://host:port) as the sgl_lite system, "
           "driven through SGLang's native /generate (its cache is flushed first).",
    "backend": "How --url is driven: sglang (SGLang's native /generate, token ids) or openai-chat "
               "(/v1/chat/completions, any OpenAI-compatible server: vLLM, llama-server, SGLang, sgl_lite's HTTP "
               "front; prompts are the ids decoded with --model-path's tokenizer).",
    "chat_history": "How OpenAI chat systems (--backend openai-chat, --openai-urls) get a session's history: "
                    "one-message (the whole conversation as one user message) or "
                    "messages (the first prompt and each observation as user messages, each answer as an assistant "
                    "message, as agent frameworks send it).",
    "prompt_format": "How token-id systems (ZeroMQ, --backend sglang, runtimes the benchmark starts) get a turn: ids "
                     "(the workload's token ids as they are) or chat (the conversation --chat-history messages sends, "
                     "rendered by the model's chat template and tokenized as sgl_lite's HTTP front does: the prompt "
                     "ids a chat request of it gets, so two paths compared prefill the same tokens).",
    "api_key": "Key of the runtime at --address or the server at --url.",
    "systems": f"Comma-separated systems to measure, in order: some of {','.join(SYSTEM_NAMES)}, and "
               f"{ROUTER_SYSTEM_PREFIX}N: N replicas (one CPU share each) behind sglang-router, driven over HTTP.",
    "openai_urls": "More systems: already running OpenAI-compatible servers as NAME=URL[,NAME=URL...], each driven "
                   "over /v1/chat/completions like --backend openai-chat (e.g. vllm=http://127.0.0.1:8000,"
                   "llama-server=http://127.0.0.1:8080); --model-path must name the model they serve (its tokenizer).",
    "router_policy": f"sglang-router policy of the {ROUTER_SYSTEM_PREFIX}N systems.",
    "router_args": f"Extra sglang-router flags for the {ROUTER_SYSTEM_PREFIX}N systems, as one string "
                   "(--router-args='--cache-threshold 0.82').",
    "workload": "Workload generator.",
    "seed": "Seed of every random choice (prompts, observation lengths, arrivals).",
    "agent_num_sessions": "multiturn-agent: concurrent agent sessions.",
    "agent_num_turns": "multiturn-agent: turns per session.",
    "agent_system_prompt_len": "multiturn-agent: system prompt tokens, shared by all sessions.",
    "agent_task_len": "multiturn-agent: task tokens, one task per session.",
    "agent_obs_len_min": "multiturn-agent: tool observations have a length uniform in [min, max].",
    "agent_obs_len_max": "multiturn-agent: see --agent-obs-len-min.",
    "agent_output_len": "multiturn-agent: output tokens per turn.",
    "gsp_num_groups": "shared-prefix: groups, each with its own system prompt (SGLang default 64).",
    "gsp_prompts_per_group": "shared-prefix: prompts per group (SGLang default 16).",
    "gsp_system_prompt_len": "shared-prefix: system prompt tokens (SGLang default 2048).",
    "gsp_question_len": "shared-prefix: question tokens (SGLang default 128).",
    "gsp_output_len": "shared-prefix: output tokens (SGLang default 256).",
    "num_prompts": "random: number of prompts (SGLang default 1000).",
    "random_input_len": "random: prompt tokens (SGLang default 1024).",
    "random_output_len": "random: output tokens (SGLang default 1024).",
    "request_rate": "Poisson arrivals (sessions per second); inf sends everything at once.",
    "max_concurrency": "At most this many requests in flight.",
    "naive_batch_size": "Max prompts per generate() batch of the hf baseline.",
    "output_dir": "Where the JSON report and the plots go.",
    "plots": "Write PNG plots.",
    "progress": "Show a tqdm progress bar.",
    "startup_timeout": "Seconds to wait for a started runtime to become ready.",
}



def build_parser(prog: str = "bench_serving") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Serving benchmark: sgl_lite vs the same runtime without radix cache "
        "vs a naive transformers server, on a reproducible workload.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(BenchConfig)
    for f in dataclasses.fields(BenchConfig):
        if f.name == "server_args":
            continue
        flag = flag_of(f.name)
        kind = field_base_type(hints[f.name])
        help_text = _HELP[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.name in ("systems", "openai_urls"):
            parser.add_argument(flag, default=",".join(f.default), help=help_text)
        elif f.name == "backend":
            parser.add_argument(flag, default=f.default, choices=URL_BACKENDS, help=help_text)
        elif f.name == "workload":
            parser.add_argument(flag, default=f.default, choices=WORKLOAD_NAMES, help=help_text)
        elif f.name == "chat_history":
            parser.add_argument(flag, default=f.default, choices=CHAT_HISTORIES, help=help_text)
        elif f.name == "prompt_format":
            parser.add_argument(flag, default=f.default, choices=PROMPT_FORMATS, help=help_text)
        elif f.name == "router_policy":
            parser.add_argument(flag, default=f.default, choices=ROUTER_POLICIES, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=help_text)
    group = parser.add_argument_group("runtime server args (passed to every runtime the benchmark starts)")
    server_hints = typing.get_type_hints(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.name in _OWN_SERVER_FIELDS:
            continue
        flag = flag_of(f.name)
        kind = field_base_type(server_hints[f.name])
        common: dict[str, Any] = dict(dest="server_arg__" + f.name, default=argparse.SUPPRESS,
                                    metavar=f.name.upper(), help=f.metadata["help"])
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(flag, type=kind, choices=f.metadata.get("choices"), **common)
    return parser


def parse_config(argv: Sequence[str] | None = None, prog: str = "bench_serving") -> BenchConfig:
    namespace = vars(build_parser(prog).parse_args(argv))
    server_args = {k.removeprefix("server_arg__"): v for k, v in namespace.items() if k.startswith("server_arg__")}
    values = {k: v for k, v in namespace.items() if not k.startswith("server_arg__")}
    for name in ("systems", "openai_urls"):
        values[name] = tuple(s.strip() for s in values[name].split(",") if s.strip())
    config = BenchConfig(**values, server_args=server_args)
    config.validate()
    return config
