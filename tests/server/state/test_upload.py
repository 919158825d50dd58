"""Checkpoint upload (``state.upload``): the order of puts and deletes that keeps the bucket resumable at every
moment. Files before the manifest, the compaction the checkpoint allowed only after its manifest, retention that
takes an old checkpoint's manifest before its files, pinned checkpoints that local retention leaves alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentjet_server.batching.buffer import BufferSnapshot
from agentjet_server.state.checkpoint import CheckpointMeta, StateDir
from agentjet_server.state.objectstore import ObjectStore, open_store, part_key
from agentjet_server.state.shipping import LogShipper
from agentjet_server.state.upload import CheckpointUploader, UploadJob


class Recording(ObjectStore):
    """The store, with every write and delete noted in order."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner.fs, inner.root, inner.uri)
        self.ops: list[tuple[str, str]] = []

    def put(self, key: str, data: bytes) -> None:
        self.ops.append(("put", key))
        super().put(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self.ops.append(("put", key))
        super().put_file(key, path)

    def delete(self, keys) -> None:  # type: ignore[no-untyped-def]
        keys = list(keys)
        self.ops.extend(("delete", k) for k in keys)
        super().delete(keys)


def meta(step: int, segment: int) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        version=step,
        next_lsn=0,
        buffer=BufferSnapshot([], []),
        trained=0,
        skipped_batches=0,
        segment=segment,
    )


def checkpoint(state: StateDir, step: int) -> Path:
    path = state.checkpoint_dir / f"step-{step:08d}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "model.safetensors").write_bytes(b"w" * (100 + step))
    (path / "trainer.pt").write_bytes(b"t" * 10)
    (path / "state.json").write_text(meta(step, 1).to_json())
    return path


@pytest.fixture
def parts(tmp_path: Path):  # type: ignore[no-untyped-def]
    state = StateDir.open(tmp_path / "state")
    state.checkpoint_dir.mkdir(exist_ok=True)
    store = Recording(open_store(f"file://{tmp_path}/bucket"))
    shipper = LogShipper(store, (10, 0))  # the log is at segment 10: every checkpoint below may upload
    uploader = CheckpointUploader(store, state, shipper, keep=2)
    yield state, store, uploader
    uploader.close()
    shipper.close()
    state.close()


def test_the_manifest_comes_after_every_file_and_the_compaction_after_the_manifest(parts):
    state, store, uploader = parts
    state.log_dir.mkdir(exist_ok=True)
    (state.log_dir / "00000001.ids").write_text('["a", "t0", null, 0, []]\n')
    store.put(part_key(1, 0, 3), b"abc")  # the segment's bytes, shipped before it was compacted
    store.put(part_key(2, 0, 3), b"def")  # a segment the checkpoint did not compact
    store.ops.clear()
    path = checkpoint(state, 5)
    assert uploader.upload(UploadJob(path, meta(5, 2), compacted=[1]))
    keys = [k for op, k in store.ops if op == "put"]
    manifest = keys.index("checkpoints/step-00000005/MANIFEST.json")
    files = [k for k in keys if k.startswith("checkpoints/step-00000005/") and not k.endswith("MANIFEST.json")]
    assert len(files) == 3 and all(keys.index(f) < manifest for f in files)
    assert keys.index("log/00000001.ids") > manifest
    deleted = [k for op, k in store.ops if op == "delete"]
    assert deleted == [part_key(1, 0, 3)]  # segment 2 is still needed by this checkpoint's resume
    assert store.ops.index(("delete", part_key(1, 0, 3))) > store.ops.index(("put", "log/00000001.ids"))
    written = json.loads(store.get("checkpoints/step-00000005/MANIFEST.json"))
    assert written["step"] == 5 and written["run_id"] == state.run_id
    sizes = {f["path"]: f["size"] for f in written["files"]}
    assert sizes == {
        "model/model.safetensors": 105,
        "trainer.pt": 10,
        "state.json": len((path / "state.json").read_text()),
    }
    assert uploader.last_uploaded_step == 5


def test_retention_takes_the_manifest_first_and_keeps_the_newest(parts):
    state, store, uploader = parts
    for step in (1, 2, 3):
        assert uploader.upload(UploadJob(checkpoint(state, step), meta(step, 1)))
    store.put("checkpoints/step-00000000/model/model.safetensors", b"left by a dead upload")
    store.ops.clear()
    assert uploader.upload(UploadJob(checkpoint(state, 4), meta(4, 1)))
    left = {k.split("/")[1] for k in store.list("checkpoints/")}
    assert left == {"step-00000003", "step-00000004"}
    deleted = [k for op, k in store.ops if op == "delete"]
    old = [k for k in deleted if k.startswith("checkpoints/step-00000002/")]
    assert old[0] == "checkpoints/step-00000002/MANIFEST.json" and len(old) == 4
    assert "checkpoints/step-00000000/model/model.safetensors" in deleted


def test_a_checkpoint_being_uploaded_is_pinned_against_local_retention(parts, model_dir):
    from transformers import AutoModelForCausalLM

    state = parts[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer_state = {"weights": model.state_dict()}
    uploading = state.write(meta(1, 1), trainer_state, model, model_dir, keep=1)
    state.pinned.add(uploading)
    state.write(meta(2, 1), trainer_state, model, model_dir, keep=1)
    state.write(meta(3, 1), trainer_state, model, model_dir, keep=1)
    assert [p.name for p in state.checkpoints()] == ["step-00000001", "step-00000003"]
    state.pinned.discard(uploading)  # uploaded: the next checkpoint's retention takes it
    state.write(meta(4, 1), trainer_state, model, model_dir, keep=1)
    assert [p.name for p in state.checkpoints()] == ["step-00000004"]


def test_a_submitted_checkpoint_is_uploaded_in_the_background_and_unpinned(parts):
    state, store, uploader = parts
    path = checkpoint(state, 3)
    uploader.submit(path, meta(3, 1), [])
    assert uploader.flush(timeout=30)
    assert uploader.last_uploaded_step == 3 and path not in state.pinned
    assert "checkpoints/step-00000003/MANIFEST.json" in store.list()
