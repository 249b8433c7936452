"""The whole training step as one graph (:mod:`.whole_step`): whether its Python may be frozen (:mod:`.step_code`,
:mod:`.bytecode`), the values a replay relies on (:mod:`.watched`), and host reads of constants answered at capture
(:mod:`.capture_reads`).
"""
