"""Looking images up in the store by name and by id: what refs.json says
now, whether it was read before or just replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from nsbox.errors import NsboxError
from nsbox.storage.store import ImageNotFound, Record, Store

pytestmark = pytest.mark.timeout(30)

A, B = "abcd1" + "1" * 59, "abcd2" + "2" * 59


def record(name: str, config_hex: str) -> Record:
    return Record(name, "sha256:" + "d" * 64, "sha256:" + config_hex, 0.0, 1, "oci", "linux/amd64")


def write(store: Store, *records: Record) -> None:
    store._write_records({r.name: r for r in records})


def test_an_image_is_found_by_its_whole_id_or_a_prefix_of_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    write(store, record("docker.io/library/a:1", A), record("docker.io/library/b:1", B),
          record("docker.io/library/b:2", B))
    for ref in (f"sha256:{A}", A, A[:12], "abcd1"):
        rec, by_id = store._lookup(ref)
        assert by_id and rec.id == f"sha256:{A}", ref
    assert store.lookup(B).id == f"sha256:{B}"
    assert store.lookup("b:2").name == "docker.io/library/b:2"
    with pytest.raises(NsboxError, match="image id abcd is ambiguous"):
        store.lookup("abcd")
    with pytest.raises(ImageNotFound):
        store.lookup("sha256:" + "e" * 64)


def test_a_lookup_sees_the_names_as_they_are_now(tmp_path: Path) -> None:
    """The names (and the ids they give) are kept between lookups: a
    change to refs.json, by this process or another, must show at once."""
    store = Store(tmp_path / "store")
    write(store, record("docker.io/library/a:1", A))
    assert store.lookup(A).name == "docker.io/library/a:1"
    write(store, record("docker.io/library/b:1", B))  # a:1 removed, b:1 added
    with pytest.raises(ImageNotFound):
        store.lookup(A)
    with pytest.raises(ImageNotFound):
        store.lookup("a:1")
    assert store.lookup(B).name == "docker.io/library/b:1"
    # Another process's store object, writing the file anew.
    write(Store(tmp_path / "store"), record("docker.io/library/a:2", A))
    assert store.lookup(f"sha256:{A}").name == "docker.io/library/a:2"
    with pytest.raises(ImageNotFound):
        store.lookup(B)
