"""Benchmarks: each `bench_*.py` module measures one goal against a baseline run in the same
process and prints the ratio. Run all with ``python -m benchmarks`` (or ``python3 dev.py
bench``), one with ``python -m benchmarks NAME``. Results go to benchmarks/RESULTS.md."""
