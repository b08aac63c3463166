"""Makes some ranks of a CPU run slower on purpose, for benchmarks/mixed_cluster.py: on the ranks
named in MIXED_SLOW_RANKS (comma-separated global ranks), every F.linear runs its matmuls
MIXED_SLOW_FACTOR times in forward and in backward (the extra results are discarded), so those
ranks compute like a device that many times slower, in proportion to their share of the batch.
Put on PYTHONPATH for the emitted program's ranks only; it changes no result."""

import os

_rank = os.environ.get("RANK")
_slow = {r for r in os.environ.get("MIXED_SLOW_RANKS", "").split(",") if r}
if _rank is not None and _rank in _slow:
    import torch
    import torch.nn.functional as F

    _extra = max(0, int(os.environ.get("MIXED_SLOW_FACTOR", "3")) - 1)
    _linear = F.linear

    def _slow_linear(x, weight, bias=None):
        out = _linear(x, weight, bias)
        with torch.no_grad():
            for _ in range(_extra):
                _linear(x.detach(), weight.detach())
        if out.requires_grad:
            xd, wd = x.detach(), weight.detach()

            def burn(grad):
                with torch.no_grad():
                    for _ in range(_extra):
                        grad @ wd  # what the input's gradient costs
                        grad.reshape(-1, grad.shape[-1]).T @ xd.reshape(-1, xd.shape[-1])
                return None

            out.register_hook(burn)
        return out

    F.linear = _slow_linear
