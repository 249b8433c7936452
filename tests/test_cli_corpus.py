"""A corpus of bad input: malformed configurations and bad data files, each refused by ``python -m cg_lightning``
with an ``error:`` line that names the key (or the path) and the file it came from, exit status 2, no traceback and
no training step. In-process (one ``main`` call per case); a few cases also as real processes, for the status.

Each case is ``(id, files, args, expected)``: files to write into the case's folder (``{name}`` in an argument or
in ``expected`` is the path of that file, ``{tmp}`` the folder), the arguments after ``fit --config BASE``, and the
fragments one ``error:`` line must hold (the key, and the source: a file or ``command line``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import cg_lightning.examples.gpt
import tests.helpers_config as helpers
from cg_lightning.cli import main
from tests.helpers import ROOT

BASE = """
seed_everything: 1
trainer:
  accelerator: cpu
  devices: 1
  strategy: auto
  max_steps: 2
  limit_val_batches: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_checkpointing: false
  enable_model_summary: false
  logger: false
model:
  class_path: cg_lightning.examples.gpt.GPTLightningModule
  init_args: {vocab_size: 256, block_size: 16, n_layer: 1, n_head: 2, d_model: 16}
data:
  class_path: cg_lightning.examples.data.TextDataModule
  init_args: {block_size: "${model.init_args.block_size}", batch_size: 2, max_bytes: 20000}
