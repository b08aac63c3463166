"""Codegen: turn a Plan into a standalone torchrun training script."""
