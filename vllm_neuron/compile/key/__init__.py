"""What a graph is called: the cache key, the canonical graph it hashes, and the
compiler arguments it covers.

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
