"""The parallel layout as a validated value: dp x pp x tp ranks spread over nodes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Layout(BaseModel):
    """How the world is cut: dp replicas, each a pp x tp group; ranks_per_node ranks per node.

    Ranks are numbered with tp fastest, then pp, then dp (torchtitan's order), so one
    replica occupies a contiguous block of ranks and therefore whole nodes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int = Field(
        4, ge=1, description="Data-parallel degree: model replicas training on different samples (replicas)."
    )
    pp: int = Field(
        1, ge=1, description="Pipeline-parallel degree: stages one replica is cut into (ranks per replica)."
    )
    tp: int = Field(
        1, ge=1, description="Tensor-parallel degree: ranks sharing each stage's matrices (ranks per stage)."
    )
    ranks_per_node: int = Field(1, ge=1, description="Rank processes that run on one node (ranks).")

    @model_validator(mode="after")
    def _replica_fills_whole_nodes(self) -> Layout:
        replica = self.pp * self.tp
        if replica % self.ranks_per_node and self.ranks_per_node % replica:
            raise ValueError(
                f"layout.ranks_per_node: {self.ranks_per_node} neither divides nor is a multiple of one replica's "
                f"pp*tp = {replica} ranks, so a node would hold parts of two replicas; "
                f"pick a divisor or multiple of {replica}"
            )
        return self

    @property
    def world_size(self) -> int:
        """Total ranks: dp * pp * tp."""
        return self.dp * self.pp * self.tp

    @property
    def nodes(self) -> int:
        """Nodes the layout occupies."""
        return -(-self.world_size // self.ranks_per_node)

    def node_of_rank(self, rank: int) -> int:
        """Index (in the assignment) of the node that hosts a rank."""
        return rank // self.ranks_per_node

    def replica_of_rank(self, rank: int) -> int:
        """Data-parallel replica a rank belongs to."""
        return rank // (self.pp * self.tp)
