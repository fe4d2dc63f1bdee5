"""A hypothesis state machine: the memory store against a dict model.

Rules write, create, delete, read, stage (several stagings may be open at once), commit,
abort and unpublish. After every step the store must agree with the model: reads return
the last committed value, create-if-absent and publication are first-writer-wins, and a
published directory always holds exactly one writer's complete content.

Plain files live under ``f/`` and published directories under ``p/``, so the two
namespaces never collide (on a filesystem a key cannot be both a file and a directory).

Under the ``ci`` profile (tests/hypothesis_profiles.py, what ``python3 dev.py test`` runs)
it runs 2,000 examples of up to 20 steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from hypothesis_profiles import examples  # tests/hypothesis_profiles.py

from vllm_neuron.backends import Staging, join, open_store
from vllm_neuron.backends.base import COMMIT_RECORD
from vllm_neuron.backends.testing import published_files

FILE_KEYS = st.sampled_from(["f/a", "f/b", "f/dir/c", "f/dir/d/e"])
FINALS = st.sampled_from(["p/one", "p/two", "p/nested/three"])
CONTENT = st.binary(max_size=24)
STAGED_FILES = st.dictionaries(
    st.sampled_from(["x", "y", "sub/z"]), st.binary(max_size=16), max_size=3
)


@dataclass
class OpenStaging:
    staging: Staging
    files: dict[str, bytes]


class StoreMachine(RuleBasedStateMachine):
    stagings = Bundle("stagings")

    def __init__(self) -> None:
        super().__init__()
        self.store = open_store("memory://")  # anonymous: fresh for every example
        self.files: dict[str, bytes] = {}
        self.published: dict[str, dict[str, bytes]] = {}
        self.open_stagings = 0

    # ------------------------------------------------------------ files
    @rule(key=FILE_KEYS, data=CONTENT)
    def write(self, key: str, data: bytes) -> None:
        self.store.write(key, data)
        self.files[key] = data

    @rule(key=FILE_KEYS, data=CONTENT)
    def create(self, key: str, data: bytes) -> None:
        created = self.store.create(key, data)
        assert created == (key not in self.files)
        self.files.setdefault(key, data)

    @rule(key=FILE_KEYS)
    def delete(self, key: str) -> None:
        assert self.store.delete(key) == (key in self.files)
        self.files.pop(key, None)

    @rule(key=FILE_KEYS)
    def read(self, key: str) -> None:
        assert self.store.read(key) == self.files.get(key)

    # ------------------------------------------------------- publication
    @rule(target=stagings, final=FINALS, files=STAGED_FILES)
    def stage(self, final: str, files: dict[str, bytes]) -> OpenStaging:
        staging = self.store.stage(final)
        for rel, data in files.items():
            staging.write(rel, data)
        self.open_stagings += 1
        return OpenStaging(staging, files)

    @rule(item=consumes(stagings))
    def commit(self, item: OpenStaging) -> None:
        won = item.staging.commit()
        self.open_stagings -= 1
        final = item.staging.final
        assert won == (final not in self.published)
        if won:
            self.published[final] = dict(item.files)

    @rule(item=consumes(stagings))
    def abort(self, item: OpenStaging) -> None:
        item.staging.abort()
        self.open_stagings -= 1

    @rule(final=FINALS)
    def unpublish(self, final: str) -> None:
        assert self.store.unpublish(final) == (final in self.published)
        self.published.pop(final, None)

    # -------------------------------------------------------- invariants
    @invariant()
    def files_match_the_model(self) -> None:
        for key, data in self.files.items():
            assert self.store.read(key) == data
        assert self.store.list("f") == sorted(self.files)

    @invariant()
    def published_content_is_one_whole_writer(self) -> None:
        for final in ("p/one", "p/two", "p/nested/three"):
            assert published_files(self.store, final) == self.published.get(final, {})
            assert (self.store.published(final) is not None) == (final in self.published)
        assert self.store.published_children("p") == sorted(
            f.split("/")[1] for f in self.published if f.count("/") == 1
        )

    @precondition(lambda self: self.open_stagings == 0)
    @invariant()
    def nothing_is_left_behind(self) -> None:
        """With no staging open: live files, published content and commit records only."""
        content: set[str] = set()
        for final in self.published:
            prefix = self.store.published(final)
            assert prefix is not None
            content.update(self.store.list(prefix))
        extra = set(self.store.list("")) - set(self.files) - content
        # The memory store publishes with a commit record (it has no atomic rename).
        assert extra == {join(final, COMMIT_RECORD) for final in self.published}


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=examples(ci=2000),
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
