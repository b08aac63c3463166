"""Codegen: turn a Plan into a standalone torchrun training script, plan.json and launch.sh."""

from autopar.codegen.emit import emit
from autopar.codegen.write import write_outputs

__all__ = ["emit", "write_outputs"]
