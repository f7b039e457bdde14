"""Past one device: tensor-parallel decoding over one shared index.

``cacheidx.parallel.tensor`` cuts a Llama's config and weights per rank (heads and hidden
units), and ``cacheidx.parallel.groups`` says how ranks sum their parts (``torch.distributed``'s
all-reduce, JAX's ``psum`` under ``shard_map``) and where arrays live. Ranks are started by
torchrun (``torchrun --standalone --nproc-per-node K``), or by whatever starts the processes of
a ``jax.distributed`` run; docs/scale.md says how. Imports neither torch nor jax until a group
of theirs is asked for.
"""

from .groups import JaxGroup, TorchGroup, group, initialize
from .tensor import cuts, shard, split

__all__ = [
    "JaxGroup",
    "TorchGroup",
    "cuts",
    "group",
    "initialize",
    "shard",
    "split",
]
