"""The responses a `/v1/responses` front keeps (`store`, default true): for retrieval by id, and for
`previous_response_id`, which continues a response's conversation without the client resending it.

Bounded by count and by size, evicting the least recently used response first (creating, retrieving or
continuing a response uses it). A response's size is counted as the request bodies and outputs of its
whole conversation, so a long conversation's later turns weigh more. An evicted, deleted or never stored
id is simply unknown: the caller answers 404. Used only from the HTTP event loop, so no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sgl_lite.http.openai_api.protocol import ChatMessage

MAX_STORED_RESPONSES = 4096
MAX_STORED_RESPONSE_BYTES = 256 * 1024 * 1024


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as retrieval returns it
    conversation: tuple[ChatMessage, ...]  # every message through this response's output, instructions excluded
    conversation_bytes: int  # the request bodies and outputs that make up `conversation`

    @property
    def size(self) -> int:
        return self.conversation_bytes


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_RESPONSE_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("a response store holds at least one response and one byte")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None when unknown (never stored, evicted, deleted)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry`, evicting the least recently used ones to make room. False (nothing kept) when it
        alone is larger than the whole store."""
        self.delete(response_id)
        if entry.size > self.max_bytes:
            return False
        while self._entries and (len(self._entries) >= self.max_responses or self._bytes + entry.size > self.max_bytes):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
        self._entries[response_id] = entry
        self._bytes += entry.size
        return True

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
