"""The version of workbench (written into every checkpoint it saves)."""

__version__ = "0.1.0"
