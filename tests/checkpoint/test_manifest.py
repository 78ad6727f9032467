"""SHA256SUMS: written with every checkpoint, checked on load, naming the file that changed."""

import hashlib
import os
import shutil
import stat
import subprocess

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint import CheckpointError
from k3.pretrained import load_pretrained, save_pretrained
from k3.checkpoint.manifest import MANIFEST, read_checksums, verify_checksums


@pytest.fixture
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny")).eval()


def flip_tensor_byte(path, at: float = 0.5) -> None:
    """Flip one bit inside the tensor data of a safetensors file (past the 8-byte length and the JSON header)."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    i = start + int((len(raw) - start) * at)
    raw[i] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("shard", [None, 300_000])
def test_every_file_is_recorded_in_sha256sum_format(tmp_path, model, shard):
    save_pretrained(model, tmp_path, **({"max_shard_bytes": shard} if shard else {}))
    sums = read_checksums(tmp_path)
    files = {p.name for p in tmp_path.iterdir()} - {MANIFEST}
    assert set(sums) == files
    assert files == {"config.json", "model.safetensors"} if shard is None else \
        {"config.json", "model.safetensors.index.json", "model-00001-of-00008.safetensors"} < files
    for name, digest in sums.items():
        assert digest == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    if shutil.which("sha256sum"):  # the format coreutils checks
        assert subprocess.run(["sha256sum", "--check", "--quiet", MANIFEST], cwd=tmp_path).returncode == 0


def test_a_flipped_byte_is_caught_on_load_and_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    flip_tensor_byte(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its sha256"):
        load_pretrained(tmp_path)
    damaged = load_pretrained(tmp_path, verify=False)  # the data still parses: only the checksum can tell
    differs = [n for n, t in damaged.state_dict().items() if not torch.equal(t, model.state_dict()[n])]
    assert len(differs) == 1


def test_a_flipped_byte_in_a_shard_or_the_config_is_named(tmp_path, model):
    save_pretrained(model, tmp_path, max_shard_bytes=300_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    flip_tensor_byte(shard, at=0.1)
    with pytest.raises(CheckpointError, match=shard.name):
        load_pretrained(tmp_path)
    save_pretrained(model, tmp_path, max_shard_bytes=300_000)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text().replace('"hidden_size": 64', '"hidden_size": 64 '))
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(tmp_path)


@pytest.mark.slow
def test_directories_without_a_manifest_load(tmp_path, model):
    """The official release and transformers' save_pretrained write no SHA256SUMS: nothing to verify."""
    save_pretrained(model, tmp_path)
    (tmp_path / MANIFEST).unlink()
    x = torch.randint(0, 1024, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp_path)(x)["logits"], model(x)["logits"])
    verify_checksums(tmp_path)  # no manifest: passes


def test_files_added_later_load_and_a_damaged_manifest_is_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # copied in afterwards: no entry, not checked
    verify_checksums(tmp_path, ["tokenizer.json", "model.safetensors"])
    (tmp_path / MANIFEST).write_text("not a checksum line\n")
    with pytest.raises(CheckpointError, match=f"{MANIFEST}:1"):
        load_pretrained(tmp_path)
    save_pretrained(model, tmp_path)  # rewriting replaces a damaged manifest
    load_pretrained(tmp_path)


def test_a_failed_rewrite_leaves_the_old_files_loadable(tmp_path, model, monkeypatch):
    """The entries of files about to be rewritten go first: a crash in between never reads as corruption."""
    save_pretrained(model, tmp_path)
    import k3.checkpoint.io as io

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(io, "save_file", boom)
    with pytest.raises(OSError):
        save_pretrained(model, tmp_path)
    monkeypatch.undo()
    load_pretrained(tmp_path)


def test_files_are_written_with_the_ordinary_mode(tmp_path, model):
    old = os.umask(0o022)
    try:
        save_pretrained(model, tmp_path, max_shard_bytes=300_000)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert set(modes.values()) == {0o644}, modes  # not mkstemp's 0600
