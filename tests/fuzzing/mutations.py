"""The mutations of a campaign: a pure function of the seed and the case number
(:func:`make_case`), and the :data:`NAMED` ones for readable tests.
"""

from __future__ import annotations

import copy
import random

from fuzzing.cases import OP_WEIGHTS, OPS, Action, Case, Mutation, in_step
from fuzzing.edits import (
    Edit,
    EditFn,
    edit_deep,
    edit_duplicate,
    edit_extra,
    edit_huge,
    edit_long_string,
    edit_remove,
    edit_retype,
)
from fuzzing.jsonpath import short
from fuzzing.root import BN_KEYS, DATA, OBJECTS, STEP1, STEP2, Pristine
from fuzzing.schema_edits import edit_field, edit_permute, swap
from fuzzing.seal import Subs, dump_manifest, dump_objects, objects_well_formed, reseal
from pitstop.format.names import MANIFEST

__all__ = ["NAMED", "make_case", "named_mutation"]

NAMED = (
    "swap_bn_keys",
    "fifo_objects",
    "huge_nbytes",
    "deep_nesting_manifest",
    "deep_nesting_objects",
)


_STRUCTURED: dict[str, EditFn] = {
    "permute": edit_permute,
    "retype": edit_retype,
    "huge": edit_huge,
    "long_string": edit_long_string,
    "deep": edit_deep,
    "duplicate": edit_duplicate,
    "remove": edit_remove,
    "extra": edit_extra,
    "field": edit_field,
}


def _structured(
    family: str, target: str, sealed: bool, p: Pristine, rng: random.Random
) -> Mutation:
    subs = Subs()
    doc = copy.deepcopy(p.manifest if target == "manifest" else p.objects)
    edit = _STRUCTURED[family](rng, doc, subs, target, p)
    return _finish(family, target, sealed, edit, subs, p)


def _finish(
    family: str, target: str, sealed: bool, edit: Edit, subs: Subs, p: Pristine
) -> Mutation:
    """Serialize an edited document (and, sealed, the manifest that vouches for it)."""
    if target == "manifest":
        if sealed:
            reseal(edit.doc, None, p.algorithm, subs, integrity=not edit.integrity)
        writes = {MANIFEST: dump_manifest(edit.doc, subs)}
        forgery = sealed and edit.forgery
    else:
        data = dump_objects(edit.doc, subs)
        writes = {OBJECTS: data}
        if sealed:
            manifest = copy.deepcopy(p.manifest)
            reseal(manifest, data, p.algorithm)
            writes[MANIFEST] = dump_manifest(manifest, Subs())
        forgery = sealed and objects_well_formed(data, p)
    actions = tuple(Action("write", in_step(name), data) for name, data in writes.items())
    return Mutation(family, target, edit.what, sealed, forgery, actions)


