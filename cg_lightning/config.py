"""Run configuration: an OmegaConf structured schema, its loader and the object builders.

The schema is a tree of dataclasses that mirrors the objects a run is made of::

    RunConfig
    ├── seed
    ├── trainer      TrainerConfig      -> lightning.pytorch.Trainer keyword arguments
    ├── strategy     StrategyConfig     -> CUDAGraphDDPStrategy / DDPStrategy / "auto"
    │   ├── graphs   GraphOptions       (cg_lightning.graphs.options, reused as is)
    │   └── ddp      DDPOptions         (cg_lightning.ddp.options, reused as is)
    ├── model        ComponentConfig    -> any LightningModule, by import path
    ├── data         ComponentConfig    -> any LightningDataModule, by import path
    └── callbacks    [ComponentConfig]  -> Lightning callbacks, by import path

:func:`load_config` merges YAML files and ``dotted.key=value`` overrides on top of the schema's
defaults and turns every problem into one :class:`ConfigError` whose message says where the bad
value came from (file or command line), its full key path, and what was expected. The ``build_*``
functions turn a loaded :class:`RunConfig` into Lightning objects.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cg_lightning.ddp.options import DDPOptions
from cg_lightning.graphs.options import GraphOptions

__all__ = [
    "ComponentConfig",
    "ConfigError",
    "RunConfig",
    "SaveResolvedConfig",
    "StrategyConfig",
    "TrainerConfig",
    "build_callbacks",
    "build_datamodule",
    "build_model",
    "build_strategy",
    "build_trainer",
    "config_to_yaml",
    "load_config",
]

STRATEGY_NAMES = ("cudagraph_ddp", "ddp", "auto")
LOGGERS = ("csv", "tensorboard", "none")
GRADIENT_CLIP_ALGORITHMS = ("norm", "value")
LOGGER_NAME = "lightning_logs"
CONFIG_FILENAME = "config.yaml"
COMMAND_LINE = "command line"


class ConfigError(ValueError):
    """A configuration problem. The message names where the value came from and its key path.

    Several problems found in one pass are reported together, one per line.
    """


# ----------------------------------------------------------------------------------- schema


@dataclass
class ComponentConfig:
    """An object built by import path: ``class_path(**init_args)``.

    Attributes:
        class_path: ``"package.module.ClassName"``; imported with :mod:`importlib`, so modules such
            as ``examples.gpt`` resolve relative to the current directory (the repository root).
        init_args: keyword arguments of the constructor; free-form, checked against the constructor's
            signature when the object is built.
    """

    class_path: str = MISSING
    init_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class StrategyConfig:
    """Which training strategy runs the job.

    Attributes:
        name: ``"cudagraph_ddp"`` (per-layer graphs under the cg_lightning DDP engine), ``"ddp"``
            (Lightning's eager ``DDPStrategy``, for comparison runs) or ``"auto"`` (Lightning's choice).
        graphs: graph options; only used by ``cudagraph_ddp``.
        ddp: data-parallel engine options; only used by ``cudagraph_ddp``.
    """

    name: str = "cudagraph_ddp"
    graphs: GraphOptions = field(default_factory=GraphOptions)
    ddp: DDPOptions = field(default_factory=DDPOptions)

    def __post_init__(self) -> None:
        if self.name not in STRATEGY_NAMES:
            raise ValueError(f"name must be one of {STRATEGY_NAMES}, got {self.name!r}")


@dataclass
class TrainerConfig:
    """Keyword arguments of ``lightning.pytorch.Trainer`` (same names, same meaning).

    ``logger`` is the exception: ``"csv"``, ``"tensorboard"`` or ``"none"`` selects Lightning's
    ``CSVLogger``, ``TensorBoardLogger`` (writing under ``default_root_dir/lightning_logs``) or no
    logger. ``devices``, ``val_check_interval`` and ``limit_val_batches`` take an int, a float or a
    string (``"auto"``), hence ``Any``.
    """

    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = -1
    max_epochs: Optional[int] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: Any = None
    limit_val_batches: Any = 1.0
    check_val_every_n_epoch: Optional[int] = 1
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 10
    default_root_dir: str = "runs"
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    logger: str = "csv"
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.logger not in LOGGERS:
            raise ValueError(f"logger must be one of {LOGGERS}, got {self.logger!r}")
        if self.gradient_clip_algorithm not in GRADIENT_CLIP_ALGORITHMS:
            raise ValueError(
                f"gradient_clip_algorithm must be one of {GRADIENT_CLIP_ALGORITHMS}, "
                f"got {self.gradient_clip_algorithm!r}"
            )


@dataclass
class RunConfig:
    """One training or validation run."""

    seed: int = 1234
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ComponentConfig = field(
        default_factory=lambda: ComponentConfig(class_path="examples.gpt.GPTLightningModule")
    )
    data: ComponentConfig = field(default_factory=lambda: ComponentConfig(class_path="examples.data.TextDataModule"))
    callbacks: List[ComponentConfig] = field(default_factory=list)


# ------------------------------------------------------------------------- schema helpers


def _join(path: str, key: Any) -> str:
    return str(key) if not path else f"{path}.{key}"


def _hints(schema: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _strip_optional(tp)
    if optional:
        return f"{_type_name(inner)} or null"
    if inner is Any:
        return "any value"
    if dataclasses.is_dataclass(inner):
        return f"a mapping ({inner.__name__})"
    origin = typing.get_origin(inner)
    if origin in (list, List, tuple):
        args = typing.get_args(inner)
        if args and dataclasses.is_dataclass(args[0]):
            return f"list of mappings ({args[0].__name__})"
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in (dict, Dict):
        return "a mapping"
    return getattr(inner, "__name__", str(inner))


def _list_item_dataclass(tp: Any) -> Optional[type]:
    inner, _ = _strip_optional(tp)
    if typing.get_origin(inner) in (list, List):
        args = typing.get_args(inner)
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _SourceChecker:
    """Walks one source (a YAML file or the overrides) against the schema before it is merged.

    Collects every unknown key and every value OmegaConf would reject, each with its full key path
    (OmegaConf's own errors lose the path inside lists), and records which source set which key.
    """

    def __init__(self, source: str, provenance: Dict[str, str]) -> None:
        self.source = source
        self.provenance = provenance
        self.problems: List[str] = []
        self._probes: Dict[type, DictConfig] = {}

    def problem(self, path: str, text: str) -> None:
        self.problems.append(f"{self.source}: {path or '<top level>'}: {text}")

    def check_node(self, data: Any, schema: type, path: str) -> None:
        if not isinstance(data, Mapping):
            self.problem(path, f"expected {_type_name(schema)}, got {data!r}")
            return
        fields = _hints(schema)
        for key, value in data.items():
            kpath = _join(path, key)
            if key not in fields:
                self.problem(kpath, _unknown_key_text(key, path, list(fields)))
                continue
            self._record(value, kpath)
            self.check_value(value, fields[key], schema, key, kpath)

    def check_value(self, value: Any, tp: Any, parent: type, key: str, path: str) -> None:
        if value == "???" or _is_interpolation(value):
            return  # missing marker / resolved later: reported by the missing-key or resolve step
        inner, optional = _strip_optional(tp)
        if value is None and optional:
            return
        if dataclasses.is_dataclass(inner):
            self.check_node(value, inner, path)
            return
        item_schema = _list_item_dataclass(tp)
        if item_schema is not None:
            if not isinstance(value, (list, tuple)):
                self.problem(path, f"expected {_type_name(tp)}, got {value!r}")
                return
            for i, item in enumerate(value):
                if not (item == "???" or _is_interpolation(item)):
                    self.check_node(item, item_schema, f"{path}[{i}]")
            return
        probe = self._probes.get(parent)
        if probe is None:
            probe = self._probes[parent] = OmegaConf.structured(parent)
        try:
            OmegaConf.merge(probe, {key: value})
        except OmegaConfBaseException:
            self.problem(path, f"expected {_type_name(tp)}, got {value!r}")

    def _record(self, value: Any, path: str) -> None:
        self.provenance[path] = self.source
        if isinstance(value, (list, tuple)):  # a list replaces the previous one whole: forget its items
            for stale in [k for k in self.provenance if k.startswith(path + "[")]:
                del self.provenance[stale]
        if isinstance(value, Mapping):
            for k, v in value.items():
                self._record(v, _join(path, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._record(v, f"{path}[{i}]")


def _unknown_key_text(key: Any, parent_path: str, valid: List[str]) -> str:
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    where = f"under '{parent_path}'" if parent_path else "at the top level"
    return f"unknown key{hint}; valid keys {where}: {', '.join(valid)}"


def _missing_text(path: str, provenance: Mapping[str, str]) -> str:
    if path in provenance:
        return f"{path}: missing value (set to '???' in {provenance[path]})"
    probe = path
    while True:
        cut = max(probe.rfind("."), probe.rfind("["))
        if cut <= 0:
            break
        probe = probe[:cut]
        if probe in provenance:
            return f"{path}: missing value ({probe} comes from {provenance[probe]}, which does not set it)"
    return f"{path}: missing value (no default; set it in a config file or on the command line as {path}=...)"


# ---------------------------------------------------------------------------------- loading


def _read_yaml(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    try:
        loaded = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{path}: cannot read: {_short(exc)}") from exc
    except Exception as exc:  # yaml.YAMLError and friends: keep the line/column information
        text = " ".join(str(exc).split())
        raise ConfigError(f"{path}: invalid YAML: {text}") from exc
    return loaded


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(
            "\n".join(f"{COMMAND_LINE}: override {o!r} is not of the form dotted.key=value" for o in bad)
        )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{COMMAND_LINE}: cannot parse overrides {list(overrides)}: {_short(exc)}") from exc


def _merge_source(cfg: DictConfig, data: Any, source: str, provenance: Dict[str, str]) -> DictConfig:
    if isinstance(data, ListConfig) or not isinstance(data, (DictConfig, Mapping)):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    raw = OmegaConf.to_container(data, resolve=False) if isinstance(data, DictConfig) else dict(data)
    checker = _SourceChecker(source, provenance)
    checker.check_node(raw, RunConfig, "")
    if checker.problems:
        raise ConfigError("\n".join(checker.problems))
    try:
        return OmegaConf.merge(cfg, data)
    except OmegaConfBaseException as exc:  # anything the walk above did not foresee
        key = getattr(exc, "full_key", None) or "<top level>"
        raise ConfigError(f"{source}: {key}: {_short(exc)}") from exc


def _dataclass_field_in(message: str, schema: type) -> Optional[str]:
    """The field of ``schema`` mentioned first in a ``__post_init__`` message, if any."""
    best: Optional[tuple[int, str]] = None
    for f in dataclasses.fields(schema):
        m = re.search(rf"(?<![\w]){re.escape(f.name)}(?![\w])", message)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), f.name)
    return best[1] if best else None


class _Located(Exception):
    def __init__(self, path: str, exc: BaseException) -> None:
        super().__init__(path)
        self.path = path
        self.exc = exc


def _to_object_located(node: Union[DictConfig, ListConfig], path: str) -> Any:
    """``OmegaConf.to_object`` that, on failure, finds the deepest node (and field) responsible."""
    try:
        return OmegaConf.to_object(node)
    except Exception as exc:
        keys: Iterable[Any] = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            child_path = f"{path}[{key}]" if isinstance(node, ListConfig) else _join(path, key)
            try:
                child = node[key]
            except Exception as child_exc:  # a leaf whose interpolation does not resolve
                raise _Located(child_path, child_exc) from child_exc
            if OmegaConf.is_config(child):
                try:
                    OmegaConf.to_object(child)
                except Exception:
                    _to_object_located(child, child_path)  # raises _Located
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        where = path
        if isinstance(exc, OmegaConfBaseException) and getattr(exc, "key", None) is not None:
            where = _join(path, exc.key)
        elif schema is not None and dataclasses.is_dataclass(schema):
            name = _dataclass_field_in(str(exc), schema)
            if name is not None:
                where = _join(path, name)
        raise _Located(where, exc) from exc


def _missing_keys(data: Any, path: str) -> List[str]:
    """Key paths of ``???`` values, without resolving interpolations (``OmegaConf.missing_keys`` does)."""
    if isinstance(data, Mapping):
        return [k for key, value in data.items() for k in _missing_keys(value, _join(path, key))]
    if isinstance(data, list):
        return [k for i, value in enumerate(data) for k in _missing_keys(value, f"{path}[{i}]")]
    return [path] if data == "???" else []


def _without_key_prefix(message: str, path: str) -> str:
    """``"graphs.backend must be ..."`` at ``strategy.graphs.backend`` -> ``"must be ..."``."""
    parts = path.split(".")
    for i in range(len(parts)):
        prefix = ".".join(parts[i:])
        if prefix and message.startswith(prefix + " "):
            return message[len(prefix) + 1 :]
    return message


def load_config(config_files: Sequence[Union[str, os.PathLike]] = (), overrides: Sequence[str] = ()) -> RunConfig:
    """Resolve a :class:`RunConfig` from YAML files and command-line overrides.

    Sources are merged in order on top of the schema's defaults: each file of ``config_files``, then
    ``overrides`` (``"dotted.key=value"``, value parsed as YAML). Later sources win; mappings merge
    key by key (so ``init_args`` given by an earlier source stay, even when a later one changes
    ``class_path``; the constructor check in :func:`build_model` reports any that no longer fit), and
    lists (``callbacks``) are replaced whole. Interpolations such as ``${model.init_args.block_size}``
    are resolved at the end, and every dataclass's ``__post_init__`` validation runs.

    Raises:
        ConfigError: naming the source (file or ``command line``), the full key path and what was
            expected, for: unreadable files, unknown keys (with the valid keys and a suggestion),
            values of the wrong type, missing mandatory values (all of them), unresolvable
            interpolations and values rejected by the options' validation.
    """
    cfg = OmegaConf.structured(RunConfig)
    provenance: Dict[str, str] = {}
    for path in config_files:
        source = os.fspath(path)
        cfg = _merge_source(cfg, _read_yaml(source), source, provenance)
    if overrides:
        cfg = _merge_source(cfg, _parse_overrides(overrides), COMMAND_LINE, provenance)

    missing = _missing_keys(OmegaConf.to_container(cfg, resolve=False), "")
    if missing:
        raise ConfigError("\n".join(_missing_text(key, provenance) for key in missing))

    try:
        result = _to_object_located(cfg, "")
    except _Located as located:
        source = provenance.get(located.path)
        prefix = f"{source}: " if source else ""
        text = _without_key_prefix(_short(located.exc), located.path)
        raise ConfigError(f"{prefix}{located.path or '<top level>'}: {text}") from located.exc
    assert isinstance(result, RunConfig)
    return result


def config_to_yaml(cfg: RunConfig) -> str:
    """The resolved configuration as YAML; loading it back with :func:`load_config` gives ``cfg``."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# --------------------------------------------------------------------------------- building


def _import_class(class_path: str, key: str) -> Any:
    module_name, _, attr = class_path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{key}.class_path: {class_path!r} is not an import path of the form 'package.module.ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{key}.class_path: cannot import module {module_name!r} for {class_path!r} ({exc}); "
            f"modules such as 'examples.*' are imported from the current directory, "
            f"which must be the repository root"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean '{module_name}.{close[0]}'?)" if close else ""
        raise ConfigError(f"{key}.class_path: module {module_name!r} has no attribute {attr!r}{hint}") from exc


