"""Layer 1: the on-disk format as pure data (names, manifest, checksums, tensor codec)."""
