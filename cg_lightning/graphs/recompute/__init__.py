"""Recomputation and parameter discovery: checkpointing that cooperates with capture (:mod:`.checkpointing`,
:mod:`.outer_checkpoint`) and which parameters a captured backward produces gradients for (:mod:`.discovery`).
"""
