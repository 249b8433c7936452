"""One check of option values for the Python API and YAML (:mod:`cg_lightning.option_checks`): every field of
``GraphOptions`` and ``DDPOptions`` given a value of the wrong type, or out of range, is refused on both paths with
the same words: the option's key, the value given and what is accepted (CPU, fast). The YAML path is the command
line's (``trainer.strategy.init_args.graphs.*``); one configuration carries every bad field of a section, since every
problem is reported at once."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, List, Optional

import pytest

import cg_lightning
from cg_lightning.cli import CGLightningCLI, main
from cg_lightning.ddp.options import DDPOptions
from cg_lightning.option_checks import expected_type, field_types, type_name
from cg_lightning.graphs.options import GraphOptions
from cg_lightning.options import as_options

SECTIONS = ((GraphOptions, "graphs"), (DDPOptions, "ddp"))

#: a value of the wrong type for each annotation the option fields use (one YAML and Python both refuse)
WRONG = {bool: "maybe", int: "two", float: "big", str: ["x"], Optional[str]: ["x"], Optional[List[str]]: 3,
         Optional[bool]: "maybe"}


def _fields():
    return [pytest.param(cls, section, f, id=f"{section}.{f.name}") for cls, section in SECTIONS
            for f in dataclasses.fields(cls)]


def _constrained():
    out = []
    for cls, section in SECTIONS:
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if "one_of" in meta:
                bad = "nope"
            elif "at_least" in meta:
                bad = types[f.name](meta["at_least"] - 1)
            elif "above" in meta:
                bad = types[f.name](meta["above"])
            else:
                continue
            out.append(pytest.param(cls, section, f.name, bad, id=f"{section}.{f.name}={bad!r}"))
    return out


STRATEGY_KEY = "trainer.strategy.init_args"


def _yaml(tmp_path, section: str, values: dict) -> str:
    """A run configuration whose strategy section ``section`` holds ``values``; returns its path."""
    from tests.test_cli import BASE_YAML

    path = tmp_path / "options.yaml"
    strategy = {"class_path": "cg_lightning.CUDAGraphDDPStrategy", "init_args": {section: values}}
    path.write_text(BASE_YAML.replace("  strategy: auto\n", "  strategy: " + json.dumps(strategy) + "\n"))
    return str(path)  # JSON is YAML


def _yaml_errors(tmp_path, capsys, section: str, values: dict) -> List[str]:
    """The ``error:`` lines of ``fit`` with ``values`` in strategy section ``section``, without the prefix."""
    capsys.readouterr()
    assert main(["fit", "--config", _yaml(tmp_path, section, values)]) == 2
    return [line[len("error: "):] for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def _python_error(entry: str, cls, section: str, options: dict, kind=Exception) -> str:
    with pytest.raises(kind) as info:
        if entry == "dataclass":
            cls(**options)
        elif entry == "as_options":
            as_options(cls, options, section)
        elif entry == "strategy":
            cg_lightning.CUDAGraphDDPStrategy(**{section: options})
        else:
            from cg_lightning.accelerate import CUDAGraphAccelerator

            CUDAGraphAccelerator(**{section: options})
    return str(info.value)


ENTRIES = ("dataclass", "as_options", "strategy", "accelerator")


def test_every_annotation_has_a_wrong_value():
    used = {tp for cls, _ in SECTIONS for tp in field_types(cls).values()}
    assert used <= set(WRONG), used - set(WRONG)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("cls, section, f", _fields())
def test_wrong_type_names_option_value_and_type_in_python(cls, section, f, entry):
    tp = field_types(cls)[f.name]
    bad = WRONG[tp]
    python = _python_error(entry, cls, section, {f.name: bad}, TypeError)
    assert python.startswith(f"{section}.{f.name}: expected {type_name(tp)}, got {bad!r}"), python


@pytest.mark.parametrize("cls, section", SECTIONS, ids=[s for _, s in SECTIONS])
def test_wrong_types_in_yaml_read_as_in_python(cls, section, tmp_path, capsys):
    bad = {f.name: WRONG[field_types(cls)[f.name]] for f in dataclasses.fields(cls)}
    lines = _yaml_errors(tmp_path, capsys, section, bad)
    path = tmp_path / "options.yaml"
    for name, value in bad.items():
        python = _python_error("dataclass", cls, section, {name: value}, TypeError)
        assert f"{path}: {STRATEGY_KEY}.{python}" in lines, (python, lines)
    assert len(lines) == len(bad), lines


@pytest.mark.parametrize("cls, section, name, bad", _constrained())
def test_value_out_of_range_names_option_value_and_choices_in_python(cls, section, name, bad):
    python = _python_error("as_options", cls, section, {name: bad}, ValueError)
    assert python.startswith(f"{section}.{name}: expected ") and python.endswith(f", got {bad!r}"), python
    accepted = python.split(": expected ", 1)[1]
    assert accepted.startswith(("one of (", "int >= ", "float > ")), python


@pytest.mark.parametrize("cls, section", SECTIONS, ids=[s for _, s in SECTIONS])
def test_values_out_of_range_in_yaml_read_as_in_python(cls, section, tmp_path, capsys):
    bad = {p.values[2]: p.values[3] for p in _constrained() if p.values[1] == section}
    lines = _yaml_errors(tmp_path, capsys, section, bad)
    for name, value in bad.items():
        python = _python_error("as_options", cls, section, {name: value}, ValueError)
        assert f"{tmp_path / 'options.yaml'}: {STRATEGY_KEY}.{python}" in lines, (python, lines)


VALID = {
    "graphs": {"enabled": [False], "layers": [None, ["model.blocks.*"], ("a.*", "b")], "warmup_steps": [0, 5],
               "num_warmup_iters": [1, 3], "backend": ["auto", "cuda", "eager"],
               "shape_policy": ["eager", "error", "recapture"], "max_graph_sets": [1, 8],
               "on_capture_error": ["raise", "eager", "split"], "capture_optimizer": [True], "whole_step": [True, False, None], "cached_optimizer_step": [False],
               "segments": [False], "capture_eval": [True], "direct_grad_ready": [False],
               "compile": [True], "compile_mode": ["default", "max-autotune-no-cudagraphs"],
               "compile_backend": ["inductor", "aot_eager"]},
    "ddp": {"bucket_size_mb": [0.5, 4], "average": [False], "grad_dtype": [None, "float32", "bfloat16", "float16"],
            "timeout_s": [1, 2.5], "check_grad_ready": [False], "broadcast_buffers": [False],
            # the two modes exclude each other: each round sets one of them
            "find_unused_parameters": [True, False], "distributed_optimizer": [False, True],
            "overlap_param_gather": [False, True]},
}


def test_valid_values_cover_every_field():
    for cls, section in SECTIONS:
        assert set(VALID[section]) == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls, section, name, value", [
    pytest.param(cls, section, name, value, id=f"{section}.{name}={value!r}")
    for cls, section in SECTIONS for name, values in VALID[section].items() for value in values
])
def test_valid_values_pass_in_python(cls, section, name, value):
    got = getattr(as_options(cls, {name: value}, section), name)
    assert got == (list(value) if isinstance(value, tuple) else value)


@pytest.mark.parametrize("cls, section", SECTIONS, ids=[s for _, s in SECTIONS])
def test_valid_values_reach_the_strategy_from_yaml(cls, section, tmp_path):
    """Every valid value of every field, a few configurations per section (the i-th value of each field)."""
    rounds = max(len(values) for values in VALID[section].values())
    for i in range(rounds):
        values = {name: list(vs[i % len(vs)]) if isinstance(vs[i % len(vs)], tuple) else vs[i % len(vs)]
                  for name, vs in VALID[section].items()}
        built = CGLightningCLI(args=["--config", _yaml(tmp_path, section, values)], run=False)
        options = getattr(built.trainer.strategy, f"{section}_options" if section == "ddp" else "graph_options")
        assert {name: getattr(options, name) for name in values} == values


def test_unknown_keys_suggest_the_closest_field_on_both_paths(tmp_path, capsys):
    valid = ", ".join(f.name for f in dataclasses.fields(GraphOptions))
    python = _python_error("strategy", GraphOptions, "graphs", {"warmup_step": 1, "segment": False}, TypeError)
    assert python.splitlines() == [
        f"graphs.warmup_step: unknown key (did you mean 'warmup_steps'?); valid keys under 'graphs': {valid}",
        f"graphs.segment: unknown key (did you mean 'segments'?); valid keys under 'graphs': {valid}",
    ]
    lines = _yaml_errors(tmp_path, capsys, "graphs", {"warmup_step": 1})
    assert lines == [f"{tmp_path / 'options.yaml'}: {STRATEGY_KEY}.graphs.warmup_step: unknown key (did you mean "
                     f"'warmup_steps'?); valid keys under '{STRATEGY_KEY}.graphs' (GraphOptions): "
                     f"{', '.join(sorted(valid.split(', ')))}"]


def test_every_problem_is_reported_at_once():
    with pytest.raises(TypeError) as info:
        GraphOptions(warmup_steps="two", backend="tpu", max_graph_sets=0)
    assert str(info.value).splitlines() == [
        "graphs.warmup_steps: expected int, got 'two'",
        "graphs.backend: expected one of ('auto', 'cuda', 'eager'), got 'tpu'",
        "graphs.max_graph_sets: expected int >= 1, got 0",
    ]


def test_options_changed_after_construction_are_checked_when_passed():
    options = GraphOptions()
    options.warmup_steps = "two"
    with pytest.raises(TypeError, match=r"^graphs\.warmup_steps: expected int, got 'two'$"):
        cg_lightning.CUDAGraphDDPStrategy(graphs=options)
    with pytest.raises(TypeError, match=r"^ddp: expected a DDPOptions, a mapping of its fields or None, got 'x'$"):
        cg_lightning.CUDAGraphDDPStrategy(ddp="x")


def test_callback_arguments_are_checked_as_graph_options():
    from cg_lightning.callbacks import CUDAGraphCallback

    with pytest.raises(TypeError, match=r"^graphs\.warmup_steps: expected int, got 1\.5$"):
        CUDAGraphCallback(warmup_steps=1.5)
    with pytest.raises(ValueError, match=r"^graphs\.shape_policy: expected one of \('eager', 'error', 'recapture'\)"):
        CUDAGraphCallback(shape_policy="sometimes")


@pytest.mark.parametrize("tp, value, expected", [
    (int, True, "int"), (int, 3, None), (float, 3, None), (float, False, "float"), (bool, 0, "bool"),
    (str, 5, "str"), (Optional[int], None, None), (Optional[int], "x", "int or null"),
    (List[str], ("a", "b"), None), (List[str], ["a", 1], "list of str"), (typing.Literal["a", "b"], "c",
                                                                          "one of ('a', 'b')"),
    (typing.Union[int, str], 2.5, "int or str"), (typing.Dict[str, Any], {"a": 1}, None), (Any, object(), None),
    (typing.Sequence[int], "too rich to judge", None),
])
def test_expected_type(tp, value, expected):
    assert expected_type(tp, value) == expected


@pytest.mark.parametrize("name", ["bucket_size_mb", "timeout_s"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e15, -1.0])
def test_non_finite_and_out_of_range_numbers_refused(name, value):
    with pytest.raises(ValueError, match=rf"^ddp\.{name}: expected (finite )?float > 0 and <= \d+, got "):
        DDPOptions(**{name: value})


def test_non_finite_numbers_refused_in_yaml(tmp_path, capsys):
    from tests.test_cli import BASE_YAML

    path = tmp_path / "options.yaml"
    path.write_text(BASE_YAML.replace("  strategy: auto\n", "  strategy:\n    class_path: cg_lightning.CUDAGraphDDPStrategy"
                                      "\n    init_args:\n      ddp: {bucket_size_mb: 1.0e+15, timeout_s: .nan}\n"))
    capsys.readouterr()
    assert main(["fit", "--config", str(path)]) == 2
    lines = [line[len("error: "):] for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert lines == [
        f"{path}: {STRATEGY_KEY}.ddp.bucket_size_mb: expected float > 0 and <= 1048576, got 1000000000000000.0",
        f"{path}: {STRATEGY_KEY}.ddp.timeout_s: expected finite float > 0 and <= 10000000, got nan"]
