"""What keeps a tier in bounds and clean: the size bound (eviction), garbage collection,
owed promotions, and the background pass that runs them.

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
