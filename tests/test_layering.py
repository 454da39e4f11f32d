"""The package's structure: the library never imports its command line, no two modules import
each other (directly or around a loop), at module level or inside functions, no import runs up
the layers of packages (LAYERS), and below lightrft/cli/ run configs are read by section, never
by flat flag name. Imports are read with `ast`, lazy facades resolved to the modules they load."""

import ast
import dataclasses
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightrft"


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def facade_homes(path: Path) -> dict[str, str]:
    """The names a lazy facade resolves to their home modules: a package `__init__` that defines
    `__getattr__` and a name -> "lightrft...." dict (`_HOMES`, `_EXPORTS`) that it imports from with
    `importlib`, read with `ast` (importing it would import the homes). A facade whose
    `__getattr__` imports its homes itself (`lightrft.agents`) is an ordinary lazy import, which the
    walk sees; anything else maps nothing."""
    tree = ast.parse(path.read_text())
    if not any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body):
        return {}
    homes = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            pairs = [(k.value, v.value) for k, v in zip(node.value.keys, node.value.values)
                     if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)]
            if pairs and len(pairs) == len(node.value.keys) and all(
                    isinstance(k, str) and isinstance(v, str) and v.startswith("lightrft.") for k, v in pairs):
                homes.update(pairs)
    return homes


