"""The command line (``CGLightningCLI``, ``python -m cg_lightning``): shipped configs, subcommands, merging,
interpolation, ``--print_config``; in-process (CPU, fast). Error messages: tests/test_cli_errors.py."""

from __future__ import annotations

import dataclasses
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer

import cg_lightning
from cg_lightning.cli import CGLightningCLI, ConfigError, main
from cg_lightning.cli.sources import Provenance
from cg_lightning.ddp import DDPOptions
from cg_lightning.examples.configs import names as shipped_names, path as shipped_config
from cg_lightning.graphs import GraphOptions

SHIPPED = [Path(shipped_config(name)) for name in shipped_names()]
HELPERS = "tests.helpers_config"

BASE_YAML = f"""
seed_everything: 7
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
  class_path: {HELPERS}.TinyRegressor
  init_args:
    in_features: 3
    hidden: 5
data:
  class_path: {HELPERS}.TinyData
  init_args:
    in_features: ${{model.init_args.in_features}}
    n: 16
"""
GRAPHS = ["--trainer.strategy=cudagraph_ddp"]


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def base(tmp_path: Path) -> str:
    return write(tmp_path, "base.yaml", BASE_YAML)


def printed(capsys, *args: str) -> dict:
    """The resolved configuration ``--print_config`` prints for ``args``, as a mapping."""
    capsys.readouterr()
    assert main([*args, "--print_config"]) == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    assert "${" not in out
    return yaml.safe_load(out)


def cli(*args: str, run: bool = False) -> CGLightningCLI:
    return CGLightningCLI(args=list(args), run=run)


# --------------------------------------------------------------------------------------------- shipped configs


