"""Benchmark harness: ``python -m ep_plugin.bench --help``."""
