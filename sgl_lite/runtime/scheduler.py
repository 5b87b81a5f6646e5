"""SPEC STUB (replaced by the implementation): the scheduler's public interface.

class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunnerBase, *, tokenizer=None,
                 eos_token_ids: Iterable[int] = (), context_length: int) -> None
        Builds SlotAllocator(runner.num_slots), RadixCache, the policy. `tokenizer` (has .decode)
        is needed only for stop strings.
    def add_request(self, req: Req) -> None
        Validates (prompt + max_new_tokens within context_length, priority rules, queue limit) and
        queues. Raises ValueError with a message naming the field or limit at fault; nothing is
        queued then. A queue-full rejection raises QueueFullError(ValueError).
    def abort_request(self, rid: str) -> bool
        Waiting or running: the request ends with FinishKind.ABORT; its KV is released; it is
        reported by the next step(). False when the rid is unknown.
    def step(self) -> list[Req]
        Runs at most one forward (prefill batch first, else decode batch) and returns every request
        whose state changed: new output tokens, finished (any reason, including aborts and queue
        evictions since the last step). Finished requests are removed and their KV cached/freed.
    def has_work(self) -> bool
    def flush_cache(self) -> bool            only when idle; False otherwise
    def check_invariant(self) -> None        AssertionError unless free + evictable + protected == total
                                             and (when idle) no request row or slot in use
    def stats(self) -> dict                  waiting, running, slot counts, hit counters, retractions, ...
"""
