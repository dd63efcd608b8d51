"""The names ``pitstop export`` writes: module keys without the prefixes of wrappers, and
optimizer state keyed by parameter name, both read from the checkpoint's objects tree.

A module wrapped by DDP (``module.``) or torch.compile (``_orig_mod.``) saves its keys with
the wrapper's prefix; the tools an export is for expect the plain model's names (DCP's
``get_state_dict`` strips them too). ``optimizer.state_dict()`` keys its state by integer
id; DCP's ``get_state_dict`` keys it by the parameter's fully qualified name. The saved tree
says which stored tensor each id is (``params`` of an optimizer's stateful node, written
since objects format 3); older checkpoints have only the ``param_names`` that torch >= 2.5
optimizers built from ``named_parameters()`` keep in their param groups, and otherwise keep
integer ids with a note.

Call sequence (the CLI's thread, ``run_export``, on the value that ``CheckpointManager.load``
built from the same tree; both change the value in place)::

    found = find_names(tree)
    strip_wrappers_in(value, found)               # every format
    notes = name_optimizers(value, found)         # --to dcp: notes to print
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from pitstop.state.keys import strip_wrappers, unescape_key
from pitstop.state.tree import children, node_kind

__all__ = ["Found", "find_names", "name_optimizers", "strip_wrappers_in"]

Path = tuple[Any, ...]
"""The keys and list indices from the state's top level down to a value."""


@dataclass
class Found:
    """What the tree says about names: ``renames`` of each Stateful's state dict (typed path
    -> saved key -> plain key; empty where stripping would make two keys one), the
    ``optimizers`` (typed path, key path, the stored key of each parameter id or None when
    the tree does not record them), and the ``owner`` of each stored tensor (key path and
    typed path of the dict that holds it first, and its key there)."""

    renames: dict[Path, dict[Any, str]] = field(default_factory=dict)
    optimizers: list[tuple[Path, str, list[str | None] | None]] = field(default_factory=list)
    owner: dict[str, tuple[str, Path, Any]] = field(default_factory=dict)


def find_names(tree: Any) -> Found:
    """Walk a validated tree once (iteratively) and collect what :class:`Found` holds."""
    found = Found()
    stack: list[tuple[Any, str, Path]] = [(tree, "", ())]
    while stack:
        node, key, path = stack.pop()
        kind = node_kind(node)
        if kind == "stateful":
            state = node["state"]
            if _is_optimizer_node(state):
                found.optimizers.append((path, key, node.get("params")))
            elif node_kind(state) == "dict":
                found.renames[path] = _plain_keys([k for k, _ in state["dict"]])
        elif kind == "dict":
            for k, child in node["dict"]:
                if node_kind(child) == "tensor" and child["tensor"] not in found.owner:
                    found.owner[child["tensor"]] = (key, path, k)
            if _is_optimizer_node(node) and not any(p == path for p, _, _ in found.optimizers):
                found.optimizers.append((path, key, None))  # an imported optimizer state dict
        kids = children(node, kind, key)
        for k, child_key, child in reversed(kids):
            stack.append((child, child_key, path if kind == "stateful" else (*path, k)))
    return found


def _is_optimizer_node(node: Any) -> bool:
    if node_kind(node) != "dict":
        return False
    return {k for k, _ in node["dict"]} >= {"state", "param_groups"}


def _plain_keys(keys: list[Any]) -> dict[Any, str]:
    """Saved key -> key without wrapper prefixes, for the keys that change; empty if two keys
    would become one."""
    plain = {k: strip_wrappers(k) for k in keys if isinstance(k, str)}
    if len(set(plain.values())) != len(plain):
        return {}
    return {k: v for k, v in plain.items() if v != k}


def _at(value: Any, path: Path) -> Any:
    """The value at ``path``, or None if ``value`` has nothing there (e.g. not ``--only``)."""
    for k in path:
        try:
            value = value[k]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def strip_wrappers_in(value: Any, found: Found) -> None:
    """Rename the keys of every Stateful's state dict (and of its ``_metadata``) to plain
    names, in place, keeping their order."""
    for path, renames in found.renames.items():
        sd = _at(value, path)
        if not renames or not isinstance(sd, MutableMapping):
            continue
        items = list(sd.items())
        sd.clear()
        sd.update((renames.get(k, k), v) for k, v in items)
        meta = getattr(sd, "_metadata", None)
        if isinstance(meta, MutableMapping):  # module prefixes: "_orig_mod.fc" -> "fc"
            entries = list(meta.items())
            meta.clear()
            meta.update((k, v) for k, v in entries if _plain_prefix(k) == k)
            meta.update((_plain_prefix(k), v) for k, v in entries if _plain_prefix(k) != k)