def _describe_params(sig: inspect.Signature) -> str:
    parts = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}")
    return ", ".join(parts) if parts else "(none)"


def _bad_kwargs_error(key: str, class_path: str, sig: Optional[inspect.Signature], kwargs: Mapping[str, Any],
                      reason: BaseException) -> ConfigError:
    details = []
    if sig is not None:
        params = sig.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not takes_any:
            for name in kwargs:
                if name not in params:
                    close = difflib.get_close_matches(str(name), named, n=1)
                    hint = f" (did you mean '{close[0]}'?)" if close else ""
                    details.append(f"unknown argument {name!r}{hint}")
    if not details:
        details.append(_short(reason))
    accepted = _describe_params(sig) if sig is not None else "unknown (no signature)"
    return ConfigError(f"{key}.init_args: {class_path}: {'; '.join(details)}. Accepted parameters: {accepted}")


def _instantiate(component: ComponentConfig, key: str, expected: type) -> Any:
    cls = _import_class(component.class_path, key)
    kwargs = dict(component.init_args)
    try:
        sig: Optional[inspect.Signature] = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as exc:
            raise _bad_kwargs_error(key, component.class_path, sig, kwargs, exc) from exc
    try:
        obj = cls(**kwargs)
    except TypeError as exc:
        text = str(exc)
        if sig is None or "keyword argument" in text or ("required" in text and "argument" in text):
            raise _bad_kwargs_error(key, component.class_path, sig, kwargs, exc) from exc
        raise
    except (ValueError, MisconfigurationException) as exc:
        raise ConfigError(f"{key}.init_args: {component.class_path} rejected its arguments: {_short(exc)}") from exc
    if not isinstance(obj, expected):
        raise ConfigError(
            f"{key}.class_path: {component.class_path} built a {type(obj).__module__}.{type(obj).__qualname__}, "
            f"which is not a {expected.__module__}.{expected.__qualname__}"
        )
    return obj


