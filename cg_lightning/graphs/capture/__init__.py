"""Capture: a layer's warmup, parameter discovery's use, forward and backward capture of one call
(:mod:`.call_capture`), a capture that leaves the process as it was (:mod:`.capture_guard`), the calls of a step
recorded (:mod:`.recording`) and captured in order as a graph set (:mod:`.capture_order`, :mod:`.set_capture`), and
what a capture refuses (:mod:`.guards`, :mod:`.host_sync`).
"""
