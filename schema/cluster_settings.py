"""What a user writes about a cluster backend other than the local one (the spec's
`cluster.kubernetes` and `cluster.slurm` sections)."""

from __future__ import annotations

from pydantic import Field

from lazarus.schema.base import MAX_SECONDS, Strict


class KubernetesSettings(Strict):
    """Where and how the Kubernetes backend runs a node's ranks (one pod per node and incarnation)."""

    namespace: str = Field(
        default="lazarus", description="Namespace of the rank pods, the run's ConfigMap and its Events."
    )
    pool: str = Field(
        default="default", description="Value of the `lazarus.dev/pool` label that selects the nodes this run may use."
    )
    image: str = Field(
        default="lazarus-trainer:latest",
        description="Container image of the rank pods; it must hold this project and the trainer.",
    )
    cpu: str = Field(
        default="1", description="CPU request and limit of a rank pod (Kubernetes quantity, e.g. `8` or `500m`)."
    )
    memory: str = Field(default="4Gi", description="Memory request and limit of a rank pod (Kubernetes quantity).")
    gpus: int = Field(
        default=0, ge=0, description="`nvidia.com/gpu` per rank pod (GPUs); usually layout.ranks_per_node."
    )
    volume_claim: str = Field(
        default="lazarus-runs",
        description=(
            "ReadWriteMany PersistentVolumeClaim holding run directories (heartbeats, checkpoints); "
            "the worker mounts it too."
        ),
    )
    mount_path: str = Field(
        default="/lazarus", description="Where the pods and the worker mount volume_claim; LAZARUS_HOME there."
    )
    delete_grace_seconds: int = Field(
        default=5, ge=0, le=MAX_SECONDS, description="Grace period when drain deletes an incarnation's pods (seconds)."
    )
    master_port: int = Field(
        default=29500,
        ge=1024,
        le=65535,
        description="Port of rank 0's rendezvous store on its node (pods use the host network).",
    )


class SlurmSettings(Strict):
    """Where the Slurm backend allocates the run's nodes (one allocation: the active nodes and spares)."""

    partition: str | None = Field(
        default=None, description="Partition of the allocation (`salloc -p`); None: the default one."
    )
    account: str | None = Field(
        default=None, description="Account charged for it (`salloc -A`); None: the user's default."
    )
    time_limit: str | None = Field(
        default=None,
        description="Its time limit in Slurm's words (`salloc -t`, e.g. `2-00:00:00`); None: the partition's.",
    )
