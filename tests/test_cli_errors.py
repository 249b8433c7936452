"""Configuration errors of ``python -m cg_lightning``: one ``error:`` line per problem naming the key and the file
(or ``command line``) it came from, exit status 2, no traceback, no training step (CPU, in-process, fast).

Each case gives the files to write (``{name}`` in an argument or an expected line is that file's path) and the
argument list after ``fit --config BASE`` (``@test`` first: another subcommand); ``expected`` are fragments of the
``error:`` lines.
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest
import torch

import tests.helpers_config as helpers
from cg_lightning.cli import main
from cg_lightning.cli.app import TRACEBACK_VARIABLE
from tests.test_cli import BASE_YAML, HELPERS

S = "--trainer.strategy.init_args."
STRATEGY_FILE = "trainer:\n  strategy:\n    class_path: cg_lightning.CUDAGraphDDPStrategy\n    init_args:\n{}"


def strategy_file(body: str) -> str:
    return STRATEGY_FILE.format(textwrap.indent(textwrap.dedent(body), " " * 6))


CASES = [
    # ------------------------------------------------------------------ unknown keys, with a close match
    ("unknown-key-in-file", {"bad.yaml": "trainer:\n  max_step: 5\n"}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: trainer.max_step: unknown key (did you mean 'max_steps'?); valid keys under 'trainer': "]),
    ("unknown-keys-all-at-once", {"bad.yaml": "trainr: {}\nseed: 3\n" + strategy_file("graphs: {backnd: cuda}\n")},
     ["--config", "{bad.yaml}"],
     ["{bad.yaml}: trainr: unknown key (did you mean 'trainer'?)",
      "{bad.yaml}: seed: unknown key (did you mean 'seed_everything'?)",
      "{bad.yaml}: trainer.strategy.init_args.graphs.backnd: unknown key (did you mean 'backend'?)"]),
    ("key-at-the-wrong-level", {"bad.yaml": "strategy: {graphs: {warmup_steps: 3}}\nbucket_size_mb: 4\n"},
     ["--config", "{bad.yaml}"],
     ["{bad.yaml}: strategy: unknown key (did you mean 'trainer.strategy'?)",
      "{bad.yaml}: bucket_size_mb: unknown key (did you mean 'trainer.strategy.init_args.ddp.bucket_size_mb'?)"]),
    ("unknown-key-on-the-command-line", {}, ["--trainer.max_step=3"],
     ["command line: trainer.max_step: unknown key (did you mean 'max_steps'?)"]),
    ("unknown-init-arg", {}, ["--model.init_args.hiden=3"],
     [f"command line: model.init_args.hiden: unknown key (did you mean 'hidden'?); valid keys under 'model.init_args' "
      f"({HELPERS}.TinyRegressor): hidden, in_features, lr"]),
    ("unknown-init-arg-shorthand", {}, ["--model.hiden=3"],
     ["command line: model.init_args.hiden: unknown key (did you mean 'hidden'?)"]),
    ("unknown-key-in-a-list-item", {"bad.yaml": f"trainer:\n  callbacks:\n    - class_path: {HELPERS}.RecordingCallback"
                                                "\n      init_arg: {}\n"}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: trainer.callbacks[0].init_arg: unknown key (did you mean 'init_args'?)"]),
    ("unknown-callback-init-arg", {}, [f"--trainer.callbacks=[{{class_path: {HELPERS}.RecordingCallback, "
                                       "init_args: {tagg: a}}]"],
     ["command line: trainer.callbacks[0].init_args.tagg: unknown key (did you mean 'tag'?)"]),
    ("option-spelled-with-dashes", {}, ["--ckpt-path", "x.ckpt"], ["command line: ckpt-path: unknown key (did you mean "
                                                             "'ckpt_path'?)"]),
    # ------------------------------------------------------------------ wrong types
    ("wrong-type-in-file", {"bad.yaml": "trainer:\n  max_steps: abc\n"}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: trainer.max_steps: expected int, got 'abc'"]),
    ("wrong-type-optional", {}, ["--trainer.max_epochs=many"], ["command line: trainer.max_epochs: expected int or "
                                                                "null, got 'many'"]),
    ("section-where-a-value-was", {"bad.yaml": "seed_everything: {a: 1}\n"}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: seed_everything: expected bool or int, got "]),
    ("section-not-a-mapping", {"bad.yaml": "trainer: 5\n"}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: trainer: expected a mapping of keys (accelerator, "]),
    ("init-args-not-a-mapping", {"bad.yaml": "model:\n  init_args: 3\n"}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: model.init_args: expected a mapping of keys (hidden, in_features, lr, ...), got 3"]),
    ("layers-not-a-list", {"bad.yaml": strategy_file("graphs: {layers: 'net.*'}\n")}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: trainer.strategy.init_args.graphs.layers: expected list of str or null, got 'net.*' (a single "
      "item is written as a list: ['net.*'])"]),
    ("init-arg-annotation", {}, ["--model.init_args.hidden=abc"], ["command line: model.init_args.hidden: expected "
                                                                   "int, got 'abc'"]),
    ("literal-and-optional-annotations", {}, [f"--trainer.callbacks=[{{class_path: {HELPERS}.ChoiceCallback, "
                                              "init_args: {mode: median, patience: x}}]"],
     ["command line: trainer.callbacks[0].init_args.mode: expected one of ('min', 'max'), got 'median'",
      "command line: trainer.callbacks[0].init_args.patience: expected int or null, got 'x'"]),
    ("logger-name", {}, ["--trainer.logger=wandb"], ["command line: trainer.logger: expected bool or "
                                                     "Iterable[Logger] or Logger or null, got 'wandb'"]),
    # ------------------------------------------------------------------ missing values
    ("missing-value", {"bad.yaml": "model:\n  init_args:\n    hidden: ???\n"}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: model.init_args.hidden: missing value ('???'); expected int"]),
    ("class-path-missing-in-list-item", {"bad.yaml": "trainer:\n  callbacks:\n    - init_args: {tag: x}\n"},
     ["--config", "{bad.yaml}"], ["{bad.yaml}: trainer.callbacks[0].class_path: missing"]),
    # ------------------------------------------------------------------ option values, every one at once
    ("graph-option-values", {"bad.yaml": strategy_file("graphs: {num_warmup_iters: 0}\n")},
     ["--config", "{bad.yaml}", S + "graphs.backend=foo", S + "ddp.bucket_size_mb=0", S + "ddp.grad_dtype=int8",
      "--trainer.max_steps=x"],
     ["{bad.yaml}: trainer.strategy.init_args.graphs.num_warmup_iters: expected int >= 1, got 0",
      "command line: trainer.strategy.init_args.graphs.backend: expected one of ('auto', 'cuda', 'eager'), got 'foo'",
      "command line: trainer.strategy.init_args.ddp.bucket_size_mb: expected float > 0 and <= 1048576, got 0",
      "command line: trainer.strategy.init_args.ddp.grad_dtype: expected one of",
      "command line: trainer.max_steps: expected int, got 'x'"]),
    ("trainer-value-ranges", {}, ["--trainer.accumulate_grad_batches=0", "--trainer.gradient_clip_val=-1",
                                  "--trainer.max_steps=-2"],
     ["command line: trainer.max_steps: expected an int >= -1, got -2",
      "command line: trainer.accumulate_grad_batches: expected an int >= 1, got 0",
      "command line: trainer.gradient_clip_val: expected a finite number >= 0 or null, got -1"]),
    ("trainer-rejects-a-value", {}, ["--trainer.gradient_clip_algorithm=max"],
     ["command line: trainer.gradient_clip_algorithm: the Trainer refused it: `gradient_clip_algorithm` max is "
      "invalid"]),
    ("trainer-rejects-devices", {}, ["--trainer.devices=abc"], ["command line: trainer.devices: the Trainer refused "
                                                                "it:"]),
    ("strategy-name", {}, ["--trainer.strategy=ddpp"], ["command line: trainer.strategy: the Trainer refused it: You "
                                                        "selected an invalid strategy name", "(did you mean 'ddp'?)"]),
    ("interpolation", {}, ["--data.init_args.n=${model.init_args.nope}"],
     ["command line: data.init_args.n: interpolation does not resolve: no key 'model.init_args.nope'"]),
    # ------------------------------------------------------------------ sources
    ("missing-file", {}, ["--config", "{tmp}/nope.yaml"], ["{tmp}/nope.yaml: no such config file"]),
    ("list-file", {"list.yaml": "- 1\n- 2\n"}, ["--config", "{list.yaml}"], ["{list.yaml}: expected a mapping of "
                                                                            "keys at the top level, got list"]),
    ("broken-yaml", {"broken.yaml": "trainer: [1, 2\n"}, ["--config", "{broken.yaml}"],
     ["{broken.yaml}: invalid YAML at line 2, column 1:"]),
    ("empty-file", {"empty.yaml": ""}, ["--config", "{empty.yaml}"], ["{empty.yaml}: the file holds no settings"]),
    ("override-without-dashes", {}, ["trainer.max_steps=3"], ["command line: 'trainer.max_steps=3' is not an "
                                                              "option; overrides are written --trainer.max_steps=3"]),
    ("override-without-value", {}, ["--trainer.max_steps"], ["command line: --trainer.max_steps has no value"]),
    # ------------------------------------------------------------------ classes
    ("class-path-typo", {}, [f"--model.class_path={HELPERS}.TinyRegresor"],
     [f"command line: model.class_path: module '{HELPERS}' has no attribute 'TinyRegresor' (did you mean "
      f"'{HELPERS}.TinyRegressor'?)"]),
    ("class-path-no-module", {}, ["--model.class_path=no_such_pkg.Model"],
     ["command line: model.class_path: cannot import 'no_such_pkg.Model': no module named 'no_such_pkg'"]),
    ("class-path-not-an-import-path", {}, ["--data.class_path=TinyDat"],
     ["command line: data.class_path: 'TinyDat' is neither an import path"]),
    ("wrong-kind-of-class", {}, [f"--model.class_path={HELPERS}.TinyData",
                                 f"--trainer.callbacks=[{{class_path: {HELPERS}.NotACallback}}]"],
     [f"command line: trainer.callbacks[0].class_path: {HELPERS}.NotACallback is not a subclass of "
      "lightning.pytorch.callbacks.callback.Callback",
      f"command line: model.class_path: {HELPERS}.TinyData is not a subclass of lightning.pytorch.core.module."
      "LightningModule"]),
    ("no-model", {}, ["--model=null"], ["model: missing: fit needs a "
                                                                                   "LightningModule"]),
    # ------------------------------------------------------------------ refused before the first batch
    ("checkpoint-missing", {}, ["--ckpt_path", "{tmp}/nope.ckpt"], ["command line: ckpt_path: '{tmp}/nope.ckpt': no "
                                                                     "such file"]),
    ("checkpoint-not-one", {"fake.ckpt": "not a checkpoint\n"}, ["--ckpt_path", "{fake.ckpt}"],
     ["command line: ckpt_path: '{fake.ckpt}' is not a checkpoint (torch.load cannot read it: "]),
    ("layers-match-nothing", {}, ["--trainer.strategy=cg_lightning.CUDAGraphDDPStrategy",
                                  S + "graphs.layers=[nope.*]"],
     ["command line: trainer.strategy.init_args.graphs.layers: ['nope.*'] matched no module; some module names: "]),
    ("cuda-backend-on-cpu", {"bad.yaml": strategy_file("graphs: {backend: cuda}\n")}, ["--config", "{bad.yaml}"],
     ["{bad.yaml}: trainer.strategy.init_args.graphs.backend: 'cuda' needs a CUDA device but the strategy runs on "
      "'cpu'"]),
    ("manual-optimization-with-clipping", {}, [f"--model.class_path={HELPERS}.ManualRegressor",
                                               "--trainer.gradient_clip_val=0.5"],
     ["command line: trainer.gradient_clip_val: the Trainer refused it: Automatic gradient clipping is not "
      "supported for manual optimization"]),
    ("shape-policy-error-with-a-smaller-last-batch", {},
     ["--trainer.strategy=cg_lightning.CUDAGraphDDPStrategy", S + "graphs.shape_policy=error",
      S + "graphs.warmup_steps=1", "--data.init_args.n=18", "--trainer.max_steps=6"],
     ["command line: trainer.strategy.init_args.graphs.shape_policy: 'error' cannot work with this training data: "
      "on process 0 each epoch ends, after 4 full batches of 4, with a batch of 2",
      "drop_last=True in the training DataLoader"]),
    ("test-without-test-step", {}, ["@test"], ["{base}: model.class_path: No `test_step()` method defined"]),
]


@pytest.fixture
def no_training(monkeypatch):
    """Any training, validation, test or prediction step fails the test."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a step ran despite a configuration error")

    for hook in ("training_step", "validation_step", "test_step", "predict_step"):
        if hook in vars(helpers.TinyRegressor):
            monkeypatch.setattr(helpers.TinyRegressor, hook, refuse)