"""
CL = "command line"
STRATEGY = "trainer:\n  strategy:\n    class_path: cg_lightning.CUDAGraphDDPStrategy\n    init_args:\n      {}: {{{}: {}}}\n"


def _file(name: str, text: str, key: str) -> tuple:
    """A case whose bad value is in a config file of its own."""
    return ({name: text}, ["--config", "{" + name + "}"], [key, "{" + name + "}"])


def _override(arg: str, key: str) -> tuple:
    return ({}, [arg], [key, CL])


def _trainer(name: str, value: str) -> tuple:
    return _file("t.yaml", f"trainer:\n  {name}: {value}\n", f"trainer.{name}:")


def _option(section: str, name: str, value: str) -> tuple:
    return _file("s.yaml", STRATEGY.format(section, name, value), f"trainer.strategy.init_args.{section}.{name}:")


def _model(name: str, value: str) -> tuple:
    return _override(f"--model.init_args.{name}={value}", f"model.init_args.{name}:")


def _data(name: str, value: str) -> tuple:
    return _override(f"--data.init_args.{name}={value}", f"data.init_args.{name}:")


CONFIGS = {
    # Trainer numbers and types: out of range, non-finite, wrong type (21)
    **{f"trainer-{k}={v}": _trainer(k, v) for k, v in [
        ("max_steps", "-5"), ("max_steps", "abc"), ("max_steps", "1.5"), ("max_epochs", "-3"), ("min_steps", "-1"),
        ("accumulate_grad_batches", "0"), ("accumulate_grad_batches", "-2"), ("gradient_clip_val", "-1"),
        ("gradient_clip_val", ".nan"), ("gradient_clip_val", ".inf"), ("limit_train_batches", "-1"),
        ("limit_val_batches", "1.5"), ("limit_val_batches", ".nan"), ("val_check_interval", "0"),
        ("val_check_interval", "0.0"), ("log_every_n_steps", "0"), ("num_sanity_val_steps", "-2"),
        ("check_val_every_n_epoch", "0"), ("num_nodes", "0"), ("devices", "abc"), ("precision", "17")]},
    # Trainer settings Lightning refuses (3)
    "trainer-gradient_clip_algorithm": _trainer("gradient_clip_algorithm", "max"),
    "trainer-strategy-name": _trainer("strategy", "ddpp"),
    "trainer-logger-name": _trainer("logger", "wandb"),
    # strategy options: type, range, non-finite, unknown (20)
    **{f"option-{s}.{k}={v}": _option(s, k, v) for s, k, v in [
        ("graphs", "enabled", "maybe"), ("graphs", "layers", "3"), ("graphs", "layers", "'net.*'"),
        ("graphs", "warmup_steps", "-1"), ("graphs", "warmup_steps", "two"), ("graphs", "num_warmup_iters", "0"),
        ("graphs", "backend", "tpu"), ("graphs", "shape_policy", "sometimes"), ("graphs", "max_graph_sets", "0"),
        ("graphs", "on_capture_error", "ignore"), ("graphs", "segments", "[1]"), ("graphs", "warmup_step", "1"),
        ("ddp", "bucket_size_mb", "0"), ("ddp", "bucket_size_mb", ".inf"), ("ddp", "bucket_size_mb", "1.0e+15"),
        ("ddp", "timeout_s", ".nan"), ("ddp", "timeout_s", "1.0e+15"), ("ddp", "timeout_s", "-3"),
        ("ddp", "grad_dtype", "int8"), ("ddp", "bucket_size", "4")]},
    # the example model's and data module's arguments (16)
    **{f"model-{k}={v}": _model(k, v) for k, v in [
        ("lr", "-1"), ("lr", ".nan"), ("lr", "abc"), ("n_layer", "0"), ("n_head", "3"), ("d_model", "0"),
        ("d_model", "1000000000"), ("block_size", "0"), ("vocab_size", "-256"), ("dropout", "1.5"),
        ("betas", "[1.0, 2.0]"), ("warmup_lr_steps", "-1"), ("weight_decay", "-0.1")]},
    **{f"data-{k}={v}": _data(k, v) for k, v in [
        ("batch_size", "0"), ("batch_size", "-4"), ("val_fraction", "1.5"), ("max_bytes", "0"),
        ("num_workers", "-1"), ("block_size", "64")]},
    # seeds (3)
    "seed=-1": _override("--seed_everything=-1", "seed_everything:"),
    "seed=2**70": _override(f"--seed_everything={2**70}", "seed_everything:"),
    "seed=abc": _file("seed.yaml", "seed_everything: abc\n", "seed_everything:"),
    # unknown keys, at every level (8)
    "unknown-top": _file("u.yaml", "trainr: {max_steps: 1}\n", "trainr:"),
    "unknown-strategy-at-the-top": _file("u.yaml", "strategy: {name: ddp}\n", "strategy:"),
    "unknown-seed": _file("u.yaml", "seed: 3\n", "seed:"),
    "unknown-trainer": _override("--trainer.max_step=3", "trainer.max_step:"),
    "unknown-model-arg": _override("--model.init_args.n_layr=2", "model.init_args.n_layr:"),
    "unknown-data-arg": _file("u.yaml", "data:\n  init_args: {batchsize: 4}\n", "data.init_args.batchsize:"),
    "unknown-class-key": _file("u.yaml", "model:\n  init_arg: {}\n", "model.init_arg:"),
    "unknown-option-flag": _override("--ckpt-path=x", "ckpt-path:"),
    # class paths (8)
    "class-no-module": _override("--model.class_path=no_such_pkg.Model", "model.class_path:"),
    "class-typo": _override("--model.class_path=cg_lightning.examples.gpt.GPTLightningModul", "model.class_path:"),
    "class-no-dots": _override("--data.class_path=TextDataModul", "data.class_path:"),
    "class-missing": _override("--model.class_path=???", "model.class_path:"),
    "class-wrong-kind": _override("--model.class_path=cg_lightning.examples.data.TextDataModule", "model.class_path:"),
    "class-callback-wrong-kind": _override("--trainer.callbacks=[{class_path: cg_lightning.examples.gpt.GPT}]",
                                           "trainer.callbacks[0].class_path:"),
    "class-not-a-class": _override("--model.class_path=cg_lightning.examples.data.whole", "model.class_path:"),
    "class-no-class-path": _file("c.yaml", "trainer:\n  callbacks:\n    - init_args: {x: 1}\n",
                                 "trainer.callbacks[0].class_path:"),
    # sections of the wrong shape, missing values, interpolations (6)
    "section-scalar": _file("w.yaml", "trainer: 5\n", "trainer:"),
    "init-args-scalar": _file("w.yaml", "model:\n  init_args: 3\n", "model.init_args:"),
    "missing-value": _file("w.yaml", "model:\n  init_args:\n    n_layer: ???\n", "model.init_args.n_layer:"),
    "interpolation-to-nothing": _file("w.yaml", "data:\n  init_args: {batch_size: '${model.init_args.nope}'}\n",
                                      "data.init_args.batch_size:"),
    "interpolation-override": _override("--data.init_args.batch_size=${nope}", "data.init_args.batch_size:"),
    "no-model": _override("--model=null", "model:"),
    # overrides (3)
    "override-broken-yaml": _override("--trainer.max_steps=[1,", "--trainer.max_steps=[1,"),
    "override-without-dashes": _override("trainer.max_steps=3", "'trainer.max_steps=3'"),
    "override-without-value": _override("--trainer.max_steps", "--trainer.max_steps"),
    # config files that are not configurations (8)
    "file-missing": ({}, ["--config", "{tmp}/nope.yaml"], ["{tmp}/nope.yaml: no such config file"]),
    "file-folder": ({"sub/x.yaml": "a: 1\n"}, ["--config", "{tmp}/sub"], ["{tmp}/sub: is a folder"]),
    "file-empty": ({"e.yaml": ""}, ["--config", "{e.yaml}"], ["{e.yaml}: the file holds no settings"]),
    "file-comments-only": ({"e.yaml": "# nothing\n"}, ["--config", "{e.yaml}"], ["{e.yaml}: the file holds no"]),
    "file-list": ({"e.yaml": "- a\n- b\n"}, ["--config", "{e.yaml}"], ["{e.yaml}: expected a mapping"]),
    "file-scalar": ({"e.yaml": "42\n"}, ["--config", "{e.yaml}"], ["{e.yaml}: expected a mapping"]),
    "file-broken-yaml": ({"e.yaml": "trainer: [1, 2\n"}, ["--config", "{e.yaml}"], ["{e.yaml}: invalid YAML"]),
    "file-binary": ({"e.yaml": b"\xff\xfe\x00bin"}, ["--config", "{e.yaml}"], ["{e.yaml}: not a text file"]),
    # checkpoints (5)
    "ckpt-missing": ({}, ["--ckpt_path", "{tmp}/no.ckpt"], ["ckpt_path:", CL, "no such file"]),
    "ckpt-folder": ({"d/x": "1"}, ["--ckpt_path", "{tmp}/d"], ["ckpt_path:", CL, "is a folder"]),
    "ckpt-text": ({"t.ckpt": "text"}, ["--ckpt_path", "{t.ckpt}"], ["ckpt_path:", CL, "is not a checkpoint"]),
    "ckpt-empty": ({"e.ckpt": b""}, ["--ckpt_path", "{e.ckpt}"], ["ckpt_path:", CL, "is not a checkpoint"]),
    "ckpt-state-dict": ({"s.ckpt": "@state_dict"}, ["--ckpt_path", "{s.ckpt}"], ["ckpt_path:", CL,
                                                                              "not a Lightning checkpoint"]),
    # output folders (3)
    "root-is-a-file": ({"f": "x"}, ["--trainer.default_root_dir={f}"], ["trainer.default_root_dir:", CL, "is a file"]),
    "root-under-a-file": ({"f": "x"}, ["--trainer.default_root_dir={f}/runs"], ["trainer.default_root_dir:", CL,
                                                                                "cannot be created"]),
    "logger-under-a-file": ({"f": "x"}, ["--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                                         "--trainer.logger.init_args.save_dir={f}/logs"],
                            ["trainer.logger.init_args.save_dir:", CL, "cannot be created"]),
    # refused at the start of the run (2)
    "layers-match-nothing": ({}, ["--trainer.strategy=cg_lightning.CUDAGraphDDPStrategy",
                                  "--trainer.strategy.init_args.graphs.layers=[nope.*]"],
                             ["trainer.strategy.init_args.graphs.layers:", CL, "matched no module"]),
    "manual-optimization-clipping": ({}, [f"--model.class_path={'tests.helpers_config'}.ManualRegressor",
                                          "--model.init_args={}", "--data.class_path=tests.helpers_config.TinyData",
                                          "--data.init_args={}", "--trainer.gradient_clip_val=1"],
                                     ["trainer.gradient_clip_val:", CL]),
}

rng = np.random.default_rng(0)
DATA = {
    "data-missing-text": ({}, "{tmp}/nope.txt"),
    "data-missing-bin": ({}, "{tmp}/nope.bin"),
    "data-empty-folder": ({"empty/.keep": ""}, "{tmp}/empty"),
    "data-folder-of-binaries": ({"bins/a.dat": b"\xff\xfe\x80" * 50}, "{tmp}/bins"),
    "data-empty-text": ({"e.txt": ""}, "{e.txt}"),
    "data-not-utf8": ({"b.txt": b"\xff\xfe\x80" * 200}, "{b.txt}"),
    "data-text-too-short": ({"s.txt": "abc" * 5}, "{s.txt}"),
    "data-val-split-too-short": ({"v.txt": "x" * 150}, "{v.txt}"),
    "data-bin-odd-bytes": ({"o.bin": b"\x01\x00\x02"}, "{o.bin}"),
    "data-bin-empty": ({"z.bin": b""}, "{z.bin}"),
    "data-bin-too-short": ({"t.bin": np.arange(10, dtype=np.uint16).tobytes()}, "{t.bin}"),
    "data-bin-vocab-mismatch": ({"v.bin": rng.integers(0, 1000, 4000).astype(np.uint16).tobytes()}, "{v.bin}"),
    "data-dev-null": ({}, "/dev/null"),
    "data-bin-is-a-folder": ({"dir.bin/x": "1"}, "{tmp}/dir.bin"),
}


@pytest.fixture
def no_step(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("a training step ran despite bad input")

    for cls in (cg_lightning.examples.gpt.GPTLightningModule, helpers.TinyRegressor):
        monkeypatch.setattr(cls, "training_step", refuse)


def _write(tmp_path, files: dict) -> dict:
    names = {"tmp": str(tmp_path)}
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == "@state_dict":
            torch.save({"weight": torch.zeros(2)}, path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        names[name] = str(path)
    return names


def _fill(text: str, names: dict) -> str:
    for name, path in names.items():
        text = text.replace("{" + name + "}", path)
    return text


def _refused(tmp_path, capsys, args, expected, names):
    base = tmp_path / "base.yaml"
    base.write_text(BASE)
    names["base.yaml"] = str(base)
    capsys.readouterr()
    root = tmp_path / "runs"
    assert main(["fit", "--config", str(base), f"--trainer.default_root_dir={root}",
                 *(_fill(a, names) for a in args)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    fragments = [_fill(e, names) for e in expected]
    assert any(all(f in line for f in fragments) for line in lines), (fragments, err[-3000:])
    assert "Traceback" not in err, err[-3000:]


def test_the_corpus_is_large_enough():
    assert len(CONFIGS) >= 80 and len(DATA) >= 12, (len(CONFIGS), len(DATA))


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_malformed_config(case, tmp_path, capsys, no_step):
    files, args, expected = CONFIGS[case]
    _refused(tmp_path, capsys, args, expected, _write(tmp_path, files))


@pytest.mark.parametrize("case", sorted(DATA))
def test_bad_data(case, tmp_path, capsys, no_step):
    files, path = DATA[case]
    names = _write(tmp_path, files)
    data = tmp_path / "data.yaml"
    data.write_text(f"data:\n  init_args:\n    path: {_fill(path, names)}\n")
    names["data.yaml"] = str(data)
    _refused(tmp_path, capsys, ["--config", str(data)], ["data.init_args.path:", str(data)], names)


def test_import_error_in_the_users_module_names_the_key_then_shows_its_traceback(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_module.py").write_text("import math\n\nVALUE = math.sqrt(-1)\n\nclass Model: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = tmp_path / "base.yaml"
    base.write_text(BASE)
    assert main(["fit", "--config", str(base), "--model.class_path=broken_module.Model"]) == 2
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if line.startswith("error: "))
    assert first == ("error: command line: model.class_path: importing module 'broken_module' failed: ValueError: "
                     "math domain error")
    trace = err[err.index(first) + len(first):]
    assert "broken_module.py\", line 3" in trace and "cg_lightning" not in trace and "importlib" not in trace


def test_exit_status_of_a_real_process(tmp_path):
    """Bad data, from a real process (a malformed config: tests/test_main_job.py)."""
    base = tmp_path / "base.yaml"
    base.write_text(BASE)
    proc = subprocess.run([sys.executable, "-m", "cg_lightning", "fit", "--config", str(base),
                           "--data.init_args.path=/dev/null"], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: command line: data.init_args.path: data path '/dev/null' is neither a regular file" in proc.stderr
    assert "Traceback" not in proc.stderr
