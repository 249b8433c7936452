"""Layering that holds at run time: the engine packages load torch only, and ``import cg_lightning`` still
registers the strategy with each Lightning package (``lightning.pytorch``, ``pytorch_lightning``), whichever is
imported first. Each case runs in an interpreter of its own (what an earlier test imported would hide a violation):
children forked, all at once on first use, from one process that imported torch only; each test reads its own."""

import ast
import importlib.util
import os
import sys
import textwrap

import pytest

from tests.helpers import ROOT

FRONT_ENDS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "omegaconf")
TORCH_ONLY = ("graphs", "ddp", "optim", "torch_compat")
TORCH_ONLY_MODULES = ("protocol.py", "phase.py", "option_checks.py", "collate.py", "main_grad_adds.py")


#: forks one child per case after importing torch (and nothing of the package or a front end), so each case is a
#: fresh interpreter as far as these tests can tell without paying torch's import again (about 4 s of CPU a case)
_ZYGOTE = """
import json, os, sys, traceback
import torch
folder, cases = sys.argv[1], json.loads(sys.stdin.read())
children = {}
for name, code in cases.items():
    pid = os.fork()
    if pid == 0:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            os.dup2(os.open(os.path.join(folder, name + suffix), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout, sys.stderr = os.fdopen(1, "w", buffering=1), os.fdopen(2, "w", buffering=1)
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    children[pid] = name
statuses = {}
while children:
    pid, status = os.wait()
    statuses[children.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps(statuses))
"""


