"""The package's layering, read off its imports: no cycles, mechanisms never import the layers above them.

Every ``import`` of a ``dist_trainer`` module is collected from the source (module level and inside
functions alike: a lazy import is still a dependency), then:

- the module graph has no cycle;
- every folder of the package and every top-level module stands on one floor (``FLOORS``, bottom up), no import
  runs up a floor, and no two folders (or top-level modules) import each other (issue 34);
- the bottom floor's ``facts/`` (the torch-free facts: model shapes and names, fine-tuning sets, int8 sizes, span
  lengths, a mixture's sources, Hugging Face config and file arithmetic) imports nothing of the package but
  itself, and no torch;
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


# The floors, bottom up (issue 34): a module imports only from its own floor or below. A unit is a folder of the
# package or one of its top-level modules; every unit is placed, so a new one says where it stands.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("facts", "families"),  # torch-free facts; the model families (config.json and tensor names as plain data)
    ("config_fields", "config_moe", "config_mla", "config_model", "config", "config_load", "files",
     "optim_entries"),  # the run's config, read and
    # validated; the optimizers' entries (torch-free: what each takes, keeps and costs)
    ("layout_rules",),  # which layouts run, torch-free
    ("quant", "model_positions", "model_lora", "model_moe", "model_seq2seq", "model_blocks", "model",
     "model_recompute", "model_loss", "model_offload", "model_mla", "model_moe_routing", "model_moe_experts",
     "optim_lowbit"),  # one process's model and AdamW's low-bit states, pure torch
    # the token data; the mechanisms that cut the model over ranks; the optimizers (Muon's owners gather over them)
    ("data", "parallel", "optim_muon", "optim"),
    ("planner",),  # torch-free arithmetic over layouts; writes DeepSpeed JSON through parallel/zero/config.py
    ("checkpoint",),
    ("health",),
    ("engines",),
    ("train", "experiments", "testing"),
    ("cli", "torchrun", "accelerate_launch", "forward_signals"),
)
FLOOR_OF = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}


def _unit(module: str) -> str:
    """The folder of the package a module is in, or the top-level module it is (``dist_trainer.facts.span`` ->
    ``facts``, ``dist_trainer.config`` -> ``config``)."""
    return module.split(".")[1]


def _unit_graph() -> dict[str, set[str]]:
    """{unit: the other units it imports}, the package's root (empty) left out."""
    units: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module != "dist_trainer":
            units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if t != "dist_trainer")
    return {u: targets - {u} for u, targets in units.items()}


def test_every_folder_and_top_level_module_stands_on_a_floor() -> None:
    units = set(_unit_graph())
    assert units == set(FLOOR_OF), (sorted(units - set(FLOOR_OF)), sorted(set(FLOOR_OF) - units))


def test_no_import_runs_up_a_floor() -> None:
    graph = import_graph()
    assert "dist_trainer.facts.model_shape" in graph["dist_trainer.config_model"]  # the scan sees the floor's users
    bad = sorted((m, t) for m, ts in graph.items() if m != "dist_trainer" for t in ts
                 if FLOOR_OF[_unit(t)] > FLOOR_OF[_unit(m)])
    assert bad == [], bad


def test_no_two_folders_import_each_other() -> None:
    units = _unit_graph()
    assert "engines" in units["train"]  # the scan sees imports between folders
    both = sorted((a, b) for a, targets in units.items() for b in targets if a < b and a in units.get(b, ()))
    assert both == [], both


def test_the_facts_sit_at_the_bottom_and_import_no_torch() -> None:
    """facts/ holds what every layer reads and none needs torch for: it imports nothing of the package but itself,
    and neither torch nor numpy, so the config, the layout rules and the planner load without them."""
    graph = import_graph()
    facts = [m for m in graph if _in(m, "dist_trainer.facts")]
    assert {"dist_trainer.facts.model_shape", "dist_trainer.facts.quant_sizes", "dist_trainer.facts.span"} <= \
        set(facts)
    bad = sorted((m, t) for m in facts for t in graph[m] if not _in(t, "dist_trainer.facts"))
    assert bad == [], bad
    heavy = sorted(str(p.relative_to(ROOT)) for p in (PACKAGE / "facts").rglob("*.py")
                   if {"torch", "numpy", "safetensors", "deepspeed", "yaml"} & _imported_top_level(p))
    assert heavy == [], heavy


