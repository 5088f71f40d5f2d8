"""Load an example script (examples/NAME.py) as a module, as its tests call its functions."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    """examples/NAME.py, executed as the module `example_NAME` (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
