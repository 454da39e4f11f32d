"""Loading a workflow file (`--workflow FILE.py[:Class]`): a lightrft `Workflow` subclass, or an
OpenRLHF agent file's `AgentInstance` (run by `OpenRLHFWorkflow`)."""

import inspect
from pathlib import Path

from lightrft.agents.openrlhf import OpenRLHFWorkflow
from lightrft.agents.workflow import Workflow
from lightrft.utils.pyfile import PythonFileError, import_python_file


def load_workflow(spec: str) -> Workflow:
    """The workflow named by `--workflow FILE.py[:Class]`: the named class, else the file's one
    `Workflow` subclass, else its OpenRLHF `AgentInstance` (wrapped by
    `lightrft.agents.openrlhf.OpenRLHFWorkflow`). Errors name the flag and what the file lacks."""
    path_text, _, class_name = spec.partition(".py:")
    path = Path(path_text if not class_name else path_text + ".py")
    if not path.is_file():
        raise ValueError(f"--workflow {spec}: no such file {path}")
    try:
        module = import_python_file(path, "lightrft_workflow", "--workflow file")
    except PythonFileError as err:
        raise ValueError(str(err)) from err.__cause__
    if class_name:
        cls = getattr(module, class_name, None)
        if not inspect.isclass(cls):
            raise ValueError(f"--workflow {spec}: {path} defines no class {class_name}")
    else:
        local = [obj for obj in vars(module).values()
                 if inspect.isclass(obj) and obj.__module__ == module.__name__]
        workflows = [obj for obj in local if issubclass(obj, Workflow)]
        if len(workflows) > 1:
            names = ", ".join(sorted(w.__name__ for w in workflows))
            raise ValueError(f"--workflow {spec}: {path} defines several workflows ({names}); name one as "
                             f"{path}:ClassName")
        cls = workflows[0] if workflows else getattr(module, "AgentInstance", None)
        if cls is None:
            raise ValueError(f"--workflow {spec}: {path} defines no Workflow subclass (lightrft.agents.Workflow) "
                             "and no OpenRLHF AgentInstance class")
    if issubclass(cls, Workflow):
        workflow = cls()
    elif hasattr(cls, "step"):
        workflow = OpenRLHFWorkflow(cls)
    else:
        raise ValueError(f"--workflow {spec}: {cls.__name__} is neither a lightrft Workflow subclass nor an OpenRLHF "
                         "AgentInstance (async reset/step)")
    workflow.source_file = str(path.resolve())
    return workflow