def _fill(text: str, names: dict) -> str:
    for name, path in names.items():
        text = text.replace("{" + name + "}", path)
    return text


@pytest.mark.parametrize("files, extra, expected", [pytest.param(f, a, e, id=i) for i, f, a, e in CASES])
def test_error_lines(files, extra, expected, tmp_path, capsys, no_training):
    names = {"tmp": str(tmp_path), "base": str(tmp_path / "base.yaml")}
    (tmp_path / "base.yaml").write_text(BASE_YAML)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        names[name] = str(tmp_path / name)
    subcommand = "fit"
    if extra and extra[0].startswith("@"):
        subcommand, extra = extra[0][1:], extra[1:]
    root = tmp_path / "runs"
    args = [subcommand, "--config", names["base"], f"--trainer.default_root_dir={root}",
            *(_fill(a, names) for a in extra)]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in err, err
    for fragment in (_fill(e, names) for e in expected):
        assert any(fragment in line for line in lines), f"{fragment!r} not in:\n" + "\n".join(lines)
    assert not (root / "lightning_logs").exists()


def test_one_line_per_problem_and_nothing_else(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(BASE_YAML)
    assert main(["fit", "--config", str(tmp_path / "base.yaml"), "--trainer.max_step=1", "--model.hiden=2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: command line: ") for line in lines), lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_gpu_accelerator_without_gpu(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text(BASE_YAML)
    assert main(["fit", "--config", str(tmp_path / "base.yaml"), "--trainer.accelerator=gpu"]) == 2
    assert "error: command line: trainer.accelerator: the Trainer refused it:" in capsys.readouterr().err


# ------------------------------------------------------------------ input PyYAML and the parser let through
#: seven lines of aliases of aliases: 8**7 (about two million) leaves once expanded
BOMB = "a0: &a0 [x, x, x, x, x, x, x, x]\n" + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 8)}]\n"
                                                    for i in range(1, 7))
