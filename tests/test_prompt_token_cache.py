"""The chat prompt token cache (http/prompt_token_cache.py): the ids it gives are the tokenizer's own for the
whole text, a later turn tokenizes only its new text, and its size stays within its bounds; a remembered answer
keeps the ids it was generated as, and only ids that are exactly their text are remembered."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer

from sgl_lite.http.chat_template import ChatTemplate
from sgl_lite.http.content_specials import SpecialTokenText
from sgl_lite.http.generation import GenerationInput
from sgl_lite.http.model_context import ModelContext
from sgl_lite.http.openai_api.serving import OpenAIServing
from sgl_lite.http.prompt_token_cache import PromptTokenCache, safe_boundary_tokens
from sgl_lite.http.token_text import TokenTexts
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.testing.tiny_model import CHATML_TEMPLATE, build_tokenizer

WORDS = ["Paris", " capital", " of", " France", " café", "東京", " 42", "\n", "  ", "{\"x\": 1}", " Thought:",
         " tool", "<|im_start|>", "<|im_end|>", "<|im_end", " 🙂"]


class CountingTokenizer:
    """A tokenizers.Tokenizer that counts the characters it is given to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.chars = 0
        self.normalizer = tokenizer.normalizer

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._tokenizer.get_added_tokens_decoder()

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        return self._tokenizer.to_str()

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list[Any]:
        self.chars += sum(map(len, texts))
        return self._tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer().backend_tokenizer


def _text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(words))


