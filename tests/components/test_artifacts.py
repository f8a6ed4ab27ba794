from __future__ import annotations

import pytest

from components.artifacts import ArtifactStore
from lopd_core.artifacts import ArtifactRef, sha256_json, sha256_path


def test_put_get_file_and_dir_round_trip(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    f = tmp_path / "data.jsonl"
    f.write_text('{"a": 1}\n')
    ref = store.put(f, "dataset", {"n": 1})
    assert ref.sha256 == sha256_path(f) and ref.metadata["n"] == 1
    assert store.get(ref).read_text() == '{"a": 1}\n'
    assert store.put(f, "dataset", {"n": 1}) == ref  # same content: same object, stored once
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "w.bin").write_bytes(b"\x00\x01")
    (d / "meta.json").write_text("{}")
    dref = store.put(d, "checkpoint")
    got = store.get(dref)
    assert (got / "sub" / "w.bin").read_bytes() == b"\x00\x01" and sha256_path(got) == dref.sha256
    assert ArtifactRef.from_json(dref.to_json()) == dref


def test_tampered_or_missing_artifacts_are_errors(tmp_path):
    store = ArtifactStore(tmp_path)
    f = tmp_path / "x.txt"
    f.write_text("one")
    ref = store.put(f, "metrics")
    store.get(ref).write_text("two")
    with pytest.raises(ValueError, match="does not match its digest"):
        store.get(ref)
    gone = ArtifactRef(str(tmp_path / "nope"), "metrics", "0" * 64)
    with pytest.raises(FileNotFoundError, match="missing"):
        store.get(gone)


def test_digests_are_content_based(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "f").write_text("same")
    assert sha256_path(a) == sha256_path(b)
    (b / "g").write_text("more")
    assert sha256_path(a) != sha256_path(b)
    assert sha256_json({"x": 1, "y": [1, 2]}) == sha256_json({"y": [1, 2], "x": 1})
    with pytest.raises(ValueError, match="kind"):
        ArtifactRef("u", "weights", "0" * 64)


def test_memory_filesystem_store(tmp_path):
    store = ArtifactStore("memory://lopd-test")
    f = tmp_path / "r.json"
    f.write_text("[1]")
    ref = store.put_json([1, 2], "metrics", "r.json")
    assert ref.uri.startswith("memory://") and store.read_json(ref) == [1, 2]
