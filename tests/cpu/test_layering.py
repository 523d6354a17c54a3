"""The layering DESIGN.md asks for, checked: the router core and the simulator import no Ray, no
torch and nothing of `actors/`, and the router core imports only the policies and itself."""

import ast
import subprocess
import sys
from pathlib import Path

import stepserve.routing

ROUTING = Path(stepserve.routing.__file__).parent


def test_simulator_and_router_core_import_no_ray_torch_or_actors():
    code = ("import sys, stepserve.routing.core, stepserve.load_tests.sim.simulator\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch') "
            "or m.startswith('stepserve.actors')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_router_core_imports_only_policies_and_itself():
    for path in ROUTING.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stepserve"):
                assert node.module.startswith(("stepserve.policies", "stepserve.routing")), (path.name, node.module)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("stepserve.") or alias.name.startswith(
                        ("stepserve.policies", "stepserve.routing")), (path.name, alias.name)
