"""The Lightning Trainer front end: ``Trainer(strategy="cudagraph_ddp")`` on the torch-only driver.

:mod:`.strategy` (the ``lightning.pytorch`` strategy, its backward and optimizer-step hooks in :mod:`.step_hooks`;
:mod:`.pytorch_lightning` the same body for the standalone ``pytorch_lightning`` package), :mod:`.faults` (bounded
collectives, named peer errors, preemption), :mod:`.whole_step` and :mod:`.step_checks` (the training step as one
graph, where it is provably safe), :mod:`.setup_checks` (options refused before the first step),
:mod:`.distributed_optimizer` (its sharded checkpoint files and clipping) and :mod:`.torch_ddp_options` (torch DDP
keyword arguments). The strategy name is registered with each Lightning package as it is imported by
:mod:`cg_lightning.registration`. Importing this package alone loads neither Lightning package; its modules do.
"""
