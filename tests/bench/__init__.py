"""Benchmarks (`make bench`): each bench_*.py writes reports/bench_<name>.json; report.py
merges them into reports/bench.json, draws the plots and writes the table."""
