"""The layout of the ranks: world size = D × P, and which replica and which pipeline stage each rank is.

    P  pipeline_stages  ranks that share one copy of the model, each holding one stage of it (dist.pipeline_stages)
    D  replicas         data-parallel copies of the model: world size / P

Only D counts as "ranks" in the batch arithmetic (G = m·A·D), the ×D compensation of the loss, the data split
and the validation split: the P stages of one replica run the same rows (the first stage reads their inputs,
the last one their labels), so they are one data-parallel rank between them.

Ranks are laid out as a D × P mesh with the stage index varying fastest: rank = replica · P + stage, so the
stages of one replica are neighbouring ranks (on one node, where their point-to-point activations travel).
Gradients of a stage are averaged over the dp group (the D ranks holding that stage); activations travel in
the pp group (the P ranks of one replica). With P = 1 no mesh is built: every rank is a replica and the dp
group is the whole world, as plain DDP has it.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    ranks: int  # world size, D × P
    pipeline_stages: int  # P
    replica: int  # this rank's data-parallel replica, 0..D-1: which rows it runs
    stage: int  # this rank's pipeline stage, 0..P-1: which part of the model it holds
    dp_group: dist.ProcessGroup | None = None  # the D ranks of this stage (None: the whole world, or one process)
    pp_group: dist.ProcessGroup | None = None  # the P ranks of this replica (None when P = 1)

    @property
    def replicas(self) -> int:
        """D, the number of data-parallel replicas."""
        return self.ranks // self.pipeline_stages

    @property
    def pipelined(self) -> bool:
        return self.pipeline_stages > 1

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline_stages - 1


def check_layout(ranks: int, pipeline_stages: int) -> str | None:
    """Why `ranks` cannot be laid out as D × P, or None when they can."""
    if ranks % pipeline_stages != 0:
        return (
            f"dist.pipeline_stages: {ranks} ranks cannot be split into replicas of {pipeline_stages} pipeline stages; "
            f"launch a multiple of {pipeline_stages} ranks (torchrun --nproc_per_node=N) or choose P dividing {ranks}"
        )
    return None


def layout_of(ranks: int, rank: int, pipeline_stages: int) -> Layout:
    """The arithmetic alone (no process groups): which replica and stage `rank` is."""
    why_not = check_layout(ranks, pipeline_stages)
    if why_not is not None:
        raise ValueError(why_not)
    return Layout(ranks, pipeline_stages, replica=rank // pipeline_stages, stage=rank % pipeline_stages)


def build_layout(device: torch.device, pipeline_stages: int) -> Layout:
    """This rank's layout, with the dp and pp process groups when P > 1 (a D × P device mesh). Every rank must
    call it (creating the groups is collective). One process, or P = 1: no groups are created."""
    if not dist.is_initialized():
        return layout_of(1, 0, pipeline_stages)
    layout = layout_of(dist.get_world_size(), dist.get_rank(), pipeline_stages)
    if not layout.pipelined:
        return layout
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (layout.replicas, pipeline_stages), mesh_dim_names=("dp", "pp"))
    return Layout(
        layout.ranks,
        pipeline_stages,
        layout.replica,
        layout.stage,
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
    )