KEEP_ONE = "a key may appear once in a mapping (YAML 1.2): keep one"
SLIPPED = [
    pytest.param({"deep.yaml": "trainer: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"}, ["--config", "{deep.yaml}"],
                 "{deep.yaml}: mappings and lists nested deeper than 32 levels (at {deep.yaml}:1); the command line "
                 "reads at most 32 levels", id="deep-mapping"),
    pytest.param({"bomb.yaml": BOMB}, ["--config", "{bomb.yaml}"],
                 "{bomb.yaml}: 2,739,143 values once its aliases (*name) are expanded, more than the 100,000 the "
                 "command line reads; write the values out, or use fewer aliases of aliases", id="alias-bomb"),
    pytest.param({"dup.yaml": "trainer: {max_steps: 3, max_steps: 5}\n"}, ["--config", "{dup.yaml}"],
                 "{dup.yaml}: trainer.max_steps: given twice in one mapping, at {dup.yaml}:1, column 11 and at "
                 f"{{dup.yaml}}:1, column 25; {KEEP_ONE}", id="duplicate-key"),
    pytest.param({"dup.yaml": "trainer:\n  max_steps: 3\ntrainer:\n  max_epochs: 5\n"}, ["--config", "{dup.yaml}"],
                 "{dup.yaml}: trainer: given twice in one mapping, at {dup.yaml}:1 and at {dup.yaml}:3; " + KEEP_ONE,
                 id="duplicate-section"),
    pytest.param({}, ["--trainer={max_steps: 3, max_steps: 5}"],
                 "command line: --trainer={max_steps: 3, max_steps: 5}: trainer.max_steps: given twice in one "
                 f"mapping, at column 2 and at column 16; {KEEP_ONE}", id="duplicate-key-in-an-override"),
    pytest.param({}, ["--=5"], "command line: '--=5': names no key; overrides are written --KEY=VALUE "
                 "(--trainer.max_steps=5)", id="override-without-a-key"),
    pytest.param({}, ["--trainer.val_check_interval=100000"], "command line: trainer.val_check_interval: the Trainer "
                 "refused it: `val_check_interval` (100000) must be less than or equal to the number of the training "
                 "batches", id="val-check-interval-beyond-the-epoch"),
    # as root, os.access allows writing anywhere, /proc too; making the folder there fails
    pytest.param({}, ["--trainer.default_root_dir=/proc/forbidden/runs"], "command line: trainer.default_root_dir: "
                 "'/proc/forbidden/runs' cannot be created: making a folder in /proc failed: ",
                 id="root-dir-under-proc", marks=pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")),
]


@pytest.mark.parametrize("files, extra, expected", SLIPPED)
def test_one_line_for_input_that_used_to_slip_through(files, extra, expected, tmp_path, capsys, no_training):
    """Each of these ended in a traceback (RecursionError, FileNotFoundError), ran (a duplicate key: the last one
    won) or hung for minutes (the alias bomb): now one ``error:`` line, status 2, in seconds."""
    names = {name: str(tmp_path / name) for name in files}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "base.yaml").write_text(BASE_YAML)
    capsys.readouterr()
    start = time.perf_counter()
    assert main(["fit", "--config", str(tmp_path / "base.yaml"), *(_fill(a, names) for a in extra)]) == 2
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + _fill(expected, names)), err[-3000:]
    assert elapsed < 30, elapsed  # the parsers are built once per process: most of this on a cold start


