"""The package version, in a module of its own so any layer can read it.

Importing it pulls in nothing else of the package (the package's ``__init__`` re-exports
it as ``vllm_neuron.__version__``); pyproject.toml reads the package's version from here.
"""

__version__ = "0.1.0"
