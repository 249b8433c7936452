"""Optimizer pieces: the cached fused Adam step and the optimizer-step graph.

Imports only torch; the optimizer-step graph is handed a graph backend (:mod:`cg_lightning.graphs.backends`).
"""
