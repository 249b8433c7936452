"""Splitting: a layer that cannot be captured whole graphed in parts (:mod:`.splitting`), and what becomes of a layer
whose capture fails (:mod:`.failures`, ``graphs.on_capture_error``).
"""
