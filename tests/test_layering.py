"""The package's structure: the library never imports its command line, no two modules import
each other (directly or around a loop), at module level or inside functions, and below
lightrft/cli/ run configs are read by section, never by flat flag name."""

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


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The lightrft modules `path` imports anywhere in its body (lazy imports included)."""
    def owner(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names if alias.name.startswith("lightrft")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightrft"):
            found.add(owner(node.module))
            found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known}
    return found - {"", "lightrft"}


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


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


def test_a_planted_cycle_is_found(tmp_path, monkeypatch):
    """The walk itself: two modules importing each other inside functions form a cycle."""
    (tmp_path / "lightrft").mkdir()
    (tmp_path / "lightrft" / "__init__.py").write_text("")
    (tmp_path / "lightrft" / "a.py").write_text("def f():\n    from lightrft.b import g\n")
    (tmp_path / "lightrft" / "b.py").write_text("def g():\n    import lightrft.a\n")
    (tmp_path / "lightrft" / "c.py").write_text("from lightrft import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "lightrft")
    graph = import_graph()
    assert graph == {"lightrft": set(), "lightrft.a": {"lightrft.b"}, "lightrft.b": {"lightrft.a"},
                     "lightrft.c": {"lightrft.a"}}
    assert find_cycles(graph) == [["lightrft.a", "lightrft.b", "lightrft.a"]]


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
