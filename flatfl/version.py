"""flatfl's version: a bottom module, so that any layer can record it without importing the package root."""
__version__ = "0.1.0"
