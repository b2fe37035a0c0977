"""Tensor and pipeline parallelism: process group state and stages (``parallel_state``),
collectives and the stage hand-over (``communication``), which layers a stage holds
(``pipeline``), parallel layers (``linear``; ``vocab``: embedding and LM head) and how
a model's dimensions divide over ranks (``sharding``)."""

from compile_runtime.distributed.communication import (
    broadcast_from_first_rank,
    gather_to_first_rank,
    receive_from_previous_stage,
    send_to_next_stage,
    tensor_parallel_all_reduce,
)
from compile_runtime.distributed.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from compile_runtime.distributed.parallel_state import (
    LOOPBACK,
    default_backend,
    destroy_distributed,
    free_port,
    get_parallel_state,
    get_pp_rank,
    get_pp_world_size,
    get_tp_rank,
    get_tp_world_size,
    init_distributed,
    sampling_rank,
)
from compile_runtime.distributed.sharding import (
    TensorParallelConfigError,
    check_tensor_parallel,
    head_layout,
)
from compile_runtime.distributed.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "LOOPBACK",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "TensorParallelConfigError",
    "VocabParallelEmbedding",
    "broadcast_from_first_rank",
    "check_tensor_parallel",
    "default_backend",
    "destroy_distributed",
    "free_port",
    "gather_to_first_rank",
    "get_pp_rank",
    "get_pp_world_size",
    "get_tp_rank",
    "get_tp_world_size",
    "head_layout",
    "init_distributed",
    "get_parallel_state",
    "receive_from_previous_stage",
    "sampling_rank",
    "send_to_next_stage",
    "tensor_parallel_all_reduce",
]
