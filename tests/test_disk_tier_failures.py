"""The SSD tier (memory.disk_path) when the disk fails it: a write error mid-run (a full disk) stops the run with one
error naming memory.disk_path and the cause, the complete checkpoints stay valid and a resume from them is exact;
the error is never lost (a failed write-behind whose slot is then reused for a read-ahead used to be dropped, so the
run went on with a file that no longer held the state). A run killed outright leaves its scratch folder, which the
next run removes, and resumes exactly; an unwritable memory.disk_path is refused before anything is written."""

import contextlib
import errno
import os
import threading

import pytest

from megatrain.checkpoint import complete_checkpoints, verify_checkpoint
from megatrain.errors import MegatrainError
from megatrain.runtime import disk_tier
from test_checkpoint_helpers import losses, run, setup_run, unit_hashes

STEPS = 6
DISK = "memory.disk_states=[v,m]"


def failing_writes(monkeypatch, fail_at: int, after=None) -> list:
    """The tier's `fail_at`-th write (counted from 1, on its I/O threads; with `after`, counted from the first write
    issued once after() holds) fails with ENOSPC, as on a full disk: the system call fails, as it would, and the
    tier's own request code sees it."""
    writes = []
    pwritev = os.pwritev

    def patched(fd, buffers, offset, *rest):
        if threading.current_thread().name.startswith("megatrain-ssd") and (after is None or writes or after()):
            writes.append(fd)
            if len(writes) == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device")
        return pwritev(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "pwritev", patched)
    return writes


def _logged(out, steps: int):
    """Whether `steps` steps are in out/metrics.jsonl (read by the tier's I/O thread before a write)."""
    return lambda: (out / "metrics.jsonl").is_file() and len(losses(out)) >= steps


# the first step's first write-behind; the first one of the fifth step's updates (counted from the fourth step's
# record: how many writes a step takes depends on how the I/O threads meet their requests)
@pytest.mark.parametrize("fail_after", [None, 4], ids=["first-write", "fifth-step"])
def test_a_write_error_stops_the_run_and_the_checkpoints_resume_exactly(tmp_path, monkeypatch, fail_after):
    cfg = setup_run(tmp_path, train={"steps": STEPS, "precision": "fp32"}, checkpoint={"every": 2, "keep": 0})
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    reference = tmp_path / "reference"
    run(cfg, f"output.dir={reference}")  # all in RAM, uninterrupted

    out = tmp_path / "run"
    writes = failing_writes(monkeypatch, 1, None if fail_after is None else _logged(out, fail_after))
    with pytest.raises(MegatrainError) as e:
        run(cfg, f"memory.disk_path={ssd}", DISK)
    message = str(e.value)
    assert f"memory.disk_path {ssd}" in message and "No space left on device" in message, message
    assert "\n" not in message and "resume" in message
    assert len(writes) >= 1
    done = max(losses(out), default=0) if (out / "metrics.jsonl").is_file() else 0
    assert done < STEPS  # it stopped: no step after the failure was logged as trained
    assert fail_after is None or done >= fail_after
    saved = [s for s, _ in complete_checkpoints(out / "checkpoints")]
    for s in saved:
        verify_checkpoint(out / "checkpoints" / f"step-{s}")
    assert list(ssd.iterdir()) == []  # the tier's scratch files are removed all the same

    monkeypatch.undo()
    run(cfg, "resume=auto", f"memory.disk_path={ssd}", DISK)  # from the last checkpoint, or from the start
    assert losses(out) == losses(reference)
    assert unit_hashes(out / "checkpoints" / f"step-{STEPS}") == \
        unit_hashes(reference / "checkpoints" / f"step-{STEPS}")


def test_a_lost_write_is_reported_by_the_tier_itself(tmp_path, monkeypatch):
    """DiskTier alone: a write-behind that fails, whose slot is reused by a read-ahead before anyone waits on it,
    still fails the next call (acquire, release, flush, read_unit) with the error naming the unit and the state."""
    import torch

    tier = disk_tier.DiskTier(tmp_path, ("exp_avg_sq",), [4096, 4096, 4096, 4096], piece=1024, depth=1, threads=1,
                              request=4096)
    pwritev = os.pwritev

    def fail_unit_0_writes(fd, buffers, offset, *rest):
        if fd == tier.fds[(0, "exp_avg_sq")]:
            raise OSError(errno.EIO, "Input/output error")
        return pwritev(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "pwritev", fail_unit_0_writes)
    try:
        got = tier.acquire(0, 0)
        got["exp_avg_sq"].fill_(1.0)
        tier.release(0, 0)  # the write-behind fails on its I/O thread
        with pytest.raises(MegatrainError, match=r"unit 0's Adam v .*Input/output error"):
            for u in range(4):  # read-aheads reuse the slot of the failed write
                for a, _ in tier.pieces(u):
                    tier.acquire(u, a)
                    tier.release(u, a, dirty=False)
            tier.flush()
        with pytest.raises(MegatrainError, match="Input/output error"):
            tier.read_unit(1, "exp_avg_sq", torch.empty(4096))
    finally:
        with contextlib.suppress(MegatrainError):
            tier.close()  # waits for the writes (raising the error again), then removes the scratch folder
    assert not tier.dir.exists()


