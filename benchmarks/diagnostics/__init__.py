"""One-off probes of where a training step's time goes (host phases, device work and idle gaps, profiles,
kernel choices under capture, the ``AccumulateGrad`` stream binding). They explain a figure of the step-time
benchmark; they are not comparisons of peers. Each runs with ``python -m benchmarks.diagnostics.<name> --help``.
"""
