"""What only the command line calls: prune, compat, warm and the load check.

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
