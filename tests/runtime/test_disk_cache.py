"""runtime/disk_cache.py: an entry is used only when its record, written last, claims what the caller
expects and holds the digest of the bytes on disk; anything else is logged, deleted and "absent"."""

from __future__ import annotations

import json
import logging
import os

import pytest

from pdserve.runtime import disk_cache

CLAIMS = {"format": 1, "mode": "w4a16", "dtype": "torch.bfloat16", "source": "abc"}


def written_file(tmp_path, content: bytes = b"x" * 100_000) -> str:
    entry = str(tmp_path / "entry.pt")
    tmp = str(tmp_path / ".tmp-entry")
    with open(tmp, "wb") as f:
        f.write(content)
    disk_cache.commit(tmp, entry, CLAIMS)
    assert not os.path.exists(tmp)
    return entry


def written_folder(tmp_path) -> str:
    entry = str(tmp_path / "folder")
    tmp = tmp_path / ".tmp-folder"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(os.urandom(50_000))
    (tmp / "sub" / "config.json").write_text("{}")
    (tmp / "empty").write_bytes(b"")
    disk_cache.commit(str(tmp), entry, CLAIMS)
    return entry


def refused(entry: str, caplog, reason: str, claims: dict = CLAIMS) -> None:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.runtime.disk_cache"):
        assert disk_cache.check(entry, claims) is False
    assert f"cache entry {entry} is not used" in caplog.text and reason in caplog.text, caplog.text
    assert not os.path.lexists(entry) and not os.path.exists(disk_cache.record_path(entry))
    caplog.clear()
    assert disk_cache.check(entry, claims) is False and not caplog.text  # now simply absent


def test_an_entry_is_checked_and_used(tmp_path, caplog) -> None:
    for entry in (written_file(tmp_path), written_folder(tmp_path)):
        assert disk_cache.check(entry, CLAIMS) and disk_cache.check(entry, dict(reversed(CLAIMS.items())))
    assert not caplog.text
    assert disk_cache.check(str(tmp_path / "never-written"), CLAIMS) is False and not caplog.text


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_one_changed_byte_is_caught(tmp_path, caplog, where) -> None:
    entry = written_file(tmp_path)
    offset = {"start": 0, "middle": 50_000, "end": 99_999}[where]
    with open(entry, "r+b") as f:
        f.seek(offset)
        f.write(b"y")
    refused(entry, caplog, "does not match its digest")


def test_truncated_grown_and_missing_files_are_caught(tmp_path, caplog) -> None:
    entry = written_file(tmp_path)
    os.truncate(entry, 10)
    refused(entry, caplog, "holds 10 bytes, 100000 were written")
    folder = written_folder(tmp_path)
    with open(os.path.join(folder, "sub", "config.json"), "a") as f:
        f.write(" ")
    refused(folder, caplog, "sub/config.json holds 3 bytes, 2 were written")
    folder = written_folder(tmp_path)
    os.unlink(os.path.join(folder, "empty"))
    refused(folder, caplog, "empty is missing")


def test_an_entry_claiming_something_else_is_refused(tmp_path, caplog) -> None:
    entry = written_file(tmp_path)
    refused(entry, caplog, "it claims mode='w4a16' (expected 'w8a16_int8')", {**CLAIMS, "mode": "w8a16_int8"})


def test_a_missing_or_broken_record_is_refused(tmp_path, caplog) -> None:
    entry = written_file(tmp_path)
    os.unlink(disk_cache.record_path(entry))  # a writer that died before its record, or an older pdserve
    refused(entry, caplog, "it has no record")
    for bad, why in [
        ("{", "could not be read (JSONDecodeError"),
        ("[]", "not a JSON object"),
        ('{"format": 99, "algorithm": "xxh3_128"}', "format 99"),
        (json.dumps({"format": 1, "algorithm": "xxh3_128", "claims": CLAIMS, "files": {}}), "names no files"),
        (json.dumps({"format": 1, "algorithm": "xxh3_128", "claims": CLAIMS, "files": {"": 3}}), "could not"),
    ]:
        entry = written_file(tmp_path)
        with open(disk_cache.record_path(entry), "w") as f:
            f.write(bad)
        refused(entry, caplog, why)


def test_a_record_without_its_content_and_a_folder_in_place_of_a_file(tmp_path, caplog) -> None:
    entry = written_file(tmp_path)
    os.unlink(entry)
    refused(entry, caplog, "its content is missing")
    entry = written_file(tmp_path)
    os.unlink(entry)
    os.mkdir(entry)
    refused(entry, caplog, "is missing")


def test_reject_deletes_and_commit_replaces(tmp_path, caplog) -> None:
    entry = written_file(tmp_path)
    disk_cache.reject(entry, "it would not load")
    assert "it would not load" in caplog.text and not os.path.exists(entry)
    entry = written_file(tmp_path, b"first")
    entry = written_file(tmp_path, b"second")
    assert disk_cache.check(entry, CLAIMS)
    with open(entry, "rb") as f:
        assert f.read() == b"second"
