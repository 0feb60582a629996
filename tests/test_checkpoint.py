"""Checkpoints that can't betray a resume (issue 17): a manifest of every file's checksum,
written last; torn checkpoints detected and set aside; retention counts complete ones only."""

from __future__ import annotations

import json
import os

import pytest

from xrlhf.checkpoint import (MANIFEST, WARMUP, any_checkpoint, checkpoint_problem, checkpoint_step, list_checkpoints,
                              remove_checkpoints, resume_checkpoint, save_checkpoint)


class Handle:
    trainable = True

    def __init__(self, value):
        self.value = value

    def save_state(self, path):
        import torch
        os.makedirs(path)
        torch.save({"w": [self.value] * 1000}, os.path.join(path, "state.pt"))

    def rng_state(self):
        return {"seed": self.value}


def save(out, step, keep=3, prefix="step-"):
    return save_checkpoint(out, step, {"trainer": {"step": step}}, {"policy": Handle(step)}, keep, prefix=prefix)


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    path = save(tmp_path, 1)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 1 and set(manifest["files"]) == {"driver.pt", "policy/state.pt", "rng.pt"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] == (path / n).stat().st_size for n, f in manifest["files"].items())
    assert checkpoint_problem(path) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "no_manifest"])
def test_a_torn_checkpoint_is_set_aside_and_the_previous_used(tmp_path, damage):
    first, second = save(tmp_path, 1), save(tmp_path, 2)
    victim = second / "policy" / "state.pt"
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[-10] ^= 1
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:50])
    elif damage == "remove":
        victim.unlink()
    else:
        (second / MANIFEST).unlink()
        (second / "rng.pt").unlink()  # a directory whose writing never finished
    assert checkpoint_problem(second) is not None
    assert resume_checkpoint(tmp_path) == first
    assert (tmp_path / "checkpoints" / "torn-step-00000002").is_dir()
    assert list_checkpoints(tmp_path) == [first]


def test_all_torn_gives_none_and_legacy_checkpoints_are_accepted(tmp_path):
    only = save(tmp_path, 1)
    (only / "driver.pt").write_bytes(b"x")
    assert resume_checkpoint(tmp_path) is None and list_checkpoints(tmp_path) == []
    legacy = save(tmp_path, 2)
    os.remove(legacy / MANIFEST)  # written before manifests existed: rng.pt marks it complete
    assert checkpoint_problem(legacy) is None and resume_checkpoint(tmp_path) == legacy


def test_retention_keeps_the_newest_complete_ones(tmp_path):
    for step in range(1, 5):
        save(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    (tmp_path / "checkpoints" / "step-00000009").mkdir()  # half-written: not complete, never counted
    save(tmp_path, 5, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000005"]


def test_warmup_checkpoints_are_their_own_kind(tmp_path):
    """``warmup-*`` beside ``step-*``: listed, kept, set aside when torn and removed apart; a run's
    newest checkpoint is an RL one once there is one."""
    for step in (10, 20, 30):
        save(tmp_path, step, keep=2, prefix=WARMUP)
    warm = list_checkpoints(tmp_path, WARMUP)
    assert [p.name for p in warm] == ["warmup-00000020", "warmup-00000030"] and list_checkpoints(tmp_path) == []
    assert [checkpoint_step(p) for p in warm] == [20, 30] and any_checkpoint(tmp_path) == warm[-1]
    (warm[-1] / "rng.pt").write_bytes(b"x")
    assert resume_checkpoint(tmp_path) is None and resume_checkpoint(tmp_path, WARMUP) == warm[0]
    assert (tmp_path / "checkpoints" / "torn-warmup-00000030").is_dir()
    rl = save(tmp_path, 1)
    assert any_checkpoint(tmp_path) == rl
    remove_checkpoints(tmp_path, WARMUP)
    assert list_checkpoints(tmp_path, WARMUP) == [] and list_checkpoints(tmp_path) == [rl]
