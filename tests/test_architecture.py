"""The package's layering, read off its imports: no cycles, mechanisms never import the layers above them.

Every ``import`` of a ``dist_trainer`` module is collected from the source (module level and inside
functions alike: a lazy import is still a dependency), then:

- the module graph has no cycle;
- ``parallel/``, ``planner/``, ``checkpoint/`` and the bottom modules never import ``train/`` or ``engines/``;
  ``planner/`` and ``layout_rules`` never import ``engines/``, ``train/`` or ``checkpoint/``;
- the mechanisms (``parallel/``, ``model*``, ``layout_rules``) and ``health/`` never import ``planner/``,
  ``train/`` or ``engines/``: the model's shape arithmetic they share with the planner is ``model_shape``'s;
- the ZeRO stages are written once (``config.ZERO_STAGES``);
- the torch-free modules (config, layout rules, the planner, the model families) load without torch;
- the model families sit at the bottom (``families/`` imports nothing of the package but itself), and no module
  outside ``families/`` writes a family's name (``model_type``) as a string: families are found by lookup;
- every regime ``layout_rules`` names has one engine, and the model builds modules under model_names' names;
- no module imports ``transformers`` (a test-only dependency);
- one Layout class, no method replaced on a live object, and context parallelism named only in its own folder
  and the files of its rules and its price (issue 22).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_trainer.layout_rules import REGIMES
from tests.helpers import ROOT

PACKAGE = ROOT / "dist_trainer"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """{module: dist_trainer modules it imports}, every import statement included."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from dist_trainer.x import y`: y is a submodule when one exists, else a name in x
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            for t in targets:
                if t.startswith("dist_trainer") and t in modules and t != name:
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_import_cycles() -> None:
    assert _cycles(import_graph()) == []


def test_mechanisms_never_import_the_layers_above() -> None:
    graph = import_graph()
    upper = ("dist_trainer.train", "dist_trainer.engines", "dist_trainer.experiments", "dist_trainer.cli",
             "dist_trainer.health")
    lower = ("dist_trainer.parallel", "dist_trainer.planner", "dist_trainer.checkpoint", "dist_trainer.layout_rules",
             "dist_trainer.config", "dist_trainer.model", "dist_trainer.model_names", "dist_trainer.optim",
             "dist_trainer.data", "dist_trainer.families")
    bad = sorted((m, t) for m, ts in graph.items() if _in(m, *lower) for t in ts if _in(t, *upper))
    assert bad == [], bad
    torch_free = ("dist_trainer.planner", "dist_trainer.layout_rules", "dist_trainer.families")
    bad = sorted((m, t) for m, ts in graph.items() if _in(m, *torch_free) for t in ts
                 if _in(t, "dist_trainer.checkpoint", "dist_trainer.model", "dist_trainer.optim", "dist_trainer.data")
                 and not _in(t, "dist_trainer.model_names"))
    assert bad == [], bad
    # the checkpoint package sits below the engines: parallel/ may not reach up into it either
    bad = sorted((m, t) for m, ts in graph.items() if _in(m, "dist_trainer.parallel") for t in ts
                 if _in(t, "dist_trainer.checkpoint"))
    assert bad == [], bad


def _mechanisms(graph: dict[str, set[str]]) -> list[str]:
    """parallel/, the model modules (model.py, model_*.py), layout_rules and health/."""
    return [m for m in graph if _in(m, "dist_trainer.parallel", "dist_trainer.layout_rules", "dist_trainer.health")
            or (m.count(".") == 1 and m.split(".")[1].startswith("model"))]


def test_mechanisms_and_health_never_import_the_planner_or_the_loop() -> None:
    graph = import_graph()
    mechanisms = _mechanisms(graph)
    assert {"dist_trainer.model", "dist_trainer.model_shape", "dist_trainer.parallel.tp.layers",
            "dist_trainer.health.attention", "dist_trainer.layout_rules"} <= set(mechanisms)  # the scan sees them
    bad = sorted((m, t) for m in mechanisms for t in graph[m]
                 if _in(t, "dist_trainer.planner", "dist_trainer.train", "dist_trainer.engines"))
    assert bad == [], bad


def _zero_stage_literals() -> list[str]:
    """Where a tuple or list of exactly the constants 0, 1, 2, 3 is written in the package's code (not its text)."""
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted(PACKAGE.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Tuple | ast.List) and len(node.elts) == 4
            and all(isinstance(e, ast.Constant) and e.value == i for i, e in enumerate(node.elts))]


