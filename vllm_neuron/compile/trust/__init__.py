"""Who may have built an entry: Ed25519 signing and the trust policy (docs/trust.md).

No re-exports: import the module that holds a name, so importing a wing costs nothing
until that module is needed."""
