"""Past one device: tensor-parallel decoding over one shared index, and a launcher for ranks.

``cacheidx.parallel.tensor`` cuts a Llama's config and weights per rank (heads and hidden
units), ``cacheidx.parallel.groups`` says how ranks sum their parts (``torch.distributed``'s
all-reduce, JAX's ``psum`` under ``shard_map``) and where arrays live, and
``cacheidx.parallel.launch`` starts ranks on this host under a deadline. Imports neither torch
nor jax until a group of theirs is asked for.
"""

from .groups import JaxGroup, TorchGroup, group, initialize
from .launch import RankFailed, RankResult, free_port, launch
from .tensor import cuts, shard, split

__all__ = [
    "JaxGroup",
    "RankFailed",
    "RankResult",
    "TorchGroup",
    "cuts",
    "free_port",
    "group",
    "initialize",
    "launch",
    "shard",
    "split",
]
