"""Compiles off the tracing thread: the pool of worker processes, the worker process
itself, job directories, and the node's compile slots.

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