def _as_run_config(cfg: Union[RunConfig, DictConfig]) -> RunConfig:
    if isinstance(cfg, RunConfig):
        return cfg
    if isinstance(cfg, DictConfig):
        obj = OmegaConf.to_object(cfg)
        if isinstance(obj, RunConfig):
            return obj
    raise TypeError(f"expected a RunConfig (from load_config), got {type(cfg).__name__}")


def build_model(cfg: RunConfig) -> Any:
    """The ``LightningModule`` of ``cfg.model``. Call ``seed_everything(cfg.seed)`` first."""
    from lightning.pytorch import LightningModule

    return _instantiate(_as_run_config(cfg).model, "model", LightningModule)


def build_datamodule(cfg: RunConfig) -> Any:
    """The ``LightningDataModule`` of ``cfg.data``."""
    from lightning.pytorch import LightningDataModule

    return _instantiate(_as_run_config(cfg).data, "data", LightningDataModule)


def build_callbacks(cfg: RunConfig) -> List[Any]:
    """The Lightning callbacks of ``cfg.callbacks``, in order."""
    cfg = _as_run_config(cfg)
    return [_instantiate(c, f"callbacks[{i}]", Callback) for i, c in enumerate(cfg.callbacks)]


def build_strategy(cfg: RunConfig) -> Any:
    """``CUDAGraphDDPStrategy`` (``cudagraph_ddp``), Lightning's ``DDPStrategy`` (``ddp``) or ``"auto"``.

    ``graphs`` and ``ddp`` options only apply to ``cudagraph_ddp``; the eager ``ddp`` baseline uses
    Lightning's defaults.
    """
    cfg = _as_run_config(cfg)
    name = cfg.strategy.name
    if name == "cudagraph_ddp":
        from cg_lightning.strategy import CUDAGraphDDPStrategy  # lazy: heavy, and optional for other names

        return CUDAGraphDDPStrategy(
            graphs=dataclasses.replace(cfg.strategy.graphs), ddp=dataclasses.replace(cfg.strategy.ddp)
        )
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if name == "auto":
        return "auto"
    raise ConfigError(f"strategy.name: must be one of {STRATEGY_NAMES}, got {name!r}")


