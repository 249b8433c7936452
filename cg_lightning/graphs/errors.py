"""The errors of the graphs package, in one module that imports nothing, so every part of ``graphs/`` (and
``segments/``) can raise them without importing another part.

Each is a ``RuntimeError`` whose message names the layer or call, the cause and what to do.
"""


class GraphCaptureError(RuntimeError):
    """A layer could not be captured; the message names the layer and the cause."""

    #: the :class:`HostSyncError` that made the capture fail, when that was the cause: the message quotes it whole
    #: (operation and source line), so it is not chained as ``__cause__``
    host_sync = None


class GraphSignatureError(RuntimeError):
    """A call's arguments differ from those a graph was captured with (shape policy ``"error"``)."""


class HostSyncError(RuntimeError):
    """A host synchronization inside a graphed layer or a captured step (:mod:`.capture.host_sync`)."""


class BufferReuseError(RuntimeError):
    """A callable in memory-saving mode was not called with the previous callable's output."""


class OutputStructureError(TypeError):
    """A call's output holds a leaf that is neither a tensor nor a constant (``outputs.CONSTANT_TYPES``), or no
    tensor at all."""


class SegmentError(RuntimeError):
    """A call inside a segment was not handed the chained tensor it was captured with (:mod:`.segments`)."""
