"""The plan's predictions against the measured runs: GPU peak, host peak RSS and step time.

    python bench/plan_vs_measured.py [RESULTS_DIR ...] [--profile PROFILE.json]

For every benchmark result (a result.json of bench_megatrain.py runs, or of `megatrain train` runs through
bench_cli.py that recorded the plan they made at their start) under the given folders (default: bench/results), the
plan is made for the same model, shape, micro-batches, precision and compile mode and compared with what the run
measured; a `megatrain train` run is compared with its own plan, as the run printed it. Measured:
torch.cuda.max_memory_allocated, the process's peak RSS (several ranks: the node's summed PSS) and the mean step
time. Targets: memory within 10%, time within 15%. Without --profile the plan uses its defaults (fitted to the runs
of bench/results/planner-fit-h200: those rows are in-sample); --profile bench/results/probe-h200/profile.json uses
that H200's probe instead. The GPU idle column is the step's time without compute: the forward waiting for the CPU
optimizer, mostly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from megatrain.models import get_adapter  # noqa: E402
from megatrain.planner import Workload, make_plan  # noqa: E402
from megatrain.planner.profile import DEFAULTS, GiB, load_profile  # noqa: E402  (not exported by megatrain.planner)
from megatrain.runtime.schedule import Placement  # noqa: E402
from refruns import host_measured, runs_of  # noqa: E402


def load_results(*dirs: Path) -> list[dict]:
    """Every bench_megatrain.py result on CUDA (a JSON whose result has step_s) under the folders, oldest first."""
    out = []
    for d in dirs:
        for f in sorted(Path(d).rglob("*.json")):
            try:
                payload = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if not isinstance(payload, dict):
                continue
            for run in runs_of(payload):  # a reference run of several runs lists them
                r, cmd = run.get("result"), run.get("command", "")
                cli = "bench_cli" in cmd and isinstance(r, dict) and isinstance(r.get("plan"), dict)
                if (isinstance(r, dict) and "step_s" in r and ("bench_megatrain" in cmd or cli)
                        and r.get("device", "cuda") == "cuda"):  # --device cpu runs check the script only
                    out.append({**r, "file": str(f.relative_to(HERE.parent) if f.is_relative_to(HERE.parent) else f),
                                "command": cmd})
    return out


def _arg(command: str, name: str, default=None):
    parts = command.split()
    return parts[parts.index(name) + 1] if name in parts[:-1] else default


def workload_of(r: dict, vocab: int) -> Workload:
    seqs, micro = r["seqs_per_step"], r["micro"]
    # a result that does not record the LM-head chunk ran the older head: chunks of ~1 GiB of fp32 logits and the
    # eager cross-entropy (no CUDA head kernels)
    chunk = int(r.get("loss_chunk") or max(128, (1 << 28) // vocab))
    head_kernels = "loss_chunk" in r
    sizes = [micro] * (seqs // micro) + ([seqs % micro] if seqs % micro else [])
    cmd = r.get("command", "")
    pl = r.get("placement")
    if isinstance(pl, dict):  # the placement the run used (--auto: the planner's)
        placement = Placement(**pl)
    else:  # a result that records no placement: spill and offloaded gradients only
        placement = Placement(spill_layers=int(r.get("spill_layers") or _arg(cmd, "--spill", 0)),
                              grads_to_host=int(r.get("offload_units") or _arg(cmd, "--offload", 0)))
    return Workload(tuple(sizes), r["seq"], device="cuda", precision=r.get("precision", "bf16"),
                    compile=bool(r.get("compile")), num_slots=int(_arg(cmd, "--slots", 2)), placement=placement,
                    loss_chunk_tokens=chunk, head_kernels=head_kernels)


def adapter_of(r: dict):
    from transformers import AutoConfig

    model = _arg(r.get("command", ""), "--model") or f"bench/model-configs/{r['model']}"
    path = HERE.parent / model if not Path(model).is_absolute() else Path(model)
    cfg = AutoConfig.from_pretrained(path)
    for key, arg in (("num_hidden_layers", "--layers"), ("hidden_size", "--hidden"),
                     ("intermediate_size", "--intermediate")):
        v = _arg(r.get("command", ""), arg)
        if v is not None:
            setattr(cfg, key, int(v))
    if r.get("layers") and r["layers"] != cfg.num_hidden_layers:
        cfg.num_hidden_layers = r["layers"]
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[0]] * cfg.num_hidden_layers
    return get_adapter(cfg)


def compare(r: dict, profile=DEFAULTS) -> dict:
    if isinstance(r.get("plan"), dict):  # a `megatrain train` run: the plan it made at its start
        p = r["plan"]
        gpu, host, step = p["gpu_peak_gib"], p["host_peak_gib"], p["step_time_s"]
        # several ranks: the plan's host figure is the node's, the shared store once (a rank's RSS counts the
        # shared store and leaves the other ranks out)
        host_meas = host_measured(r)
        return {"label": r["label"], "file": r["file"], "compile": bool(r.get("compile")),
                "gpu_pred": gpu, "gpu_meas": r["gpu_peak_gib"], "gpu_err": gpu / r["gpu_peak_gib"] - 1,
                "host_pred": host, "host_meas": host_meas, "host_err": host / host_meas - 1,
                "time_pred": step, "time_meas": r["step_s"], "time_err": step / r["step_s"] - 1,
                "idle_pred": float("nan"), "idle_meas": r["step_s"] * r.get("gpu_idle", 0.0),
                "bound": p["bound"] + " (the run's own plan)", "phase": ""}
    adapter = adapter_of(r)
    p = make_plan(adapter, workload_of(r, adapter.vocab_size), profile, suggest=False)
    assert p.params == r["params"], (p.params, r["params"])
    gpu, host, step = p.gpu_peak / GiB, p.host_total / GiB, p.step_s
    return {"label": r["label"], "file": r["file"], "compile": bool(r.get("compile")),
            "gpu_pred": gpu, "gpu_meas": r["gpu_peak_gib"], "gpu_err": gpu / r["gpu_peak_gib"] - 1,
            "host_pred": host, "host_meas": r["host_peak_rss_gib"], "host_err": host / r["host_peak_rss_gib"] - 1,
            "time_pred": step, "time_meas": r["step_s"], "time_err": step / r["step_s"] - 1,
            "idle_pred": p.time.get("gpu_idle_s", 0.0), "idle_meas": r["step_s"] * r.get("gpu_idle", 0.0),
            "bound": p.time["bound"], "phase": p.gpu_peak_phase}


def table(rows: list[dict]) -> str:
    head = (f"{'run':<30}{'GPU peak GiB pred/meas':>24}{'err':>7}{'host RSS GiB pred/meas':>25}{'err':>7}"
            f"{'step s pred/meas':>20}{'err':>7}{'GPU idle s':>14}  bound")
    lines = [head]
    for x in rows:
        lines.append(f"{x['label']:<30}{x['gpu_pred']:>14.1f} / {x['gpu_meas']:<7.1f}{x['gpu_err']:>+7.1%}"
                     f"{x['host_pred']:>15.1f} / {x['host_meas']:<7.1f}{x['host_err']:>+7.1%}"
                     f"{x['time_pred']:>11.2f} / {x['time_meas']:<6.2f}{x['time_err']:>+7.1%}"
                     f"{x['idle_pred']:>7.2f} / {x['idle_meas']:<4.2f}  {x['bound']}")
    ok = all(abs(x["gpu_err"]) <= 0.10 and abs(x["host_err"]) <= 0.10 and abs(x["time_err"]) <= 0.15 for x in rows)
    lines.append(f"targets (memory within 10%, time within 15%): {'met' if ok else 'NOT met'} on {len(rows)} runs")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", default=[str(HERE / "results")])
    ap.add_argument("--profile", default=None, help="a `megatrain probe` profile (default: the plan's defaults)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    profile = load_profile(args.profile) if args.profile else DEFAULTS
    rows = [compare(r, profile) for r in load_results(*map(Path, args.dirs))]
    print(f"profile: {profile.source}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
