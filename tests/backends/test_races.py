"""Races between real processes: one key, one staged directory, a writer and its readers.

Each racing process is started first and waits for a ``go`` file, so all of them are past
interpreter start-up when the race begins (see store_worker.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from worker_pool import Workers

from vllm_neuron.backends import Store, open_store
from vllm_neuron.backends.testing import published_files


@pytest.fixture(params=["local", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Store]:
    """(url, store) on local disk or on the moto S3 server (workers find it via the env)."""
    if request.param == "local":
        url = str(tmp_path / "store")
        return url, open_store(url)
    request.getfixturevalue("s3_env")  # AWS_ENDPOINT_URL for this process and workers
    url = request.getfixturevalue("s3_store_url")
    return url, open_store(url)


def _expect_one_winner_per_key(
    results: list[list[str]], keys: list[str], store: Store
) -> dict[str, int]:
    winners: dict[str, list[int]] = {key: [] for key in keys}
    for worker_id, won in enumerate(results):
        for key in won:
            winners[key].append(worker_id)
    wrong = {key: ids for key, ids in winners.items() if len(ids) != 1}
    # On failure, show who each such key's stored content says won.
    assert wrong == {}, {key: (ids, store.read(key)) for key, ids in wrong.items()}
    return {key: ids[0] for key, ids in winners.items()}


@pytest.mark.timeout(180)
def test_create_if_absent_race_has_exactly_one_winner(
    target: tuple[str, Store], workers: Workers
) -> None:
    url, store = target
    keys = [f"race/k{i}" for i in range(20 if store.capabilities.local_paths else 3)]
    racers = workers.start_many(16, "create", url, keys=keys)
    workers.release()
    winners = _expect_one_winner_per_key(workers.results(racers), keys, store)
    for key, worker_id in winners.items():
        assert store.read(key) == b"winner-%d" % worker_id
    assert store.list("") == sorted(keys)  # no temp files left behind


@pytest.mark.timeout(180)
def test_publish_race_has_exactly_one_complete_winner(
    target: tuple[str, Store], workers: Workers
) -> None:
    url, store = target
    finals = [f"entries/e{i}" for i in range(3 if store.capabilities.local_paths else 2)]
    racers = workers.start_many(8, "publish", url, finals=finals)
    workers.release()
    winners = _expect_one_winner_per_key(workers.results(racers), finals, store)
    for final, w in winners.items():
        assert published_files(store, final) == {
            "a": b"%d" % w * 1000,
            "sub/b": b"writer %d" % w,
            f"only-{w}": b"",
        }
    assert store.published_children("entries") == sorted(f.split("/")[1] for f in finals)
    # Losers cleaned up after themselves: only the winners' files and commit records remain.
    content = {k for f in finals for k in store.list(store.published(f) or "")}
    leftovers = set(store.list("")) - content
    assert all(k.endswith("/.commit") for k in leftovers), sorted(leftovers)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("profile", ["local", "nfs"])
def test_readers_never_see_a_partial_record_local(
    tmp_path: Path, workers: Workers, profile: str
) -> None:
    _rewrite_while_reading(
        str(tmp_path / "store"), {"profile": profile}, workers, size=1 << 20, seconds=1.5
    )


@pytest.mark.timeout(180)
def test_readers_never_see_a_partial_record_s3(
    s3_env: str, s3_store_url: str, workers: Workers
) -> None:
    _rewrite_while_reading(s3_store_url, {}, workers, size=128 << 10, seconds=1.5)


def _rewrite_while_reading(
    url: str, options: dict[str, Any], workers: Workers, *, size: int, seconds: float
) -> None:
    store = open_store(url, **options)
    values = ["a", "b"]
    store.write("record", b"a" * size)
    common = {"key": "record", "size": size, "values": values, "seconds": seconds}
    writer = workers.start("rewrite", url, options, **common)
    readers = [workers.start("read", url, options, id=i, **common) for i in range(2)]
    for worker in (writer, *readers):
        assert worker.message(timeout=120)["ready"] is True
    workers.release()
    reports = workers.results(readers)
    workers.stop_all()
    writes = writer.message(timeout=120)["result"]
    for report in reports:
        assert report["n_bad"] == 0, f"partial or foreign reads: {report}"
    assert writes >= 2, f"the writer only managed {writes} rewrites"
    # The test only means something if reads overlapped rewrites: both values were seen.
    for report in reports:
        assert report["seen"] == values, reports
    assert store.read("record") in (b"a" * size, b"b" * size)
    assert store.list("") == ["record"]  # no temp files left behind


def test_a_forked_child_appends_although_a_parent_thread_held_the_log_at_the_fork(
    tmp_path: Path,
) -> None:
    """A thread of the parent inside an append's slow path when another thread forks (a
    cache's background upkeep writing an event while vLLM starts a worker): the child's
    first append must not wait for a lock no thread of the child will ever release."""
    import os
    import threading

    from vllm_neuron.compile.entry.events import CacheMiss

    store = open_store(str(tmp_path / "store"))
    log = store.log("events")
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with log._slow_path:  # what a slow-path append holds while it opens and writes
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: one thread; its append either returns or hangs
        try:
            log.append(CacheMiss(key="c" * 32, at=1.0))
            os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            os._exit(1)
    release.set()
    holder.join()
    statuses: list[int] = []
    reaper = threading.Thread(target=lambda: statuses.append(os.waitpid(pid, 0)[1]))
    reaper.start()
    reaper.join(60)  # bounded only against the hang this test is about: a working child exits
    if reaper.is_alive():
        os.kill(pid, 9)
        reaper.join()
        pytest.fail("the forked child's first append waited for the parent thread's lock")
    assert os.waitstatus_to_exitcode(statuses[0]) == 0
    lines = [line for _, data in log.segment_data() for line in data.splitlines()]
    assert len(lines) == 1 and b'"miss"' in lines[0]