def test_output_folders_are_tried_and_left_as_they_were(tmp_path, capsys):
    """The check of ``default_root_dir`` makes a folder in the nearest existing parent and removes it again (here
    the run stops on another key)."""
    (tmp_path / "base.yaml").write_text(BASE_YAML)
    assert main(["fit", "--config", str(tmp_path / "base.yaml"), f"--trainer.default_root_dir={tmp_path}/a/b/runs",
                 "--trainer.max_steps=x"]) == 2
    assert "trainer.max_steps" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["base.yaml"]


# ------------------------------------------------------------------ the package's errors of a started run
RUN_ERRORS = [
    pytest.param([f"--model.class_path={HELPERS}.HostReadRegressor",
                  "--trainer.strategy=cg_lightning.CUDAGraphDDPStrategy", S + "graphs.layers=[blocks.*]"],
                 "error: GraphCaptureError: could not capture the forward of layer 'blocks.0': host read of tensor "
                 f"data: .item() at File \"{helpers.__file__}\", line ",
                 ["in forward: scale = y.abs().max().item().", "leave the layer out of graphs.layers"], id="capture"),
    pytest.param([f"--model.class_path={HELPERS}.LateParameterRegressor", "--trainer.strategy=cudagraph_ddp"],
                 "error: GradSyncError: rank 0: gradients of these parameters of LateParameterRegressor did not "
                 "report ready", ["late.weight (ready 0 times", "freeze it with requires_grad=False"], id="grad-sync"),
]


