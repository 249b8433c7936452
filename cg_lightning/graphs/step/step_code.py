"""Whether a training step's Python may run once, at capture, and be replayed from then on.

A replayed step runs none of its Python, which is safe when that Python does the same device work at every step.
:func:`check_step_code` reads the bytecode (``dis``) of the step method and of the Python it calls, and refuses
what could bring a changing value in: an argument other than ``self`` and the batch (``batch_idx``); ``self.x``
where ``x`` is a property or method of the training framework (``global_step``, ``trainer``, ``optimizers()``), a
mutable object, or cannot be resolved; an assignment to any attribute; a global or closure variable that is not
a constant, torch code or a plain function (read the same way, :data:`MAX_DEPTH` calls deep); builtins outside
:data:`SAFE_BUILTINS` (``print``, ``getattr``); imports of anything but :data:`SAFE_MODULES`; ``self`` handed to
another function. Submodules, parameters and buffers are allowed (the front-end compares their structure, modes,
scalar attributes and ``requires_grad`` before each replay, :class:`.whole_step.StepGuards`); numbers, strings, small containers of them
and tensors held by ``self`` are *watched* (:mod:`.watched`). A submodule's ``forward`` is not read: as for
per-layer graphs, the model's own code is checked at capture (host reads, hooks) and by its modes.

Code it cannot follow is refused, and the step gets per-layer graphs. It reads CPython 3.10-3.14 bytecode. Checking
what Python a captured region read before each replay is dynamo's guards (``torch._dynamo.guards``), here for the
few reads a training step makes.
"""

from __future__ import annotations

import dis
import inspect
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
import torch.nn as nn

from .bytecode import (CONSTANT_PROPERTIES, HOST_EFFECTS, SAFE_BUILTINS, SAFE_MODULES, framework_defined, loaded_name,
                       name_of, read_names, trusted)
from .watched import StepCodeReport, Watch, closure_value, comparable, global_value, immutable, self_attribute

MAX_DEPTH = 4  #: calls followed below the step method

class _Refused(Exception):  # why the step cannot be frozen
    pass


