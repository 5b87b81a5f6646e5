"""Scheduling simulator: the real Scheduler, RadixCache and policies in virtual time, no model weights.

`sgl-lite simulate` (sgl_lite.sim.cli) replays a bench workload or a JSONL trace under each queue
policy and reports hit rate, throughput, TTFT and queue waits per priority class.
"""