def _plain_prefix(prefix: Any) -> Any:
    """A ``_metadata`` key (a module's prefix, without its trailing dot) made plain."""
    if not isinstance(prefix, str):
        return prefix
    return strip_wrappers(prefix + ".").removesuffix(".") if prefix else prefix


def name_optimizers(value: Any, found: Found) -> list[str]:
    """Key the state and param groups' ``params`` of every optimizer state dict in ``value`` by
    parameter name, as ``torch.distributed.checkpoint.state_dict.get_state_dict`` does; a note
    for each one whose names are unknown (it keeps integer ids) or guessed."""
    notes: list[str] = []
    for path, key, stored in found.optimizers:
        sd = _at(value, path)
        if not isinstance(sd, MutableMapping):
            continue
        names, why = _names(sd, stored, found)
        if names is None:
            notes.append(f"note: optimizer state at {key!r} keeps integer parameter ids: {why}")
            continue
        if why:
            notes.append(f"note: optimizer state at {key!r}: {why}")
        if len(sd["state"]) < len(names):
            notes.append(
                f"note: optimizer state at {key!r} has no state for {len(names) - len(sd['state'])}"
                f" of {len(names)} parameters (it had not stepped for them); get_state_dict makes "
                "state for every parameter, so load it with dcp.load(sd, checkpoint_id=..., "
                "planner=DefaultLoadPlanner(allow_partial_load=True))"
            )
        sd["state"] = {names[i]: v for i, v in sd["state"].items()}
        for group in sd["param_groups"]:
            group["params"] = [names[i] for i in group["params"]]
    return notes


_SAVED_BEFORE = (
    "the checkpoint was saved before pitstop recorded which parameter each id is (save it again "
    "with this version, or build the optimizer from named_parameters())"
)


def _names(
    sd: Mapping[str, Any], stored: list[str | None] | None, found: Found
) -> tuple[list[str] | None, str]:
    """The name of each parameter id and a remark, or None and why there is none."""
    groups, state = sd.get("param_groups"), sd.get("state")
    if not (isinstance(groups, list) and isinstance(state, Mapping)) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        return None, "its param_groups are not a list of groups with params"
    ids = [i for g in groups for i in g["params"]]
    if ids != list(range(len(ids))) or not all(type(i) is int and 0 <= i < len(ids) for i in state):
        return None, "its ids are not those optimizer.state_dict() assigns (0, 1, ... in order)"
    if stored is not None:
        names, why = _names_from_tree(stored, found)
    elif all(isinstance(g.get("param_names"), list) for g in groups):  # torch >= 2.5, named
        names, why = [strip_wrappers(str(n)) for g in groups for n in g["param_names"]], ""
    else:
        return None, _SAVED_BEFORE
    if names is not None and len(names) != len(ids):
        return None, f"the checkpoint names {len(names)} parameters for {len(ids)} ids"
    if names is not None and len(set(names)) != len(names):
        return None, "two of its parameters have the same name"
    return names, why


def _names_from_tree(stored: list[str | None], found: Found) -> tuple[list[str] | None, str]:
    """Names from the stored key of each parameter: its key in the module state dict that
    holds it (wrapper prefixes stripped); prefixed with that dict's key path (``.`` for
    ``/``) when the parameters come from several state dicts."""
    if None in stored:
        i = stored.index(None)
        return None, f"parameter id {i} is not stored anywhere else in the checkpoint"
    owners = [found.owner.get(k) for k in stored if k is not None]
    if any(o is None for o in owners):
        return None, "a parameter is stored outside any state dict"
    plain = [found.renames.get(o[1], {}).get(o[2], o[2]) for o in owners if o is not None]
    if len({o[0] for o in owners if o is not None}) == 1:
        return [str(k) for k in plain], ""
    names = [
        ".".join(unescape_key(p) for p in o[0].split("/")) + f".{k}"
        for o, k in zip(owners, plain)
        if o is not None
    ]
    return names, "its parameters come from several modules: names are prefixed with their key"
