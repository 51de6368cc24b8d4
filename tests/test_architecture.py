"""The package's layout is its architecture: who may import whom.

Read from the source (every import statement, including those inside functions), not from
what happens to be loaded: the serving path (`engine`, `core`, `worker`, `model`, the public
modules and `kernels`) never imports the book's instruments, the course tooling or training;
`kernels` imports nothing of minillm; the layers import downwards only; nothing imports in a
circle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = ("minillm", "minillm.llm", "minillm.sampling_params", "minillm.outputs")
SERVING = ("minillm.engine", "minillm.core", "minillm.worker", "minillm.model", "kernels")
SERVING += ("minillm.distributed",)
OFF_THE_SERVING_PATH = ("minillm.lab", "minillm.course", "minillm.training", "minillm.cli")
# a layer imports only what is listed for it (besides itself)
LAYERS = {
    "minillm.core": ("minillm.sampling_params", "minillm.outputs", "minillm.lora"),
    "minillm.model": ("kernels", "minillm.lora"),
    "minillm.worker": ("minillm.core", "minillm.model", "minillm.sampling_params", "kernels")
    + ("minillm.outputs",),
    "minillm.distributed": ("minillm.core", "minillm.worker", "minillm.model", "kernels")
    + ("minillm.outputs", "minillm.sampling_params"),
    "minillm.spec": ("minillm.core", "minillm.worker", "minillm.model", "minillm.outputs")
    + ("minillm.sampling_params", "kernels"),
    # constrained decoding: compiled on the tokenizer's vocabulary; the sampler applies it
    "minillm.structured": ("minillm.model", "minillm.sampling_params"),
    "minillm.engine": ("minillm.core", "minillm.worker", "minillm.model", "minillm.outputs")
    + ("minillm.structured",)
    + ("minillm.sampling_params", "minillm.distributed", "minillm.spec", "minillm.lora"),
    # the HTTP server: the engine and what it hands back, never the book's instruments
    "minillm.serve": ("minillm.engine", "minillm.core", "minillm.model", "minillm.outputs")
    + ("minillm.lora",)
    + ("minillm.sampling_params", "minillm.llm")
    # response_format mapped onto constrained decoding; the vocabulary's longest token
    + ("minillm.structured",),
    # LoRARequest (vLLM's vllm.lora.request): a plain value every layer may carry
    "minillm.lora": (),
    # what the engine hands back (RequestOutput, RequestMetrics): plain values every layer may
    # carry, so they import nothing of the engine
    "minillm.outputs": (),
    "kernels": (),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, pathlib.Path]:
    files = [*ROOT.glob("minillm/**/*.py"), *ROOT.glob("kernels/**/*.py")]
    return {module_name(path): path for path in files}


MODULES = source_modules()


def imports_of(name: str) -> set[str]:
    """The minillm and kernels modules that module `name` imports, anywhere in its code."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # `from package import module` imports the module
            targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = targets or [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]  # `import a.b.c` of a name inside a module
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_layout_has_the_layers_of_the_design():
    for package in (*SERVING, *OFF_THE_SERVING_PATH, "minillm.bundled"):
        assert (ROOT / package.replace(".", "/")).is_dir(), package
    top_level = {p.name for p in (ROOT / "minillm").glob("*.py")}
    assert top_level == {"__init__.py", "llm.py", "sampling_params.py", "outputs.py"}


def test_the_serving_path_never_imports_the_book_the_course_or_training():
    offenders = [
        (name, target)
        for name, targets in GRAPH.items()
        if within(name, SERVING + PUBLIC[1:]) or name == "minillm"
        for target in targets
        if within(target, OFF_THE_SERVING_PATH)
    ]
    assert offenders == []


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(layer):
    allowed = (layer, *LAYERS[layer])
    offenders = [
        (name, target)
        for name, targets in GRAPH.items()
        if within(name, (layer,))
        for target in targets
        if not within(target, allowed)
    ]
    assert offenders == []


def test_kernels_import_nothing_of_minillm():
    assert [
        (n, t)
        for n, ts in GRAPH.items()
        if within(n, ("kernels",))
        for t in ts
        if t.startswith("minillm")
    ] == []


def test_the_model_runner_gets_its_blocks_from_the_scheduler_output():
    assert "minillm.core.kv_cache_manager" not in GRAPH["minillm.worker.model_runner"]
    assert "minillm.core.block_pool" not in GRAPH["minillm.worker.model_runner"]


def test_scheduling_state_holds_no_tensors():
    for name, path in MODULES.items():
        if within(name, ("minillm.core",)):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            imported = {
                alias.name.split(".")[0]
                for node in ast.walk(tree)
                if isinstance(node, ast.Import)
                for alias in node.names
            } | {
                (node.module or "").split(".")[0]
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)
            }
            assert "torch" not in imported, name


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the cycles of the graph, as its components of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return components


def test_no_module_imports_in_a_circle():
    assert strongly_connected(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_reader_sees_imports_inside_functions():
    # minillm.model.attention imports its backends by name; the CLI imports its subcommands
    # by name; but the lazy import of the measurement in minillm.lab is a real import
    assert "minillm.model.tokenizer" in GRAPH["minillm.model.loader"]
    assert any(t.startswith("minillm.") for t in GRAPH["minillm.lab.kernel_bench"])


# packages the serving path may import: the runtime dependencies in pyproject.toml, and the
# optional extra that fetches checkpoints from the Hugging Face Hub (imported only when asked)
RUNTIME_PACKAGES = {"torch", "triton", "numpy", "safetensors", "tokenizers", "tqdm"}
OPTIONAL_PACKAGES = {"huggingface_hub"}


def third_party_imports(path: pathlib.Path) -> set[str]:
    import sys

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"minillm", "kernels", "__future__"}


def test_the_engine_installs_with_its_runtime_dependencies_alone():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    declared = {
        d.split(">")[0].split("=")[0].split(";")[0].strip()
        for d in pyproject["project"]["dependencies"]
    }
    assert declared == RUNTIME_PACKAGES
    used = {
        name: third_party_imports(path)
        for name, path in MODULES.items()
        if within(name, SERVING + PUBLIC[1:]) or name == "minillm"
    }
    extra = {n: sorted(i - RUNTIME_PACKAGES - OPTIONAL_PACKAGES) for n, i in used.items()}
    assert {n: i for n, i in extra.items() if i} == {}


def test_the_public_values_load_no_compiler():
    # SamplingParams compiles a constraint only when a request has one, so importing the
    # public value types loads neither the grammar compilers nor the engine
    import subprocess
    import sys

    code = (
        "import sys, minillm.sampling_params, minillm.outputs; "
        "print(sorted(m for m in sys.modules if m.startswith(('minillm.structured', "
        "'minillm.core', 'minillm.engine'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"