def test_mechanisms_never_import_the_layers_above() -> None:
    graph = import_graph()
    upper = ("dist_trainer.train", "dist_trainer.engines", "dist_trainer.experiments", "dist_trainer.cli",
             "dist_trainer.health")
    lower = ("dist_trainer.parallel", "dist_trainer.planner", "dist_trainer.checkpoint", "dist_trainer.layout_rules",
             "dist_trainer.config", "dist_trainer.model", "dist_trainer.facts.model_names", "dist_trainer.optim",
             "dist_trainer.data", "dist_trainer.families")
    bad = sorted((m, t) for m, ts in graph.items() if _in(m, *lower) for t in ts if _in(t, *upper))
    assert bad == [], bad
    torch_free = ("dist_trainer.planner", "dist_trainer.layout_rules", "dist_trainer.families")
    bad = sorted((m, t) for m, ts in graph.items() if _in(m, *torch_free) for t in ts
                 if _in(t, "dist_trainer.checkpoint", "dist_trainer.model", "dist_trainer.optim", "dist_trainer.data")
                 and not _in(t, "dist_trainer.facts.model_names"))
    assert bad == [], bad
    # the checkpoint package sits below the engines: parallel/ may not reach up into it either
    bad = sorted((m, t) for m, ts in graph.items() if _in(m, "dist_trainer.parallel") for t in ts
                 if _in(t, "dist_trainer.checkpoint"))
    assert bad == [], bad


def _mechanisms(graph: dict[str, set[str]]) -> list[str]:
    """parallel/, the model modules (model.py, model_*.py), layout_rules and health/."""
    return [m for m in graph if _in(m, "dist_trainer.parallel", "dist_trainer.layout_rules", "dist_trainer.health",
                                    "dist_trainer.facts")
            or (m.count(".") == 1 and m.split(".")[1].startswith("model"))]


def test_mechanisms_and_health_never_import_the_planner_or_the_loop() -> None:
    graph = import_graph()
    mechanisms = _mechanisms(graph)
    assert {"dist_trainer.model", "dist_trainer.facts.model_shape", "dist_trainer.parallel.tp.layers",
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
    code = ("import sys; import dist_trainer.layout_rules, dist_trainer.facts.model_shape, "
            "dist_trainer.planner.search, dist_trainer.planner.emit, dist_trainer.families; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_one_engine_per_regime_and_the_model_uses_the_shared_names() -> None:
    from dist_trainer.config_load import model_config
    from dist_trainer.engines import ENGINES
    from dist_trainer.facts.model_names import (
        FIRST_STAGE_MODULES,
        LAST_STAGE_MODULES,
        LAST_STAGE_PARAMETERS,
        LAYER_MODULES,
        MLM_TRANSFORM_LEAVES,
        TAIL_NAMES,
    )
    from dist_trainer.facts.model_shape import embedding_params, layer_params, tail_params
    from dist_trainer.model import build_model

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


def test_one_pre_launch_check_of_a_layout() -> None:
    """One function named check_layout (issue 34: there were two, three calls deep): the rules of a run config's
    layout, in layout_rules; the trainer's pre-launch function (train/check.resolve_launch) asks it."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted(PACKAGE.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef) and node.name == "check_layout"]
    assert len(found) == 1 and found[0].startswith("dist_trainer/layout_rules/check.py:"), found


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
    "planner/activation_spec.py", "planner/activations.py",  # its saved tensors: the spec's fields, the layers'
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


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _words(node: ast.AST, docstrings: set[int]) -> list[str]:
    """The names a node writes in code: a string (not a docstring), an identifier, an attribute, an import."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        return [node.value]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return [node.name, node.asname or ""]
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return [node.name]
    return []


def test_optimizer_names_stay_out_of_the_engines_and_checkpoints() -> None:
    """Adding an optimizer is one entry (``optim_entries.OPTIMIZERS``): the engines and the checkpoint code never
    write an optimizer's name (string, identifier or import), so none of them asks which optimizer runs."""
    from dist_trainer.optim_entries import OPTIMIZERS

    found = []
    for path in sorted([*(PACKAGE / "engines").rglob("*.py"), *(PACKAGE / "checkpoint").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        found += [f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {word}" for node in ast.walk(tree)
                  for word in _words(node, docstrings) if any(name in word.lower() for name in OPTIMIZERS)]
    assert len(OPTIMIZERS) >= 3 and found == [], found
