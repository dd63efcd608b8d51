"""The package version (layer 0)."""

__version__ = "0.1.0"
