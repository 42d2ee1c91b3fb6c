"""megatrain: full-precision training of Hugging Face causal LMs larger than GPU memory, on one GPU.

Where things live (each package's docstring lists its modules):

    cli.py, config.py, errors.py   the command line, the validated config, user-facing errors
    run/        the run: check every input, build the runtime, the step loop, evaluation, metrics, OOM diagnosis
    runtime/    the step: the schedule as data and its executor (engine), LM head, host store, pinned memory,
                optimizer pipeline, CPU AdamW, activation spill, timeline
    planner/    memory and time of a run from config.json alone (it simulates the runtime's schedule); probe
    models/     architecture adapters: Hugging Face names -> units, stateless layer templates
    data/       files -> formats -> chat template -> label masks -> packing -> resumable sampler
    checkpoint/ background per-unit saves, exact resume, Hugging Face export

Dependencies point one way: cli -> run -> runtime / data / checkpoint -> models (tests/test_layout.py).
"""

__version__ = "0.1.0"