class _Interpreters:
    """The module's cases, each run as a child of one process that imported torch only (:data:`_ZYGOTE`), all at
    once on first use."""

    def __init__(self) -> None:
        self.cases = {}
        self.statuses = None
        self.folder = None

    def add(self, name: str, code: str) -> None:
        self.cases[name] = textwrap.dedent(code)

    def output(self, name: str) -> str:
        if self.statuses is None:
            import json
            import subprocess
            import tempfile

            self.folder = tempfile.mkdtemp(prefix="layering-")
            done = subprocess.run([sys.executable, "-c", _ZYGOTE, self.folder], input=json.dumps(self.cases),
                                  cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            self.statuses = json.loads(done.stdout.strip().splitlines()[-1])
        read = lambda suffix: open(os.path.join(self.folder, name + suffix)).read()  # noqa: E731
        assert self.statuses[name] == 0, read(".err")[-3000:]
        return read(".out")


_INTERPRETERS = _Interpreters()


_LOADED = """
    import sys
    loaded = sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in {front_ends!r}))
    print("LOADED", loaded)
"""


def test_engine_packages_load_no_front_end_at_run_time():
    """``import cg_lightning.graphs, cg_lightning.ddp, cg_lightning.protocol`` (and every module inside the engine
    packages, the optimizer pieces and the torch compat module) loads none of Lightning, pytorch_lightning,
    Accelerate, OmegaConf."""
    out = _INTERPRETERS.output("engine")
    assert "LOADED []" in out, out


_INTERPRETERS.add("engine", textwrap.dedent("""
        import importlib, pkgutil
        import cg_lightning.graphs, cg_lightning.ddp, cg_lightning.protocol, cg_lightning.phase
        import cg_lightning.torch_compat, cg_lightning.optim, cg_lightning.option_checks, cg_lightning.collate
        for pkg in (cg_lightning.graphs, cg_lightning.ddp, cg_lightning.optim, cg_lightning.torch_compat):
            for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                importlib.import_module(info.name)
    """) + textwrap.dedent(_LOADED.format(front_ends=FRONT_ENDS)))


def test_engine_packages_import_no_front_end_anywhere():
    """Not even inside a function: ``graphs/``, ``ddp/`` and the torch-only modules they use name none of the
    front-end packages in any import statement."""
    paths = [os.path.join(ROOT, "cg_lightning", sub, name) for sub in TORCH_ONLY
             for name in sorted(os.listdir(os.path.join(ROOT, "cg_lightning", sub))) if name.endswith(".py")]
    paths += [os.path.join(ROOT, "cg_lightning", name) for name in TORCH_ONLY_MODULES]
    for path in paths:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for mod in mods:
                assert mod.split(".")[0] not in FRONT_ENDS, f"{os.path.relpath(path, ROOT)} imports {mod}"


HAS_PL = importlib.util.find_spec("pytorch_lightning") is not None
#: Lightning package -> the module of its strategy class
STRATEGY_MODULES = {"lightning.pytorch": "cg_lightning.trainer.strategy",
                    "pytorch_lightning": "cg_lightning.trainer.pytorch_lightning"}
INSTALLED = [p for p in STRATEGY_MODULES if p != "pytorch_lightning" or HAS_PL]
_PACKAGES = [
    pytest.param(package, module, id=package, marks=pytest.mark.skipif(
        package not in INSTALLED, reason="pytorch_lightning is not installed"))
    for package, module in STRATEGY_MODULES.items()
]

_TRAIN = textwrap.dedent("""
    from {package} import Trainer
    trainer = Trainer(strategy="cudagraph_ddp", accelerator="cpu", devices=1, logger=False)
    print("STRATEGY", type(trainer.strategy).__module__, type(trainer.strategy).__name__)
""")


for _package, _module in STRATEGY_MODULES.items():
    if _package in INSTALLED:
        _INTERPRETERS.add(f"cg-first-{_package}", textwrap.dedent(f"""
            import cg_lightning
            import sys
            assert {_package!r} not in sys.modules
        """) + _TRAIN.format(package=_package))
        _INTERPRETERS.add(f"lightning-first-{_package}", textwrap.dedent(f"""
            import {_package}
            import cg_lightning
        """) + _TRAIN.format(package=_package))
        _INTERPRETERS.add(f"module-first-{_package}",
                          f"import {_module}\n" + "".join(_TRAIN.format(package=p) for p in INSTALLED))


@pytest.mark.parametrize("package, module", _PACKAGES)
def test_import_cg_lightning_then_lightning_registers_the_strategy(package, module):
    out = _INTERPRETERS.output(f"cg-first-{package}")
    assert f"STRATEGY {module} CUDAGraphDDPStrategy" in out, out


@pytest.mark.parametrize("package, module", _PACKAGES)
def test_import_lightning_then_cg_lightning_registers_the_strategy(package, module):
    out = _INTERPRETERS.output(f"lightning-first-{package}")
    assert f"STRATEGY {module} CUDAGraphDDPStrategy" in out, out


@pytest.mark.parametrize("package, module", _PACKAGES)
def test_importing_a_strategy_module_first_registers_every_package(package, module):
    """A strategy module imports its Lightning package itself (and the ``pytorch_lightning`` one the shared body
    with ``lightning.pytorch``): each installed package gets the name, with its own class."""
    out = _INTERPRETERS.output(f"module-first-{package}")
    for p in INSTALLED:
        assert f"STRATEGY {STRATEGY_MODULES[p]} CUDAGraphDDPStrategy" in out, out


def test_public_names_resolve_lazily():
    out = _INTERPRETERS.output("public-names")
    assert "OK False False" in out, out


_INTERPRETERS.add("public-names", """
        import cg_lightning
        from cg_lightning import CUDAGraphDDPStrategy, make_graphed_callables, GraphOptions, DDPOptions
        from cg_lightning import checkpoint, is_graph_capturing, is_graph_warmup, CheckpointWithoutOutput
        import cg_lightning.graphs.callables as callables
        assert make_graphed_callables is callables.make_graphed_callables
        assert set(cg_lightning.__all__) <= set(dir(cg_lightning))
        for name in cg_lightning.__all__:
            getattr(cg_lightning, name)
        assert cg_lightning.callbacks.CUDAGraphCallback is not None
        from lightning.pytorch.strategies import DDPStrategy
        assert issubclass(CUDAGraphDDPStrategy, DDPStrategy)
        print("OK", is_graph_capturing(), is_graph_warmup())
    """)


#: the package's top-level modules: the torch-only base, the package's own entry points, and the two documented
#: import paths kept for Lightning users (``cg_lightning.pytorch_lightning``, ``cg_lightning.distributed_optimizer``)
TOP_LEVEL = set(TORCH_ONLY_MODULES) | {"__init__.py", "__main__.py", "errors.py", "options.py", "registration.py",
                                       "pytorch_lightning.py", "distributed_optimizer.py"}


def test_each_front_end_has_its_own_package_and_the_top_level_holds_the_base():
    """The Lightning Trainer's adapter lives in ``trainer/``, Accelerate's in ``accelerate/``; a new module at the top
    level must be torch-only base (listed above) or it belongs in a front end's package."""
    top = {n for n in os.listdir(os.path.join(ROOT, "cg_lightning")) if n.endswith(".py")}
    assert top == TOP_LEVEL, sorted(top ^ TOP_LEVEL)
    for shim in ("pytorch_lightning.py", "distributed_optimizer.py"):  # re-exports only
        tree = ast.parse(open(os.path.join(ROOT, "cg_lightning", shim)).read())
        assert all(isinstance(n, (ast.Expr, ast.ImportFrom, ast.Assign)) for n in tree.body), shim


def test_documented_import_paths_still_resolve():
    import cg_lightning
    from cg_lightning.distributed_optimizer import consolidate
    from cg_lightning.trainer.distributed_optimizer import consolidate as defined
    from cg_lightning.trainer.strategy import CUDAGraphDDPStrategy

    assert cg_lightning.CUDAGraphDDPStrategy is CUDAGraphDDPStrategy and consolidate is defined
    if HAS_PL:
        from cg_lightning.pytorch_lightning import CUDAGraphDDPStrategy as PLStrategy
        from cg_lightning.trainer.pytorch_lightning import CUDAGraphDDPStrategy as PLDefined

        assert PLStrategy is PLDefined


def test_the_graph_errors_live_in_one_module_that_imports_nothing():
    """Every ``...Error`` class of ``graphs/`` is defined in ``graphs/errors.py``, which imports no other module, so
    any part of ``graphs/`` (``segments/`` included) raises them without importing another part."""
    graphs = os.path.join(ROOT, "cg_lightning", "graphs")
    where = {}
    for folder, _, names in os.walk(graphs):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for node in ast.parse(open(path).read()).body:
                    if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                        where[node.name] = os.path.relpath(path, graphs)
    assert where and set(where.values()) == {"errors.py"}, where
    tree = ast.parse(open(os.path.join(graphs, "errors.py")).read())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_every_package_module_is_readable_in_one_sitting():
    """No module of the package is over 300 lines (a longer one holds more than one concept: split it)."""
    long = {}
    for folder, _, names in os.walk(os.path.join(ROOT, "cg_lightning")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    lines = sum(1 for _ in f)
                if lines > 300:
                    long[os.path.relpath(path, ROOT)] = lines
    assert not long, long
