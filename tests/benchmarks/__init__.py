"""Benchmarks: ``python -m tests.benchmarks.run [--quick] [--json PATH]`` (never collected by pytest)."""