def _bytes_mutation(rng: random.Random, p: Pristine) -> Mutation:
    target = rng.choice(["manifest", "objects"])
    data = bytearray(p.manifest_bytes if target == "manifest" else p.objects_bytes)
    kind = rng.choice(["flip", "overwrite", "truncate", "insert", "append", "delete"])
    at = rng.randrange(len(data))
    if kind == "flip":
        bits = rng.randint(1, 8)
        spots = sorted(rng.sample(range(len(data) * 8), bits))
        for bit in spots:
            data[bit // 8] ^= 1 << (bit % 8)
        what = f"flipped {bits} bit(s) at bytes {[b // 8 for b in spots][:8]}"
    elif kind == "overwrite":
        value = rng.choice([*b'"{}[]\\,:0-9', 0, 0xFF, 0x80, rng.randrange(256)])
        what = f"byte {at}: {data[at]:#04x} -> {value:#04x}"
        data[at] = value
    elif kind == "truncate":
        at = rng.choice([0, 1, at, len(data) - 1])
        del data[at:]
        what = f"truncated to {at} bytes"
    elif kind == "insert":
        chunk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        data[at:at] = chunk
        what = f"inserted {len(chunk)} random bytes at {at}"
    elif kind == "append":
        options = [
            b"\n",
            b"{}",
            b"\x00",
            bytes(data),
            b" " * (1 << 20),
            bytes(rng.randrange(256) for _ in range(64)),
        ]
        chunk = rng.choice(options)
        data += chunk
        what = f"appended {len(chunk)} bytes ({short(chunk[:8])})"
    else:
        n = rng.randint(1, 64)
        del data[at : at + n]
        what = f"deleted {n} bytes at {at}"
    sealed = target == "objects" and rng.random() < 0.5
    writes = {MANIFEST if target == "manifest" else OBJECTS: bytes(data)}
    forgery = False
    if sealed:
        manifest = copy.deepcopy(p.manifest)
        reseal(manifest, bytes(data), p.algorithm)
        writes[MANIFEST] = dump_manifest(manifest, Subs())
        forgery = objects_well_formed(bytes(data), p)
    actions = tuple(Action("write", in_step(n), d) for n, d in writes.items())
    return Mutation("bytes", target, what, sealed, forgery, actions)


_SPECIAL = ("fifo", "dev_zero", "dev_null", "outside_abs", "outside_rel", "outside_secret",
            "directory", "directory_with_file", "sparse_3g", "empty", "dangling", "loop")  # fmt: skip


def _special(kind: str, target: str) -> Mutation:
    name = {"manifest": MANIFEST, "objects": OBJECTS, "data": DATA}[target]
    path = in_step(name)
    replace: dict[str, Action] = {
        "fifo": Action("fifo", path),
        "dev_zero": Action("symlink", path, target="/dev/zero"),
        "dev_null": Action("symlink", path, target="/dev/null"),
        "outside_abs": Action("symlink", path, target=f"@/outside/{name}"),
        "outside_rel": Action("symlink", path, target=f"../../outside/{name}"),
        "outside_secret": Action("symlink", path, target="@/outside/secret.txt"),
        "directory": Action("mkdir", path),
        "sparse_3g": Action("sparse", path),
        "empty": Action("write", path),
        "dangling": Action("symlink", path, target="@/outside/no-such-file"),
        "loop": Action("symlink", path, target=name),
    }
    if kind == "directory_with_file":
        actions: tuple[Action, ...] = (
            Action("remove", path),
            Action("mkdir", path),
            Action("write", f"{path}/x", b"{}"),
        )
    else:
        actions = (Action("remove", path), replace[kind])
    return Mutation("special", target, f"{name} is {kind.replace('_', ' ')}", actions=actions)


def _special_mutation(rng: random.Random, p: Pristine) -> Mutation:
    target = rng.choices(["manifest", "objects", "data"], weights=[4, 4, 1])[0]
    return _special(rng.choice(_SPECIAL), target)


def _step_symlink_mutation(rng: random.Random, p: Pristine) -> Mutation:
    kind = rng.choice(
        [
            "pristine_abs",
            "pristine_rel",
            "damaged_objects",
            "damaged_manifest",
            "step1_copy",
            "empty_dir",
            "to_file",
            "dangling",
        ]
    )
    out = "outside/step-dir"
    actions: list[Action] = []
    if kind == "step1_copy":
        actions.append(Action("copytree", out, target=f"@/root/{STEP1}"))
    elif kind == "empty_dir":
        actions.append(Action("mkdir", out))
    elif kind not in ("to_file", "dangling"):
        actions.append(Action("copytree", out, target=f"@/root/{STEP2}"))
    if kind == "damaged_objects":
        actions.append(
            Action("write", f"{out}/{OBJECTS}", p.objects_bytes[: len(p.objects_bytes) // 2])
        )
    if kind == "damaged_manifest":
        actions.append(Action("write", f"{out}/{MANIFEST}", p.manifest_bytes[:-40]))
    link = {
        "pristine_rel": "../outside/step-dir",
        "to_file": "@/outside/secret.txt",
        "dangling": "@/outside/nothing",
    }.get(kind, f"@/{out}")
    actions += [Action("remove", f"root/{STEP2}"), Action("symlink", f"root/{STEP2}", target=link)]
    return Mutation(
        "step_symlink",
        "step",
        f"{STEP2} is a symlink out of the root ({kind.replace('_', ' ')})",
        actions=tuple(actions),
    )


_FAMILIES: tuple[tuple[str, float], ...] = (
    ("bytes", 3), ("permute", 2), ("retype", 2), ("huge", 1.5), ("long_string", 1),
    ("deep", 1), ("duplicate", 1), ("remove", 1.5), ("extra", 1), ("field", 2.5),
    ("special", 1.5), ("step_symlink", 0.6),
)  # fmt: skip


def make_case(p: Pristine, seed: int, index: int) -> Case:
    """Case ``index`` of the campaign ``seed``: a mutation and an operation, drawn from their
    own random streams (so a case can be made again alone)."""
    rng = random.Random(f"pitstop-fuzz/{seed}/{index}")
    op = random.Random(f"pitstop-fuzz-op/{seed}/{index}").choices(OPS, weights=OP_WEIGHTS)[0]
    family = rng.choices([f for f, _ in _FAMILIES], weights=[w for _, w in _FAMILIES])[0]
    if family == "bytes":
        mutation = _bytes_mutation(rng, p)
    elif family == "special":
        mutation = _special_mutation(rng, p)
    elif family == "step_symlink":
        mutation = _step_symlink_mutation(rng, p)
    else:
        target = (
            "manifest"
            if family == "field" and rng.random() < 0.8
            else rng.choice(["manifest", "objects"])
        )
        mutation = _structured(family, target, rng.random() < 0.5, p, rng)
    return Case(index, mutation, op)


def named_mutation(p: Pristine, name: str) -> Mutation:
    """The mutations of :data:`NAMED`, for readable tests."""
    if name == "swap_bn_keys":
        doc = copy.deepcopy(p.manifest)
        a, b = (next(t for t in doc["tensors"] if t["key"] == k) for k in BN_KEYS)
        swap(a, b, ["key"])
        return _finish(
            "permute",
            "manifest",
            False,
            Edit(doc, f"swapped key of {BN_KEYS[0]!r} and {BN_KEYS[1]!r}"),
            Subs(),
            p,
        )
    if name == "fifo_objects":
        return _special("fifo", "objects")
    if name == "huge_nbytes":
        doc = copy.deepcopy(p.manifest)
        entry = next(t for t in doc["tensors"] if t["key"] == BN_KEYS[0])
        entry["nbytes"] = 2**64
        entry["shape"] = [2**62]
        for f in doc["files"]:
            if f["name"] == DATA:
                f["nbytes"] = 2**63
        return _finish(
            "huge",
            "manifest",
            True,
            Edit(doc, "a tensor of 2**64 bytes in a data file of 2**63"),
            Subs(),
            p,
        )
    if name in ("deep_nesting_manifest", "deep_nesting_objects"):
        target = name.rsplit("_", 1)[1]
        subs = Subs()
        doc = copy.deepcopy(p.manifest if target == "manifest" else p.objects)
        deep = subs.raw("[" * 10**5 + "]" * 10**5)
        if target == "manifest":
            doc["topology"]["hosts"] = deep
        else:
            doc["tree"]["dict"][-1][1] = deep
        return _finish(
            "deep", target, True, Edit(doc, "a value nested 100000 levels deep"), subs, p
        )
    raise ValueError(f"unknown named mutation {name!r}; known: {', '.join(NAMED)}")
