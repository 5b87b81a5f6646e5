"""How many CPU threads each forward runs on: chosen per batch size by measuring both counts.

On a small CPU box the best intra-op thread count is not fixed. A decode step is hundreds of short
parallel regions (every matmul, norm and attention call of every layer): with all cores free, two
threads beat one, but when any other process holds a core - a neighbour, or this server's own HTTP
front and its clients - the thread that lost its core stalls every region's barrier and two threads fall
far below one, at every batch size (with some neighbours a two-thread forward takes many times its
one-thread time; docs/performance.md, "Decode attention kernel, 8-bit KV cache, threads on a shared
box"). Which
side of that line a step is on changes with the load, so the governor measures instead of guessing:
forwards are grouped by their token count (powers of two), each group runs on its current thread count
and now and then on the other for a few probe forwards, and switches when the other count's median
forward time is clearly lower.

What probing may cost is bounded: after a probe that lost, the next one waits until the time the lost
probe wasted is at most `probe_budget` (2%) of the forward time in between, so a count that loses
badly is tried rarely; a probe forward 1.5x the current median ends the probe at once (on a free box a
prefill on one thread takes about twice as long, so a higher bar would let all three probe forwards of a
turn's prefills run; docs/performance.md, "Threads in serving: only contention that lasts").
When the current count's forwards have been clearly slower than when it was chosen for SUSTAINED_S
in a row (a neighbour took a core), the group probes at once, judging the current count by those slow
forwards.
A busy core slows every size alike, so a switch to fewer threads in one group moves every other group
there too (each then confirms it with a probe of its own), a hopeless probe postpones that count's probes in
every group on the same count, and a group seen for the first time starts from the latest verdict:
rare sizes - large prefills - would otherwise each pay for the discovery. A group whose count was set that
way, by another group's evidence and not by a probe of its own, keeps following every later verdict,
up as well as down: a prefill size sees a handful of forwards per agent turn, so after a moment of
contention it would otherwise wait minutes for its own probe and run on one thread, at half speed,
long after the decode sizes found the core free again (docs/performance.md, "Threads in serving"). A
count a group chose by its own probe is not dragged up, so sizes that differ on a
free box do not drag each other back and forth.

A core taken shows at once in how long the forward's threads waited for a CPU (run_queue.py): on a free
box a two-thread decode forward's threads waited 0-13% of its wall time; in serving, where the HTTP front
and its clients take turns on the cores, mostly up to ~42%, and 54-56% when a turn's requests arrive at once
(the front rendering and tokenizing them); with a neighbour spinning on one core 45-100% (91-100% in
serving). Such a starved forward (waits over STARVED_WAIT x its wall time) on a group with no verdict
yet, or slower than _SLOWDOWN x its verdict, moves every group to one thread without waiting for
probes (once the starvation lasts: below): with a busy neighbour two-thread forwards in serving took
many times their one-thread time, and each group discovering that by itself cost a whole benchmark run's
worth of stalled forwards. The usual probes bring two threads back when they win again. STARVED_WAIT sits above a turn's arrivals: at
0.5 they moved served agent runs to one thread, and 0.7 served them faster, with a neighbour spinning
too (docs/performance.md, "Threads in serving").

A forward need not end to be judged: the model calls the governor's ForwardWatch between layers, and a
multi-threaded forward long past its usual time with starved threads runs the rest of its layers on one
thread (and falls as above).

A fall ends early when the box is free again: each one-thread forward after it looks, once, between its
layers (QuietLook), whether anything else on the machine is runnable (/proc/loadavg's count of runnable
tasks); when nothing is, every size goes back to the count it had before the fall. Why: the front's burst
at a turn's arrival - not a neighbour - caused the falls seen in serving without a neighbour, and until
the probes brought two threads back the turn's prefills ran at half speed and its decode steps markedly
slower (docs/performance.md, "Threads in serving: a fall ends when the box is free again"). A spinning neighbour is always
runnable, so it holds the fall; a fall within _RECOVERY_HOLD_S of an early end is left to the probes (a
neighbour that comes and goes). The count is machine-wide: on a host shared with other tenants it is
rarely zero, and falls end as before.

A probe that moves its own size to fewer threads moves every other size as a fall does, and ends early
the same way (the probing size keeps its verdict): a moment of contention during one size's probe - a
decode size probes every few seconds - otherwise left the sizes seen rarely, a turn's prefills, on one
thread at half speed until a later probe of a frequent size chose two threads again (docs/performance.md,
"Threads in serving: a probe's fall ends too").

Either way the governor acts only on contention that lasts: a fall needs starved forwards in a row
(with the one under way) that add up to SUSTAINED_S of wall time, and an early probe slow forwards
that do. The front's bursts are short - a turn's prompts rendered and tokenized, its clients' replies -
and starved or slowed one decode step at a time: when one such forward was enough, it moved every size
to one thread in some served runs, or switched the decode sizes after a probe judged against that one
forward (once falls alone needed lasting starvation), for up to seconds at a time. A neighbour's
starvation does not end: a fall comes SUSTAINED_S later than it did, once. With 0.1 s, served
8-session runs gained, and so did runs beside a busy neighbour (docs/performance.md, "Threads in
serving: only contention that lasts").
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sgl_lite.runtime.model_executor.cpu_host.forward_looks import (
    LOOK_EVERY_S,
    STARVED_WAIT,
    SUSTAINED_S,
    ForwardWatch,
    QuietLook,
    others_runnable,
)
from sgl_lite.runtime.model_executor.cpu_host.run_queue import RunQueueWait, forward_thread_ids

logger = logging.getLogger(__name__)

_WINDOW = 5  # forward times kept per (group, thread count): medians of 5 shrug off one outlier
_SWITCH_MARGIN = 0.93  # the other count must be at least 7% faster to take over
_SLOWDOWN = 1.3  # a forward this much slower than its count's time at the verdict is slow
_LOSING = 1.5  # a probe forward this much slower than the current median ends the probe
_HOPELESS = 2.0  # ... and this much slower, postpones the probed count's probes in every group on the same count
_REWATCH_EVERY = 256  # multi-threaded forwards between looks at which threads run them
_FIRST_LOOK_UNKNOWN_S = 0.05  # a forward of a size not yet timed is first looked at after this long
_RECOVERY_HOLD_S = 2.0  # a fall this soon after a fall ended early is left to the probes


@dataclass
class _Group:
    """The forwards of one token-count group: the current thread count and recent times of each count."""

    current: int
    times: dict[int, deque[float]] = field(default_factory=dict)
    since_probe: int = 0
    probe_interval: int = 0
    probing: int = 0  # probe forwards still to run on the other count
    verdict_seconds: float = 0.0  # the current count's median forward time when the latest probe chose it (0: none yet)
    slow: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))  # the latest slow forwards in a row
    slow_seconds: float = 0.0  # their total wall time (all of them, not only the last _WINDOW)
    imposed: bool = True  # the current count came from other groups' evidence, not from a probe of this group's own

    def impose(self, threads: int, probe_interval: int) -> None:
        """Run on `threads` from now on, on other groups' evidence: no probe under way, none of its own yet."""
        self.current, self.probing, self.since_probe, self.probe_interval = threads, 0, 0, probe_interval
        self.verdict_seconds, self.imposed = 0.0, True