def test_configs_are_shipped():
    assert {"gpt_tiny.yaml", "gpt_small.yaml", "gpt_small_multigpu.yaml", "llama_tiny.yaml"} <= {p.name for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_config_prints_resolved_and_round_trips(path: Path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped configs and the classes they name need no repository
    first = printed(capsys, "fit", "--config", str(path))
    assert first["data"]["init_args"]["block_size"] == first["model"]["init_args"]["block_size"]
    assert first["trainer"]["strategy"]["class_path"] == "cg_lightning.CUDAGraphDDPStrategy"
    again = write(tmp_path, "printed.yaml", yaml.safe_dump(first))
    assert printed(capsys, "fit", "--config", again) == first  # the printed config is itself a valid --config


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_config_builds(path: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(path), f"--trainer.default_root_dir={tmp_path}"]
    if "llama" in path.name:
        pytest.importorskip("transformers")
    if yaml.safe_load(path.read_text())["trainer"]["accelerator"] == "gpu" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"trainer\.accelerator: the Trainer refused it"):
            cli(*args)
        return
    built = cli(*args)
    assert isinstance(built.trainer.strategy, cg_lightning.CUDAGraphDDPStrategy)
    assert built.trainer.max_steps == built.config.trainer.max_steps > 0
    assert built.datamodule.block_size == built.config.model.init_args.block_size  # the interpolation, resolved
    assert built.trainer.logger.save_dir == str(tmp_path)  # ${trainer.default_root_dir} sees the override


def test_gpt_tiny_values(capsys):
    cfg = printed(capsys, "fit", "--config", shipped_config("gpt_tiny"))
    assert cfg["trainer"]["accelerator"] == "cpu" and cfg["trainer"]["max_steps"] == 300
    assert cfg["trainer"]["strategy"]["init_args"]["graphs"]["warmup_steps"] == 2
    assert cfg["model"]["init_args"]["lr"] == pytest.approx(3e-3)
    assert cfg["data"]["init_args"]["block_size"] == 128 and cfg["data"]["init_args"]["path"] is None
    assert cfg["trainer"]["logger"]["init_args"]["save_dir"] == "runs"


def test_gpt_small_multigpu_values(capsys):
    cfg = printed(capsys, "fit", "--config", shipped_config("gpt_small_multigpu"))
    assert cfg["trainer"]["accelerator"] == "gpu" and cfg["trainer"]["devices"] >= 2
    assert cfg["trainer"]["precision"] == "bf16-mixed" and cfg["data"]["init_args"]["drop_last"] is True
    assert cfg["trainer"]["strategy"]["init_args"]["ddp"]["bucket_size_mb"] == 25
    assert [c["class_path"].rsplit(".", 1)[1] for c in cfg["trainer"]["callbacks"]] == ["GraphMonitor",
                                                                                      "LearningRateMonitor",
                                                                                      "ModelCheckpoint"]


def test_a_run_shorter_than_val_check_interval_ends_with_a_checkpoint(tmp_path):
    """The shipped configs validate every val_check_interval steps; a run that stops before the first validation
    (or between two) still leaves the checkpoint of its last step, as a run ending on a validation does."""
    root = tmp_path / "runs"
    assert main(["fit", "--config", shipped_config("gpt_tiny"), "--trainer.max_steps=2",
                 "--data.init_args.max_bytes=200000", f"--trainer.default_root_dir={root}",
                 "--trainer.enable_progress_bar=false"]) == 0
    saved = sorted(root.glob("lightning_logs/version_0/checkpoints/*.ckpt"))
    assert [p.name for p in saved] == ["epoch=0-step=2.ckpt"]
    assert torch.load(saved[0], weights_only=False)["global_step"] == 2


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_configs_checkpoint_at_the_end_of_each_run(path: Path, capsys):
    """Every shipped config saves its checkpoint at the end of the run (Lightning's default saves only after a
    validation, so a run that ends between two validations would lose its last steps)."""
    checkpoints = [c for c in printed(capsys, "fit", "--config", str(path))["trainer"]["callbacks"] or []
                   if c["class_path"] == "lightning.pytorch.callbacks.ModelCheckpoint"]
    assert [c["init_args"]["save_on_train_epoch_end"] for c in checkpoints] == [True]


# ----------------------------------------------------------------------------------- merging and interpolation


def test_files_merge_in_order_and_overrides_win(tmp_path, base, capsys):
    second = write(tmp_path, "second.yaml", "trainer:\n  max_steps: 9\nmodel:\n  init_args:\n    hidden: 11\n")
    cfg = printed(capsys, "fit", "--config", base, "--config", second)
    assert cfg["trainer"]["max_steps"] == 9 and cfg["trainer"]["num_sanity_val_steps"] == 0  # first kept
    assert cfg["model"]["init_args"]["hidden"] == 11 and cfg["model"]["init_args"]["in_features"] == 3
    assert cfg["seed_everything"] == 7
    cfg = printed(capsys, "fit", "--config", base, "--config", second, "--trainer.max_steps=4",
                  "--model.init_args.in_features=6")
    assert cfg["trainer"]["max_steps"] == 4
    assert cfg["data"]["init_args"]["in_features"] == 6  # the interpolation sees the override
    # the order is the order of the arguments: a file after an override wins over it
    assert printed(capsys, "fit", "--trainer.max_steps=4", "--config", base)["trainer"]["max_steps"] == 2


def test_interpolation_given_on_the_command_line(base, capsys):
    cfg = printed(capsys, "fit", "--config", base, "--data.init_args.n=${model.init_args.hidden}")
    assert cfg["data"]["init_args"]["n"] == 5


def test_shorthand_init_args_and_strategy_by_name(base, capsys):
    cfg = printed(capsys, "fit", "--config", base, "--model.hidden=4", "--trainer.strategy=cudagraph_ddp")
    assert cfg["model"]["init_args"]["hidden"] == 4 and cfg["trainer"]["strategy"] == "cudagraph_ddp"


def test_strategy_options_reach_the_strategy(base):
    built = cli("--config", base, "--trainer.strategy=cg_lightning.CUDAGraphDDPStrategy",
                "--trainer.strategy.init_args.graphs.warmup_steps=3", "--trainer.strategy.init_args.ddp.bucket_size_mb=4")
    strategy = built.trainer.strategy
    assert isinstance(strategy, cg_lightning.CUDAGraphDDPStrategy)
    assert strategy.graph_options == GraphOptions(warmup_steps=3) and strategy.ddp_options == DDPOptions(bucket_size_mb=4)


def test_print_config_shows_the_strategy_options_it_runs_with(base, capsys):
    """A section of the strategy that a config leaves out prints as the defaults the strategy then runs with (not
    ``null``), and what a config sets is printed over them."""
    cfg = printed(capsys, "fit", "--config", base, "--trainer.strategy={class_path: cg_lightning.CUDAGraphDDPStrategy}")
    options = cfg["trainer"]["strategy"]["init_args"]
    assert options["ddp"] == dataclasses.asdict(DDPOptions())
    assert options["graphs"] == dataclasses.asdict(GraphOptions())
    options = printed(capsys, "fit", "--config", shipped_config("gpt_tiny"))["trainer"]["strategy"]["init_args"]
    assert options["ddp"] == dataclasses.asdict(DDPOptions())
    assert options["graphs"] == dataclasses.asdict(GraphOptions(backend="auto", warmup_steps=2))


def test_default_strategy_is_cudagraph_ddp(tmp_path, capsys):
    minimal = write(tmp_path, "minimal.yaml", f"model:\n  class_path: {HELPERS}.TinyRegressor\n")
    assert printed(capsys, "fit", "--config", minimal)["trainer"]["strategy"] == "cudagraph_ddp"


def test_sources_are_remembered(tmp_path, base):
    second = write(tmp_path, "second.yaml", "trainer:\n  max_steps: 9\n")
    built = cli("--config", base, "--config", second, "--model.hidden=4", "--trainer.callbacks=[]")
    source = built.provenance.source_of
    assert source("trainer.max_steps") == second and source("trainer.accelerator") == base
    assert source("model.init_args.hidden") == "command line"  # shorthand written out
    assert source("trainer.precision") is None  # a default
    assert source("trainer.callbacks") == "command line"


def test_sources_of_a_large_configuration_are_tracked_in_linear_time():
    """50,000 list items, then a value where the list was: each key once (it was every earlier key for each)."""
    provenance = Provenance()
    start = time.perf_counter()
    provenance.record({"seed_everything": 7, "trainer": {"plugins": list(range(50_000))}}, "a.yaml")
    provenance.record({"seed_everything": {"a": 1}, "trainer": {"plugins": 3}}, "b.yaml")
    assert time.perf_counter() - start < 5
    assert provenance.source_of("trainer.plugins") == provenance.source_of("trainer.plugins[7]") == "b.yaml"
    assert provenance.source_of("seed_everything") == "b.yaml"  # a section where a value was


# ------------------------------------------------------------------------------------------------ subcommands


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_each_subcommand_runs(subcommand, base, tmp_path, capsys):
    root = tmp_path / "runs"
    args = [subcommand, "--config", base, f"--model.class_path={HELPERS}.EvalRegressor",
            f"--trainer.default_root_dir={root}", "--trainer.logger=true"]
    built = cli(*args, run=True)
    assert built.subcommand == subcommand
    if subcommand == "fit":
        assert built.trainer.global_step == 2
    saved = root / "lightning_logs" / "version_0" / "config.yaml"
    assert saved.is_file()  # LightningCLI's SaveConfigCallback: the resolved config, itself a valid --config
    assert printed(capsys, subcommand, "--config", str(saved)) == printed(capsys, *args)


def test_trainer_overrides_take_effect(base, tmp_path):
    built = cli("fit", "--config", base, "--trainer.max_steps=3", "--trainer.limit_train_batches=2",
                "--trainer.max_epochs=5", f"--trainer.default_root_dir={tmp_path}", run=True)
    assert built.trainer.limit_train_batches == 2 and built.trainer.global_step == 3


def test_fast_dev_run(base, tmp_path):
    root = tmp_path / "runs"
    built = cli("fit", "--config", base, "--trainer.fast_dev_run=true", f"--trainer.default_root_dir={root}",
                "--trainer.logger=true", run=True)
    assert built.trainer.fast_dev_run and built.trainer.global_step == 1
    assert not root.exists()  # fast_dev_run writes no logs, checkpoints or config


def test_main_returns_0_after_a_run_with_graphs(base, tmp_path):
    assert main(["fit", "--config", base, *GRAPHS, f"--trainer.default_root_dir={tmp_path}"]) == 0


def test_manual_optimization_trains_and_validates_under_cudagraph_ddp(base, tmp_path):
    manual = [f"--model.class_path={HELPERS}.ManualRegressor", f"--trainer.default_root_dir={tmp_path}"]
    assert main(["fit", "--config", base, *GRAPHS, *manual]) == 0
    assert main(["validate", "--config", base, *GRAPHS, *manual]) == 0


def test_help_exits_0(capsys):
    assert main(["fit", "--help"]) == 0
    assert "--trainer.max_steps" in capsys.readouterr().out


def test_trainer_is_the_lightning_trainer(base):
    assert type(cli("--config", base).trainer) is Trainer


def test_ints_written_for_int_or_float_trainer_arguments_stay_ints():
    """jsonargparse may hand ``limit_val_batches: 20`` back as ``20.0`` (a union of int and float cached in the
    float-first order, as under torch 2.11): the ints the configuration wrote are given back; floats stay."""
    from jsonargparse import Namespace

    from cg_lightning.cli.values import restore_written_ints

    trainer = Namespace(limit_val_batches=20.0, limit_train_batches=0.5, overfit_batches=1.0, max_steps=3)
    restore_written_ints(trainer, {"limit_val_batches": 20, "limit_train_batches": 0.5, "overfit_batches": 1.0,
                                   "max_steps": 3})
    assert trainer.limit_val_batches == 20 and isinstance(trainer.limit_val_batches, int)
    assert isinstance(trainer.limit_train_batches, float) and isinstance(trainer.overfit_batches, float)


def test_unions_of_int_and_float_try_int_first():
    """The parser's int-or-float arguments try int first, whatever order ``typing``'s cache gave their union (under
    torch 2.11 Lightning's ``limit_val_batches`` annotation is float-first): ``--print_config`` prints 20, not 20.0."""
    import typing
    from types import SimpleNamespace

    from cg_lightning.cli.values import int_before_float

    action = SimpleNamespace(_typehint=float | int | None)
    untouched = SimpleNamespace(_typehint=typing.Optional[str])
    int_before_float(SimpleNamespace(_actions=[action, untouched, SimpleNamespace()]))
    assert typing.get_args(action._typehint) == (int, float, type(None))
    assert untouched._typehint == typing.Optional[str]


def test_the_command_line_lets_openmp_threads_sleep_before_torch_loads(tmp_path):
    """``python -m cg_lightning`` sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set) before torch, and so its OpenMP
    runtime, is imported: the policy is read once, at load. A policy the user set is kept."""
    import subprocess
    import sys

    from tests.helpers import ROOT, subprocess_env

    probe = textwrap.dedent("""
        import importlib.abc, os, runpy, sys
        seen = []
        class Watch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch":  # what torch would read; then stop (the rest is not this test's)
                    seen.append(os.environ.get("OMP_WAIT_POLICY"))
                    raise KeyboardInterrupt
        sys.meta_path.insert(0, Watch())
        sys.argv = ["cg_lightning", "--help"]
        try:
            runpy.run_module("cg_lightning", run_name="__main__", alter_sys=True)
        except (SystemExit, KeyboardInterrupt):
            pass
        print("AT TORCH IMPORT", seen)
    """)
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {k: v for k, v in subprocess_env().items() if k != "OMP_WAIT_POLICY"}
        if given:
            env["OMP_WAIT_POLICY"] = given
        done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert f"AT TORCH IMPORT [{expected!r}]" in done.stdout, done.stdout[-1000:] + done.stderr[-2000:]