class _Reader:
    def __init__(self, owner: nn.Module, recorded: Sequence[str], framework: Sequence[str]) -> None:
        self.owner = owner
        self.recorded = set(recorded)
        self.framework = tuple(framework)
        self.watches: Dict[str, Watch] = {}
        self.prefix = ""  # the path of ``owner`` below the step's module while one of its methods is read
        self.functions: List[str] = []
        self.seen: Set[Any] = set()

    # ------------------------------------------------------------ functions
    def function(self, fn: Callable, *, self_name: Optional[str], refused_args: Sequence[str], depth: int) -> None:
        code = getattr(fn, "__code__", None)  # a decorated function is read as the wrapper it is
        if code is None:
            raise _Refused(f"calls {name_of(fn)}, which is not Python code that can be read")
        if code in self.seen:
            return
        if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
            raise _Refused(f"calls {name_of(fn)}, a generator or coroutine, whose steps are not followed")
        self.seen.add(code)
        self.functions.append(name_of(fn))
        defaults = list(getattr(fn, "__defaults__", None) or ()) + list((getattr(fn, "__kwdefaults__", None) or {}).values())
        if any(not immutable(d) and not trusted(d) for d in defaults):
            raise _Refused(f"{name_of(fn)} has a mutable default argument, which keeps state from call to call")
        cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
        closure = {name: cell.cell_contents for name, cell in cells.items()}
        self.code(code, fn, self_name=self_name, refused_args=set(refused_args), closure=closure, depth=depth,
                  cells=cells)

    def code(self, code: types.CodeType, fn: Callable, *, self_name: Optional[str], refused_args: Set[str],
             closure: Dict[str, Any], depth: int, cells: Dict[str, Any]) -> None:
        where = name_of(fn)
        ins = list(dis.get_instructions(code))
        for i, cur in enumerate(ins):
            op = cur.opname
            names = read_names(cur)
            if self_name is not None and self_name in names[:-1]:
                raise _Refused(f"{where} hands self to other code, whose reads of it are not followed")
            for name in names:
                if name in refused_args:
                    raise _Refused(f"{where} reads its argument {name!r}, which changes from step to step")
                if op in ("LOAD_DEREF", "LOAD_CLOSURE") and name in closure and name != self_name:
                    self.value(closure[name], f"{where} reads the closure variable {name!r}", depth)
                    cell = cells.get(name)
                    if cell is not None and comparable(closure[name]):
                        self.watches.setdefault(f"closure {name}", closure_value(cell, name))
            if self_name is not None and loaded_name(cur) == self_name:
                self.self_use(ins, i, where, depth)
            if op in ("LOAD_GLOBAL", "LOAD_NAME") and cur.argval == "super" and self_name is not None \
                    and "super" not in getattr(fn, "__globals__", {}):
                self.super_call(fn, ins, i, where, depth)
            elif op in ("LOAD_GLOBAL", "LOAD_NAME"):
                self.global_(fn, cur.argval, where, depth)
            elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                raise _Refused(f"{where} assigns the global {cur.argval!r}")
            elif op in ("STORE_ATTR", "DELETE_ATTR"):  # on self, a submodule or any object: state kept past the step
                raise _Refused(f"{where} assigns the attribute {cur.argval!r}, which would happen only at capture")
            elif op in ("STORE_DEREF", "DELETE_DEREF") and cur.argval in closure:  # nonlocal state of a closure
                raise _Refused(f"{where} assigns the closure variable {cur.argval!r}, which would happen only at "
                               "capture")
            elif op in ("LOAD_ATTR", "LOAD_METHOD") and cur.argval in HOST_EFFECTS:
                raise _Refused(f"{where} calls {cur.argval}(), whose effect on the host would happen only at capture")
            elif op == "IMPORT_NAME":
                module = str(cur.argval)
                if not any(module == m or module.startswith(m + ".") for m in SAFE_MODULES):
                    raise _Refused(f"{where} imports {module!r}")
        for const in code.co_consts:
            if isinstance(const, types.CodeType):  # comprehensions (before 3.12), lambdas, inner functions
                self.code(const, fn, self_name=self_name, refused_args=refused_args, closure=closure, depth=depth,
                          cells=cells)

    # ------------------------------------------------------------ self
    def self_use(self, ins: List[dis.Instruction], i: int, where: str, depth: int) -> None:
        nxt = ins[i + 1] if i + 1 < len(ins) else None
        prev = ins[i - 1] if i > 0 else None
        if nxt is not None and nxt.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            self.self_attr(str(nxt.argval), where, depth)
            child = self.owner._modules.get(str(nxt.argval))
            if child is not None:
                self.submodule_chain(child, f"self.{nxt.argval}", ins, i + 2, where, depth)
        elif nxt is not None and nxt.opname == "LOAD_SUPER_ATTR":
            return  # super().name: followed from the load of super (:meth:`super_call`)
        elif nxt is not None and nxt.opname in ("STORE_ATTR", "DELETE_ATTR"):
            raise _Refused(f"{where} assigns self.{nxt.argval}, which would happen only at capture")
        elif (prev is not None and prev.opname == "PUSH_NULL") or (nxt is not None and nxt.opname == "PUSH_NULL"):
            # self(...): the module's forward
            forward = type(self.owner).forward
            if not framework_defined(forward, self.framework) and not trusted(forward):
                self.follow(forward, "self.forward", where, depth, is_method=True)
        else:
            raise _Refused(f"{where} hands self to other code, whose reads of it are not followed")

    def submodule_chain(self, sub: nn.Module, path: str, ins: List[dis.Instruction], j: int, where: str,
                        depth: int) -> None:
        """``self.sub.x...``: submodules, parameters, buffers and torch's own methods (``parameters()``) may be read
        through a submodule, and its class's own methods are read like the step's (its attributes watched); its
        other state is refused."""
        while j < len(ins) and ins[j].opname in ("LOAD_ATTR", "LOAD_METHOD"):
            name = str(ins[j].argval)
            children, params, buffers = sub._modules, sub._parameters, sub._buffers
            if children.get(name) is not None:
                sub, path, j = children[name], f"{path}.{name}", j + 1
                continue
            if name in params or name in buffers:
                return
            try:
                static = inspect.getattr_static(sub, name)
            except AttributeError:
                static = None
            if isinstance(static, types.FunctionType) and name not in vars(sub) and not trusted(static) \
                    and not framework_defined(static, self.framework):
                saved = self.owner, self.prefix
                self.owner, self.prefix = sub, f"{path[len('self.'):]}."
                try:
                    self.follow(static, f"{path}.{name}", where, depth, is_method=True)
                finally:
                    self.owner, self.prefix = saved
                return
            if isinstance(static, types.FunctionType) and trusted(static) and name not in vars(sub):
                return
            raise _Refused(f"{where} reads {path}.{name}, state of a submodule that is not followed")

    def self_attr(self, name: str, where: str, depth: int) -> None:
        owner = self.owner
        if name in self.recorded:
            return
        if name in owner._modules:
            child = owner._modules[name]
            if child is not None and any(framework_defined(k, self.framework) for k in type(child).__mro__):
                raise _Refused(f"{where} calls self.{name}, a {type(child).__name__} whose Python state (counts, "
                               "cached results) would change only at capture")
            return
        if name in owner._parameters or name in owner._buffers:
            return
        try:
            static = inspect.getattr_static(owner, name)
        except AttributeError:
            raise _Refused(f"{where} reads self.{name}, which cannot be found without running the step") from None
        in_instance = name in vars(owner)
        if in_instance:
            value = vars(owner)[name]
            if isinstance(value, torch.Tensor) or comparable(value):
                self.watches.setdefault(self.prefix + name, self_attribute(owner, name, self.prefix + name))
                return
            if isinstance(value, nn.Module) or trusted(value):
                return
            if isinstance(value, types.FunctionType) and not framework_defined(value, self.framework):
                self.follow(value, f"self.{name}", where, depth, is_method=False)
                return
            raise _Refused(f"{where} reads self.{name}, a {type(value).__name__} whose contents may change between "
                           "steps")
        if isinstance(static, property):
            if name in CONSTANT_PROPERTIES:
                return
            if static.fget is None or framework_defined(static.fget, self.framework):
                raise _Refused(f"{where} reads self.{name}, which changes during training (its value at capture "
                               "would be replayed)")
            self.follow(static.fget, f"self.{name}", where, depth, is_method=True)
            return
        if isinstance(static, (staticmethod, classmethod)):
            static = static.__func__
        if isinstance(static, types.FunctionType):
            if trusted(static):
                return
            if framework_defined(static, self.framework):
                raise _Refused(f"{where} calls self.{name}(), which would run only at capture")
            self.follow(static, f"self.{name}", where, depth, is_method=True)
            return
        if immutable(static):
            self.watches.setdefault(self.prefix + name, self_attribute(owner, name, self.prefix + name))  # class-level
            return
        if trusted(static):
            return
        raise _Refused(f"{where} reads self.{name}, a {type(static).__name__} that may change between steps")

    def super_call(self, fn: Callable, ins: List[dis.Instruction], i: int, where: str, depth: int) -> None:
        """``super().name``: the method of the next class in the owner's MRO after the one defining ``fn``."""
        name = next((str(x.argval) for x in ins[i + 1:] if x.opname in ("LOAD_SUPER_ATTR", "LOAD_ATTR", "LOAD_METHOD")),
                    None)
        mro = type(self.owner).__mro__
        here = next((k for k, klass in enumerate(mro)
                     if any(getattr(v, "__code__", None) is fn.__code__ for v in vars(klass).values())), None)
        target = None
        if name is not None and here is not None:
            target = next((vars(k)[name] for k in mro[here + 1:] if name in vars(k)), None)
        if not isinstance(target, types.FunctionType):
            raise _Refused(f"{where} calls super().{name}, which cannot be found without running the step")
        if trusted(target):
            return
        if framework_defined(target, self.framework):
            raise _Refused(f"{where} calls super().{name}(), which would run only at capture")
        self.follow(target, f"super().{name}", where, depth, is_method=True)

    # ------------------------------------------------------------ globals
    def global_(self, fn: Callable, name: str, where: str, depth: int) -> None:
        globs = getattr(fn, "__globals__", {})
        if name in globs:
            self.value(globs[name], f"{where} reads the global {name!r}", depth)
            if comparable(globs[name]):
                self.watches.setdefault(f"global {name}", global_value(globs, name))
            return
        if name in SAFE_BUILTINS:
            return
        if name == "print":
            raise _Refused(f"{where} prints, which would happen only at capture")
        raise _Refused(f"{where} calls the builtin {name!r}")

    def value(self, value: Any, what: str, depth: int) -> None:
        if immutable(value) or trusted(value):
            return
        if isinstance(value, types.FunctionType):
            if framework_defined(value, self.framework):
                raise _Refused(f"{what}, a function of the training framework that is not followed")
            self.follow(value, value.__qualname__, what, depth, is_method=False)
            return
        if isinstance(value, nn.Module) or (isinstance(value, type) and issubclass(value, nn.Module)):
            return  # a module, or a module class built in the step: its forward is model code
        kind = "module" if isinstance(value, types.ModuleType) else type(value).__name__
        raise _Refused(f"{what}, a {kind} that may change between steps or is not followed")

    def follow(self, fn: Callable, label: str, where: str, depth: int, is_method: bool) -> None:
        if depth >= MAX_DEPTH:
            raise _Refused(f"{where} calls {label}, more than {MAX_DEPTH} calls deep")
        code = getattr(fn, "__code__", None)
        self_name = code.co_varnames[0] if is_method and code is not None and code.co_argcount else None
        self.function(fn, self_name=self_name, refused_args=(), depth=depth + 1)


