"""Checkpoints and resume with the SSD tier (memory.disk_path): a disk-tier run's checkpoints are the all-RAM run's,
byte for byte (the same unit files, the same sha256), with the writer racing the optimizer; a RAM checkpoint resumes
exactly into a disk-tier run and a disk-tier checkpoint exactly into a RAM run; the config's memory keys are checked
before anything is written."""

import pytest

from megatrain.config import load_config
from megatrain.errors import MegatrainError
from megatrain.run.trainer import prepare
from test_checkpoint_helpers import losses, records, run, setup_run, unit_hashes


@pytest.mark.parametrize("precision,states", [("fp32", "[v,m]"), ("bf16", "[v,m,master]")])
def test_disk_tier_checkpoints_equal_ram_and_resume_both_ways(tmp_path, monkeypatch, precision, states):
    cfg = setup_run(tmp_path, train={"precision": precision}, checkpoint={"every": 3, "keep": 0})
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    disk = (f"memory.disk_path={ssd}", f"memory.disk_states={states}")
    ram_out, disk_out = tmp_path / "run", tmp_path / "disk"
    run(cfg)
    # slow writer: step 4's optimizer waits, unit by unit, for the step-3 save, which reads the tier's files
    monkeypatch.setenv("MEGATRAIN_TEST_SAVE_DELAY_S", "0.03")
    summary = run(cfg, f"output.dir={disk_out}", *disk)
    monkeypatch.delenv("MEGATRAIN_TEST_SAVE_DELAY_S")
    assert losses(disk_out) == losses(ram_out) and len(losses(ram_out)) == 6
    for step in (3, 6):
        assert unit_hashes(disk_out / "checkpoints" / f"step-{step}") == \
            unit_hashes(ram_out / "checkpoints" / f"step-{step}")
    assert list(ssd.iterdir()) == []  # the tier's scratch files are gone with the run
    assert summary["last_loss"] == losses(ram_out)[6]
    steps = [r for r in records(disk_out) if "loss" in r]  # the disk's traffic in every step's record
    assert all("disk_read_gb" in r and "disk_write_gbps" in r for r in steps)
    assert sum(r["disk_write_gb"] for r in steps) > 0 and "disk_read_gb" not in records(ram_out)[0]
    for r in steps:  # the disk's own busy time: at least either kind's, at most both kinds' (they overlap)
        assert max(r["disk_read_busy_s"], r["disk_write_busy_s"]) <= r["disk_busy_s"] + 1e-9
        assert r["disk_busy_s"] <= r["disk_read_busy_s"] + r["disk_write_busy_s"] + 1e-9
        moved = r["disk_read_gb"] + r["disk_write_gb"]
        assert r["disk_gbps"] == (pytest.approx(moved / r["disk_busy_s"]) if moved else 0.0)
        assert r["disk_busy"] == pytest.approx(r["disk_busy_s"] / r["step_time_s"])
    if precision == "fp32":
        return  # the resumes, once (the bf16 case has every state on disk)

    # a RAM checkpoint resumed into a disk-tier run, and a disk-tier checkpoint into a RAM run: both exact
    to_disk, to_ram = tmp_path / "to_disk", tmp_path / "to_ram"
    run(cfg, f"output.dir={to_disk}", f"resume={ram_out / 'checkpoints' / 'step-3'}", *disk)
    run(cfg, f"output.dir={to_ram}", f"resume={disk_out / 'checkpoints' / 'step-3'}")
    later = {s: v for s, v in losses(ram_out).items() if s > 3}
    want = unit_hashes(ram_out / "checkpoints" / "step-6")
    for out in (to_disk, to_ram):
        assert losses(out) == later
        assert unit_hashes(out / "checkpoints" / "step-6") == want


@pytest.mark.parametrize("overrides,message", [
    (("memory.disk_states=[v]",), "memory.disk_states: ['v'] needs memory.disk_path"),
    (("memory.disk_path={missing}",), "memory.disk_path: {missing} does not exist"),
    (("memory.disk_path={file}",), "memory.disk_path: {file} is not a folder"),
    (("memory.disk_path={ssd}", "memory.disk_states=[v,master]"), "memory.disk_states: 'master' on disk needs the "
                                                                  "bf16 streaming copy"),
])
def test_disk_keys_refused_before_anything_is_written(tmp_path, overrides, message):
    """Bad memory.disk_* keys: one MegatrainError naming the key, and output.dir never created."""
    cfg = setup_run(tmp_path)  # train.precision fp32: the master is what streams
    paths = {"missing": tmp_path / "nope", "file": tmp_path / "train.jsonl", "ssd": tmp_path}
    with pytest.raises(MegatrainError) as e:
        prepare(load_config(cfg, [o.format(**paths) for o in overrides]))
    assert message.format(**paths) in str(e.value)
    assert not (tmp_path / "run").exists()


def test_the_run_keeps_the_configured_states_on_disk(tmp_path):
    """prepare builds the store the plan describes: the states memory.disk_states names on the tier, no RAM for
    them, the plan's host figure without them and with the tier's cache."""
    cfg = setup_run(tmp_path, train={"precision": "bf16"})
    (tmp_path / "ssd").mkdir()
    r = prepare(load_config(cfg, [f"memory.disk_path={tmp_path / 'ssd'}", "memory.disk_states=[master,v]"]))
    try:
        assert r.plan.workload.disk_states == ("v", "master")
        assert r.store.disk is not None and set(r.store.disk.kinds) == {"exp_avg_sq", "master"}
        assert r.store.master.numel() == 0 and r.store.exp_avg_sq.numel() == 0 and r.store.exp_avg.numel() > 0
        assert "fp32 master weights" not in r.plan.host and "Adam v (fp32)" not in r.plan.host
        assert r.plan.host["SSD tier cache (read-ahead and write-behind slots)"] == r.store.disk.cache_bytes
        assert r.plan.ssd["resident_bytes"] == r.store.disk.disk_bytes
        assert len(list(r.store.disk.dir.glob("*.bin"))) == 2 * len(r.store.tiles)
    finally:
        r.runtime.close()
    assert list((tmp_path / "ssd").iterdir()) == []
