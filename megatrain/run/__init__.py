"""The run: everything between the command line and the runtime. Modules:

    launch.py     `megatrain train` in one process, or as one rank of a torchrun launch (megatrain/distributed)
    roles.py      what each rank writes: rank 0 output.dir, the others nothing
    prepare.py    check every input (config, model, tokenizer, data, checkpoints, output paths, the plan), then
                  fill the host store and build the runtime; nothing is written before that succeeds
    trainer.py    the step loop: start, step, evaluate, save (the saver decides when), stop, finish
    prefetch.py   the next step's micro-batches prepared on a thread while this step trains
    evaluate.py   held-out loss and exact match with the streaming engine
    stepstats.py  per-step throughput, memory and stream shares; the start summary
    plancheck.py  a GPU run's steady step held against its plan: off by more than 15%, one line says where and why
    oom.py        out-of-memory errors turned into one message naming what was being allocated
    metrics.py    progress bar or plain lines, metrics.jsonl, TensorBoard, wandb
"""

__all__ = ["train"]


def __getattr__(name: str):
    """`train`, imported when first used: `megatrain plan` reads run/bounds.py alone, without the step loop's
    imports (the data loader, checkpoints, the distributed runtime)."""
    if name != "train":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .launch import train

    return train
