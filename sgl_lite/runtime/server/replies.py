"""What the runtime server sends a client about one of its requests after a step: the replies, built from the
request's state and the server's record of the request in flight.

A streaming request gets TokenChunks as its text grows (at most one per --stream-interval tokens, or the
request's own interval), then its last TokenChunk carrying the meta info and finish_reason, then Finished; a
non-streaming one gets only Finished. A request aborted by the server (a failed step, a disconnect, a limit)
gets an ErrorReply instead; one aborted by its own client ends like a finished one, with the output so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sgl_lite.runtime import protocol
from sgl_lite.runtime.managers.request import FinishKind, Req
from sgl_lite.runtime.server.detokenizer import IncrementalDetokenizer, chunk_due

if TYPE_CHECKING:  # the core needs torch, which this module does not import at load time
    from sgl_lite.runtime.server.core import RuntimeCore


@dataclass
class InFlight:
    """The server's record of one request it has not sent the final reply for."""

    identity: bytes
    rid: str  # the client's rid (the scheduler's is identity-prefixed)
    stream_state: IncrementalDetokenizer | None  # None for non-streaming requests
    streamed_tokens: int = 0  # output tokens when its last chunk was sent
    abort_message: str | None = None  # why we aborted it (a failed step, a disconnect)
    client_gone: bool = False  # replies cannot be delivered any more


def replies_for(req: Req, flight: InFlight, core: RuntimeCore, stream_interval: int) -> list[protocol.Reply]:
    """What to send for a request that changed in the last step (maybe nothing); `stream_interval` is the
    server's --stream-interval, used where the request sets none."""
    if flight.client_gone:
        return []
    reason = req.finished_reason
    if reason is not None and reason.kind == FinishKind.ABORT and reason.error_code is not None:
        message = flight.abort_message or reason.message or "request aborted"
        return [protocol.ErrorReply(flight.rid, message, reason.error_code)]
    if reason is not None:  # finished, or aborted by its client: the output so far
        text = core.output_text(req)
        meta_info = {**core.meta_info(req), "id": flight.rid}  # the client's rid, not ours
        stream = flight.stream_state
        last_delta = None if stream is None else (stream.finish(text), stream.new_ids(req.output_ids))
        return final_replies(flight.rid, text, list(req.output_ids), meta_info, last_delta)
    interval = req.sampling_params.stream_interval or stream_interval
    if flight.stream_state is not None and chunk_due(len(req.output_ids), flight.streamed_tokens, interval):
        delta = flight.stream_state.update(req.output_ids)
        if delta:
            flight.streamed_tokens = len(req.output_ids)
            ids = flight.stream_state.new_ids(req.output_ids)
            progress = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids)}
            return [protocol.TokenChunk(flight.rid, delta, ids, progress)]
    return []


def final_replies(rid: str, text: str, output_ids: list[int], meta_info: dict[str, Any],
                  last_delta: tuple[str, list[int]] | None) -> list[protocol.Reply]:
    """Finished, after a stream's last TokenChunk (`last_delta`: the text and ids not streamed yet; None when
    not streaming), which carries the finish_reason."""
    final = protocol.Finished(rid, text, output_ids, meta_info)
    return [final] if last_delta is None else [protocol.TokenChunk(rid, last_delta[0], last_delta[1], meta_info), final]
