"""A user's sampling-params dict read as SGLang reads one, before it becomes the wire's SamplingParams.

SGLang builds its SamplingParams from the dict with every field of its own: null means the field's
default (except max_new_tokens, whose null means "up to the context" and travels as such), `sampling_seed`
is the seed, logit_bias keys may be ints in Python, and some fields exist there that the runtime here does
not act on. Those that could change a result are accepted only at their off value (null, empty, or
beam_width 1) and refused otherwise, naming the field; the others cannot change a result here and
are checked for type, then dropped. docs/http.md lists every field and what becomes of it.

Torch-free and free of sgl_lite imports: runtime/protocol.py uses it for every dict it converts.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# Fields that would change the result, each with why it is refused when given a value.
UNSERVED_SAMPLING_FIELDS = {
    "beam_width": "beam search (beam_width > 1) is not supported by sgl_lite",
    "watermark": "watermarking is not supported by sgl_lite",
}
# Fields that cannot change a result here, with the type SGLang gives them.
NO_EFFECT_SAMPLING_FIELDS: dict[str, Any] = {
    # read only by a request's custom logit processor, which sgl_lite does not run
    "custom_params": Union[dict[str, Any], None],
}


def sglang_sampling_dict(params: Any) -> Any:
    """`params` with nulls dropped, sampling_seed as seed, and the fields above checked and removed;
    ValueError names a field that cannot be served. A non-dict is returned as is (msgspec names it)."""
    if not isinstance(params, dict):
        return params
    out = {key: value for key, value in params.items() if value is not None}
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        out["max_new_tokens"] = None  # SGLang's "as many as fit, up to the context"
    bias = out.get("logit_bias")
    if isinstance(bias, dict):  # SGLang reads each key with int(): a Python caller may give ints
        out["logit_bias"] = {str(key) if type(key) is int else key: value for key, value in bias.items()}
    for name, reason in UNSERVED_SAMPLING_FIELDS.items():
        value = out.pop(name, None)
        if value not in (None, "", [], {}) and not (name == "beam_width" and type(value) is int and value == 1):
            raise ValueError(f"invalid sampling_params: {reason}; got {name}={value!r}")
    for name, kind in NO_EFFECT_SAMPLING_FIELDS.items():
        if name in out:
            try:
                msgspec.convert(out.pop(name), kind)
            except msgspec.ValidationError as e:
                raise ValueError(f"invalid sampling_params: {name}: {e}") from None
    if "sampling_seed" in out:  # SGLang's name of the seed
        seed = out.pop("sampling_seed")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"invalid sampling_params: sampling_seed must be an integer; got {seed!r}")
        if out.setdefault("seed", seed) != seed:
            raise ValueError("invalid sampling_params: seed and sampling_seed differ; give one of them")
    return out
