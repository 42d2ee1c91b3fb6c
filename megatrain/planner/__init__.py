"""The planner: what a run will use and how fast it goes, from config.json and the config alone, before any weight
is read; and `megatrain probe`, which measures the machine it plans for. Modules, one job each:

    plan.py         the entry points: make_plan (a workload's plan, and what would fit when it does not),
                    plan_for_config, plan_command (`megatrain plan`), check_before_run (`megatrain train`'s check),
                    target_device
    estimate.py     Plan (a workload's figures and whether they fit) and estimate, which computes it
    workload.py     Workload, what the run asks of the engine (step shape, engine settings), from a Config
    memory.py       host RAM by component and the GPU phase by phase, walking the runtime's step schedule
    peak_walk.py    the placement search's walk for the GPU peak alone (a group's backward uses in one loop)
    activations.py  one layer's and the LM head's activation memory, measured by running the runtime's own
                    functions on the meta device
    meta_trace.py   those meta-device runs without importing torch._dynamo or sympy (seconds; `megatrain plan`
                    never compiles)
    timing.py       executed FLOPs and step time: an event simulation of the runtime's step schedule and of the
                    CPU optimizer pipeline
    placement.py    the search over the memory knobs (checkpoints, spills, gradients to host, wave groups, tiles)
    choice.py       the run's placement: that search with the states in RAM, else on the SSD tier; the least host
                    RAM that fits the GPU when nothing fits host RAM
    suggest.py      what would fit when the run does not
    report.py       the plan as text, and the refusal `megatrain train` gives
    profile.py      the machine profile (rates, sizes) and its H200 defaults
    calibration.py  every fitted constant (rates, efficiencies, overheads, slowdowns): value, unit, meaning, and
                    the benchmark that refits it
    probe.py        `megatrain probe`: measures this machine into a profile
    sysmem.py       host RAM free (cgroup-aware), disk free, memlock
    flops.py        FLOP counting for throughput reports
    world.py        several ranks: the node's host RAM (one shared store), the network's bytes, the world's step

The planner simulates the runtime's schedule (runtime/schedule.py) and sizes what the runtime allocates with the
runtime's own functions and constants (runtime/store.py, optimizer_pipeline.py, lmhead.py); it never builds an
Engine nor calls a private name of the runtime. Only the standard library and torch are needed here (the probe
runs where pydantic is not installed).
"""

from .estimate import Plan
from .plan import World, check_before_run, make_plan, plan_command, plan_for_config, target_device
from .report import refusal
from .suggest import suggestions
from .workload import Workload

__all__ = ["Plan", "World", "Workload", "check_before_run", "make_plan", "plan_command", "plan_for_config", "refusal",
           "suggestions", "target_device"]
