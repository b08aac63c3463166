"""The machinery of an autopar ``train.py``, one module per concern, in the order ``train.py``
calls them.

autopar emits this package verbatim beside ``train.py``; it depends on torch only (numpy; and
transformers for HuggingFace models, pyarrow / datasets for --data formats that need them, all
imported where used), never on autopar. ``train.py`` holds the plan's constants and reads like a
training script (``import autopar_runtime as rt``; ``rt.parse_args(...)``); every function here
takes what it needs of the plan as a ``Constants`` (built from ``train.py``'s upper-case names)
or as plain arguments. Every public name of every module is re-exported here.

- ``common``: the plan's constants, user errors (``fail``, ``InputError``), ``say``;
- ``trust``: the safe DCP reader, trusted-directory checks, the checkpoint directory's lock;
- ``launch``: flags, every check before any collective, device and mesh, ``finish``;
- ``rendezvous``: what launch.sh reports when the nodes do not all arrive;
- ``build``: the model file or HF config, built on meta, materialized shard by shard;
- ``hf_model``: the HF model of a config (built, batched, scored), which autopar plans too;
- ``context_parallel``, ``expert_parallel``, ``tensor_parallel``, ``parallelize`` (activation
  checkpointing, compile, the composition), ``data_parallel`` (FSDP2 / DDP, precision, offload):
  the plan applied, in torchtitan's order;
- ``stages`` (the cut into pipeline stages) and ``pipeline`` (the schedule, its step);
- ``batch`` (batches of any pytree shape, the --data stream), ``data`` (the --data sources);
- ``dropout``: each step's seed, --verify's dropout off;
- ``loop``: optimizer, LR schedule, gradient norm, the step, logs, evaluation;
- ``profiling``: --profile-steps, the measured terms of a step written to profile.json;
  ``records``: its records of collectives and allocations from torch's profiler;
- ``weights`` (--init-from), ``checkpoint`` (save, resume, after each step), ``export``
  (--save-hf), ``verify`` (--verify), ``global_batch`` (a batch-coupled model: synced batch
  norms, a gathered loss).
"""

from __future__ import annotations

from .batch import *  # noqa: F403
from .batch import __all__ as _batch
from .build import *  # noqa: F403
from .build import __all__ as _build
from .checkpoint import *  # noqa: F403
from .checkpoint import __all__ as _checkpoint
from .common import *  # noqa: F403
from .common import __all__ as _common
from .context_parallel import *  # noqa: F403
from .context_parallel import __all__ as _context_parallel
from .data import *  # noqa: F403
from .data import __all__ as _data
from .data_parallel import *  # noqa: F403
from .data_parallel import __all__ as _data_parallel
from .dropout import *  # noqa: F403
from .dropout import __all__ as _dropout
from .expert_parallel import *  # noqa: F403
from .expert_parallel import __all__ as _expert_parallel
from .export import *  # noqa: F403
from .export import __all__ as _export
from .global_batch import *  # noqa: F403
from .global_batch import __all__ as _global_batch
from .hf_model import *  # noqa: F403
from .hf_model import __all__ as _hf_model
from .launch import *  # noqa: F403
from .launch import __all__ as _launch
from .loop import *  # noqa: F403
from .loop import __all__ as _loop
from .parallelize import *  # noqa: F403
from .parallelize import __all__ as _parallelize
from .pipeline import *  # noqa: F403
from .pipeline import __all__ as _pipeline
from .profiling import *  # noqa: F403
from .profiling import __all__ as _profiling
from .records import *  # noqa: F403
from .records import __all__ as _records
from .rendezvous import *  # noqa: F403
from .rendezvous import __all__ as _rendezvous
from .stages import *  # noqa: F403
from .stages import __all__ as _stages
from .tensor_parallel import *  # noqa: F403
from .tensor_parallel import __all__ as _tensor_parallel
from .trust import *  # noqa: F403
from .trust import __all__ as _trust
from .verify import *  # noqa: F403
from .verify import __all__ as _verify
from .weights import *  # noqa: F403
from .weights import __all__ as _weights

__all__ = [
    *_common,
    *_trust,
    *_launch,
    *_rendezvous,
    *_build,
    *_hf_model,
    *_context_parallel,
    *_expert_parallel,
    *_tensor_parallel,
    *_parallelize,
    *_data_parallel,
    *_global_batch,
    *_stages,
    *_pipeline,
    *_batch,
    *_data,
    *_dropout,
    *_loop,
    *_profiling,
    *_records,
    *_weights,
    *_checkpoint,
    *_export,
    *_verify,
]
