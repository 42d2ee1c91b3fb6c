"""The disk's rates for the SSD tier: measured as the tier moves its states (runtime/disk_probe.py), by
`megatrain probe --disk DIR` into the profile, and by `megatrain train` at memory.disk_path when no profile states
them; the plan's SSD lines say which rates it used and where they came from."""

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from megatrain.errors import MegatrainError
from megatrain.planner.profile import DEFAULTS, from_dict, load_profile
from megatrain.runtime import disk_probe
from megatrain.runtime.disk_files import stale_folders

MiB = 1 << 20


def test_measures_write_then_read_and_leaves_nothing(tmp_path):
    d = disk_probe.measure_disk(tmp_path, 8 * MiB, threads=4, request=MiB)
    assert d["bytes"] == 8 * MiB and d["request"] == MiB and d["threads"] == 4 and d["path"] == str(tmp_path)
    assert d["read_bps"] > 0 and d["write_bps"] > 0
    assert d["direct"] in (True, False)
    assert list(tmp_path.iterdir()) == []  # the scratch folder, its file and its lock are gone
    line = disk_probe.describe(d)
    assert line.startswith(f"disk at {tmp_path}: read ") and "4 x 1 MiB requests in flight" in line


def test_the_file_holds_random_bytes_not_zeros(tmp_path, monkeypatch):
    """A compressing or thin-provisioned disk stores zeros for nothing: what is written must be data."""
    seen = []
    real = os.pwritev

    def spy(fd, bufs, offset):
        if len(bufs[0]) == MiB:  # the measurement's requests (not the O_DIRECT check's page)
            seen.append(bytes(bufs[0][:4096]))
        return real(fd, bufs, offset)

    monkeypatch.setattr(disk_probe.os, "pwritev", spy)
    disk_probe.measure_disk(tmp_path, 4 * MiB, threads=2, request=MiB)
    assert len(seen) == 4 and all(len(set(b)) > 200 for b in seen)


def test_rounds_to_whole_requests_and_keeps_to_half_the_free_space(tmp_path, monkeypatch):
    assert disk_probe.measure_disk(tmp_path, 5 * MiB + 123, threads=2, request=MiB)["bytes"] == 5 * MiB
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_probe.shutil, "disk_usage", lambda p: usage(100 * MiB, 94 * MiB, 6 * MiB))
    assert disk_probe.measure_disk(tmp_path, 64 * MiB, threads=2, request=MiB)["bytes"] == 3 * MiB
    monkeypatch.setattr(disk_probe.shutil, "disk_usage", lambda p: usage(100 * MiB, 99 * MiB, MiB))
    with pytest.raises(MegatrainError, match=r"memory.disk_path: .* has 1 MiB free, too little to measure"):
        disk_probe.measure_disk(tmp_path, 64 * MiB, threads=2, request=MiB)
    assert list(tmp_path.iterdir()) == []


def test_unusable_folder_names_the_key(tmp_path):
    with pytest.raises(MegatrainError, match="memory.disk_path: .*missing does not exist; create the folder"):
        disk_probe.measure_disk(tmp_path / "missing", MiB, request=MiB)
    with pytest.raises(MegatrainError, match=r"^probe: --disk: .*missing does not exist; create the folder \(on a "
                                             r"local SSD\)$"):
        disk_probe.measure_disk(tmp_path / "missing", MiB, request=MiB, key="probe: --disk")


def test_an_io_error_is_one_message_and_nothing_is_left(tmp_path, monkeypatch):
    def full(fd, bufs, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_probe.os, "pwritev", full)
    with pytest.raises(MegatrainError, match=r"memory.disk_path: measuring the disk at .* failed: No space left"):
        disk_probe.measure_disk(tmp_path, 4 * MiB, threads=2, request=MiB)
    assert list(tmp_path.iterdir()) == []


def test_a_probe_killed_half_way_leaves_a_folder_the_tier_removes(tmp_path):
    """The probe's scratch folder is the tier's kind: while the probe runs its lock is held (not stale); once its
    process is gone (here: the lock's descriptor closed without cleaning up) the next tier removes it."""
    from megatrain.runtime.disk_files import open_scratch

    folder, fd = open_scratch(tmp_path, "probe-")
    (folder / "probe.bin").write_bytes(b"x" * 4096)
    try:
        assert folder.name.startswith("megatrain-ssd-probe-") and stale_folders(tmp_path) == []
    finally:
        os.close(fd)
    assert [d for d, _ in stale_folders(tmp_path)] == [folder]
    shutil.rmtree(folder)


def test_profile_disk_section_and_its_source(tmp_path):
    assert not DEFAULTS.disk_measured and DEFAULTS.disk_source.startswith("the defaults")
    p = from_dict({"disk": {"read_bps": 7e9, "write_bps": 3e9, "path": "/nvme"}}, "prof.json")
    assert (p.disk_read_bps, p.disk_write_bps, p.disk_measured) == (7e9, 3e9, True)
    assert p.disk_source == "prof.json, measured at /nvme"
    q = from_dict({"cpu": {"adamw_params_per_s": 1e9}}, "prof.json")  # probed without --disk: the defaults
    assert (q.disk_read_bps, q.disk_write_bps, q.disk_measured) == (1.2e9, 1.6e9, False)


