"""What the cache writes and hands back: the commit record (`entry.json`) and its checks,
the events, the outcomes a caller can tell apart, and the per-key notes.

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
