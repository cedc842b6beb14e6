"""The package version, importable without the package's public names."""
__version__ = "0.1.0"