def _cfg(tmp_path, monkeypatch, *overrides):
    from megatrain.config import load_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no probed profile at the default path
    return load_config(None, list(overrides))


def test_train_measures_the_disk_at_disk_path_when_the_profile_does_not_say(tmp_path, monkeypatch):
    from megatrain.planner import plan as plan_mod
    from megatrain.planner import probe

    monkeypatch.setattr(probe, "measure_adamw_threads", lambda cores, numel, reps=2: (2, {2: 3e9}))
    calls = []
    real = disk_probe.measure_disk

    def measured(path, nbytes, **kw):
        calls.append((str(path), nbytes))
        return real(path, 2 * MiB, request=MiB)

    monkeypatch.setattr(disk_probe, "measure_disk", measured)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    prof = plan_mod.run_profile(_cfg(tmp_path, monkeypatch, f"memory.disk_path={ssd}"), "cuda")
    assert calls == [(str(ssd), disk_probe.START_BYTES)]
    assert prof.disk_measured and prof.disk_source.startswith(f"measured here at start: disk at {ssd}: read ")
    assert prof.disk_read_bps > 0 and prof.disk_read_bps != DEFAULTS.disk_read_bps
    assert prof.adamw_params_per_s == 3e9  # the AdamW rate is measured as before
    # without memory.disk_path, or for a CPU run (its updates inline; the tests' tiny SSD runs), nothing is measured
    plan_mod.run_profile(_cfg(tmp_path, monkeypatch), "cuda")
    plan_mod.run_profile(_cfg(tmp_path, monkeypatch, f"memory.disk_path={ssd}"), "cpu")
    assert len(calls) == 1
    # a profile that states the disk is kept; one probed without --disk gets the disk measured
    stated = tmp_path / "stated.json"
    stated.write_text(json.dumps({"cpu": {"adamw_params_per_s": 1e9}, "disk": {"read_bps": 5e9, "write_bps": 4e9}}))
    kept = plan_mod.run_profile(_cfg(tmp_path, monkeypatch, f"memory.disk_path={ssd}", f"plan.profile={stated}"),
                                "cuda")
    assert (kept.disk_read_bps, kept.disk_write_bps) == (5e9, 4e9) and len(calls) == 1
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"cpu": {"adamw_params_per_s": 1e9}}))
    got = plan_mod.run_profile(_cfg(tmp_path, monkeypatch, f"memory.disk_path={ssd}", f"plan.profile={bare}"),
                               "cuda")
    assert got.disk_measured and got.adamw_params_per_s == 1e9 and len(calls) == 2


def test_plan_names_the_disk_rates_it_used(tmp_path):
    """Qwen2.5-14B with Adam v on the SSD: the plan's SSD lines give the rates and where they came from."""
    from transformers import AutoConfig

    from megatrain.models import get_adapter
    from megatrain.planner import Workload, make_plan
    from megatrain.planner.plan import with_disk_measured
    from megatrain.planner.report import render

    adapter = get_adapter(AutoConfig.from_pretrained(Path(__file__).resolve().parent.parent / "bench" /
                                                     "model-configs" / "qwen2.5-14b"))
    w = Workload((158,), 1024, compile=True, disk_states=("v",))
    text = render(make_plan(adapter, w, DEFAULTS, disk_path="/ssd", suggest=False))
    assert "at 1.20 GB/s read, 1.60 GB/s write (the defaults: a local disk with O_DIRECT" in text
    prof = with_disk_measured(DEFAULTS, str(tmp_path), nbytes=2 * MiB)
    p = make_plan(adapter, w, prof, disk_path=str(tmp_path), suggest=False)
    assert p.ssd["read_bps"] == prof.disk_read_bps and p.ssd["source"] == prof.disk_source
    assert f"write (measured here at start: disk at {tmp_path}: read" in render(p)


def test_probe_cli_writes_the_disk_section(tmp_path):
    from megatrain.planner.probe import main

    out = tmp_path / "profile.json"
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    assert main(["--out", str(out), "--disk", str(ssd), "--disk-gib", "0.03125", "--adam-params", "65536",
                 "--matmul", "64"]) == 0
    raw = json.loads(out.read_text())
    assert raw["disk"]["bytes"] == 32 * MiB and raw["disk"]["path"] == str(ssd) and raw["disk"]["read_bps"] > 0
    prof = load_profile(out)
    assert prof.disk_measured and prof.disk_read_bps == raw["disk"]["read_bps"]
    assert list(ssd.iterdir()) == []


def test_probe_cli_refuses_a_bad_disk_before_measuring(tmp_path, capsys):
    from megatrain.planner.probe import main

    out = tmp_path / "profile.json"
    assert main(["--out", str(out), "--disk", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "probe: --disk: " in err and "does not exist" in err and "unset" not in err
    assert main(["--out", str(out), "--disk", str(tmp_path), "--disk-gib", "0"]) == 2
    assert "argument --disk-gib: expected a finite number above 0, got '0'" in capsys.readouterr().err
    assert not out.exists()