def test_a_dead_runs_scratch_folder_is_removed_and_a_live_ones_kept(tmp_path):
    """Scratch folders left by a run that did not end (unlocked) are removed by the next tier on the same disk_path
    and counted as free by the planner; a live tier's (locked) and a folder without a lock file are left alone."""
    live = disk_tier.DiskTier(tmp_path, ("exp_avg_sq",), [4096], piece=1024)
    dead = tmp_path / "megatrain-ssd-dead"
    dead.mkdir()
    (dead / "unit-00000.exp_avg_sq.bin").write_bytes(b"\0" * 8192)
    (dead / ".lock").touch()
    foreign = tmp_path / "megatrain-ssd-foreign"  # no lock file: not the tier's to judge
    foreign.mkdir()
    assert [d for d, _ in disk_tier.stale_folders(tmp_path)] == [dead]
    notices = []
    other = disk_tier.DiskTier(tmp_path, ("exp_avg_sq",), [4096], piece=1024, notice=notices.append)
    try:
        assert not dead.exists() and live.dir.exists() and foreign.exists()
        assert len(notices) == 1 and "removed the SSD tier's files of 1 earlier run(s) that did not end" in notices[0]
        assert disk_tier.stale_folders(tmp_path) == []  # both open tiers hold their locks
    finally:
        other.close()
        live.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatrain-ssd-foreign"]


def test_kill_9_of_a_disk_tier_run_then_resume_equals_the_ram_run(tmp_path, capfd):
    """A run with Adam m and v on the SSD tier killed with -9 after a checkpoint: its scratch folder stays behind;
    `resume: auto` on the same disk_path removes it, says so, and trains to the same losses and the same final
    checkpoint, byte for byte, as an uninterrupted run with every state in RAM."""
    from test_resume_signals import logged_losses, start_training, wait_until

    steps = 20
    cfg = setup_run(tmp_path, train={"steps": steps, "precision": "fp32"}, checkpoint={"every": 2, "keep": 0})
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    reference = tmp_path / "reference"
    run(cfg, f"output.dir={reference}")
    out = tmp_path / "run"
    with open(cfg, "a") as f:  # the killed run's config: the same keys as the resume's below
        f.write(f"memory:\n  disk_path: {ssd}\n  disk_states: [v, m]\n")
    proc = start_training(cfg, delay=0.1)  # slow saves: the kill lands well before the last step
    try:
        wait_until(lambda: (out / "checkpoints" / "step-4" / "manifest.json").is_file()
                   and len(logged_losses(out)) >= 5, proc)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(logged_losses(out)) < steps
    assert [p.name.startswith("megatrain-ssd-") for p in ssd.iterdir()] == [True]  # left behind by the kill

    summary = run(cfg, "resume=auto")
    assert "removed the SSD tier's files of 1 earlier run(s) that did not end" in capfd.readouterr().err
    assert summary["last_loss"] == losses(reference)[steps]
    assert losses(out) == losses(reference)
    assert unit_hashes(out / "checkpoints" / f"step-{steps}") == \
        unit_hashes(reference / "checkpoints" / f"step-{steps}")
    assert list(ssd.iterdir()) == []


def test_an_unwritable_disk_path_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """One error naming the key before the run starts (os.access reports the folder unwritable: CI runs as root,
    whom a chmod does not stop)."""
    from pathlib import Path

    from megatrain.config import load_config
    from megatrain.run.trainer import prepare

    cfg = setup_run(tmp_path)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == ssd else access(p, mode, *a, **k))
    with pytest.raises(MegatrainError, match=f"memory.disk_path: {ssd} is not writable by this user"):
        prepare(load_config(cfg, [f"memory.disk_path={ssd}", "memory.disk_states=[v]"]))
    assert not (tmp_path / "run").exists()


def test_the_plan_counts_a_dead_runs_scratch_as_free(tmp_path):
    """`megatrain plan` with memory.disk_path: the SSD's free bytes include what a dead run's scratch folder holds
    (the run removes it when the tier opens), and the plan says so."""
    from megatrain.config import load_config
    from megatrain.models import get_adapter
    from megatrain.planner.plan import plan_for_config
    from megatrain.planner.profile import GiB
    from megatrain.planner.sysmem import disk_free
    from transformers import AutoConfig

    cfg_path = setup_run(tmp_path)
    ssd = tmp_path / "ssd"
    dead = ssd / "megatrain-ssd-dead"
    dead.mkdir(parents=True)
    (dead / ".lock").touch()
    with open(dead / "unit-00000.exp_avg_sq.bin", "wb") as f:
        f.write(os.urandom(1 << 20))  # 1 MiB written: blocks on disk, not a hole
    cfg = load_config(cfg_path, [f"memory.disk_path={ssd}", "memory.disk_states=[v]"])
    plan = plan_for_config(cfg, get_adapter(AutoConfig.from_pretrained(tmp_path / "model")), "cpu")
    stale = disk_tier.stale_folders(ssd)[0][1]
    assert stale >= 1 << 20
    assert abs(plan.ssd_free - (disk_free(ssd) + stale)) < 64 << 20  # (other writers may move the disk's free space)
    assert any(f"{stale / GiB:.1f} GiB of SSD-tier files left by runs that did not end" in n for n in plan.notes)


def test_a_filesystem_without_flock_keeps_every_folder(tmp_path, monkeypatch):
    """Where flock is not supported (ENOLCK: some network filesystems) the tier still opens, and no scratch folder
    is judged stale, so none is removed wrongly."""
    import fcntl

    dead = tmp_path / "megatrain-ssd-dead"
    dead.mkdir()
    (dead / ".lock").touch()

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert disk_tier.stale_folders(tmp_path) == []
    tier = disk_tier.DiskTier(tmp_path, ("exp_avg_sq",), [4096], piece=1024)
    tier.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatrain-ssd-dead"]