def test_the_zero_stages_are_written_once() -> None:
    from dist_trainer.config import ZERO_STAGES

    found = _zero_stage_literals()
    assert len(found) == 1 and found[0].startswith("dist_trainer/config.py:"), found
    assert ZERO_STAGES == (0, 1, 2, 3)


def test_rules_and_planner_load_without_torch() -> None:
    code = ("import sys; import dist_trainer.layout_rules, dist_trainer.model_shape, dist_trainer.planner.search, "
            "dist_trainer.planner.emit, dist_trainer.families; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_one_engine_per_regime_and_the_model_uses_the_shared_names() -> None:
    from dist_trainer.config_load import model_config
    from dist_trainer.engines import ENGINES
    from dist_trainer.model import build_model
    from dist_trainer.model_names import (
        FIRST_STAGE_MODULES,
        LAST_STAGE_MODULES,
        LAST_STAGE_PARAMETERS,
        LAYER_MODULES,
        MLM_TRANSFORM_LEAVES,
        TAIL_NAMES,
    )
    from dist_trainer.model_shape import embedding_params, layer_params, tail_params

    assert set(ENGINES) == set(REGIMES)
    llama = model_config("tiny", activation="swiglu", tie_embeddings=False, n_token_types=2, pooler=True)
    bert = model_config("bert-base", n_layers=1, mlm_head=True)
    for cfg in (llama, bert):
        model = build_model(cfg, "meta")
        # attributes under these names (None where the config leaves them out), the others modules or parameters
        names = FIRST_STAGE_MODULES + LAST_STAGE_MODULES
        assert all(hasattr(model, n) for n in names)
        own = {name for name, _ in model.named_parameters(recurse=False)}
        assert {n for n in names if getattr(model, n) is not None} <= {n for n, _ in model.named_children()} | own
        leaves = {name.split(".")[-1] for name, m in model.layers[0].named_modules() if list(m.parameters(False))}
        # the leaves this config builds (gate_proj when gated, q/k norms with model.qk_norm, post norms when sandwich)
        assert leaves == {leaf for leaf in LAYER_MODULES if layer_params(cfg)[leaf]}
        # the planner's per-module counts are keyed by the same names
        assert tuple(embedding_params(cfg)) == FIRST_STAGE_MODULES
        assert tuple(layer_params(cfg)) == LAYER_MODULES
        assert tuple(tail_params(cfg)) == TAIL_NAMES
    # the MLM head: the transform's modules and the model's own parameter, under the shared names
    assert own == set(LAST_STAGE_PARAMETERS)
    assert {name for name, _ in model.mlm_transform.named_children()} == set(MLM_TRANSFORM_LEAVES)
    held = {name for name, m in model.named_modules() if name and list(m.parameters(False))} | own
    assert {n for n in TAIL_NAMES if tail_params(bert)[n]} <= held


def _imported_top_level(path: Path) -> set[str]:
    """Top-level packages a source file imports: import statements anywhere, and importlib.import_module /
    __import__ calls on a literal name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__"):
                names.add(node.args[0].value.split(".")[0])
    return names


def test_the_package_never_imports_transformers() -> None:
    """transformers is a test-only dependency (the dev extra): the tests check the model's maths against it, and a
    user's install of dist_trainer neither needs nor loads it."""
    assert "transformers" in _imported_top_level(ROOT / "tests" / "test_model_hf_maths.py")  # the reader sees it
    bad = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if {"transformers", "peft"} & _imported_top_level(p))
    assert bad == [], bad


def _class_definitions(name: str) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted(PACKAGE.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef) and node.name == name]


def test_one_layout_class_held_by_the_rules() -> None:
    """One description of a layout (issue 22): the planner, the pre-launch check, the mesh and the engines read the
    Layout of layout_rules, which checks its own fields as it is built."""
    from dist_trainer.layout_rules import Layout
    from dist_trainer.parallel.state import ParallelState
    from dist_trainer.planner.memory import Layout as PlannerLayout

    found = _class_definitions("Layout")
    assert len(found) == 1 and found[0].startswith("dist_trainer/layout_rules/layout.py:"), found
    assert PlannerLayout is Layout and ParallelState.single().layout == Layout()
    with pytest.raises(ValueError, match="sequence_parallel=true needs parallel.tp_size > 1"):
        Layout(sequence_parallel=True)


