"""Serving benchmarks: workloads, the naive transformers baseline, the load driver and its report.

Run `python scripts/bench_serving.py --help` (or `sgl_lite.bench.driver.main(argv)`).
"""