def _build_logger(trainer_cfg: TrainerConfig) -> Any:
    if trainer_cfg.logger == "none":
        return False
    if trainer_cfg.logger == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=trainer_cfg.default_root_dir, name=LOGGER_NAME)
    if trainer_cfg.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        try:
            return TensorBoardLogger(save_dir=trainer_cfg.default_root_dir, name=LOGGER_NAME)
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"trainer.logger: 'tensorboard' needs the tensorboard package ({exc}); "
                f"install it or use 'csv' or 'none'"
            ) from exc
    raise ConfigError(f"trainer.logger: must be one of {LOGGERS}, got {trainer_cfg.logger!r}")


class SaveResolvedConfig(Callback):
    """Writes the resolved run configuration to ``<trainer.log_dir>/config.yaml`` (rank zero only).

    The file is a valid ``--config`` for ``python -m cg_lightning``: loading it reproduces the run's
    configuration.
    """

    def __init__(self, cfg: RunConfig, filename: str = CONFIG_FILENAME) -> None:
        self.yaml_text = config_to_yaml(_as_run_config(cfg))
        self.filename = filename
        self.path: Optional[str] = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank must ask
        if not trainer.is_global_zero or not log_dir:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, self.filename)
        with open(self.path, "w", encoding="utf-8") as fh:
            fh.write(self.yaml_text)


