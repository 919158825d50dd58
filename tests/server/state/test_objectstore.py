"""The object store (``state.objectstore``) on a local directory and on a local S3 server (moto): whole objects
in and out, listings that see every new object at once, and errors that say what to fix without the credentials."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentjet_server.errors import ConfigError, StateError
from agentjet_server.state.objectstore import ObjectStore, open_store, parse_part, part_key


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/bucket/run")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(bucket.uri("run"), bucket.options)


def test_objects_round_trip_and_listings_see_each_change_at_once(store, tmp_path):
    assert store.list() == {} and store.run_id() is None
    store.put("RUN.json", json.dumps({"run_id": "abc"}).encode())
    assert store.run_id() == "abc"
    big = tmp_path / "weights.bin"
    big.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    store.put_file("checkpoints/step-00000003/model/weights.bin", big)
    store.put(part_key(2, 0, 5), b"hello")
    assert store.list() == {
        "RUN.json": len(json.dumps({"run_id": "abc"})),
        "checkpoints/step-00000003/model/weights.bin": big.stat().st_size,
        "log/00000002/0000000000000000-0000000000000005.part": 5,
    }
    assert store.list("log/") == {"log/00000002/0000000000000000-0000000000000005.part": 5}
    store.get_file("checkpoints/step-00000003/model/weights.bin", tmp_path / "back" / "weights.bin")
    assert (tmp_path / "back" / "weights.bin").read_bytes() == big.read_bytes()
    store.put(part_key(2, 0, 5), b"HELLO")  # an object is replaced whole
    assert store.get(part_key(2, 0, 5)) == b"HELLO"
    store.delete(["RUN.json", "no-such-key"])
    assert "RUN.json" not in store.list()
    store.delete_all()
    assert store.list() == {}


def test_a_missing_object_is_a_state_error_that_names_it(store):
    with pytest.raises(StateError, match=r"cannot read checkpoints/step-00000001/MANIFEST.json"):
        store.get("checkpoints/step-00000001/MANIFEST.json")


def test_part_keys_name_their_segment_and_byte_range():
    key = part_key(7, 1024, 4096)
    assert key == "log/00000007/0000000000001024-0000000000004096.part"
    assert parse_part(key) == (7, 1024, 4096)
    assert parse_part("log/00000007.ids") is None and parse_part("checkpoints/step-1/x.part") is None


def test_wrong_uris_and_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs a scheme and a path"):
        open_store("s3://")
    with pytest.raises(ConfigError, match="nosuchproto"):
        open_store("nosuchproto://bucket/run")
    bad = tmp_path / "options.json"
    bad.write_text("{endpoint_url")
    with pytest.raises(ConfigError, match="give a JSON object file"):
        open_store(f"file://{tmp_path}/run", bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        open_store(f"file://{tmp_path}/run", bad)


def test_a_missing_bucket_is_named_and_credentials_never_appear(s3_bucket, tmp_path):
    with pytest.raises(StateError, match="the bucket no-such-bucket does not exist"):
        open_store("s3://no-such-bucket/run", s3_bucket.options)
    options = tmp_path / "wrong.json"  # a store nobody listens on, with credentials in the options file
    options.write_text(
        json.dumps({"endpoint_url": "http://127.0.0.1:9", "key": "AKIDSECRET1", "secret": "s3cr3t-v4lue"})
    )
    with pytest.raises(StateError) as caught:
        open_store("s3://bucket/run", options)
    message = str(caught.value)
    assert "cannot reach" in message and "s3://bucket/run" in message
    assert "s3cr3t-v4lue" not in message and "AKIDSECRET1" not in message