def check_step_code(owner: nn.Module, method: str, *, free_args: int = 1, recorded: Sequence[str] = (),
                    framework: Sequence[str] = ()) -> StepCodeReport:
    """Read ``owner.<method>``'s bytecode and what it calls (module docstring).

    Args:
        owner: the module whose method is the training step (a LightningModule).
        method: its name (``"training_step"``).
        free_args: positional arguments after ``self`` the step may read (the batch); later ones are refused.
        recorded: methods of ``owner`` the front-end records and issues again after each replay (``log``).
        framework: module name prefixes of the training framework (``"lightning"``): its properties and methods
            read through ``self`` are refused, since they reflect the loop's state.

    Returns:
        a :class:`StepCodeReport`; ``refusal`` is set when the step cannot be frozen.
    """
    fn = getattr(type(owner), method, None)
    if not isinstance(fn, types.FunctionType):
        return StepCodeReport(refusal=f"{type(owner).__name__}.{method} is not a Python function")
    code = fn.__code__
    starred = bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    args = list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + starred])
    if not args:
        return StepCodeReport(refusal=f"{type(owner).__name__}.{method} takes no self")
    if code.co_flags & inspect.CO_VARARGS:  # the batch and batch_idx travel together in *args
        return StepCodeReport(refusal=f"{type(owner).__name__}.{method} takes *args, which may carry batch_idx")
    reader = _Reader(owner, recorded, framework)
    try:
        reader.function(fn, self_name=args[0], refused_args=args[1 + free_args:], depth=0)
    except _Refused as exc:
        return StepCodeReport(refusal=str(exc), functions=reader.functions)
    return StepCodeReport(watches=list(reader.watches.values()), functions=reader.functions)
