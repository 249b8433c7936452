"""The example models and data of the command line, importable wherever the package is installed.

* :mod:`~cg_lightning.examples.gpt`: a byte-level GPT and its ``LightningModule``;
* :mod:`~cg_lightning.examples.llama`: a ``transformers`` Llama built from a config (random weights, no download);
* :mod:`~cg_lightning.examples.data`: ``TextDataModule``, windows of a text or token file (by default the Python
  standard library's sources);
* :mod:`~cg_lightning.examples.resumable`: a training ``DataLoader`` that Lightning resumes mid-epoch exactly;
* :mod:`~cg_lightning.examples.configs`: the YAML runs of ``python -m cg_lightning`` that use them.
"""
