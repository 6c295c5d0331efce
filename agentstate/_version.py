"""The one place the version is written: pyproject.toml reads it (setuptools `dynamic`), and so
do `agentstate.__version__`, `agentstate version` and the service's OpenAPI document."""

__version__ = "0.1.0"
