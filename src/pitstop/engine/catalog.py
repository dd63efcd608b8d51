"""What a storage root holds: committed checkpoints, debris, quarantined ones. No torch.

Call sequence: any thread; reads only. ``scan`` parses every manifest (cheap:
no data is read), so ``committed`` means "the manifest parses", which is the
definition of a checkpoint; whether its bytes are intact is ``verify``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

from pitstop.errors import CheckpointError, ManifestError
from pitstop.format.manifest import Manifest
from pitstop.format.names import MANIFEST, parse_step_dir
from pitstop.storage.base import Storage

__all__ = ["Entry", "committed", "read_manifest", "scan"]


@dataclass(frozen=True)
class Entry:
    """One name under the root. ``status``: committed, partial (no manifest: an
    interrupted save), corrupt (a manifest that does not parse, or set aside
    after failing verification), or other (not pitstop's)."""

    name: str
    step: int | None
    status: str
    manifest: Manifest | None = None
    error: str | None = None


def read_manifest(storage: Storage, directory: str) -> Manifest:
    """Parse the manifest of ``directory``; raises CheckpointNotFoundError or ManifestError."""
    data = storage.read_manifest(directory)
    manifest = Manifest.loads(data, path=f"{storage.url}/{directory}/{MANIFEST}")
    expected = parse_step_dir(directory)
    if expected is not None and manifest.step != expected:
        raise ManifestError(
            f"manifest says step {manifest.step} but lies in {directory}",
            path=f"{storage.url}/{directory}",
        )
    return manifest


def scan(storage: Storage) -> list[Entry]:
    """Every entry under the root, checkpoints sorted by step."""
    out: list[Entry] = []
    for name in storage.entries():
        step = parse_step_dir(name)
        if step is None:
            status = "corrupt" if name.startswith(".corrupt-step-") else "other"
            out.append(Entry(name, None, status))
            continue
        if not storage.has_manifest(name):
            out.append(Entry(name, step, "partial"))
            continue
        try:
            out.append(Entry(name, step, "committed", read_manifest(storage, name)))
        except CheckpointError as e:
            out.append(Entry(name, step, "corrupt", error=str(e)))
    return sorted(out, key=lambda e: (e.step is None, e.step or 0, e.name))


def committed(storage: Storage) -> list[Entry]:
    """Committed checkpoints, oldest first."""
    return [e for e in scan(storage) if e.status == "committed"]
