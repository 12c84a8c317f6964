"""Greenlane's HTTP front end. `__version__` is the package's version (pyproject reads it)."""

__version__ = "0.1.0"
