"""Replay: one graphed call's static buffers, matching and replay (:mod:`.runner`), its autograd node
(:mod:`.replay_node`), a step's calls replayed from their graph set (:mod:`.set_replay`), where each gradient goes
and which grad-ready notifications a replay fires (:mod:`.routing`, :mod:`.replay_plan`, :mod:`.direct_ready`),
calls that differ only in ``requires_grad`` or dtype (:mod:`.relaxed_calls`), input gradients and their layouts
(:mod:`.input_pieces`, :mod:`.grad_layouts`).
"""
