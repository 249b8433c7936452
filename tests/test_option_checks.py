"""One check of option values for the Python API and YAML (:mod:`cg_lightning.option_checks`): every field of
``GraphOptions`` and ``DDPOptions`` given a value of the wrong type, or out of range, is refused on both paths with
the same words: the option's key, the value given and what is accepted (CPU, fast)."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, List, Optional

import pytest

import cg_lightning
from cg_lightning.config import ConfigError, load_config
from cg_lightning.ddp.options import DDPOptions
from cg_lightning.option_checks import expected_type, field_types, type_name
from cg_lightning.graphs.options import GraphOptions
from cg_lightning.options import as_options

SECTIONS = ((GraphOptions, "graphs"), (DDPOptions, "ddp"))

#: a value of the wrong type for each annotation the option fields use (one YAML and Python both refuse)
WRONG = {bool: "maybe", int: "two", float: "big", str: ["x"], Optional[str]: ["x"], Optional[List[str]]: 3}


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


def _yaml_error(tmp_path, section: str, name: str, value: Any) -> str:
    path = tmp_path / "options.yaml"
    path.write_text(json.dumps({"strategy": {section: {name: value}}}))  # JSON is YAML
    with pytest.raises(ConfigError) as info:
        load_config([str(path)])
    return str(info.value)


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
def test_wrong_type_names_option_value_and_type_in_python_and_yaml(cls, section, f, entry, tmp_path):
    tp = field_types(cls)[f.name]
    bad = WRONG[tp]
    expected = f"{section}.{f.name}: expected {type_name(tp)}, got {bad!r}"
    python = _python_error(entry, cls, section, {f.name: bad}, TypeError)
    assert python.startswith(expected), python
    yaml = _yaml_error(tmp_path, section, f.name, bad)
    assert yaml.startswith(f"{tmp_path / 'options.yaml'}: strategy.{expected}"), yaml


@pytest.mark.parametrize("cls, section, name, bad", _constrained())
def test_value_out_of_range_names_option_value_and_choices_in_python_and_yaml(cls, section, name, bad, tmp_path):
    python = _python_error("as_options", cls, section, {name: bad}, ValueError)
    assert python.startswith(f"{section}.{name}: expected ") and python.endswith(f", got {bad!r}"), python
    accepted = python.split(": expected ", 1)[1]
    assert accepted.startswith(("one of (", "int >= ", "float > ")), python
    yaml = _yaml_error(tmp_path, section, name, bad)
    assert yaml == f"{tmp_path / 'options.yaml'}: strategy.{python}", yaml


VALID = {
    "graphs": {"enabled": [False], "layers": [None, ["model.blocks.*"], ("a.*", "b")], "warmup_steps": [0, 5],
               "num_warmup_iters": [1, 3], "backend": ["auto", "cuda", "eager"],
               "shape_policy": ["eager", "error", "recapture"], "max_graph_sets": [1, 8],
               "on_capture_error": ["raise", "eager", "split"], "capture_optimizer": [True], "cached_optimizer_step": [False],
               "segments": [False], "capture_eval": [True], "direct_grad_ready": [False],
               "compile": [True], "compile_mode": ["default", "max-autotune-no-cudagraphs"],
               "compile_backend": ["inductor", "aot_eager"]},
    "ddp": {"bucket_size_mb": [0.5, 4], "average": [False], "grad_dtype": [None, "float32", "bfloat16", "float16"],
            "timeout_s": [1, 2.5], "check_grad_ready": [False], "broadcast_buffers": [False],
            "find_unused_parameters": [True], "distributed_optimizer": [True]},
}


def test_valid_values_cover_every_field():
    for cls, section in SECTIONS:
        assert set(VALID[section]) == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls, section, name, value", [
    pytest.param(cls, section, name, value, id=f"{section}.{name}={value!r}")
    for cls, section in SECTIONS for name, values in VALID[section].items() for value in values
])
def test_valid_values_pass_both_paths(cls, section, name, value, tmp_path):
    options = as_options(cls, {name: value}, section)
    got = getattr(options, name)
    assert got == (list(value) if isinstance(value, tuple) else value)
    path = tmp_path / "ok.yaml"
    path.write_text(json.dumps({"strategy": {section: {name: value}}}))
    assert getattr(getattr(load_config([str(path)]).strategy, section), name) == got


def test_unknown_keys_suggest_the_closest_field_on_both_paths(tmp_path):
    valid = ", ".join(f.name for f in dataclasses.fields(GraphOptions))
    python = _python_error("strategy", GraphOptions, "graphs", {"warmup_step": 1, "segment": False}, TypeError)
    assert python.splitlines() == [
        f"graphs.warmup_step: unknown key (did you mean 'warmup_steps'?); valid keys under 'graphs': {valid}",
        f"graphs.segment: unknown key (did you mean 'segments'?); valid keys under 'graphs': {valid}",
    ]
    yaml = _yaml_error(tmp_path, "graphs", "warmup_step", 1)
    assert yaml == (f"{tmp_path / 'options.yaml'}: strategy.graphs.warmup_step: unknown key (did you mean "
                    f"'warmup_steps'?); valid keys under 'strategy.graphs': {valid}")


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
