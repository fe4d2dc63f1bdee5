"""The per-key decision: the two-tier cache's flow (lookup, lock, fetch, lease, compile,
promote), deferral, the fleet's single flight, prefetch and healing.

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
