"""The import graph follows DESIGN's layers, and the torch-free modules import without torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

import pitstop

SRC = os.path.dirname(pitstop.__file__)

SIDE = -1
# module prefix -> layer; the "side" package (policy) sits beside the stack
LAYERS: dict[str, float] = {
    "pitstop._version": 0, "pitstop.errors": 0, "pitstop.options": 0, "pitstop.types": 0,
    "pitstop.faults": 0, "pitstop.log": 0,
    "pitstop.format": 1,
    "pitstop.io": 2,
    "pitstop.storage": 3,
    "pitstop.ranks": 4, "pitstop.state": 4,
    "pitstop.engine": 5, "pitstop.levels": 5.5,
    "pitstop.policy": SIDE,
    "pitstop.manager": 6, "pitstop.oneshot": 6, "pitstop.profiler": 6, "pitstop.loop": 6,
    "pitstop.probe": 6,
    "pitstop.cli": 7, "pitstop.sim": 7, "pitstop.bench": 7, "pitstop.testing": 7,
    "pitstop.integrations": 7,
}  # fmt: skip
# which layers each may import (DESIGN.md's table); the side package only what applies its
# decisions: the engine (retention), the manager and loop (schedules), the tools and simulator
ALLOWED: dict[str, set[float]] = {
    "pitstop.format": {0}, "pitstop.io": {0}, "pitstop.storage": {0, 1, 2},
    "pitstop.ranks": {0, 1, 2, 3}, "pitstop.state": {0},
    "pitstop.engine": {0, 1, 2, 3, 4, SIDE}, "pitstop.levels": {0, 1, 2, 3, 4, 5, SIDE},
    "pitstop.policy": {0},
}  # fmt: skip
# modules that may import torch (DESIGN: policy, sim, format.manifest/checksum and the
# torch-free CLI commands must not)
TORCH_OK = ("pitstop.format.codec", "pitstop.state", "pitstop.ranks", "pitstop.engine", "pitstop.manager",
            "pitstop.levels.redundancy", "pitstop.levels.stack", "pitstop.levels.flush",
            "pitstop.levels.memory_peers",
            "pitstop.oneshot", "pitstop.loop", "pitstop.cli.demo", "pitstop.bench",
            "pitstop.testing.crash", "pitstop.testing.distributed",
            "pitstop.cli.convert", "pitstop.cli.compare", "pitstop.probe",
            "pitstop.cli.export_formats", "pitstop.cli.export_names",
            "pitstop.cli.dcp_safe", "pitstop.integrations")  # fmt: skip
TORCH_FREE = [
    "pitstop", "pitstop.errors", "pitstop.options", "pitstop.faults", "pitstop.format.manifest",
    "pitstop.format.checksum", "pitstop.format.names", "pitstop.io.parallel", "pitstop.io.arena",
    "pitstop.storage", "pitstop.engine.catalog", "pitstop.engine.verify", "pitstop.cli.main",
    "pitstop.format.objects", "pitstop.format.jsonsafe", "pitstop.engine.recovery",
    "pitstop.storage.retry", "pitstop.io.locks",
    "pitstop.testing", "pitstop.policy", "pitstop.sim", "pitstop.cli.simulate", "pitstop.profiler",
    "pitstop.cli.crashtest", "pitstop.cli.crashtest_causes",
]  # fmt: skip


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(SRC))[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def _layer_key(module: str) -> str | None:
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    return best


def _imports(path: str, module: str = "") -> list[tuple[str, int]]:
    """Every module ``path`` imports; relative imports are resolved against ``module``."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            out.append((target, node.lineno))
    return out


def _all_modules() -> list[tuple[str, str]]:
    found = []
    for dirpath, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found.append((_module_name(path), path))
    return sorted(found)


def test_every_module_has_a_layer() -> None:
    for module, _ in _all_modules():
        assert module == "pitstop" or _layer_key(module) is not None, (
            f"{module} is in no layer of the table"
        )


def test_imports_point_down_only() -> None:
    bad = []
    for module, path in _all_modules():
        src_key = _layer_key(module)
        if src_key is None:
            continue
        src_layer = LAYERS[src_key]
        for target, line in _imports(path, module):
            if target == "torch" or target.startswith("torch."):
                if not module.startswith(TORCH_OK):
                    bad.append(f"{module}:{line} imports torch")
                continue
            if not target.startswith("pitstop"):
                continue
            if target == "pitstop":
                if src_layer == 7:  # the demo and tools use the public API, like a user
                    continue
                bad.append(f"{module}:{line} imports the package root (import the module itself)")
                continue
            dst_key = _layer_key(target)
            if dst_key is None or dst_key == src_key or target.startswith(src_key + "."):
                continue
            dst_layer = LAYERS[dst_key]
            # below the table's explicit rows, a layer may use any lower one; layers 0, 6
            # and 7 are groups of siblings that may also use each other
            allowed = ALLOWED.get(src_key, {v for v in LAYERS.values() if 0 <= v < src_layer})
            if src_layer in (0, 6, 7) and src_key not in ALLOWED:
                allowed = allowed | {src_layer}
            if src_layer >= 6:
                allowed = allowed | {SIDE}
            if dst_layer not in allowed:
                bad.append(
                    f"{module}:{line} imports {target} (layer {dst_layer}) from layer {src_layer}"
                )
    assert not bad, "\n".join(bad)


def test_the_checker_catches_an_upward_edge(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "x.py")
    with open(path, "w") as f:
        f.write(
            "from pitstop.manager import CheckpointManager\nimport torch\nfrom ..engine import x\n"
        )
    assert _imports(path, "pitstop.io.x") == [
        ("pitstop.manager", 1),
        ("torch", 2),
        ("pitstop.engine", 3),
    ]
    assert LAYERS[_layer_key("pitstop.manager") or ""] > max(ALLOWED["pitstop.io"])
    assert SIDE not in ALLOWED["pitstop.state"]  # the side package is no free-for-all
    assert not any(m.startswith(("pitstop.sim", "pitstop.policy")) for m in TORCH_OK)


def test_torch_free_modules_import_and_run_without_torch(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "ck")
    pitstop.save(root, {"x": __import__("torch").ones(3)}, step=4)
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import importlib
        for name in {TORCH_FREE!r}:
            importlib.import_module(name)
        from pitstop.cli.main import main
        assert main(["ls", {root!r}]) == 0
        assert main(["verify", {root!r}]) == 0
        assert main(["inspect", {root!r}]) == 0
        assert main(["simulate", "--iter-secs", "1", "--stall-secs", "0.1", "--persist-secs", "1",
                     "--hours", "1", "--seeds", "1", "--jobs", "1", "--policy", "checkfreq"]) == 0
        assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("TORCH-FREE OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "TORCH-FREE OK" in out.stdout


@pytest.mark.parametrize(
    "module", ["pitstop", "pitstop.errors", "pitstop.testing", "pitstop.storage"]
)
def test_dunder_all_is_sorted_and_complete(module: str) -> None:
    mod = __import__(module, fromlist=["__all__"])
    names = list(mod.__all__)
    # isort style, as ruff enforces it: CONSTANTS, then Classes, then functions
    assert names == sorted(
        names, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n)
    )
    for name in names:
        assert getattr(mod, name) is not None
