"""The error of a call that breaks a segment's contract (see :mod:`cg_lightning.graphs.segments`)."""


class SegmentError(RuntimeError):
    """A call inside a segment was not handed the chained tensor it was captured with."""