def imports_of(path: Path, known: dict[str, Path], facades: dict[str, dict[str, str]] | None = None) -> set[str]:
    """The lightrft modules `path` imports anywhere in its body (lazy imports included). A name
    imported from a lazy facade (`from lightrft.builders import build_prompt_dataset`) is an import
    of its home (`lightrft.builders.datasets`), which is what runs when the name is first used;
    `facades` maps each facade package to its names' homes (`facade_homes`)."""
    facades = facades or {}

    def owner(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    def imported(module: str, name: str) -> str:
        if name in facades.get(module, {}):
            return owner(facades[module][name])
        return f"{module}.{name}" if f"{module}.{name}" in known else owner(module)

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names if alias.name.startswith("lightrft")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightrft"):
            found |= {imported(node.module, alias.name) for alias in node.names}
    return found - {"", "lightrft"}


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    facades = {name: homes for name, path in known.items() if path.name == "__init__.py"
               for homes in [facade_homes(path)] if homes}
    return {name: imports_of(path, known, facades) - {name} for name, path in known.items()}


def test_no_library_module_imports_the_command_line():
    graph = import_graph()
    offenders = {name: sorted(d for d in deps if d == "lightrft.cli" or d.startswith("lightrft.cli."))
                 for name, deps in graph.items() if not name.startswith("lightrft.cli")}
    assert {name: deps for name, deps in offenders.items() if deps} == {}
    # The walk sees the imports it should: the command line does import the builders.
    assert "lightrft.builders.ppo_run" in graph["lightrft.cli.train_ppo"]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop a depth-first walk of `graph` closes, as the path around it."""
    cycles = []
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep in graph and dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def test_no_import_cycles():
    assert find_cycles(import_graph()) == []


def plant(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """A lightrft package of `files` (path -> source) in tmp_path, walked in place of the real one."""
    for name, source in {"__init__.py": "", **files}.items():
        path = tmp_path / "lightrft" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "lightrft")


def test_a_planted_cycle_is_found(tmp_path, monkeypatch):
    """The walk itself: two modules importing each other inside functions form a cycle."""
    plant(tmp_path, monkeypatch, {"a.py": "def f():\n    from lightrft.b import g\n",
                                  "b.py": "def g():\n    import lightrft.a\n",
                                  "c.py": "from lightrft import a\n"})
    graph = import_graph()
    assert graph == {"lightrft": set(), "lightrft.a": {"lightrft.b"}, "lightrft.b": {"lightrft.a"},
                     "lightrft.c": {"lightrft.a"}}
    assert find_cycles(graph) == [["lightrft.a", "lightrft.b", "lightrft.a"]]


# ================================================================================== layers
# lightrft's packages from the bottom up, each layer with what it uses from those below. A module
# may import its own package and any package of a lower layer; a peer package (same layer) or a
# higher one is out of reach: what a lower layer needs is built above it and passed down.
LAYERS = (
    ("utils", "algorithms"),   # nothing of lightrft: helpers; pure torch math
    ("models", "rollout"),     # utils, algorithms: model wrappers, loading, tokenizers; rollout engines
    ("rewards",),              # + rollout: reward sources (an LLM judge generates with an engine)
    ("config",),               # + the registries of algorithms and rewards, whose names it checks
    ("strategy", "datasets"),  # + config: the first components that take a config section
    ("serving",),              # + models, rollout, datasets, strategy: the served policy and its records
    ("agents",),               # + serving's HTTP limits: workflows, episodes, tools
    ("experience",),           # + rewards, serving's records: sampling, scoring, building experience
    ("explorers",),            # + experience, strategy: explorer ranks on parts built for them
    ("trainer",),              # + experience, strategy, datasets: the trainers and their run services
    ("doctor",),               # + everything a run is made of: pre-flight checks
    ("builders",),             # + everything below: one builder per component
    ("cli",),                  # + builders: parsing and wiring
)

# Imports that still reach up, each with the reason it stands and what removes it.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def layer_of(module: str) -> tuple[str, int]:
    """(the package of a lightrft module, its layer in LAYERS)."""
    package = module.split(".")[1]
    for layer, packages in enumerate(LAYERS):
        if package in packages:
            return package, layer
    raise KeyError(f"package lightrft.{package} is in no layer: add it to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import of a peer package or a package of a higher layer."""
    found = []
    for name, deps in sorted(graph.items()):
        if name == "lightrft":
            continue
        package, layer = layer_of(name)
        for dep in sorted(deps):
            dep_package, dep_layer = layer_of(dep)
            if dep_package != package and dep_layer >= layer:
                found.append((name, dep))
    return found


def test_every_package_has_a_layer():
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    placed = [package for layer in LAYERS for package in layer]
    assert sorted(placed) == sorted(packages)


def test_no_import_runs_up_the_layers():
    found = upward_imports(import_graph())
    assert [edge for edge in found if edge not in ALLOWED_UPWARD] == []
    # An allowed import that is gone takes its entry with it.
    assert sorted(ALLOWED_UPWARD - set(found)) == []


def test_a_planted_cycle_through_a_facade_is_found(tmp_path, monkeypatch):
    """The walk resolves a lazy facade: `from lightrft.builders import build_data` is an import of
    the home its `_HOMES` names, so a loop through the facade closes."""
    plant(tmp_path, monkeypatch, {
        "builders/__init__.py": ('import importlib\n_HOMES = {"build_data": "lightrft.builders.data"}\n\n'
                                 'def __getattr__(name):\n'
                                 '    return getattr(importlib.import_module(_HOMES[name]), name)\n'),
        "builders/data.py": "from lightrft.datasets.rows import load\n\ndef build_data():\n    return load()\n",
        "datasets/__init__.py": "",
        "datasets/rows.py": "def load():\n    from lightrft.builders import build_data\n",
    })
    graph = import_graph()
    assert graph["lightrft.datasets.rows"] == {"lightrft.builders.data"}
    assert graph["lightrft.builders"] == set()
    assert find_cycles(graph) == [["lightrft.builders.data", "lightrft.datasets.rows", "lightrft.builders.data"]]


def test_a_planted_upward_import_is_found(tmp_path, monkeypatch):
    """The layer check itself: up (utils -> models), sideways (models <-> rollout, peers) and
    through a facade are found; down and within a package are not."""
    plant(tmp_path, monkeypatch, {
        "utils/__init__.py": "",
        "utils/files.py": "from lightrft.models import load\n",
        "utils/paths.py": "",
        "models/__init__.py": ('import importlib\n_EXPORTS = {"load": "lightrft.models.loading"}\n\n'
                               'def __getattr__(name):\n'
                               '    return getattr(importlib.import_module(_EXPORTS[name]), name)\n'),
        "models/loading.py": "import lightrft.utils.paths\n",
        "models/engine.py": "import lightrft.models.loading\n\ndef f():\n    from lightrft.rollout import engine\n",
        "rollout/__init__.py": "",
        "rollout/engine.py": "from lightrft.utils import paths\n",
        "experience/__init__.py": "",
        "experience/maker.py": "from lightrft.models import load\n",
        "trainer/__init__.py": "",
        "trainer/step.py": "from lightrft.experience.maker import make\n",
    })
    graph = import_graph()
    assert graph["lightrft.experience.maker"] == {"lightrft.models.loading"}
    assert upward_imports(graph) == [("lightrft.models.engine", "lightrft.rollout.engine"),
                                     ("lightrft.utils.files", "lightrft.models.loading")]


# ======================================================================= config access below cli/
# Names that hold a run config by convention when nothing annotates them otherwise.
RUN_CONFIG_NAMES = {"args", "config", "run_config"}


def run_config_vocabulary() -> tuple[set[str], set[str]]:
    """(the names a run config resolves flat through its sections, the run-config class names).
    Section names and the run config's own attributes (`to_dict`, `updates_per_step` ...) are
    not flat reads."""
    import lightrft.config.run as run

    classes = [c for c in vars(run).values() if isinstance(c, type) and issubclass(c, run.RunConfig)]
    flat, own = set(), set()
    for cls in classes:
        own |= set(dir(cls))
        for section in cls.sections().values():
            flat |= {f.name for f in dataclasses.fields(section)}
            flat |= {name for name in dir(section) if not name.startswith("_")}
    return flat - own, {c.__name__ for c in classes}


class FlatConfigReads(ast.NodeVisitor):
    """Finds `args.<flag>`, `self.args.<flag>`, `run.args.<flag>`, `config.<flag>` and
    `getattr/hasattr(<one of them>, "<flag>" or a computed name)`, where the object is a run
    config: a name or `self.` attribute annotated with a run-config class, or, without an
    annotation of another type (`Any` and `object` say nothing), named args / config /
    run_config (`x.args` and `x.run_config` always count). A `config: PretrainedConfig`, or
    `self.config = config` with `config: StrategyConfig`, is not one."""

    UNTYPED = {"Any", "object"}

    def __init__(self, flat: set[str], classes: set[str]):
        self.flat, self.classes = flat, classes
        self.scopes: list[dict[str, bool]] = []      # per function: name -> holds a run config
        self.attributes: list[dict[str, bool]] = []  # per class: self.<name> -> holds a run config
        self.found: list[tuple[int, str]] = []

    def typed(self, annotation) -> bool | None:
        """Whether an annotation names a run-config class (string annotations included); None
        when it names no type at all (`Any`, `object`)."""
        names = set()
        for node in ast.walk(annotation):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    node = ast.parse(node.value, mode="eval")
                except SyntaxError:
                    continue
                names |= {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                          if isinstance(n, (ast.Name, ast.Attribute))}
            elif isinstance(node, (ast.Name, ast.Attribute)):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
        if names & self.classes:
            return True
        return None if names <= self.UNTYPED | {"Optional", "typing"} else False

    def known(self, typed: dict) -> dict[str, bool]:
        return {name: value for name, value in typed.items() if value is not None}

    def parameters(self, function) -> dict[str, bool]:
        a = function.args
        names = {p.arg: self.typed(p.annotation) for p in a.posonlyargs + a.args + a.kwonlyargs if p.annotation}
        names.update({p.arg: False for p in (a.vararg, a.kwarg) if p is not None})
        for node in ast.walk(function):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names[node.target.id] = self.typed(node.annotation)
        return self.known(names)

    def class_attributes(self, cls: ast.ClassDef) -> dict[str, bool]:
        attributes = {n.target.id: self.typed(n.annotation) for n in cls.body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        for method in [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            params = self.parameters(method)
            for node in ast.walk(method):
                target, value = ((node.target, None) if isinstance(node, ast.AnnAssign) else
                                 (node.targets[0], node.value) if isinstance(node, ast.Assign) else (None, None))
                if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    continue
                if isinstance(node, ast.AnnAssign):
                    attributes[target.attr] = self.typed(node.annotation)
                elif isinstance(value, ast.Name) and value.id in params:
                    attributes.setdefault(target.attr, params[value.id])
        return self.known(attributes)

    def holds_run_config(self, node) -> bool:
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return node.id in RUN_CONFIG_NAMES
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                known = self.attributes[-1] if self.attributes else {}
                return known[node.attr] if node.attr in known else node.attr in RUN_CONFIG_NAMES
            return node.attr in ("args", "run_config")
        return False

    def visit_ClassDef(self, node):
        self.attributes.append(self.class_attributes(node))
        self.generic_visit(node)
        self.attributes.pop()

    def visit_FunctionDef(self, node):
        self.scopes.append(self.parameters(node))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node):
        if node.attr in self.flat and self.holds_run_config(node.value):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    def visit_Call(self, node):
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and self.holds_run_config(node.args[0])):
            name = node.args[1]
            if not isinstance(name, ast.Constant) or name.value in self.flat:
                self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def flat_config_reads(path: Path, flat: set[str], classes: set[str]) -> list[str]:
    visitor = FlatConfigReads(flat, classes)
    visitor.visit(ast.parse(path.read_text()))
    return [f"line {line}: {text}" for line, text in sorted(visitor.found)]


def test_no_flat_config_access_below_cli():
    """Below lightrft/cli/ a component reads its own section (`args.optim.train_batch_size`) or
    receives just the section it needs; flat names (`args.train_batch_size`) and
    `getattr(args, "flag", default)` hide which section a component depends on and which default
    applies."""
    flat, classes = run_config_vocabulary()
    assert {"seed", "train_batch_size", "eval_steps", "rollout_batch_size"} <= flat
    assert not {"optim", "distributed", "to_dict", "updates_per_step"} & flat
    root = PACKAGE.parent
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith("lightrft/cli/"):
            continue
        reads = flat_config_reads(path, flat, classes)
        if reads:
            offenders[name] = reads
    assert offenders == {}, "read the option through its section (args.<section>.<flag>) or pass the section"


def test_planted_flat_reads_are_found(tmp_path):
    """The walk itself: what counts as a run config, and what does not."""
    flat, classes = run_config_vocabulary()
    source = '''
import argparse

def train(args, run):
    a = args.seed                                  # 5: flat
    b = args.distributed.seed                      # section access
    c = getattr(args, "eval_steps", -1)            # 7: flat with a default
    d = run.args.micro_train_batch_size            # 8: flat through another object
    e = [getattr(args, name) for name in ("seed",)]  # 9: computed name
    f = hasattr(args, "optim")                     # a section name

def build(config: "PPORunConfig", hf_config, namespace: argparse.Namespace):
    g = config.rollout_batch_size                  # 13: annotated run config
    h = getattr(hf_config, "value_head_prefix", None)
    i = namespace.seed                             # an argparse namespace being converted

def load(config: PretrainedConfig, args: Any):
    return getattr(config, "value_head_prefix", None), args.reward_pretrain   # 18: Any says nothing

class Strategy:
    def __init__(self, config: StrategyConfig, args):
        self.config = config
        self.args = args

    def seed(self):
        return self.config.seed, self.args.seed     # 26: self.args is not typed otherwise

class Trainer:
    config: SFTRunConfig

    def fit(self, *args):
        return self.config.train_batch_size, args.count  # 32: typed on the class; *args is a tuple
'''
    path = tmp_path / "planted.py"
    path.write_text(source)
    assert flat_config_reads(path, flat, classes) == [
        "line 5: args.seed", "line 7: getattr(args, 'eval_steps', -1)", "line 8: run.args.micro_train_batch_size",
        "line 9: getattr(args, name)", "line 13: config.rollout_batch_size", "line 18: args.reward_pretrain", "line 26: self.args.seed",
        "line 32: self.config.train_batch_size"]
