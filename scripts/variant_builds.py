"""The ops of the main build and of variant builds (scripts/build_variant.sh: flash_ext/_C_<name>.abi3.so,
ops in torch.ops.flash_ext_<name>), for the scripts that time them side by side in one process (ab_*.py)."""
import importlib

import torch

import flash_ext  # noqa: F401  (loads the main build's ops)


def build_ops(variants):
    """{"main": torch.ops.flash_ext, name: torch.ops.flash_ext_<name> for each other name of `variants`, a
    comma list}, in that order; a variant whose build is missing raises ImportError naming its module."""
    ops = {"main": torch.ops.flash_ext}
    for name in filter(lambda n: n and n != "main", variants.split(",")):
        importlib.import_module(f"flash_ext._C_{name}")
        ops[name] = getattr(torch.ops, f"flash_ext_{name}")
    return ops
