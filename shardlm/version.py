"""The package version (a leaf: what any layer may read without importing the package's face)."""

__version__ = "0.1.0"
