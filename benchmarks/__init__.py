"""Benchmarks of cg-lightning against its peers (run from the repository root).

``python -m benchmarks.step_time --help``: step time of the example GPT under six training setups, side by side
in one process. Results go to ``benchmarks/results/``.
"""