@pytest.mark.parametrize("extra, first, fragments", RUN_ERRORS)
@pytest.mark.parametrize("traceback", [False, True], ids=["plain", TRACEBACK_VARIABLE])
def test_a_run_error_is_one_error_block(extra, first, fragments, traceback, tmp_path, capsys, monkeypatch):
    """A GraphCaptureError or GradSyncError after the warmup steps: its message as ``error:`` lines, exit status
    1; its traceback (one: not chained below a copy of its own words) only with CG_LIGHTNING_TRACEBACK=1."""
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1" if traceback else "")
    (tmp_path / "base.yaml").write_text(BASE_YAML)
    capsys.readouterr()
    assert main(["fit", "--config", str(tmp_path / "base.yaml"), "--trainer.max_steps=6",
                 f"--trainer.default_root_dir={tmp_path}", *extra]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(first) and all(f in lines[0] for f in fragments), err[-3000:]
    assert "[rank0]" not in err
    if traceback:
        assert err.count("Traceback (most recent call last)") == 1 and err.index("Traceback") < err.index(lines[0])
    else:
        assert "Traceback" not in err and err.rstrip().endswith(f"run again with {TRACEBACK_VARIABLE}=1)")


def test_a_configuration_error_shows_its_traceback_when_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")
    (tmp_path / "base.yaml").write_text(BASE_YAML)
    assert main(["fit", "--config", str(tmp_path / "base.yaml"), "--trainer.max_step=1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("error: command line: trainer.max_step: unknown key")
