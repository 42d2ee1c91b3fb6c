"""One optimizer step over every rank: `DistributedEngine` (a distributed run's runtime: Distributed.build_runtime).

Each rank runs the ordinary Engine (runtime/engine.py) over its own micro-batches, with the step's totals: before
the step, one host-side all-reduce sums the ranks' target tokens, micro-batches and real tokens, and the engine
divides the loss (and so every gradient) by the step's target tokens and the router loss by its micro-batches,
as one process running all of them would. The gradients are reduced by the ShardedPipeline as they finish
(grads.py). After the step, one all-reduce over every rank (NCCL on CUDA: it stays on the device until the trainer
reads it) sums the ranks' losses, router losses and expert counts, and the squared norms of node 0's reduced
shards: that is the squared norm of the global gradient, the same number on every rank, so every rank clips
alike. A preference objective adds the step's pairs and chosen target tokens to the first all-reduce (its loss is a
mean over the pairs) and its metric sums to the second.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..runtime import Engine
from ..runtime.head_objective import chosen_targets
from ..runtime.microbatch import MicroBatch, StepOutput
from .grads import ShardedPipeline
from .ranks import Ranks


class DistributedEngine:
    """The engine of one rank, whose `train_step` is the whole world's step (everything else is the engine's)."""

    def __init__(self, engine: Engine, pipeline: ShardedPipeline, d: Ranks):
        self.engine, self.pipeline, self.d = engine, pipeline, d
        self.world_tokens = 0  # real (non-padding) tokens of the last step, every rank's

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def train_step(self, microbatches: list[MicroBatch]) -> StepOutput:
        pref = self.engine.options.objective.preference
        local = [sum(mb.num_targets for mb in microbatches), len(microbatches),
                 sum(mb.real_tokens for mb in microbatches), sum(mb.num_tokens for mb in microbatches)]
        if pref:  # the step's pairs and chosen target tokens (orpo's SFT term)
            local += [sum(mb.input_ids.shape[0] // 2 for mb in microbatches),
                      sum(chosen_targets(mb) for mb in microbatches)]
        targets, micro, real, padded, *pairs = (int(x) for x in self.d.all_sum([float(x) for x in local]))
        if targets == 0:
            raise ValueError("a step without any target token (every label is -100) on every rank")
        self.world_tokens = real
        out = self.engine.train_step(microbatches, totals=(targets, micro, *pairs))
        sq = self.pipeline.shard_sq_norm()
        node0 = 1.0 if self.d.world.node == 0 else 0.0  # node 0's shards cover every element once
        aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=sq.device)
        sums = torch.stack([out.loss_sum.float(), aux.float(), sq * node0])
        waits = [dist.all_reduce(sums, async_op=True)]
        counts, metrics = out.expert_counts, out.metrics
        if counts is not None:
            counts = counts.clone()
            waits.append(dist.all_reduce(counts, async_op=True))
        if metrics is not None:  # every rank has the same keys (one objective)
            keys = sorted(metrics)
            values = torch.stack([metrics[k].float() for k in keys])
            waits.append(dist.all_reduce(values, async_op=True))
        for w in waits:
            w.wait()
        if metrics is not None:
            metrics = dict(zip(keys, values.unbind()))
        return replace(out, loss_sum=sums[0], grad_sq_norm=sums[2], num_targets=targets, num_tokens=padded,
                       aux_loss=sums[1] if out.aux_loss is not None else None, expert_counts=counts, metrics=metrics)

