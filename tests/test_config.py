"""Configuration schema, loader, builders and command line (CPU, fast)."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from cg_lightning.cli import main
from cg_lightning.config import (
    ComponentConfig,
    ConfigError,
    RunConfig,
    SaveResolvedConfig,
    build_callbacks,
    build_datamodule,
    build_model,
    build_strategy,
    build_trainer,
    config_to_yaml,
    load_config,
)
from cg_lightning.ddp.options import DDPOptions
from cg_lightning.graphs.options import GraphOptions

REPO = Path(__file__).resolve().parents[1]
# configs/accelerate/ holds Accelerate launcher configs (`accelerate launch --config_file ...`), which are
# not RunConfig files: they are skipped here on purpose. Every other YAML file under configs/, in any
# subfolder, must load, validate and build.
NOT_OUR_SCHEMA = ("configs/accelerate/",)
SHIPPED = sorted(
    p
    for pattern in ("configs/**/*.yaml", "configs/**/*.yml")
    for p in REPO.glob(pattern)
    if not p.relative_to(REPO).as_posix().startswith(NOT_OUR_SCHEMA)
)

HELPERS = "tests.helpers_config"

BASE_YAML = f"""
seed: 7
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  limit_val_batches: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_checkpointing: false
strategy:
  name: auto
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


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def base(tmp_path: Path) -> str:
    return write(tmp_path, "base.yaml", BASE_YAML)


def error_of(config_files=(), overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config_files, overrides)
    return str(info.value)


# --------------------------------------------------------------------------- shipped configs


