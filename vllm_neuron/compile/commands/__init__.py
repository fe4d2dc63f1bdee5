"""What only the command line calls: prune, compat, warm, the load check, and the stats
document (which the report shows too).

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