def build_trainer(cfg: RunConfig, extra_callbacks: Iterable[Any] = ()) -> Any:
    """A ``lightning.pytorch.Trainer`` for ``cfg``.

    Its callbacks are those of ``cfg.callbacks``, then :class:`SaveResolvedConfig`, then
    ``extra_callbacks``. Lightning's own rejections of the trainer settings (for example an
    accelerator this machine does not have) become :class:`ConfigError`.
    """
    from lightning.pytorch import Trainer

    cfg = _as_run_config(cfg)
    t = cfg.trainer
    strategy = build_strategy(cfg)
    callbacks = build_callbacks(cfg) + [SaveResolvedConfig(cfg)] + list(extra_callbacks)
    logger = _build_logger(t)
    try:
        return Trainer(
            accelerator=t.accelerator,
            strategy=strategy,
            devices=t.devices,
            num_nodes=t.num_nodes,
            precision=t.precision,
            logger=logger,
            callbacks=callbacks,
            max_steps=t.max_steps,
            max_epochs=t.max_epochs,
            accumulate_grad_batches=t.accumulate_grad_batches,
            gradient_clip_val=t.gradient_clip_val,
            gradient_clip_algorithm=t.gradient_clip_algorithm,
            val_check_interval=t.val_check_interval,
            limit_val_batches=t.limit_val_batches,
            check_val_every_n_epoch=t.check_val_every_n_epoch,
            num_sanity_val_steps=t.num_sanity_val_steps,
            log_every_n_steps=t.log_every_n_steps,
            default_root_dir=t.default_root_dir,
            enable_progress_bar=t.enable_progress_bar,
            enable_checkpointing=t.enable_checkpointing,
            deterministic=t.deterministic,
        )
    except (MisconfigurationException, ValueError) as exc:
        raise ConfigError(f"trainer: Lightning rejected the trainer settings: {_short(exc)}") from exc
