"""The wire format: msgspec Structs in one tagged union per direction, encoded as msgpack.

Client and server both import this module, so it stays torch-free. Every message is a msgpack map
whose `type` field is the struct's class name exactly as written here ("GenerateReq", "AbortReq",
..., "TokenChunk", "Finished", "ErrorReply", "InfoReply"); `decode_request` / `decode_reply`
accept exactly the union of their direction and raise `msgspec.ValidationError`/`DecodeError`
naming the field at fault for anything else. No pickle anywhere.

Request ids are chosen by the client, at most MAX_RID_CHARS long, and must be non-empty: the empty
rid is reserved for the server's keepalive, an `InfoReply(rid="", info={"keepalive": True})` sent
about once a second to every client that has requests in flight (so that a vanished client is
noticed, server/event_loop.py). Clients ignore it; it is never an answer to a request.

A message travels as one ZeroMQ frame. The connection itself is authenticated: every client opens it
with ZeroMQ's PLAIN handshake (plain_credentials: the api_key as its password, if it has one), and a
runtime with an api_key admits no peer without it (server/zap.py), so nothing an outsider sends is ever
queued or read; a runtime without one admits every client, with a key or not. An `ErrorReply` with rid
"" answers a message the server could not tell the request of (framing from another wire version): the
client then fails every request it has pending.

`SamplingParams` is also the in-process type of the Engine: keys and defaults follow SGLang's
sampling params, so `engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0})` reads the same.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Union

import msgspec

from sgl_lite.runtime.sampling_dict import sglang_sampling_dict
from sgl_lite.runtime.stop_regex import check_stop_regex, is_plain_text, stop_regex_list

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The line a `serve` child prints on stdout once it accepts requests: READY_PREFIX <address>.
READY_PREFIX = "SGL_LITE_READY"
FLOAT32_MAX = 3.4028234663852886e38  # logits are divided by the temperature in float32
GREEDY_TEMPERATURE_EPS = 1e-6
MIN_REPETITION_PENALTY = 1e-6
# No served model has a longer context: a longer input_ids list is refused while it is decoded, from its
# length alone, before any element is read (the runtime's context-length check applies below this).
MAX_PROMPT_TOKENS = 2**20
PromptIds = Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
# A request id: a non-empty string (the empty one is the keepalive's, see the module docstring) of
# bounded length, since replies carry it back: a huge rid would make every reply huge.
MAX_RID_CHARS = 256
# Every connection opens with ZeroMQ's PLAIN handshake (see the module docstring): a client with an api_key
# sends it as the password of PLAIN_USER, one without sends KEYLESS_USER and a placeholder, which no
# runtime with a key admits. The password field has a one-byte length: keys are at most MAX_API_KEY_BYTES.
PLAIN_USER = b"sgl_lite"
KEYLESS_USER = b"sgl_lite-without-key"
MAX_API_KEY_BYTES = 255


def plain_credentials(api_key: str | None) -> tuple[bytes, bytes]:
    """The (user name, password) a client sends in the PLAIN handshake (PLAIN takes no empty password)."""
    return (PLAIN_USER, api_key.encode()) if api_key else (KEYLESS_USER, b"-")
# Stop strings are matched after every token and withheld from streams up to the longest one's length.
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 512
# Stop token ids are looked up after every token (and, under min_new_tokens, masked in every step's logits).
MAX_STOP_TOKEN_IDS = 256
# logit_bias: token ids (as decimal strings, SGLang's and OpenAI's keys) -> a number added to their logits.
# Bounded in entries (each is written into the logits every step) and in size: a bias this large, divided
# by the smallest sampling temperature (GREEDY_TEMPERATURE_EPS), is still a float32 number.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 1e30
# Top logprobs cost a top-k over the vocabulary and a list per generated token (OpenAI's own cap is 20).
MAX_TOP_LOGPROBS_NUM = 64
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_RID_CHARS)]


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    # None: as many as fit, up to the context (SGLang's null); the runtime sets the number when it queues the request.
    max_new_tokens: Union[int, None] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Union[Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)], None] = None
    # Stop on the token that completes a match of one of these (runtime/stop_regex.py says what is kept).
    stop_regex: Union[str, list[str], None] = None
    logit_bias: Union[Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS_TOKENS)], None] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Passed to the tokenizer's decode beside skip_special_tokens, as SGLang does (the fast tokenizers
    # transformers loads for text models ignore it, so with them the text is the same either way).
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: Union[int, None] = None
    # Constrained decoding (at most one): a regex, a JSON Schema (string or object), an EBNF grammar,
    # an xgrammar structural tag (string or object: free text with constrained tagged parts, SGLang's field).
    regex: Union[str, None] = None
    json_schema: Union[str, dict[str, Any], None] = None
    ebnf: Union[str, None] = None
    structural_tag: Union[str, dict[str, Any], None] = None
    # A stream's chunk comes with the first token, then once this many tokens are unsent (None: --stream-interval).
    stream_interval: Union[int, None] = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field when a value is out of range."""
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0; got {self.max_new_tokens}")
        most_new = max(self.max_new_tokens, 0) if self.max_new_tokens is not None else INT64_MAX
        if not 0 <= self.min_new_tokens <= most_new:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens]; got {self.min_new_tokens}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number; got {getattr(self, name)}")
        if not 0 <= self.temperature < FLOAT32_MAX:
            raise ValueError(f"temperature must be >= 0 and a float32 number; got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k == 0 or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1 (off) or in [1, 2**63 - 1]; got {self.top_k}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must fit in a signed 64-bit integer; got {self.seed}")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop has a string of {longest} characters; at most {MAX_STOP_STRING_CHARS}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1]; got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2]; got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2]; got {self.presence_penalty}")
        # Positive logits are divided by it in float32: a tinier one overflows them to inf (NaN probabilities).
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2]; got {self.repetition_penalty}")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:  # a SamplingParams built in Python skips msgspec's check
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        if vocab_size is not None:
            for tok in self.stop_token_ids or ():
                if not 0 <= tok < vocab_size:
                    raise ValueError(f"stop_token_ids contains {tok}, outside the vocabulary [0, {vocab_size})")
        if sum(x is not None for x in (self.regex, self.json_schema, self.ebnf, self.structural_tag)) > 1:
            raise ValueError("only one of regex, json_schema, ebnf, structural_tag may be given")
        check_stop_regex(self.stop_regex)
        self._check_logit_bias(vocab_size)
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1; got {self.stream_interval}")

    def _check_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:  # a SamplingParams built in Python skips msgspec's check
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_TOKENS}")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 19:
                raise ValueError(f"logit_bias keys must be token ids written in decimal digits; got {key!r}")
            if vocab_size is not None and int(key) >= vocab_size:
                raise ValueError(f"logit_bias has token id {key}, outside the vocabulary [0, {vocab_size})")
            if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be finite numbers of at most {MAX_LOGIT_BIAS:g} in "
                                 f"magnitude; got {value} for token {key}")

    @property
    def is_greedy(self) -> bool:
        # SGLang's rule (_SAMPLING_EPS): a temperature this small is greedy. Dividing float32 logits
        # by a denormal temperature would give inf/NaN probabilities and garbage tokens.
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def trimmed_stops(self) -> list[str]:
        """What the final text is cut at when it ends the request (unless no_stop_trim): the stop strings, and
        the stop_regex patterns that are plain text (SGLang cuts at a pattern's own text, runtime/stop_regex.py)."""
        return self.stop_strings() + [p for p in stop_regex_list(self.stop_regex) if is_plain_text(p)]

    def decode_options(self) -> dict[str, bool]:
        """tokenizer.decode's keyword arguments for this request's text (spaces_between_special_tokens only
        when it is off: on is SGLang's default and what decode does without it)."""
        if self.spaces_between_special_tokens:
            return {"skip_special_tokens": self.skip_special_tokens}
        return {"skip_special_tokens": self.skip_special_tokens, "spaces_between_special_tokens": False}