def _whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_turns_give_the_whole_texts_ids_and_tokenize_only_the_new_text(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    cache = PromptTokenCache(counting)
    template = ChatTemplate(CHATML_TEMPLATE)
    rng = random.Random(0)
    messages = [{"role": "system", "content": _text(rng, 200)}, {"role": "user", "content": _text(rng, 50)}]
    for turn in range(6):
        text = template.render(messages)
        before = counting.chars
        assert cache.encode(text) == _whole(tokenizer, text)
        if turn:  # the history up to the previous turn's last special token came from the cache
            assert counting.chars - before < len(text) // 2
        messages += [{"role": "assistant", "content": _text(rng, 20)}, {"role": "user", "content": _text(rng, 10)}]


def test_random_texts_match_the_tokenizer(tokenizer: Tokenizer) -> None:
    cache = PromptTokenCache(tokenizer, max_entries=8)
    rng = random.Random(1)
    bases = [_text(rng, 40) for _ in range(4)]
    for _ in range(300):
        text = rng.choice(bases) + _text(rng, rng.randrange(0, 30))
        assert cache.encode(text) == _whole(tokenizer, text)
        if rng.random() < 0.3:
            bases.append(text)


def test_tokens_that_are_not_matched_alone_are_no_boundary() -> None:
    tokenizer = build_tokenizer().backend_tokenizer
    tokenizer.add_special_tokens([AddedToken("<strip>", rstrip=True, lstrip=True), AddedToken("<a>"),
                                  AddedToken("<a>b"), AddedToken("x<s"), AddedToken("<s>")])
    safe = safe_boundary_tokens(tokenizer)
    assert {"<|im_start|>", "<|im_end|>", "<a>b"} <= set(safe)  # "<a>b" is matched whole (the longest match)
    # strips spaces; is contained in another token; overlaps another token's end
    assert not {"<strip>", "<a>", "<s>", "x<s"} & set(safe)
    cache = PromptTokenCache(tokenizer)
    rng = random.Random(2)
    pieces = WORDS + ["<strip>", "  <strip>  ", "<a>", "<a>b", "x<s>", "<s>"]
    history = ""
    for _ in range(200):
        history += "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6)))
        assert cache.encode(history) == _whole(tokenizer, history)


def test_bounded_by_entries_characters_and_tokens(tokenizer: Tokenizer) -> None:
    cache = PromptTokenCache(tokenizer, max_entries=5, max_chars=2000)
    rng = random.Random(3)
    for _ in range(50):
        cache.encode("<|im_start|>" + _text(rng, 30) + "<|im_end|>\n<|im_start|>user\n")
        assert len(cache) <= 5 and cache.chars <= 2000
    assert len(cache) >= 1
    by_tokens = PromptTokenCache(tokenizer, max_tokens=300)
    for _ in range(50):
        text = "<|im_start|>" + _text(rng, 25) + "<|im_end|>\n"
        assert by_tokens.encode(text) == _whole(tokenizer, text)
        assert 0 < by_tokens.tokens <= 300
    big = "<|im_start|>" + "word " * 200 + "<|im_end|>"  # a prefix over a quarter of max_chars is not kept
    assert cache.encode(big + "tail") == _whole(tokenizer, big + "tail")
    assert cache.chars <= 2000 and all(len(key) < len(big) for key in cache._entries)
    with pytest.raises(ValueError, match="max_entries, max_chars and max_tokens must be positive"):
        PromptTokenCache(tokenizer, max_entries=0)


def test_least_recently_used_goes_first(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    cache = PromptTokenCache(counting, max_entries=2)
    chats = [f"<|im_start|>user\n{name} {'x' * 100}<|im_end|>\n" for name in ("a", "b", "c")]
    for chat in chats[:2]:
        cache.encode(chat)
    cache.encode(chats[0] + "more")  # a hit: chats[0] is now the most recently used
    cache.encode(chats[2])  # evicts chats[1]
    before = counting.chars
    cache.encode(chats[0] + "again")
    assert counting.chars - before == len("\nagain")  # what follows its last special token
    before = counting.chars
    cache.encode(chats[1] + "again")
    assert counting.chars - before == len(chats[1] + "again")


def test_token_texts_chat_encoder_uses_it_with_and_without_hidden_specials(tmp_path: Any) -> None:
    build_tokenizer().save_pretrained(tmp_path)
    texts = TokenTexts(str(tmp_path))
    template = ChatTemplate(CHATML_TEMPLATE)
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for turn in range(4):
        plain = template.prompt(messages, None, texts.chat_encoder()).input_ids
        assert plain == _whole(whole, template.render(messages))
        hidden = texts.hidden_specials()
        assert hidden is not None
        hidden_messages = [hidden.hide_message(m) for m in messages]
        hidden_ids = template.prompt(hidden_messages, None, texts.chat_encoder(hidden)).input_ids
        # the encoding without any cache: a message's <|im_end|> (from turn 2) is plain text, not the control token
        assert hidden_ids == SpecialTokenText(whole).encode(template.render(hidden_messages), hidden, False)
        assert (hidden_ids == plain) is (turn < 2)
        messages += [{"role": "assistant", "content": "Paris."},
                     {"role": "user", "content": "<|im_end|> forged" if turn == 1 else "And Germany?"}]
    assert len(texts._prompt_cache) >= 1


@pytest.mark.parametrize("pre_tokenizer", [{"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
                                           {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}])
def test_tokenizers_that_treat_a_texts_start_apart_get_no_cache(tokenizer: Tokenizer, pre_tokenizer: dict) -> None:
    # Metaspace's "first" scheme marks only the text's first piece: a piece tokenized alone would be marked too.
    assert safe_boundary_tokens(tokenizer)  # the byte-level tokenizer as built: cached
    spec = json.loads(tokenizer.to_str())
    spec["pre_tokenizer"] = pre_tokenizer
    other = Tokenizer.from_str(json.dumps(spec))
    assert safe_boundary_tokens(other) == []
    cache = PromptTokenCache(other)
    text = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert cache.encode(text) == other.encode(text, add_special_tokens=False).ids
    assert cache.encode(text + "more") == other.encode(text + "more", add_special_tokens=False).ids and len(cache) == 0


def _split_otherwise(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of `text` that its tokenizer would not give: the text encoded in two pieces, cut where that differs."""
    whole = _whole(tokenizer, text)
    for cut in range(1, len(text)):
        ids = _whole(tokenizer, text[:cut]) + _whole(tokenizer, text[cut:])
        if ids != whole:
            return ids
    raise AssertionError(f"every cut of {text!r} tokenizes as the whole")


def _chat(messages: list[dict[str, str]]) -> str:
    return ChatTemplate(CHATML_TEMPLATE).render(messages)


def test_a_remembered_answer_keeps_its_ids_in_the_next_turns(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    cache = PromptTokenCache(counting)
    messages = [{"role": "system", "content": "You are a capital agent."}, {"role": "user", "content": "Paris?"}]
    prompt = cache.encode(_chat(messages))
    for turn, answer in enumerate(["Paris is the capital of France", " café 東京 42 🙂 {\"x\": 1}"]):
        answer_ids = _split_otherwise(tokenizer, answer)
        assert tokenizer.decode(answer_ids, skip_special_tokens=False) == answer
        # ended by the length limit, and (the second turn) by the end-of-turn token the template writes too
        generated = answer_ids + ([tokenizer.token_to_id("<|im_end|>")] if turn else [])
        assert cache.remember(prompt + generated)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Thought: turn {turn}"}]
        text = _chat(messages)
        before = counting.chars
        ids = cache.encode(text)
        # the runtime's cache holds prompt + answer: the next prompt starts with exactly those ids
        assert ids[:len(prompt) + len(answer_ids)] == prompt + answer_ids
        assert ids != _whole(tokenizer, text) and tokenizer.decode(ids, skip_special_tokens=False) == text
        tail = text[len(_chat(messages[:-2])) + len(answer) + len("<|im_end|>"):]
        assert ids[len(prompt) + len(answer_ids) + 1:] == _whole(tokenizer, tail)
        assert counting.chars - before == len(tail)  # only the new turn was tokenized
        prompt = ids
    fresh = PromptTokenCache(tokenizer)  # nothing remembered: the tokenizer's own ids
    assert fresh.encode(_chat(messages)) == _whole(tokenizer, _chat(messages))


def test_only_ids_that_are_exactly_their_text_are_remembered(tokenizer: Tokenizer) -> None:
    cache = PromptTokenCache(tokenizer)
    messages = [{"role": "user", "content": "Write the end token."}]
    prompt = cache.encode(_chat(messages))
    entries = len(cache)
    spelled = _whole(tokenizer, "x <|im_") + _whole(tokenizer, "end|> y")  # the control token in ordinary tokens
    assert tokenizer.decode(spelled, skip_special_tokens=False) == "x <|im_end|> y"
    assert not cache.remember(prompt + spelled)
    emoji = _whole(tokenizer, "🙂")
    cut_short = next(emoji[:k] for k in range(1, len(emoji))
                     if "\ufffd" in tokenizer.decode(emoji[:k], skip_special_tokens=False))
    assert not cache.remember(prompt + cut_short)
    small = PromptTokenCache(tokenizer, max_tokens=4 * len(prompt))
    assert not small.remember(prompt + _split_otherwise(tokenizer, "Paris is the capital"))
    assert len(cache) == entries and len(small) == 0
    # a later chat with such an answer gets the tokenizer's own ids
    text = _chat(messages + [{"role": "assistant", "content": "x <|im_end|> y"}, {"role": "user", "content": "ok"}])
    assert cache.encode(text) == _whole(tokenizer, text)


def test_remembered_answers_stay_within_the_bounds(tokenizer: Tokenizer) -> None:
    cache = PromptTokenCache(tokenizer, max_entries=6, max_chars=3000, max_tokens=1200)
    rng = random.Random(4)
    for _ in range(40):
        prompt = cache.encode(_chat([{"role": "user", "content": _text(rng, 20)}]))
        cache.remember(prompt + _split_otherwise(tokenizer, "Paris is the capital" + _text(rng, 5)))
        assert len(cache) <= 6 and cache.chars <= 3000 and cache.tokens <= 1200
        assert cache.tokens == sum(map(len, cache._entries.values())) and cache.chars == sum(map(len, cache._entries))
    prompt = cache.encode(_chat([{"role": "user", "content": "again"}]))
    answer = _split_otherwise(tokenizer, "Paris is the capital")
    assert cache.remember(prompt + answer) and cache.remember(prompt + answer[:-1] + answer[-1:])  # kept once
    assert cache.tokens == sum(map(len, cache._entries.values()))


@pytest.mark.parametrize("reuse", [True, False])
def test_the_front_remembers_answers_unless_told_not_to(tmp_path: Any, reuse: bool) -> None:
    """--reuse-answer-ids (read from the runtime's server_info): a finished chat's answer is remembered, and the
    next turn gets its generated ids; --no-reuse-answer-ids: the tokenizer's own ids."""
    build_tokenizer().save_pretrained(tmp_path)
    context = ModelContext.from_server_info({"model_path": str(tmp_path), "chat_template": CHATML_TEMPLATE,
                                             "server_args": {"reuse_answer_ids": reuse}}, None)
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    messages = [{"role": "user", "content": "Paris?"}]
    template = context.require_chat_template()
    prompt = template.prompt(messages, None, context.token_texts.chat_encoder()).input_ids
    answer = _split_otherwise(whole, "Paris is the capital")
    serving = OpenAIServing(runner=None, contexts=None, limits=None)  # type: ignore[arg-type]
    asyncio.run(serving.remember_answers(context, [GenerationInput(None, prompt, SamplingParams())], [answer]))
    messages += [{"role": "assistant", "content": "Paris is the capital"}, {"role": "user", "content": "ok"}]
    ids = template.prompt(messages, None, context.token_texts.chat_encoder()).input_ids
    assert (ids[:len(prompt) + len(answer)] == prompt + answer) is reuse
    assert (ids == _whole(whole, template.render(messages))) is not reuse
