"""Generate requests whose long text is being tokenized on the core's tokenizer thread.

The serve loop must not stop stepping while a big prompt is tokenized (a 663k-character text takes
about half a second), so RuntimeCore.prepare hands such texts to a worker thread (HF tokenizers release
the GIL while they encode) and the transport parks the request here until its Req is ready.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from sgl_lite.runtime import protocol


@dataclass
class PendingPrompt:
    identity: bytes
    msg: protocol.GenerateReq
    future: concurrent.futures.Future  # Future[Req]


class PendingPrompts:
    def __init__(self) -> None:
        self._pending: dict[str, PendingPrompt] = {}  # by the scheduler's (identity-prefixed) rid

    def __contains__(self, key: str) -> bool:
        return key in self._pending

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, key: str, identity: bytes, msg: protocol.GenerateReq, future: concurrent.futures.Future) -> None:
        self._pending[key] = PendingPrompt(identity, msg, future)

    def cancel(self, key: str) -> PendingPrompt | None:
        """Forget `key` (its tokenizing, if already running, finishes unseen); None if not pending."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.future.cancel()
        return pending

    def take_ready(self) -> list[tuple[str, PendingPrompt]]:
        """The prompts whose tokenizing has ended (with a Req or an error), removed from here."""
        ready = [(key, p) for key, p in self._pending.items() if p.future.done()]
        for key, _ in ready:
            del self._pending[key]
        return ready

    def cancel_all(self) -> list[PendingPrompt]:
        return [p for key in list(self._pending) if (p := self.cancel(key)) is not None]