@dataclass
class ThreadGovernor:
    """Picks 1 or `max_threads` intra-op threads for each forward, per token-count group, by measurement."""

    max_threads: int
    min_probe_interval: int = 16
    max_probe_interval: int = 4096
    probe_forwards: int = 3
    probe_budget: float = 0.02  # lost probe time / forward time between probes
    groups: dict[int, _Group] = field(default_factory=dict)
    latest_verdict: int = 0  # the thread count the latest finished probe chose (0: none yet, use max_threads)
    forwards_by_threads: dict[int, int] = field(default_factory=dict)
    run_queue: RunQueueWait = field(default_factory=RunQueueWait)
    starved_seconds: float = 0.0  # wall time of the latest multi-threaded forwards in a row that were starved
    runnable: Callable[[], int | None] = others_runnable
    # each group's (count, verdict time, imposed) and the latest verdict just before the current fall, while
    # it may still end early (None: no fall, a fall held, or the probes took over)
    before_fall: tuple[dict[int, tuple[int, float, bool]], int] | None = None
    fall_ended_early_at: float = -math.inf

    @classmethod
    def for_this_process(cls) -> ThreadGovernor | None:
        """A governor over torch's current thread count; None when there is nothing to choose (1 thread)."""
        threads = torch.get_num_threads()
        return cls(max_threads=threads) if threads > 1 else None

    def _other(self, threads: int) -> int:
        return 1 if threads == self.max_threads else self.max_threads

    def choose(self, num_tokens: int) -> int:
        """The thread count for the next forward over `num_tokens` tokens (set in torch as well)."""
        group = self.groups.get(num_tokens.bit_length())
        if group is None:
            group = self.groups[num_tokens.bit_length()] = _Group(current=self.latest_verdict or self.max_threads,
                                                                  probe_interval=self.min_probe_interval)
        if group.probing == 0 and group.since_probe >= group.probe_interval:
            group.probing = self.probe_forwards
            group.times.pop(self._other(group.current), None)  # judge the other count by fresh forwards only
        threads = self._other(group.current) if group.probing else group.current
        torch.set_num_threads(threads)
        return threads

    def record(self, num_tokens: int, threads: int, seconds: float, waited_seconds: float | None = None) -> None:
        """Account one forward of `num_tokens` tokens that took `seconds` on `threads` threads, during which
        its threads waited `waited_seconds` for a CPU when known (run_queue.py)."""
        group = self.groups[num_tokens.bit_length()]
        group.times.setdefault(threads, deque(maxlen=_WINDOW)).append(seconds)
        self.forwards_by_threads[threads] = self.forwards_by_threads.get(threads, 0) + 1
        mine_window = group.times.get(group.current)
        starved = threads > 1 and waited_seconds is not None and waited_seconds > STARVED_WAIT * seconds
        if threads > 1 and waited_seconds is not None:
            self.starved_seconds = self.starved_seconds + seconds if starved else 0.0
        if (starved and threads == group.current and self.starved_seconds >= SUSTAINED_S
                and (not group.verdict_seconds or seconds > _SLOWDOWN * group.verdict_seconds)):
            self._fall_to_one_thread(num_tokens, threads, seconds, waited_seconds)
            return
        if threads == group.current:
            group.since_probe += 1
            if not (group.verdict_seconds and seconds > _SLOWDOWN * group.verdict_seconds):
                group.slow.clear()
                group.slow_seconds = 0.0
                return
            group.slow.append(seconds)
            group.slow_seconds += seconds
            if group.slow_seconds >= SUSTAINED_S:
                # judge the current count by the forwards that slowed down, not by the times before
                group.times[threads] = deque(group.slow, maxlen=_WINDOW)
                group.slow.clear()
                group.slow_seconds = 0.0
                group.since_probe, group.probe_interval = self.min_probe_interval, self.min_probe_interval
                group.verdict_seconds = 0.0  # one early probe per slowdown; the next verdict sets a new reference
            return
        mine = statistics.median(mine_window) if mine_window else seconds
        group.probing = 0 if seconds > _LOSING * mine else group.probing - 1
        if group.probing:
            return
        group.since_probe = 0
        theirs = statistics.median(group.times[threads])
        before_fall = None  # a probe's verdict replaces what an earlier fall remembered
        if theirs < mine * _SWITCH_MARGIN:
            low = 1 << (num_tokens.bit_length() - 1)
            logger.info("threads: forwards of %d-%d tokens now run on %d thread(s) (median %.1f ms against %.1f ms on %d)",
                        low, 2 * low - 1, threads, theirs * 1e3, mine * 1e3, group.current)
            group.current = threads
            group.probe_interval = self.min_probe_interval
            if threads < self.max_threads:  # a busy core: every size moves to fewer threads, as in a fall
                before_fall = self._before_fall(judge=group)
                for other in self.groups.values():
                    other.imposed = other.imposed or other.current != threads
        else:  # wait until this probe's lost time is probe_budget of the forwards in between
            lost = sum(group.times[threads]) - len(group.times[threads]) * mine
            interval = max(self.min_probe_interval, min(math.ceil(lost / (self.probe_budget * mine)), self.max_probe_interval))
            group.probe_interval = interval
            if seconds > _HOPELESS * mine:  # the other count stalls: no size tries it again soon
                for other in self.groups.values():
                    if other.current == group.current and not other.probing:
                        other.since_probe, other.probe_interval = 0, max(other.probe_interval, interval)
        group.verdict_seconds = min(mine, theirs)
        group.imposed = False
        self.latest_verdict = group.current
        self.before_fall = before_fall
        self._follow(group)

    def _follow(self, judge: _Group) -> None:
        """Groups whose count was imposed (and that are not probing) take the count `judge`'s probe chose."""
        for other in self.groups.values():
            if other is not judge and other.imposed and not other.probing and other.current != judge.current:
                other.impose(judge.current, self.min_probe_interval)

    def _fall_to_one_thread(self, num_tokens: int, threads: int, seconds: float, waited_seconds: float,
                            finished_on_one: bool = False) -> None:
        """A core was taken during a forward: every group runs on one thread from the next forward on."""
        logger.info("threads: a %d-token forward on %d threads waited %.0f%% of its %.1f ms for a CPU (a core is taken%s): "
                    "every forward now runs on 1 thread", num_tokens, threads, 100 * waited_seconds / seconds, seconds * 1e3,
                    "; its last layers ran on 1" if finished_on_one else "")
        # a fall while an earlier one is still in effect (one that a probe started) keeps what that one remembered
        self.before_fall = self.before_fall or self._before_fall()
        for group in self.groups.values():
            group.impose(1, self.min_probe_interval)
        self.latest_verdict = 1
        self.starved_seconds = 0.0

    def _before_fall(self, judge: _Group | None = None) -> tuple[dict[int, tuple[int, float, bool]], int] | None:
        """What a fall about to start may go back to if it ends early: every group's state but the `judge`'s
        (a probe's verdict, which the group keeps), and the latest verdict. None when held: a fall this
        soon after one ended early is left to the probes."""
        if time.monotonic() - self.fall_ended_early_at < _RECOVERY_HOLD_S:
            return None
        snapshot = {bits: (g.current, g.verdict_seconds, g.imposed) for bits, g in self.groups.items() if g is not judge}
        return snapshot, self.latest_verdict

    def _end_fall(self) -> None:
        """Nothing else runs: every group back to its count from before the fall (groups first seen since,
        to the verdict of then); a group whose own probe moved every size keeps its verdict."""
        assert self.before_fall is not None
        snapshot, verdict = self.before_fall
        for bits, group in self.groups.items():
            if bits in snapshot:
                group.impose(snapshot[bits][0], self.min_probe_interval)
                group.verdict_seconds, group.imposed = snapshot[bits][1], snapshot[bits][2]
            elif group.imposed:
                group.impose(verdict or self.max_threads, self.min_probe_interval)
        self.latest_verdict, self.before_fall = verdict, None
        self.fall_ended_early_at = time.monotonic()
        logger.info("threads: nothing else is runnable now: every forward back on its thread count from before the fall")

    @contextmanager
    def forward(self, num_tokens: int) -> Iterator[ForwardWatch | QuietLook | None]:
        """Run the body on the chosen thread count and record how long it took and how long its threads
        waited for a CPU. The body gets a callable for between its layers: a ForwardWatch when the forward
        runs on several threads, a QuietLook when it runs on one while a fall may still end early, else None."""
        threads = self.choose(num_tokens)
        watched = threads > 1  # a one-thread forward has no barrier for a lost core to stall
        if watched and self.forwards_by_threads.get(threads, 0) % _REWATCH_EVERY == 0:
            self.run_queue.watch(forward_thread_ids())  # the pool's threads rarely change: look again now and then
        start, waited = time.perf_counter(), self.run_queue.seconds() if watched else None
        group, watch = self.groups[num_tokens.bit_length()], None
        if watched and waited is not None:
            usual = group.times.get(threads)
            first_look = _HOPELESS * statistics.median(usual) if usual else _FIRST_LOOK_UNKNOWN_S
            first_look = max(first_look, LOOK_EVERY_S, SUSTAINED_S - self.starved_seconds)
            watch = ForwardWatch(self.run_queue, start, waited, start + first_look, self.starved_seconds)
        look = QuietLook(start, self.runnable) if not watched and self.before_fall is not None else None
        yield watch if watched else look
        seconds, waited_after = time.perf_counter() - start, self.run_queue.seconds() if watched else None
        waited_seconds = None if waited is None or waited_after is None else max(0.0, waited_after - waited)
        if watch is not None and watch.dropped and threads == group.current:
            # its time mixes two counts: no sample for either; what it showed is enough to fall
            self.forwards_by_threads[threads] = self.forwards_by_threads.get(threads, 0) + 1
            self._fall_to_one_thread(num_tokens, threads, seconds, waited_seconds or 0.0, finished_on_one=True)
            return
        self.record(num_tokens, threads, seconds, waited_seconds)
        if look is not None and look.quiet and self.before_fall is not None:
            self._end_fall()

    def summary(self) -> dict[str, object]:
        """Current thread count per group (keyed by the group's smallest token count) and forwards per count."""
        return {
            "max_threads": self.max_threads,
            "threads_by_min_tokens": {1 << (bits - 1) if bits else 0: g.current for bits, g in sorted(self.groups.items())},
            "forwards_by_threads": dict(self.forwards_by_threads),
        }
