"""The store contract on S3, through s3fs against moto's S3 server on loopback."""

import pytest

from vllm_neuron.backends import Store, open_store
from vllm_neuron.backends.testing import CommitRecordContractTests, StoreContractTests


class TestS3Store(StoreContractTests, CommitRecordContractTests):
    lease_duration = 1.0  # moto answers ~150 requests/s: give heartbeats room

    @pytest.fixture
    def store(self, s3_store_url: str, s3_server: str) -> Store:
        store = open_store(s3_store_url, endpoint_url=s3_server)
        assert store.capabilities.profile == "s3"
        return store


def test_endpoint_comes_from_the_environment(
    s3_server: str, s3_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    open_store(s3_store_url).write("k", b"v")
    assert open_store(s3_store_url, endpoint_url=s3_server).read("k") == b"v"
    # The S3-specific variable wins over the general one, an explicit option over both.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server)
    assert open_store(s3_store_url).read("k") == b"v"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    assert open_store(s3_store_url, endpoint_url=s3_server).read("k") == b"v"
