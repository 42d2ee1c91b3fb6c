"""Several ranks (megatrain/distributed): what one node holds, what the network carries, and the step's time.

A run of `nodes` x `ranks_per_node` ranks is planned per node, from the one-rank plan of a rank's own step (its
micro-batches: train.micro_batch_size and grad_accum_steps are per rank):

    host    the node holds ONE host store (fp32 master, Adam m and v, the streaming copy: shared memory mapped by
            every local rank) and, per rank, what a rank allocates for itself: its landing buffers, spilled
            checkpoints, parked accumulators, one step's batches, its runtime (and on CPU its device work).
            Gradients sent to host are per-rank shards (1/ranks_per_node of each unit each): one unit's worth per
            node. Each node keeps a full replica of the state (no state is sharded across nodes).
    GPU     per rank as for one GPU (an upper bound: the finished gradients a rank keeps for the optimizer are
            reduced shards, 1/ranks_per_node of the one-GPU figure).
    PCIe    per GPU as for one GPU: each streams the whole store's weights over its own link (GPUs behind one PCIe
            switch share its uplink: not modelled).
    network per rank and step: the reduce-scatter of every fp32 gradient within the node, 4·(L-1)/L bytes per
            parameter sent (NVLink, or PCIe without it), and across nodes the all-reduce of the rank's shard,
            2·4·(N-1)/N/L bytes per parameter (8·(N-1)/N per node, on the nodes' network).
    time    the reductions run on their own streams during the backward; what is exposed is their excess over the
            backward and the reduction of the last gradient (the embedding's: the optimizer needs the global norm,
            so every reduction). CPU AdamW: the node's optimizer threads (the number chosen at the start for the
            node, plan.run_profile), split between its ranks, update one store as one rank would (host memory
            bandwidth is the limit): the one-GPU optimizer time. D2H copies (1/L of a unit per
            rank) are kept at the one-GPU figure.

Bandwidths are defaults, not probed: INTRA_NODE_BPS (NCCL bus bandwidth of a reduce-scatter over NVLink on H100/
H200 boards) and INTER_NODE_BPS (per rank: one 400 Gb/s NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from .calibration import INTER_NODE_BPS, INTRA_NODE_BPS

STORE_PARTS = ("fp32 master weights", "Adam m (fp32)", "Adam v (fp32)", "bf16 streaming copy")
SHARDED_PARTS = ("gradients sent to host during backward",)


@dataclass(frozen=True)
class World:
    nodes: int = 1
    ranks_per_node: int = 1

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.ranks_per_node} rank" \
               f"{'s' if self.ranks_per_node > 1 else ''} = {self.size}"


def node_host(host: dict[str, float], world: World) -> dict[str, float]:
    """One rank's host components -> the node's: the store once, per-rank components times ranks_per_node."""
    L = world.ranks_per_node
    if L == 1:
        return dict(host)
    out = {}
    for k, v in host.items():
        if k.startswith(STORE_PARTS):
            out[k + ", one per node"] = v
        elif k.startswith(SHARDED_PARTS):
            out[k + ", a shard per rank"] = v
        else:
            out[f"{k} x {L} ranks"] = v * L
    return out


def node_pinned(pinned: float, host: dict[str, float], world: World) -> float:
    """The node's page-locked bytes: the shared store's pages once (every rank registers the same pages), the
    rest per rank."""
    store_pinned = sum(v for k, v in host.items() if k.startswith(STORE_PARTS) and "pinned" in k)
    return store_pinned + (pinned - store_pinned) * world.ranks_per_node


def comm(params: int, units_numel: list[int], world: World, fl: dict[str, float]) -> dict[str, float]:
    """Bytes per rank and step on each link, their seconds, and what is exposed beyond the backward."""
    L, N = world.ranks_per_node, world.nodes
    intra = 4.0 * params * (L - 1) / L
    inter = 8.0 * params * (N - 1) / N / L
    seconds = intra / INTRA_NODE_BPS + inter / INTER_NODE_BPS
    last = 4.0 * units_numel[0]  # the embedding's gradient, finished last
    last_s = last * (L - 1) / L / INTRA_NODE_BPS + 2 * last * (N - 1) / N / L / INTER_NODE_BPS
    return {"intra_node_bytes_per_rank": intra, "inter_node_bytes_per_rank": inter,
            "inter_node_bytes_per_node": inter * L, "comm_s": seconds, "last_unit_s": last_s,
            "backward_share": (fl.get("backward", 0.0) + fl.get("head", 0.0)) / max(sum(fl.values()), 1.0)}


def world_time(t: dict, c: dict, world: World) -> dict:
    """The one-rank time dict -> the world's: the step plus the exposed reductions; throughput of every rank."""
    if world.size == 1:
        return t
    backward_s = t["compute_s"] * c["backward_share"]
    exposed = max(c["comm_s"] - backward_s, 0.0) + c["last_unit_s"]
    step = t["step_s"] + exposed
    f = world.size * t["step_s"] / step  # rates scale with the ranks, and down with the longer step
    out = dict(t, step_s=step, exposed_comm_s=exposed, comm_s=c["comm_s"], rank_step_s=t["step_s"])
    for k in ("tokens_per_s", "executed_tflops", "tflops_6n", "tflops_6n_active"):
        if k in t:
            out[k] = t[k] * f
    if t.get("mfu"):
        out["mfu"] = t["mfu"] * t["step_s"] / step  # per GPU
    if exposed > 0.5 * t["step_s"]:
        out["bound"] = "gradient reductions (network)"
    return out
