"""Next-token sampling for a batch of requests: logit processing, then greedy or random choice.

Pipeline per row (SGLang/vLLM semantics):
1. grammar mask (-inf where the request's grammar forbids a token);
2. min_new_tokens: EOS and stop_token_ids masked while fewer outputs exist (unless that empties the row);
3. repetition penalty over prompt + output tokens (positive logits divided, negative multiplied),
   then frequency (x count) and presence (x seen) penalties over output tokens;
4. logit_bias added to its tokens' logits (after the grammar mask, as SGLang: a forbidden token stays so);
5. greedy rows (temperature 0 or top_k 1): argmax; other rows: softmax(logits / temperature), then
   top-k, top-p, min-p on the sorted probabilities, then one inverse-CDF draw with a uniform from
   the request's own generator.

The returned logprob of each chosen id is under log_softmax of the RAW logits (what the model said),
matching SGLang's reported output logprobs. Everything is vectorized over the batch; Python work per
request is limited to reading its parameters and, for sampled rows, drawing one uniform number.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.kernels.loader import has_op
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.protocol import SamplingParams

# Candidates kept by a partial sort when top-k/top-p/min-p allow it (see _largest_probs).
_CANDIDATES = 256


def request_seed(req: Req, default_seed: int | None) -> int | None:
    """The seed for a request's generator: params.seed, else default_seed + a stable hash of rid, else None (random)."""
    if req.sampling_params.seed is not None:
        return int(req.sampling_params.seed)
    if default_seed is None:
        return None
    # hashlib, not hash(): str hashes are salted per process, and a server seed must reproduce across restarts.
    rid_hash = int.from_bytes(hashlib.sha256(req.rid.encode()).digest()[:8], "little")
    return (default_seed + rid_hash) % (2**63)


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for [B, V] logits (each row's first largest value; NaN counts as the
    largest), through kernels/csrc/layer/argmax_rows.cpp for float32 CPU logits: torch's walks a vocabulary-wide
    row several times slower than the op, and every greedy row and draft position takes one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] and has_op("argmax_rows"):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int], default_seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.default_seed = default_seed

    def sample(
        self, logits: torch.Tensor, reqs: Sequence[Req], with_logprobs: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Choose one next token per row of `logits` [B, V]; return (ids int64 [B], raw logprobs float32 [B]).

        with_logprobs=False skips the logprobs (None instead): a log_softmax over the whole vocabulary
        per row costs as much as the argmax, and most requests never ask for logprobs.
        """
        if logits.shape[0] != len(reqs):
            raise ValueError(f"logits has {logits.shape[0]} rows but {len(reqs)} requests were given")
        raw = logits.float()
        if not reqs:
            empty_ids = torch.empty(0, dtype=torch.long, device=raw.device)
            return empty_ids, torch.empty(0, device=raw.device) if with_logprobs else None
        params = [r.sampling_params for r in reqs]
        if all(p.is_greedy for p in params) and not self._needs_processing(reqs):
            next_ids = argmax_ids(raw)  # the greedy fast path: one op, no copy of the logits
        else:
            next_ids = self._choose(self.process_logits(raw, reqs), reqs)
        if not with_logprobs:
            return next_ids, None
        # log_softmax then gather: on CPU several times faster than logsumexp over the same rows.
        return next_ids, torch.log_softmax(raw, dim=-1).gather(1, next_ids.unsqueeze(1)).squeeze(1)

    def process_logits(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """Steps 1-4 of the pipeline (grammar, min_new_tokens, penalties, logit_bias) on a copy of `logits`."""
        out = logits.float().clone()
        if any(r.grammar is not None for r in reqs):
            from sgl_lite.runtime.sampling import grammar  # lazy: xgrammar is only needed for constrained requests

            grammar.apply_grammar_masks(out, [r.grammar for r in reqs])
        self._apply_min_new_tokens(out, reqs)
        self._apply_penalties(out, reqs)
        add_logit_bias(out, [r.sampling_params for r in reqs])
        return out

    def peek_uniforms(self, req: Req, count: int, device: torch.device) -> torch.Tensor:
        """The next `count` uniforms of the request's generator [count], left unconsumed.

        Drawn one at a time, as `_choose` draws them (one per sampled token), so the i-th value is the
        uniform plain decoding would use for the request's i-th next token; `skip_uniforms` then consumes
        as many as were used.
        """
        generator = self._generator(req, device)
        state = generator.get_state()
        values = torch.cat([torch.rand(1, generator=generator, device=device) for _ in range(count)])
        generator.set_state(state)
        return values

    def skip_uniforms(self, req: Req, count: int, device: torch.device) -> None:
        """Consume `count` uniforms of the request's generator, as `count` sampled tokens would."""
        generator = self._generator(req, device)
        for _ in range(count):
            torch.rand(1, generator=generator, device=device)

    def sampled_ids(self, logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
        """The token each row of processed `logits` [R, V] samples with its uniform [R] (sampled rows only):
        softmax(logits / temperature), top-k/top-p/min-p on the sorted probabilities, one inverse-CDF draw.

        The one choice rule of plain decoding and of speculative verification: given the same row and
        uniform, both pick the same token.
        """
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        probs = torch.softmax(logits / temperature, dim=-1)
        picked = torch.empty(len(params), dtype=torch.long, device=device)
        filtered = [p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
        plain = [row for row, f in enumerate(filtered) if not f]
        if plain:
            plain_index = torch.tensor(plain, device=device)
            picked[plain_index] = _inverse_cdf(probs[plain_index], uniforms[plain_index])
        rows = [row for row, f in enumerate(filtered) if f]
        if rows:
            index = torch.tensor(rows, device=device)
            row_params = [params[row] for row in rows]
            sorted_probs, order = _largest_probs(probs[index], row_params)
            choice = _inverse_cdf(_filter_sorted_probs(sorted_probs, row_params), uniforms[index])
            picked[index] = order.gather(1, choice.unsqueeze(1)).squeeze(1)
        return picked

    # ---------------------------------------------------------------- processing

    def _needs_processing(self, reqs: Sequence[Req]) -> bool:
        return any(
            r.grammar is not None or _has_penalty(r) or len(r.output_ids) < r.sampling_params.min_new_tokens
            or r.sampling_params.logit_bias
            for r in reqs
        )

    def _apply_min_new_tokens(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        rows = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.sampling_params.min_new_tokens]
        if not rows:
            return
        banned = torch.zeros_like(logits, dtype=torch.bool)
        for i in rows:
            stop_ids = set(self.eos_token_ids) | set(reqs[i].sampling_params.stop_token_ids or ())
            banned[i, [t for t in stop_ids if 0 <= t < logits.shape[1]]] = True
        candidate = logits.masked_fill(banned, float("-inf"))
        # A grammar that allows only EOS wins over min_new_tokens: never leave a row with nothing to pick.
        keeps_a_token = torch.isfinite(candidate).any(dim=-1, keepdim=True)
        logits.copy_(torch.where(keeps_a_token, candidate, logits))

    def _apply_penalties(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        rows = [i for i, r in enumerate(reqs) if _has_penalty(r)]
        if not rows:
            return
        vocab = logits.shape[1]
        device = logits.device
        row_index = torch.tensor(rows, device=device)
        sub = logits[row_index]
        params = [reqs[i].sampling_params for i in rows]

        output_counts = _token_counts([reqs[i].output_ids for i in rows], vocab, device)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = (_token_counts([reqs[i].input_ids for i in rows], vocab, device) + output_counts) > 0
            rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        sub = sub - freq * output_counts - presence * (output_counts > 0).float()
        logits[row_index] = sub

    # ---------------------------------------------------------------- choice

    def _choose(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        next_ids = argmax_ids(logits)
        sampled_rows = [i for i, r in enumerate(reqs) if not r.sampling_params.is_greedy]
        if not sampled_rows:
            return next_ids
        device = logits.device
        row_index = torch.tensor(sampled_rows, device=device)
        params = [reqs[i].sampling_params for i in sampled_rows]
        # Inverse-CDF sampling: one uniform per row, drawn from that request's own generator.
        uniforms = torch.cat(
            [torch.rand(1, generator=self._generator(reqs[i], device), device=device) for i in sampled_rows]
        )
        next_ids[row_index] = self.sampled_ids(logits[row_index], params, uniforms)
        return next_ids

    def _generator(self, req: Req, device: torch.device) -> torch.Generator:
        if req.generator is None:
            generator = torch.Generator(device=device)
            seed = request_seed(req, self.default_seed)
            if seed is None:
                generator.seed()  # nondeterministic: the request asked for no reproducibility
            else:
                generator.manual_seed(seed)
            req.generator = generator
        return req.generator


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's logit_bias to its logits [len(params), V] in place. Keys naming one id ("1", "01")
    keep the last value, as SGLang's; ids past V are left out (the validator checks them against the vocabulary)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        bias = {int(key): value for key, value in (p.logit_bias or {}).items()}
        for token, value in bias.items():
            if token < logits.shape[1]:
                rows.append(row)
                cols.append(token)
                values.append(value)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def _has_penalty(req: Req) -> bool:
    p = req.sampling_params
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id per list (ids outside the vocab are ignored)."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    # Pad with `vocab` (an extra column dropped afterwards) so the scatter stays one batched op.
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long, device=device)
    for row, tokens in enumerate(token_lists):
        if tokens:
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=device)
    padded = padded.masked_fill((padded < 0) | (padded > vocab), vocab)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _largest_probs(probs: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(descending probabilities, their token ids): only the top _CANDIDATES when the filters provably drop the rest.

    A full sort of a 50k vocabulary costs many times a top-256 on CPU. Tokens past rank K are all dropped when, per
    row, top_k <= K, or the top-K mass already exceeds top_p, or the K-th probability is below min_p * max.
    """
    vocab = probs.shape[1]
    k = max([_CANDIDATES] + [p.top_k for p in params])
    if k < vocab:
        values, order = probs.topk(k, dim=-1)
        device = probs.device
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        rest_dropped = (
            ((top_k > 0) & (top_k <= k))
            | ((top_p < 1.0) & (values.sum(dim=-1) > top_p))
            | (values[:, -1] < values[:, 0] * min_p)
        )
        if bool(rest_dropped.all()):
            return values, order
    return probs.sort(dim=-1, descending=True)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i] for unnormalized weights [R, N] >= 0."""
    cdf = torch.cumsum(weights, dim=-1)
    target = uniforms.unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).clamp_max(weights.shape[1] - 1)
    # Rounding can put the target at the very end (past the last positive weight): take the likeliest then.
    valid = weights.gather(1, index) > 0
    return torch.where(valid, index, weights.argmax(dim=-1, keepdim=True)).squeeze(1)


def _filter_sorted_probs(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p exclude (SGLang's rules, on descending probabilities)."""
    device = sorted_probs.device
    vocab = sorted_probs.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    probs = sorted_probs.masked_fill(ranks >= top_k, 0.0)
    # Keep a token while the mass strictly before it is <= top_p: the most likely token always stays.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(mass_before > top_p, 0.0)
    probs = probs.masked_fill(probs < probs[:, :1] * min_p, 0.0)
    return probs
