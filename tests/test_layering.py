"""The layers of the code base, checked from its imports: no layer imports one above it, no module
imports itself through others, the plain layers stay free of torch and Ray, placement reads only
the plain layers of the serving system, and the runtime reads model shapes in one place."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top; a module may import its own layer's package and the layers below it.
LAYERS = [
    ["core"],  # configs, sampling params, requests, outputs, roles, errors
    ["scheduling", "parallel"],  # who runs and which blocks it holds; ranks, groups, sharding
    ["kv_transfer"],  # how KV crosses between instances
    ["kv_tier"],  # the shared prefix tier: a store of KV blocks per node
    ["kv_connector"],  # what a step moves into and out of the KV cache: swap, the prefix tier
    ["model_executor"],  # the model on one rank: loading, KV cache, attention, runner, sampler, worker
    ["engine"],  # one instance's engine, its roles and executor
    ["cluster"],  # instances as Ray actors, orchestrator, routing, failover, Cluster API
    ["v1"],  # the gRPC API's generated stubs
    ["entrypoints"],  # servers, clients, launch, the offline LLM
    ["benchmark"],  # distserve bench and profile
    ["cli"],  # the distserve command
]
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}
PLAIN = ("core", "scheduling")  # importable without torch, Ray or transformers
HEAVY = ("torch", "ray", "transformers")
# Fields of a Hugging Face config that fix a model's shape: read once, into ResolvedModel.shape.
SHAPE_FIELDS = {
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "n_layer",
    "n_head",
    "n_embd",
    "n_positions",
}
SHAPE_READER = "distserve/model_executor/model_loader.py"


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at the top, inside functions or for type checking only; for
    ``from package import name``, also ``package.name`` (a module, when it is one)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_cycles() -> list[list[str]]:
    """The sets of modules of distserve and placement that import one another in a circle
    (strongly connected components of the import graph with more than one module)."""
    paths = {_module_name(p): p for p in _modules("distserve") + _modules("placement")}
    graph = {name: sorted(set(_imports(path)) & paths.keys() - {name}) for name, path in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(name: str) -> None:  # Tarjan's algorithm
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = stack[stack.index(name) :]
            del stack[stack.index(name) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return cycles


def _layer(path: Path) -> str | None:
    """The layer package of a distserve module; None for the package's own __init__."""
    parts = path.relative_to(ROOT / "distserve").with_suffix("").parts
    if parts == ("__init__",):
        return None
    return parts[0]


def _runtime_modules() -> list[Path]:
    return [p for p in _modules("distserve") if _layer(p) is not None]


def test_every_module_belongs_to_a_layer():
    unknown = {str(p.relative_to(ROOT)) for p in _runtime_modules() if _layer(p) not in LEVEL}
    assert not unknown, f"modules outside the layers of LAYERS: {sorted(unknown)}"


@pytest.mark.parametrize("path", _runtime_modules(), ids=lambda p: str(p.relative_to(ROOT / "distserve")))
def test_no_layer_imports_a_higher_one(path):
    own = _layer(path)
    upward = []
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] != "distserve" or len(parts) < 2 or parts[1] == own:
            continue
        if parts[1] not in LEVEL or LEVEL[parts[1]] >= LEVEL[own]:
            upward.append(name)
    assert not upward, f"{own} (layer {LEVEL[own]}) imports {upward}"


def test_no_import_cycles():
    """A module that needs what imports it is one concept split in two, or a callback in disguise:
    type-checking imports count too."""
    assert not _import_cycles(), f"modules importing one another in a circle: {_import_cycles()}"


@pytest.mark.parametrize("package", PLAIN)
def test_plain_layers_need_neither_torch_nor_ray(package):
    for path in _modules(f"distserve/{package}"):
        heavy = [n for n in _imports(path) if n.split(".")[0] in HEAVY]
        assert not heavy, f"{path.relative_to(ROOT)} imports {heavy}"


PLACEMENT_MAY_IMPORT = ("distserve.core", "distserve.scheduling")  # the plain layers


def test_placement_imports_neither_the_serving_system_nor_torch_nor_ray():
    for path in _modules("placement"):
        bad = [
            n
            for n in _imports(path)
            if n.split(".")[0] in HEAVY
            or (n.split(".")[0] == "distserve" and not n.startswith(tuple(f"{p}." for p in PLACEMENT_MAY_IMPORT)))
        ]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_runtime_reads_model_shapes_in_one_place():
    readers = {}
    for path in _runtime_modules():
        fields = {
            node.attr
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in SHAPE_FIELDS
        }
        if fields:
            readers[str(path.relative_to(ROOT))] = sorted(fields)
    assert set(readers) <= {SHAPE_READER}, f"model shape read outside {SHAPE_READER}: {readers}"


# The only places KV movement calls another process: a rank's KV calls and the holder's release, the
# seam an instance implements (``kv_transfer/plan.py``). Nothing there looks an actor up by name.
KV_CALL_SEAM = {("KVEndpoint", "call"), ("KVSource", "release")}


def test_kv_transfer_calls_no_actor_but_through_its_own_seam():
    calls = []
    for path in _modules("distserve/kv_transfer"):
        tree = ast.parse(path.read_text())
        for cls in [None, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
            scope = tree if cls is None else cls
            for func in (n for n in ast.iter_child_nodes(scope) if isinstance(n, ast.FunctionDef)):
                where = (cls.name if cls else "", func.name)
                for node in ast.walk(func):
                    if isinstance(node, ast.Attribute) and node.attr in ("remote", "get_actor"):
                        calls.append((path.name, *where, node.attr))
    assert calls and all((cls, func) in KV_CALL_SEAM for _, cls, func, _ in calls), calls
    assert not [c for c in calls if c[-1] == "get_actor"]
