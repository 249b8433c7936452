"""Benchmarks of cg-lightning against its peers (run from the repository root).

``python -m benchmarks.step_time --help``: step time of the example GPT or a transformers Llama under twenty-three
training setups, side by side in one process. ``benchmarks/README.md`` lists the others, the diagnostics and the naming rule of
``benchmarks/results/``.
"""
