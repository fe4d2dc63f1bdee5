"""vLLM Neuron artifact store: compile cache, compile manifest, input snapshots, profiles.

Importing this package registers the ``vllm_neuron`` torch.compile backend lazily (torch is
only imported when the backend is used), so importing it stays cheap.
"""

__version__ = "0.1.0"