def to_sampling_params(params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
    """Convert a user dict (Engine, HTTP) into SamplingParams, checking only keys and types (ValueError
    names an unknown or mistyped key); the runtime checks the values once, when it queues the request.

    The dict is read as SGLang reads one (runtime/sampling_dict.py): null means the default,
    `sampling_seed` is the seed, and SGLang's fields that are not on this wire are refused unless off
    or, where they cannot change a result, dropped."""
    if isinstance(params, SamplingParams):
        return params
    try:
        return msgspec.convert(sglang_sampling_dict(params or {}), SamplingParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid sampling_params: {e}") from None


def sampling_params_from_dict(params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
    """`to_sampling_params` plus the value checks, for clients that refuse bad values before sending (HTTP)."""
    out = to_sampling_params(params)
    out.validate()
    return out


# ---------------------------------------------------------------- client -> server

# The longest a session's prefix stays pinned after its latest request (the HTTP front's sessions expire sooner).
MAX_SESSION_IDLE_S = 86_400.0


class SessionPin(msgspec.Struct, forbid_unknown_fields=True):
    """The open session a request belongs to: when it finishes, its KV becomes the session's latest prefix,
    evicted from the radix cache only after every unpinned prefix, until UnpinSessionReq names the session,
    a later request of it finishes, or `idle_timeout_s` pass (mem_cache/session_pins.py)."""

    id: RequestId
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_SESSION_IDLE_S)]


class GenerateReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Generate (or, with max_new_tokens=0, only prefill: a prefix-cache hint)."""

    rid: RequestId
    text: Union[str, None] = None
    input_ids: Union[PromptIds, None] = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    # Input-token logprobs are returned from this prompt position on (-1: none, output only).
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    priority: Union[int, None] = None
    session_pin: Union[SessionPin, None] = None


class AbortReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    rid: RequestId


class FlushCacheReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    rid: RequestId


class ServerInfoReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    rid: RequestId


class HealthReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    rid: RequestId


class UnpinSessionReq(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The session ended (closed, expired): its prefix is evicted like any other. Answered InfoReply {"unpinned": bool}."""

    rid: RequestId
    session_id: RequestId


Request = Union[GenerateReq, AbortReq, FlushCacheReq, ServerInfoReq, HealthReq, UnpinSessionReq]


# ---------------------------------------------------------------- server -> client


class TokenChunk(msgspec.Struct, tag=True):
    """A streamed piece of output: `text` is the new text since the last chunk (never broken UTF-8)."""

    rid: str
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any] = msgspec.field(default_factory=dict)


class Finished(msgspec.Struct, tag=True):
    """The one final message of a successful generate: whole text and ids, meta_info as the Engine's."""

    rid: str
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorReply(msgspec.Struct, tag=True):
    """The one final message of a failed request; `message` names the field or limit at fault."""

    rid: str
    message: str
    code: str = "bad_request"  # bad_request | unauthorized | queue_full | aborted | internal


class InfoReply(msgspec.Struct, tag=True):
    """Answer to ServerInfoReq / FlushCacheReq / HealthReq / AbortReq / UnpinSessionReq: a free-form dict."""

    rid: str
    info: dict[str, Any] = msgspec.field(default_factory=dict)


Reply = Union[TokenChunk, Finished, ErrorReply, InfoReply]


_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Request | Reply) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> Request:
    return _decode(_request_decoder, data)


def decode_reply(data: bytes) -> Reply:
    return _decode(_reply_decoder, data)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes) -> Any:
    # msgspec decodes (and skips) nested values recursively: a ~1 KB message of arrays nested a
    # thousand deep raises RecursionError. It is an undecodable message like any other.
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("message nested too deeply to decode") from None
