"""Errors of the data-parallel engine."""


class GradSyncError(RuntimeError):
    """Gradients could not be synchronized: a parameter did not report ready as often as expected, or
    the ranks disagree. Raised on every rank, never left as a hang."""
