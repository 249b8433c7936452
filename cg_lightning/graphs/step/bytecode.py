"""What :mod:`.step_code` trusts in a training step's bytecode, and how it reads instructions.

Builtins and modules whose functions compute only from their arguments, torch calls with effects on the host,
LightningModule properties that stay the same through a fit; whether an object is code of such a module or of the
training framework; which local variables an instruction loads (CPython 3.10-3.14).
"""

from __future__ import annotations

import dis
import types
from typing import Any, Optional, Sequence, Tuple

from ...torch_compat import OP_TYPES

#: builtins a step may call: pure functions of their arguments
SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter", "float", "frozenset", "hasattr", "int",
    "isinstance", "issubclass", "len", "list", "map", "max", "min", "range", "reversed", "round", "set", "slice",
    "sorted", "str", "sum", "tuple", "type", "zip", "None", "True", "False", "NotImplemented", "Ellipsis",
    "ArithmeticError", "AssertionError", "AttributeError", "Exception", "IndexError", "KeyError",
    "NotImplementedError", "RuntimeError", "TypeError", "ValueError"
})
#: modules whose attributes a step may read (their functions compute from their arguments)
SAFE_MODULES = ("torch", "math", "operator", "einops", "cg_lightning")
#: torch functions with effects on the host that a replay would not repeat (RNG seeding, files, global defaults)
HOST_EFFECTS = frozenset({"manual_seed", "seed", "set_rng_state", "save", "load", "set_default_dtype",
                          "set_default_device", "set_printoptions", "use_deterministic_algorithms"})
#: properties of a LightningModule that stay the same through a fit
CONSTANT_PROPERTIES = frozenset({"device", "dtype", "global_rank", "local_rank"})


_CODE_KINDS = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
               type) + OP_TYPES


def trusted(obj: Any) -> bool:
    """A module of :data:`SAFE_MODULES`, or a function or class defined in one: code whose behaviour depends only on
    its arguments. Instances (a tensor, a generator) are not."""
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    elif isinstance(obj, _CODE_KINDS):
        name = getattr(obj, "__module__", None) or ""
    else:
        return False
    return any(name == m or name.startswith(m + ".") for m in SAFE_MODULES)


def read_names(ins: dis.Instruction) -> Tuple[str, ...]:
    """The local variables a load reads (``LOAD_FAST`` and its variants, ``LOAD_DEREF``; the fused two-variable
    loads of 3.13+ read two, the second ending on top of the stack), else ``()``."""
    if ins.opname.startswith("LOAD_FAST") or ins.opname in ("LOAD_DEREF", "LOAD_CLOSURE"):
        value = ins.argval
        return tuple(value) if isinstance(value, tuple) else ((value,) if isinstance(value, str) else ())
    return ()


def loaded_name(ins: dis.Instruction) -> Optional[str]:
    """The variable a load leaves on top of the stack, else ``None``."""
    names = read_names(ins)
    return names[-1] if names else None


def name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def framework_defined(fn: Any, framework: Sequence[str]) -> bool:
    module = getattr(fn, "__module__", "") or ""
    return any(module == m or module.startswith(m + ".") for m in framework)
