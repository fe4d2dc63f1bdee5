"""Where entries live: the local tier's location and health, the remote tier, building and
publishing an entry, promotion, quarantine, unpacked copies, and the inventory of a tier.

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
