"""Who gives way when room runs out: the choices behind retraction and priority preemption.

Pure functions over the running requests; the scheduler applies them (requeue, counters, budgets).
- Retraction (decode needs one slot per running request and free + evictable is short): SGLang's
  retract_decode order, fewest outputs first, then longest prompt; afterwards the new-token ratio
  is re-estimated from what the survivors have left.
- Preemption (priority scheduling): the least urgent running requests, only those less urgent than
  the newcomer by MORE than the threshold, and only as many as make it fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sgl_lite.runtime.managers.request import Req

# SGLang's SGLANG_RETRACT_DECODE_STEPS: after a retraction, reserve this many steps per remaining request.
RETRACT_DECODE_STEPS = 20


def retraction_order(running: Sequence[Req]) -> list[Req]:
    """`running` sorted so that `pop()` gives the next request to retract."""
    return sorted(running, key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True)


def new_token_ratio_after_retraction(survivors: Sequence[Req]) -> float:
    """The share of their remaining max_new_tokens the survivors are expected to use."""
    decoded = sum(len(r.output_ids) for r in survivors)
    max_new = sum(r.sampling_params.max_new_tokens for r in survivors)
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(survivors)) / (max_new + 1))


def preemption_victims(
    running: Sequence[Req],
    urgency: float,
    urgency_of: Callable[[Req], float],
    threshold: float,
    tokens_short: float,
    need_row: bool,
    tokens_freed: Callable[[Req], float],
) -> list[Req]:
    """As few running requests as free `tokens_short` budget tokens (and a row when `need_row`), each
    less urgent (larger urgency) than `urgency` by more than `threshold`; [] when they cannot."""
    # Least urgent first; among equals the most recently queued first.
    candidates = sorted(running, key=lambda r: (-urgency_of(r), -r.queue_enter_time))
    victims: list[Req] = []
    for r in candidates:
        if tokens_short <= 0 and (victims or not need_row):
            break
        if urgency_of(r) - urgency <= threshold:
            break  # candidates only get more urgent from here
        victims.append(r)
        tokens_short -= tokens_freed(r)
    return victims if victims and tokens_short <= 0 else []
