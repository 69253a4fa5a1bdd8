"""The import structure: every import in the package (those inside functions too) points down the layers
below, the device side knows nothing of the host, the host/device contract imports only jax and numpy (and
the sampling arrays it carries), and nothing imports in a circle."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"jaxinfer": REPO / "jaxinfer", "jaxinfer.models": REPO / "models",
           "jaxinfer.pallas_kernels": REPO / "pallas_kernels", "jaxinfer.meshes": REPO / "meshes"}

# Lowest first; a module may import its own layer and those below it. Names are module-name prefixes.
LAYERS = [
    ["jaxinfer.config", "jaxinfer.mesh", "jaxinfer.sharding", "jaxinfer.distributed", "jaxinfer.checkpoint",
     "jaxinfer.sampling", "jaxinfer.step", "jaxinfer.tokenizer", "jaxinfer.collectives", "jaxinfer.quant",
     "jaxinfer.quant_formats"],
    ["jaxinfer.device", "jaxinfer.models", "jaxinfer.pallas_kernels", "jaxinfer.meshes"],
    ["jaxinfer.engine", "jaxinfer.converted"],
    ["jaxinfer.plan"],
    ["jaxinfer.llm", "jaxinfer.random_model", "jaxinfer.cli", "jaxinfer"],
    ["jaxinfer.serve", "jaxinfer.launch", "jaxinfer.convert", "jaxinfer.plan.__main__", "jaxinfer.plan.calibrate"],
    ["jaxinfer.bench"],
]
DEVICE = ("jaxinfer.step", "jaxinfer.device", "jaxinfer.models", "jaxinfer.pallas_kernels")
HOST_ONLY = ("jaxinfer.engine", "jaxinfer.plan", "jaxinfer.tokenizer", "jaxinfer.serve", "jaxinfer.bench",
             "jaxinfer.llm", "jaxinfer.launch", "jaxinfer.cli", "jaxinfer.random_model", "jaxinfer.converted",
             "jaxinfer.convert")


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__").removesuffix(".__main__")
            found.setdefault(name, path)
            if path.name == "__main__.py":
                found[f"{name}.__main__"] = path
    return found


MODULES = modules()


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imports(path: Path) -> set[str]:
    """The jaxinfer modules a file imports anywhere in it (`from a import b`: a.b where that is a module,
    else a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= submodules
            if len(submodules) < len(node.names):   # names from the module itself (a package's: its __init__)
                found.add(node.module)
    return {m for m in found if within(m, ["jaxinfer"])}


def layer(name: str) -> int:
    """The layer of the longest prefix naming it."""
    matches = [(len(p), i) for i, names in enumerate(LAYERS) for p in names if within(name, [p])]
    assert matches, f"{name} is in no layer: add it to LAYERS"
    return max(matches)[1]


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def test_every_module_has_a_layer_and_imports_point_down():
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
              for a, targets in GRAPH.items() for b in targets if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_the_device_side_imports_no_host_module():
    wrong = [f"{a} imports {b}" for a, targets in GRAPH.items() if within(a, DEVICE)
             for b in targets if within(b, HOST_ONLY)]
    assert not wrong, "\n".join(wrong)


def test_the_step_contract_imports_only_jax_numpy_and_the_sampling_arrays():
    tree = ast.parse(MODULES["jaxinfer.step"].read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= {"__future__", "jax", "numpy", "flax", "jaxinfer.sampling"}, roots


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, by a depth-first search for a back edge; None if there is none (the implicit
    import of a parent package by its children is not an edge: only the imports the files write)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for target in sorted(t for t in graph.get(name, ()) if t in graph and t != name):
            if state.get(target) == 1:
                chain = [*path, name]
                return [*chain[chain.index(target):], target]
            if target not in state and (cycle := visit(target, [*path, name])):
                return cycle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [])):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walker_sees_imports_inside_functions_and_circles(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef f():\n    from jaxinfer.engine.core import Engine\n    import jaxinfer.llm\n")
    assert imports(f) == {"jaxinfer.engine.core", "jaxinfer.llm"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
