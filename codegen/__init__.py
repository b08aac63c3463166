"""Codegen: turn a Plan into a standalone torchrun training script, plan.json and launch.sh."""

from codegen.emit import emit, write_outputs

__all__ = ["emit", "write_outputs"]