def test_no_method_is_replaced_on_a_live_object() -> None:
    """The parallel regimes swap submodules or fill the seams the model declares (model.head_input, full_logits,
    pool_input; MoE.exchange), so a reader of model.py sees what runs: types.MethodType nowhere in the package."""
    bad = sorted(f"{path.relative_to(ROOT)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr == "MethodType")
    assert bad == [], bad


# Issue 22: an axis is its name, its rules, its pricing and its mechanism; everything else follows from the name
# (the mesh, the replica group the updates reduce over, checkpoints' layout record, the plan check's traffic).
# Context parallelism is named by these files outside its own folder, parallel/cp/; a file added here is one
# more place the next axis would have to touch.
CP_FILES = {
    "config.py",  # parallel.cp_size / cp_mode, the fields a user sets
    "layout_rules/__init__.py", "layout_rules/layout.py", "layout_rules/check.py",  # the Layout field, MESH_AXES
    "layout_rules/cp.py",  # its rules (new)
    "parallel/parallelize.py",  # its step in the one order
    "planner/cp.py",  # its traffic and overlap (new)
    "planner/axes/cp.py", "planner/axes/__init__.py",  # its planner entry (issue 34) and its line in AXES
    "layout_rules/early.py",  # the world's rule on tp x pp x cp, asked as the search chooses
    "planner/axes/base.py", "planner/search.py", "planner/cli.py",  # the user's max_cp_size
    "planner/activations.py",  # its saved tensors
}
CP_NAMED = re.compile(r"\bcp\b|cp_size|cp_mode|dp_cp|context.parallel|parallel[/.]cp", re.IGNORECASE)


def test_context_parallelism_is_named_only_in_its_folder_and_its_rule_and_price_files() -> None:
    naming = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
              if not path.is_relative_to(PACKAGE / "parallel" / "cp") and CP_NAMED.search(path.read_text())}
    assert naming == CP_FILES, (sorted(naming - CP_FILES), sorted(CP_FILES - naming))


# The families issue 33 names (those not registered yet included, and those refused as another issue's)
ISSUE_33_FAMILIES = {"gpt2", "llama", "mistral", "mixtral", "bert", "t5", "qwen2", "qwen3", "gemma", "gemma2",
                     "gemma3_text", "phi3", "olmo2", "granite", "starcoder2", "gpt_neox", "qwen2_moe", "qwen3_moe",
                     "deepseek_v3"}


def test_the_families_sit_at_the_bottom_and_import_no_torch() -> None:
    """families/ maps config.json and tensor names as plain data: it imports nothing of the package but itself (so
    no torch, no model, no checkpoint code), and checkpoint/ reads and writes folders through it."""
    graph = import_graph()
    families = [m for m in graph if _in(m, "dist_trainer.families")]
    assert {"dist_trainer.families", "dist_trainer.families.base", "dist_trainer.families.recipe"} <= set(families)
    bad = sorted((m, t) for m in families for t in graph[m] if not _in(t, "dist_trainer.families"))
    assert bad == [], bad
    torch_users = sorted(str(p.relative_to(ROOT)) for p in (PACKAGE / "families").rglob("*.py")
                         if {"torch", "transformers", "safetensors", "numpy"} & _imported_top_level(p))
    assert torch_users == [], torch_users


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """(line, value) of each string constant in a source file, docstrings and f-string parts included."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_family_names_are_written_only_in_the_families_folder() -> None:
    """Issue 33: a family is one module of families/, found by lookup. No other module of the package writes a
    family's model_type as a string (a switch `if family == "llama"` needs one), so a new family touches its
    module, its registry line, its presets and its tests, and nothing else. Prose naming a family (a docstring or a
    message mentioning Llama) is not a name: only a string that is exactly a model_type counts. Presets
    (configs/models/), tests and docs name families freely."""
    from dist_trainer.families import FAMILIES

    names = ISSUE_33_FAMILIES | set(FAMILIES)
    scanned = [p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(PACKAGE / "families")]
    assert PACKAGE / "checkpoint" / "hf_export.py" in scanned  # the scan sees the folder readers and writers
    found = sorted(f"{p.relative_to(ROOT)}:{line}: {value!r}" for p in scanned for line, value in _string_constants(p)
                   if value in names)
    assert found == [], found
    # the scan would see one: a family's module names its model_type as a string
    assert any(value == "llama" for _, value in _string_constants(PACKAGE / "families" / "llama.py"))
