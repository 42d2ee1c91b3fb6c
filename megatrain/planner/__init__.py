"""The planner: what a run will use and how fast it goes, from config.json and the config alone, before any weight
is read; and `megatrain probe`, which measures the machine it plans for. Modules:

    plan.py         Plan and make_plan: the workload, host and GPU memory, step time, what would fit, the report
    activations.py  one layer's and the LM head's activation memory, measured by running the runtime's own
                    functions on the meta device
    profile.py      the machine profile (rates, sizes) and its H200 defaults
    probe.py        `megatrain probe`: measures this machine into a profile
    sysmem.py       host RAM free (cgroup-aware), disk free, memlock
    flops.py        FLOP counting for throughput reports

The planner simulates the runtime's schedule (runtime/schedule.py) and sizes what the runtime allocates with the
runtime's own functions; it never builds an Engine. Only the standard library and torch are needed here (the
probe runs where pydantic is not installed).
"""

from .plan import (Plan, Workload, check_before_run, make_plan, plan_command, plan_for_config, refusal, suggestions,
                   target_device)

__all__ = ["Plan", "Workload", "check_before_run", "make_plan", "plan_command", "plan_for_config", "refusal",
           "suggestions", "target_device"]
