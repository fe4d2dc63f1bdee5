"""The names the storage layer keeps for itself inside a store (all start with a dot).

`published_children` never lists them; what each holds is in docs/storage.md
("On-disk layout"). Code above the storage layer never names them: it asks the store
(`survey`, `published`, `stage`).
"""

COMMIT_RECORD = ".commit"
VERSIONS_DIR = ".v"
STAGING_DIR = ".staging"
LOCKS_DIR = ".locks"
TRASH_DIR = ".trash"
