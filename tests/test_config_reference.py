"""Each placement knob is declared once (a field of runtime.schedule.Placement with its Knob, runtime/knobs.py) and
the rest follows from it: its memory.* config key, the plan's placement line and docs/configuration.md, which is
regenerated here and must equal the committed file."""

import importlib.util
from dataclasses import fields
from pathlib import Path

import pytest

from megatrain.config import Config, MemoryConfig, load_command_line
from megatrain.errors import ConfigError
from megatrain.planner.placement import describe
from megatrain.runtime.knobs import knobs, settings
from megatrain.runtime.schedule import Placement

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"
# memory.* keys that are not placement knobs: the budgets and the SSD tier
NOT_KNOBS = {"gpu_budget_gb", "host_budget_gb", "disk_path", "disk_states"}


def generator():
    path = ROOT / "scripts" / "make_config_reference.py"
    spec = importlib.util.spec_from_file_location("make_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_placement_field_declares_its_knob():
    missing = [f.name for f in fields(Placement) if "knob" not in f.metadata]
    assert not missing, f"Placement fields made without runtime.knobs.knob (no config key, bounds or doc): {missing}"
    for k in knobs(Placement):
        assert k.doc and (k.ge is None) != (not k.choices), k
        assert k.default == getattr(Placement(), k.name) and k.allows(k.default), k
        assert not k.shown or k.shown == "always" or k.shown in {f.name for f in fields(Placement)}, k


def test_every_knob_has_its_config_key_and_back():
    names = [k.name for k in knobs(Placement)]
    memory = list(MemoryConfig.model_fields)
    assert not set(names) - set(memory), f"Placement fields with no memory.* key: {set(names) - set(memory)}"
    extra = set(memory) - set(names) - NOT_KNOBS
    assert not extra, f"memory.* keys with no Placement field (or add them to NOT_KNOBS): {extra}"
    assert [m for m in memory if m in names] == names  # the schema lists them in the Placement's order
    for k in knobs(Placement):
        f = MemoryConfig.model_fields[k.name]
        assert f.default is None and f.description == k.description, k.key


@pytest.mark.parametrize("k", knobs(Placement), ids=lambda k: k.name)
def test_config_and_placement_accept_the_same_values(k):
    good = k.choices[-1] if k.choices else k.ge + 3
    bad = "nope" if k.choices else k.ge - 1
    assert getattr(load_command_line(None, ["model.path=m", f"{k.key}={good}"]).memory, k.name) == good
    assert getattr(Placement(**{k.name: good}), k.name) == good
    with pytest.raises(ConfigError, match=rf"command line: {k.key}: Input should be"):
        load_command_line(None, ["model.path=m", f"{k.key}={bad}"])
    with pytest.raises(ValueError, match="invalid placement"):
        Placement(**{k.name: bad})


def test_the_plan_shows_a_placement_in_config_keys():
    assert settings(Placement()) == ("memory.checkpoint_every=1 memory.spill_layers=0 memory.grads_to_host=0 "
                                     "memory.wave_groups=1")
    pl = Placement(checkpoint_every=4, keep_top_layers=0, spill_layers=13, wave_groups=2, group_grads="host",
                   stream_dtype="fp32", seq_tile=8192, attn_block=65536, reuse_attention=1)
    assert describe(pl, 1) == ("memory.checkpoint_every=4 memory.keep_top_layers=0 memory.spill_layers=13 "
                               "memory.grads_to_host=0 memory.wave_groups=1 memory.stream_dtype=fp32 "
                               "memory.seq_tile=8192 memory.attn_block=65536 memory.reuse_attention=1")
    assert "memory.group_grads=host" in describe(pl, 2) and "memory.keep_top_layers" not in describe(Placement(), 1)


def test_reference_lists_every_key_and_knob():
    text = REFERENCE.read_text()
    for section, f in Config.model_fields.items():
        model = f.annotation
        for key in getattr(model, "model_fields", {}) or [section]:
            name = f"{section}.{key}" if key != section else key
            assert f"| `{name}` |" in text, f"{name} is not in docs/configuration.md"
    for k in knobs(Placement):
        assert text.count(f"| `{k.key}` |") == 2, f"{k.key}: in the memory table and the placement knobs' table"


def test_reference_is_current():
    assert REFERENCE.read_text() == generator().render(), \
        "docs/configuration.md is stale: run python3 scripts/make_config_reference.py"
