"""The parallel layout as a validated value: dp replicas of pp x dp_shard x tp ranks, over nodes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MESH_DIMENSIONS = ("dp", "pp", "dp_shard", "tp")
"""The layout's dimensions, slowest-varying first: the order ranks are numbered in."""


class Layout(BaseModel):
    """How the world is cut: dp replicas (torchtitan's dp_replicate), each pp pipeline stages of
    dp_shard x tp ranks (FSDP shards a stage's state over dp_shard ranks, tensor parallelism splits
    its matrices over tp); ranks_per_node ranks per node.

    Ranks are numbered with tp fastest, then dp_shard, then pp, then dp, so one replica occupies
    a contiguous block of ranks and therefore whole nodes, and a tensor-parallel group (which
    talks every layer) stays inside one node.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int = Field(
        default=4,
        ge=1,
        description=(
            "Data-parallel replicas (torchtitan's dp_replicate): full copies of the model training on different "
            "samples; what recovery shrinks (replicas)."
        ),
    )
    pp: int = Field(
        default=1, ge=1, description="Pipeline-parallel degree: stages one replica is cut into (stages per replica)."
    )
    dp_shard: int = Field(
        default=1,
        ge=1,
        description=(
            "FSDP degree inside a replica: ranks each stage's parameters, gradients and optimizer state are sharded "
            "over (ranks per stage and tp coordinate)."
        ),
    )
    tp: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel degree: ranks sharing each stage's matrices, always inside one node (ranks).",
    )
    ranks_per_node: int = Field(default=1, ge=1, description="Rank processes that run on one node (ranks).")

    @model_validator(mode="after")
    def _replica_fills_whole_nodes(self) -> Layout:
        if self.ranks_per_node % self.tp:
            raise ValueError(
                f"layout.tp: {self.tp} does not divide layout.ranks_per_node {self.ranks_per_node}, so a "
                f"tensor-parallel group would span nodes; set ranks_per_node to a multiple of {self.tp} or tp to a "
                f"divisor of {self.ranks_per_node}"
            )
        replica = self.replica_ranks
        if replica % self.ranks_per_node and self.ranks_per_node % replica:
            raise ValueError(
                f"layout.ranks_per_node: {self.ranks_per_node} neither divides nor is a multiple of one replica's "
                f"pp*dp_shard*tp = {replica} ranks, so a node would hold parts of two replicas; "
                f"pick a divisor or multiple of {replica}"
            )
        return self

    @property
    def replica_ranks(self) -> int:
        """Ranks of one replica: pp * dp_shard * tp."""
        return self.pp * self.dp_shard * self.tp

    @property
    def world_size(self) -> int:
        """Total ranks: dp * pp * dp_shard * tp."""
        return self.dp * self.replica_ranks

    @property
    def nodes(self) -> int:
        """Nodes the layout occupies."""
        return -(-self.world_size // self.ranks_per_node)

    @property
    def shape(self) -> tuple[int, ...]:
        """The device mesh's shape, in MESH_DIMENSIONS order."""
        return (self.dp, self.pp, self.dp_shard, self.tp)

    def node_of_rank(self, rank: int) -> int:
        """Index (in the assignment) of the node that hosts a rank."""
        return rank // self.ranks_per_node

    def replica_of_rank(self, rank: int) -> int:
        """Data-parallel replica a rank belongs to."""
        return rank // self.replica_ranks

    def coordinates(self, rank: int) -> dict[str, int]:
        """A rank's place on each dimension of the mesh: {"dp", "pp", "dp_shard", "tp"}."""
        place = {}
        for name, size in zip(reversed(MESH_DIMENSIONS), reversed(self.shape), strict=True):
            rank, place[name] = divmod(rank, size)
        return {name: place[name] for name in MESH_DIMENSIONS}

    def describe(self) -> str:
        """The layout in one line, naming only dimensions above 1 besides dp: `dp=2 dp_shard=2 tp=2`."""
        extra = [f"{name}={size}" for name, size in zip(MESH_DIMENSIONS[1:], self.shape[1:], strict=True) if size > 1]
        return " ".join([f"dp={self.dp}", *extra])
