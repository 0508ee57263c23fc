"""Put first on a rank's PYTHONPATH by its launcher (trainer/agent/launcher.py rank_environment): every
Python process the rank's command starts runs this at startup (site.py imports `sitecustomize`),
with no change to the user's script. The rank's first one registers its stack dump on SIGUSR1
(trainer/agent/stack_dump.py); then the `sitecustomize` this one shadows, if any, runs as it would have.

Standard library only: the rank's interpreter may not be the one Lazarus is installed in.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _register() -> None:
    """Load trainer/agent/stack_dump.py beside this folder by its path and register the rank's dump."""
    path = os.path.join(os.path.dirname(_HERE), "stack_dump.py")
    spec = importlib.util.spec_from_file_location("_lazarus_stack_dump", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    module.register_from_environment(_HERE)


def _chain() -> None:
    """Run the `sitecustomize` found after this folder on sys.path (a distribution's, a virtual
    environment's), under its own name, as site.py would have without this one."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    try:
        _register()
    except Exception:  # noqa: BLE001 - a rank without the dump still trains; it is only never signalled
        pass
    _chain()