def test_configs_are_shipped():
    names = {p.name for p in SHIPPED}
    assert {"gpt_tiny.yaml", "gpt_small.yaml", "gpt_small_multigpu.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shipped_config_loads_and_builds(path: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(REPO)  # class paths such as examples.gpt resolve from the repository root
    rel = path.relative_to(REPO).as_posix()
    cfg = load_config([rel], [f"trainer.default_root_dir={tmp_path}"])
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.strategy.graphs, GraphOptions) and isinstance(cfg.strategy.ddp, DDPOptions)
    model_args, data_args = cfg.model.init_args, cfg.data.init_args
    if "block_size" in model_args and "block_size" in data_args:
        assert data_args["block_size"] == model_args["block_size"]  # interpolation resolved
    for value in model_args.values():
        assert not isinstance(value, str) or "${" not in value

    model = build_model(cfg)
    datamodule = build_datamodule(cfg)
    assert model is not None and datamodule is not None
    strategy = build_strategy(cfg)
    if cfg.strategy.name == "cudagraph_ddp":
        assert type(strategy).__name__ == "CUDAGraphDDPStrategy"
    if cfg.trainer.accelerator == "cpu":
        trainer = build_trainer(cfg)
        assert trainer.max_steps == cfg.trainer.max_steps
        assert any(isinstance(c, SaveResolvedConfig) for c in trainer.callbacks)
    elif cfg.trainer.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="trainer"):
            build_trainer(cfg)  # Lightning's refusal becomes a ConfigError


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shipped_config_print_round_trips(path: Path, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rel = path.relative_to(REPO).as_posix()
    assert main(["fit", "--config", rel, "--print-config"]) == 0
    printed = write(tmp_path, "printed.yaml", capsys.readouterr().out)
    assert load_config([printed], []) == load_config([rel], [])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shipped_config_callbacks_build(path: Path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config([path.relative_to(REPO).as_posix()], [])
    callbacks = build_callbacks(cfg)
    assert len(callbacks) == len(cfg.callbacks)
    assert all(isinstance(c, Callback) for c in callbacks)


def test_gpt_small_multigpu_values(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(["configs/gpt_small_multigpu.yaml"], [])
    assert cfg.trainer.accelerator == "gpu" and isinstance(cfg.trainer.devices, int) and cfg.trainer.devices >= 2
    assert cfg.trainer.precision == "bf16-mixed"
    assert cfg.strategy.name == "cudagraph_ddp" and cfg.strategy.graphs.enabled
    assert cfg.data.init_args["block_size"] == cfg.model.init_args["block_size"]
    assert cfg.data.init_args["drop_last"] is True
    assert [type(c).__name__ for c in build_callbacks(cfg)] == ["GraphMonitor", "LearningRateMonitor"]


def test_gpt_tiny_values(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(["configs/gpt_tiny.yaml"], [])
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.max_steps == 300
    assert cfg.strategy.name == "cudagraph_ddp" and cfg.strategy.graphs.warmup_steps == 2
    assert isinstance(cfg.model.init_args["lr"], float) and cfg.model.init_args["lr"] == pytest.approx(3e-3)
    assert cfg.data.init_args["block_size"] == cfg.model.init_args["block_size"] == 128
    assert cfg.data.init_args["path"] is None


# ---------------------------------------------------------------------------------- loading


def test_defaults_without_files():
    cfg = load_config([], [])
    assert cfg == RunConfig()
    assert cfg.model.class_path == "examples.gpt.GPTLightningModule"
    assert cfg.data.class_path == "examples.data.TextDataModule"
    assert cfg.strategy.name == "cudagraph_ddp" and cfg.callbacks == []


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    bad = write(tmp_path, "bad.yaml", "trainer:\n  max_step: 5\n")
    msg = error_of([bad])
    assert f"{bad}: trainer.max_step: unknown key" in msg
    assert "did you mean 'max_steps'" in msg
    assert "accelerator" in msg and "log_every_n_steps" in msg  # the valid keys at that level


def test_unknown_top_level_and_nested_keys(tmp_path):
    bad = write(tmp_path, "bad.yaml", "trainr: {}\nstrategy:\n  graphs:\n    backnd: cuda\n")
    msg = error_of([bad])
    assert "trainr: unknown key (did you mean 'trainer'?)" in msg
    assert "strategy.graphs.backnd: unknown key (did you mean 'backend'?)" in msg  # every problem reported


def test_key_of_a_deeper_section_is_pointed_there(tmp_path):
    """A section or option given without its parent (``graphs.warmup_steps=3`` for
    ``strategy.graphs.warmup_steps``) is named with its full path; a plain typo still gets the close match."""
    msg = error_of([], ["graphs.warmup_steps=3", "bucket_size_mb=4", "strategy.warmup_steps=1"])
    assert "command line: graphs: unknown key (did you mean 'strategy.graphs'?)" in msg
    assert "command line: bucket_size_mb: unknown key (did you mean 'strategy.ddp.bucket_size_mb'?)" in msg
    assert "command line: strategy.warmup_steps: unknown key (did you mean 'strategy.graphs.warmup_steps'?)" in msg
    bad = write(tmp_path, "bad.yaml", "ddp:\n  bucket_size_mb: 4\n")
    assert f"{bad}: ddp: unknown key (did you mean 'strategy.ddp'?)" in error_of([bad])


def test_unknown_key_inside_list_item(tmp_path):
    bad = write(tmp_path, "bad.yaml", "callbacks:\n  - class_path: a.B\n    init_arg: {}\n")
    msg = error_of([bad])
    assert f"{bad}: callbacks[0].init_arg: unknown key (did you mean 'init_args'?)" in msg


def test_wrong_type_names_key_file_and_expected_type(tmp_path):
    bad = write(tmp_path, "bad.yaml", "trainer:\n  max_steps: abc\n")
    assert f"{bad}: trainer.max_steps: expected int, got 'abc'" in error_of([bad])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("trainer:\n  max_epochs: many\n", "trainer.max_epochs: expected int or null, got 'many'"),
        ("trainer: 5\n", "trainer: expected a mapping (TrainerConfig), got 5"),
        ("strategy:\n  graphs:\n    layers: 3\n", "strategy.graphs.layers: expected list of str or null, got 3"),
        ("strategy:\n  ddp: null\n", "strategy.ddp: expected a mapping (DDPOptions), got None"),
        ("model:\n  init_args: 3\n", "model.init_args: expected a mapping, got 3"),
        ("callbacks: {class_path: a.B}\n", "callbacks: expected list of mappings (ComponentConfig)"),
    ],
)
def test_wrong_types_everywhere(tmp_path, text, expected):
    bad = write(tmp_path, "bad.yaml", text)
    assert f"{bad}: {expected}" in error_of([bad])


def test_missing_value_names_key(tmp_path):
    cfg_file = write(tmp_path, "cb.yaml", "callbacks:\n  - init_args: {tag: x}\n")
    msg = error_of([cfg_file])
    assert "callbacks[0].class_path: missing value" in msg
    assert cfg_file in msg  # where the incomplete entry came from


def test_missing_values_all_reported(tmp_path):
    cfg_file = write(tmp_path, "m.yaml", "model:\n  init_args:\n    hidden: ???\n")
    msg = error_of([cfg_file], ["callbacks=[{init_args: {}}]"])
    assert f"model.init_args.hidden: missing value (set to '???' in {cfg_file})" in msg
    assert "callbacks[0].class_path: missing value (callbacks[0] comes from command line" in msg
    # a list replaces the previous one whole, so the earlier file's entries do not count
    full = write(tmp_path, "full.yaml", f"callbacks:\n  - class_path: {HELPERS}.RecordingCallback\n")
    msg = error_of([full], ["callbacks=[{init_args: {}}]"])
    assert "callbacks[0].class_path: missing value (callbacks[0] comes from command line" in msg


def test_two_files_merge_second_wins(tmp_path, base):
    second = write(tmp_path, "second.yaml", "trainer:\n  max_steps: 9\nmodel:\n  init_args:\n    hidden: 11\n")
    cfg = load_config([base, second], [])
    assert cfg.trainer.max_steps == 9  # second wins
    assert cfg.trainer.num_sanity_val_steps == 0  # first kept where the second is silent
    assert cfg.model.init_args == {"in_features": 3, "hidden": 11}
    assert cfg.seed == 7


def test_command_line_wins_over_files(tmp_path, base):
    second = write(tmp_path, "second.yaml", "trainer:\n  max_steps: 9\n")
    cfg = load_config([base, second], ["trainer.max_steps=4", "model.init_args.in_features=6"])
    assert cfg.trainer.max_steps == 4
    assert cfg.data.init_args["in_features"] == 6  # interpolation sees the override


def test_command_line_errors_name_command_line(base):
    assert "command line: trainer.max_steps: expected int, got 'x'" in error_of([base], ["trainer.max_steps=x"])
    assert "command line: trainer.max_step: unknown key (did you mean 'max_steps'?)" in error_of(
        [base], ["trainer.max_step=3"]
    )
    assert "command line: override 'trainer.max_steps' is not of the form" in error_of([base], ["trainer.max_steps"])


def test_graph_options_error_names_key(base, tmp_path):
    msg = error_of([base], ["strategy.graphs.backend=foo"])
    assert "command line: strategy.graphs.backend:" in msg and "'foo'" in msg
    bad = write(tmp_path, "bad.yaml", "strategy:\n  graphs:\n    num_warmup_iters: 0\n")
    assert f"{bad}: strategy.graphs.num_warmup_iters:" in error_of([base, bad])
    assert "command line: strategy.ddp.bucket_size_mb:" in error_of([base], ["strategy.ddp.bucket_size_mb=0"])
    assert "command line: strategy.ddp.grad_dtype:" in error_of([base], ["strategy.ddp.grad_dtype=int8"])


def test_every_rejected_value_is_reported_at_once(base):
    """Four out-of-range values in three option groups: one line each, not only the first."""
    msg = error_of([base], ["strategy.graphs.backend=5", "strategy.graphs.shape_policy=foo",
                            "strategy.ddp.bucket_size_mb=-1", "trainer.max_steps=-2"])
    lines = msg.splitlines()
    for key in ("strategy.graphs.backend", "strategy.graphs.shape_policy", "strategy.ddp.bucket_size_mb",
                "trainer.max_steps"):
        assert sum(line.startswith(f"command line: {key}:") for line in lines) == 1, msg
    assert len(lines) == 4, msg


def test_own_validation_names_key(base):
    assert "command line: strategy.name: must be one of" in error_of([base], ["strategy.name=fsdp"])
    assert "command line: trainer.logger: must be one of" in error_of([base], ["trainer.logger=wandb"])
    assert "trainer.gradient_clip_algorithm: must be one of" in error_of(
        [base], ["trainer.gradient_clip_algorithm=max"]
    )


def test_bad_interpolation_names_key(base):
    msg = error_of([base], ["data.init_args.n=${model.init_args.nope}"])
    assert "command line: data.init_args.n:" in msg and "nope" in msg


def test_unreadable_sources_name_the_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert f"{missing}: no such config file" in error_of([missing])
    listy = write(tmp_path, "list.yaml", "- 1\n- 2\n")
    assert f"{listy}: expected a mapping at the top level" in error_of([listy])
    broken = write(tmp_path, "broken.yaml", "trainer: [1, 2\n")
    assert f"{broken}: invalid YAML" in error_of([broken])


def test_config_to_yaml_round_trips(base, tmp_path):
    cfg = load_config([base], ["strategy.graphs.layers=[model.net.*]", "trainer.devices=auto"])
    printed = write(tmp_path, "printed.yaml", config_to_yaml(cfg))
    assert load_config([printed], []) == cfg


# --------------------------------------------------------------------------------- building


def test_build_model_data_callbacks(base):
    cfg = load_config([base], [f"callbacks=[{{class_path: {HELPERS}.RecordingCallback, init_args: {{tag: a}}}}]"])
    model = build_model(cfg)
    assert type(model).__name__ == "TinyRegressor" and model.net[0].in_features == 3
    assert type(build_datamodule(cfg)).__name__ == "TinyData"
    (callback,) = build_callbacks(cfg)
    assert type(callback).__name__ == "RecordingCallback" and callback.tag == "a"


def test_bad_init_arg_names_class_and_accepted_params(base):
    cfg = load_config([base], ["model.init_args.hiden=3"])
    with pytest.raises(ConfigError) as info:
        build_model(cfg)
    msg = str(info.value)
    assert msg.startswith("model.init_args: tests.helpers_config.TinyRegressor")
    assert "unknown argument 'hiden' (did you mean 'hidden'?)" in msg
    assert "Accepted parameters: in_features=4, hidden=8, lr=0.1" in msg


def test_bad_callback_init_arg(base):
    cfg = load_config([base], [f"callbacks=[{{class_path: {HELPERS}.RecordingCallback, init_args: {{tagg: a}}}}]"])
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.init_args: .*RecordingCallback.*'tagg'.*tag=''"):
        build_callbacks(cfg)


def test_unimportable_class_path(base):
    cfg = load_config([base], ["model.class_path=no_such_pkg.Model"])
    with pytest.raises(ConfigError) as info:
        build_model(cfg)
    msg = str(info.value)
    assert "model.class_path" in msg and "no_such_pkg.Model" in msg and "repository root" in msg

    cfg = load_config([base], [f"model.class_path={HELPERS}.TinyRegresor"])
    with pytest.raises(ConfigError, match=r"has no attribute 'TinyRegresor' \(did you mean .*TinyRegressor'"):
        build_model(cfg)

    cfg = load_config([base], ["data.class_path=TinyData"])
    with pytest.raises(ConfigError, match="data.class_path: 'TinyData' is not an import path"):
        build_datamodule(cfg)


def test_built_object_must_have_the_right_kind(base):
    cfg = load_config([base], [f"callbacks=[{{class_path: {HELPERS}.NotACallback}}]"])
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.class_path: .*NotACallback.*not a .*Callback"):
        build_callbacks(cfg)
    cfg = load_config([base], [f"model.class_path={HELPERS}.NotACallback"])
    with pytest.raises(ConfigError, match="not a .*LightningModule"):
        build_model(cfg)


def test_build_strategy_names(base, monkeypatch):
    assert build_strategy(load_config([base], ["strategy.name=auto"])) == "auto"
    assert isinstance(build_strategy(load_config([base], ["strategy.name=ddp"])), DDPStrategy)

    made = {}

    class FakeStrategy:
        def __init__(self, graphs=None, ddp=None, **kwargs):
            made.update(graphs=graphs, ddp=ddp, kwargs=kwargs)

    fake = types.ModuleType("cg_lightning.strategy")
    fake.CUDAGraphDDPStrategy = FakeStrategy
    monkeypatch.setitem(sys.modules, "cg_lightning.strategy", fake)
    cfg = load_config(
        [base], ["strategy.name=cudagraph_ddp", "strategy.graphs.backend=eager", "strategy.ddp.bucket_size_mb=4"]
    )
    assert isinstance(build_strategy(cfg), FakeStrategy)
    assert made["graphs"] == GraphOptions(backend="eager") and isinstance(made["graphs"], GraphOptions)
    assert made["ddp"] == DDPOptions(bucket_size_mb=4.0) and made["kwargs"] == {}


def test_build_trainer(base, tmp_path):
    cfg = load_config(
        [base],
        [f"trainer.default_root_dir={tmp_path}", "trainer.gradient_clip_val=1.0", "trainer.log_every_n_steps=3"],
    )
    trainer = build_trainer(cfg, extra_callbacks=[marker := SaveResolvedConfig(cfg, filename="extra.yaml")])
    assert isinstance(trainer, Trainer)
    assert trainer.max_steps == 2 and trainer.gradient_clip_val == 1.0 and trainer.log_every_n_steps == 3
    assert isinstance(trainer.logger, CSVLogger) and Path(trainer.logger.save_dir) == tmp_path
    assert marker in trainer.callbacks

    trainer = build_trainer(load_config([base], [f"trainer.default_root_dir={tmp_path}", "trainer.logger=none"]))
    assert trainer.logger is None


def test_tensorboard_logger_without_tensorboard(base, tmp_path):
    pytest.importorskip("lightning.pytorch.loggers.tensorboard")
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE

    cfg = load_config([base], [f"trainer.default_root_dir={tmp_path}", "trainer.logger=tensorboard"])
    if _TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE:
        assert build_trainer(cfg).logger is not None
    else:
        with pytest.raises(ConfigError, match="trainer.logger: 'tensorboard' needs"):
            build_trainer(cfg)


# ------------------------------------------------------------------------------ command line


def test_print_config_round_trips(base, tmp_path, capsys):
    assert main(["fit", "--config", base, "--print-config", "trainer.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 7" in out and "${" not in out  # resolved
    printed = write(tmp_path, "printed.yaml", out)
    assert load_config([printed], []) == load_config([base], ["trainer.max_steps=7"])


def test_overrides_may_come_before_options(base, capsys):
    assert main(["fit", "trainer.max_steps=5", "--config", base, "--print-config", "seed=3"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 5" in out and "seed: 3" in out


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("training started despite a configuration error")

    monkeypatch.setattr(Trainer, "fit", refuse)
    monkeypatch.setattr(Trainer, "validate", refuse)


def test_config_error_exits_2_before_training(base, tmp_path, capsys, no_training):
    root = tmp_path / "runs"
    rc = main(["fit", "--config", base, f"trainer.default_root_dir={root}", "trainer.max_steps=abc"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: command line: trainer.max_steps: expected int, got 'abc'")
    assert not root.exists()


def test_build_error_exits_2_before_training(base, tmp_path, capsys, no_training):
    root = tmp_path / "runs"
    rc = main(["validate", "--config", base, f"trainer.default_root_dir={root}", "model.init_args.hiden=2"])
    assert rc == 2
    assert "error: model.init_args: tests.helpers_config.TinyRegressor" in capsys.readouterr().err
    assert not root.exists()


def test_usage_error_exits_2(capsys, no_training):
    assert main(["train"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["fit", "trainer.max_steps=1"]) == 2  # no --config: refuse to run the bare defaults
    assert "--config" in capsys.readouterr().err
    assert main(["fit", "--print-config"]) == 0  # the defaults can still be printed
    assert "class_path: examples.gpt.GPTLightningModule" in capsys.readouterr().out


def test_fit_and_validate_run_and_save_resolved_config(base, tmp_path):
    root = tmp_path / "runs"
    overrides = [f"trainer.default_root_dir={root}", "model.init_args.hidden=6", "trainer.log_every_n_steps=1"]
    assert main(["fit", "--config", base, *overrides]) == 0
    saved = root / "lightning_logs" / "version_0" / "config.yaml"
    assert saved.is_file()
    assert load_config([str(saved)], []) == load_config([base], overrides)
    assert (root / "lightning_logs" / "version_0" / "metrics.csv").is_file()

    assert main(["validate", "--config", base, *overrides]) == 0
    assert (root / "lightning_logs" / "version_1" / "config.yaml").is_file()


def test_component_config_defaults():
    assert ComponentConfig(class_path="a.B").init_args == {}



def test_init_args_survive_class_path_change_and_are_checked(base):
    cfg = load_config([base], [f"model.class_path={HELPERS}.TinyData"])
    assert cfg.model.init_args == {"in_features": 3, "hidden": 5}  # plain OmegaConf merge semantics
    with pytest.raises(ConfigError, match="model.init_args: tests.helpers_config.TinyData: unknown argument 'hidden'"):
        build_model(cfg)


# ------------------------------------------------------------------- package layout and sources


def test_public_names_of_the_config_package():
    import cg_lightning.config as config

    assert sorted(config.__all__) == sorted([
        "ComponentConfig", "ConfigError", "RunConfig", "SaveResolvedConfig", "StrategyConfig", "TrainerConfig",
        "build_callbacks", "build_datamodule", "build_model", "build_strategy", "build_trainer", "config_to_yaml",
        "load_config",
    ])
    for name in config.__all__ + ["STRATEGY_NAMES", "LOGGERS", "CONFIG_FILENAME", "LOGGER_NAME", "COMMAND_LINE"]:
        assert hasattr(config, name), name


def test_loaded_config_remembers_sources(base, tmp_path):
    from cg_lightning.config.provenance import config_sources, source_of

    second = write(tmp_path, "second.yaml", "trainer:\n  max_steps: 9\n")
    cfg = load_config([base, second], ["model.init_args.hidden=4"])
    sources = config_sources(cfg)
    assert sources["trainer.max_steps"] == second and sources["trainer.accelerator"] == base
    assert sources["model.init_args.hidden"] == "command line"
    assert source_of(cfg, "trainer.precision") is None  # schema default
    assert config_sources(RunConfig()) == {}
    assert cfg == load_config([base, second], ["model.init_args.hidden=4"])  # not part of equality


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches: must be an int >= 1, got 0"),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val: must be >= 0 or null"),
        ("trainer.max_steps=-2", "trainer.max_steps: must be -1 (no limit) or an int >= 0, got -2"),
    ],
)
def test_trainer_value_checks_name_key_and_source(base, override, expected):
    assert f"command line: {expected}" in error_of([base], [override])


# ------------------------------------------------------------------------- build errors' sources


def test_build_errors_name_the_file(base, tmp_path):
    typo = write(tmp_path, "typo.yaml", "model:\n  init_args:\n    hiden: 2\n")
    with pytest.raises(ConfigError) as info:
        build_model(load_config([base, typo], []))
    msg = str(info.value)
    assert msg.startswith("model.init_args: tests.helpers_config.TinyRegressor: unknown argument 'hiden'")
    assert msg.endswith(f"(model.init_args.hiden from {typo})")

    moved = write(tmp_path, "moved.yaml", "data:\n  class_path: tests.helpers_config.TinyDat\n")
    with pytest.raises(ConfigError, match=rf"data\.class_path: .*TinyDat.*\(data\.class_path from {moved}\)"):
        build_datamodule(load_config([base, moved], []))


def test_init_args_checked_against_annotations(base):
    cfg = load_config([base], ["model.init_args.hidden=abc"])
    with pytest.raises(ConfigError) as info:
        build_model(cfg)
    assert str(info.value) == (
        "model.init_args.hidden: expected int (the annotation of tests.helpers_config.TinyRegressor), "
        "got 'abc' (model.init_args.hidden from command line)"
    )
    assert build_model(load_config([base], ["model.init_args.lr=1"])).lr == 1  # an int is a valid float

    def callback(args: str):
        return load_config([base], [f"callbacks=[{{class_path: {HELPERS}.ChoiceCallback, init_args: {args}}}]"])

    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.init_args\.mode: expected one of \('min', 'max'\)"):
        build_callbacks(callback("{mode: median}"))
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.init_args\.patience: expected int or null \(the .*\), got 'x'"):
        build_callbacks(callback("{patience: x}"))
    (built,) = build_callbacks(callback("{mode: max, patience: null}"))
    assert built.mode == "max" and built.patience is None


def test_trainer_rejections_name_the_key(base, tmp_path):
    cfg = load_config([base], [f"trainer.default_root_dir={tmp_path}", "trainer.devices=abc"])
    with pytest.raises(ConfigError) as info:
        build_trainer(cfg)  # Lightning raises a TypeError here
    msg = str(info.value)
    assert msg.startswith("trainer.devices: Lightning rejected the trainer settings:")
    assert msg.endswith("(trainer.devices from command line)")
    if not torch.cuda.is_available():
        cfg = load_config([base], [f"trainer.default_root_dir={tmp_path}", "trainer.accelerator=gpu"])
        with pytest.raises(ConfigError, match=r"^trainer\.accelerator: Lightning rejected .*from command line\)$"):
            build_trainer(cfg)


# ------------------------------------------------------------------------- conflicting settings


GRAPHS = ["strategy.name=cudagraph_ddp", "strategy.graphs.layers=[net.0]"]


def test_cuda_backend_with_cpu_accelerator_refused(base):
    msg = error_of([base], ["strategy.name=cudagraph_ddp", "strategy.graphs.backend=cuda"])
    assert "strategy.graphs.backend: 'cuda' needs a CUDA device but trainer.accelerator is 'cpu'" in msg
    assert f"(strategy.graphs.backend from command line, trainer.accelerator from {base})" in msg
    # no conflict when the graphs do not run
    load_config([base], ["strategy.name=ddp", "strategy.graphs.backend=cuda"])
    load_config([base], ["strategy.name=cudagraph_ddp", "strategy.graphs.backend=cuda", "strategy.graphs.enabled=false"])


def test_manual_optimization_with_cudagraph_ddp_trains(base, tmp_path, capsys):
    """Manual optimization is no conflict for cudagraph_ddp: the run trains and exits 0."""
    root = tmp_path / "runs"
    rc = main(["fit", "--config", base, f"trainer.default_root_dir={root}", *GRAPHS,
               f"model.class_path={HELPERS}.ManualRegressor"])
    assert rc == 0, capsys.readouterr().err[-2000:]


def test_manual_optimization_with_clipping_or_accumulation_refused(base, tmp_path, capsys, no_training):
    root = tmp_path / "runs"
    extra = write(tmp_path, "extra.yaml", "trainer:\n  gradient_clip_val: 0.5\n  accumulate_grad_batches: 2\n")
    rc = main(["fit", "--config", base, "--config", extra, f"trainer.default_root_dir={root}",
               f"model.class_path={HELPERS}.ManualRegressor"])
    assert rc == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines  # both conflicts reported at once
    assert lines[0].startswith("error: trainer.gradient_clip_val: Lightning clips gradients only under automatic")
    assert lines[0].endswith(f"(trainer.gradient_clip_val from {extra}, model.class_path from command line)")
    assert lines[1].startswith("error: trainer.accumulate_grad_batches: Lightning accumulates gradients only")
    assert not root.exists()


def test_manual_optimization_without_conflicts_trains(base, tmp_path):
    root = tmp_path / "runs"
    assert main(["fit", "--config", base, f"trainer.default_root_dir={root}",
                 f"model.class_path={HELPERS}.ManualRegressor"]) == 0
    assert (root / "lightning_logs" / "version_0" / "config.yaml").is_file()


def test_manual_optimization_validates_under_cudagraph_ddp(base, tmp_path):
    root = tmp_path / "runs"
    assert main(["validate", "--config", base, f"trainer.default_root_dir={root}", *GRAPHS,
                 f"model.class_path={HELPERS}.ManualRegressor"]) == 0  # no optimizer step: no conflict


def test_partial_last_batch():
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

    from cg_lightning.config.conflicts import partial_last_batch

    data = TensorDataset(torch.arange(18.0))
    assert partial_last_batch(DataLoader(data, batch_size=4)) == (4, 4, 2)
    assert partial_last_batch(DataLoader(data, batch_size=4, drop_last=True)) is None
    assert partial_last_batch(DataLoader(data, batch_size=6)) is None
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)  # 9 samples per process
    assert partial_last_batch(DataLoader(data, batch_size=4, sampler=sampler)) == (2, 4, 1)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(5))

    assert partial_last_batch(DataLoader(Stream(), batch_size=2)) is None  # cannot be told: not checked


@pytest.fixture
def no_training_step(monkeypatch):
    import tests.helpers_config as helpers

    def refuse(self, batch, batch_idx):
        raise AssertionError("a training step ran despite the conflict")

    monkeypatch.setattr(helpers.TinyRegressor, "training_step", refuse)


SHAPE_ERROR = [*GRAPHS, "strategy.graphs.shape_policy=error", "strategy.graphs.warmup_steps=1",
               "trainer.enable_checkpointing=false"]


def test_shape_policy_error_with_smaller_last_batch_refused(base, tmp_path, capsys, no_training_step):
    root = tmp_path / "runs"
    rc = main(["fit", "--config", base, f"trainer.default_root_dir={root}", *SHAPE_ERROR,
               "data.init_args.n=18", "trainer.max_steps=6"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error: strategy.graphs.shape_policy: 'error' cannot work with this training data" in err
    assert "after 4 full batches of 4, with a batch of 2" in err
    assert "drop_last=True in the training DataLoader" in err  # TinyData takes no drop_last argument
    assert f"(strategy.graphs.shape_policy from command line, data.class_path from {base})" in err


def test_shape_policy_error_conflict_is_real(base, tmp_path, monkeypatch):
    """Without the check, the smaller last batch fails in the middle of training."""
    from cg_lightning.config.conflicts import ShapePolicyDataCheck
    from cg_lightning.graphs import GraphSignatureError

    monkeypatch.setattr(ShapePolicyDataCheck, "on_train_start", lambda self, trainer, pl_module: None)
    cfg = load_config([base], [f"trainer.default_root_dir={tmp_path}", *SHAPE_ERROR, "data.init_args.n=18",
                               "trainer.max_steps=6", "trainer.logger=none"])
    trainer = build_trainer(cfg)
    with pytest.raises(GraphSignatureError):
        trainer.fit(build_model(cfg), datamodule=build_datamodule(cfg))
    assert trainer.global_step == 4  # the four full batches trained, the fifth (2 samples) failed


@pytest.mark.parametrize("overrides", [["data.init_args.n=16"], ["data.init_args.n=18", "trainer.max_steps=4"]],
                         ids=["divisible", "stops-before-the-smaller-batch"])
def test_shape_policy_error_accepted_when_it_can_work(base, tmp_path, overrides):
    root = tmp_path / "runs"
    assert main(["fit", "--config", base, f"trainer.default_root_dir={root}", *SHAPE_ERROR, *overrides]) == 0


def test_missing_value_names_expected_type(tmp_path):
    cfg_file = write(tmp_path, "cb.yaml", "callbacks:\n  - init_args: {tag: x}\n")
    msg = error_of([cfg_file])
    assert msg.startswith("callbacks[0].class_path: missing value") and msg.endswith("; expected str")
    assert error_of([], ["model.init_args.hidden=???"]).endswith("; expected any value")  # free-form init_args


def test_missing_checkpoint_is_an_error_line_with_status_2(capsys):
    """``--ckpt-path`` naming no file stops before anything is built, with one ``error:`` line (was: a
    traceback from Lightning and status 1)."""
    assert main(["fit", "--config", "configs/gpt_tiny.yaml", "--ckpt-path", "nope.ckpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ckpt-path 'nope.ckpt': no such file")
