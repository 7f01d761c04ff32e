"""The ops of the main build and of variant builds (scripts/build_variant.sh: flash_ext/_C_<name>.abi3.so,
ops in torch.ops.flash_ext_<name>), and settings of the run-time knobs (FLASH_EXT_* environment variables,
read per call: env_override in csrc/flash_api.cpp), for the scripts that time them side by side in one
process (ab_*.py)."""
import importlib
import os

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


def parse_settings(text):
    """';'-separated settings, each a ','-separated list of VAR=VALUE: a list of dicts ("" gives [{}])."""
    out = []
    for item in text.split(";"):
        pairs = [kv.split("=", 1) for kv in item.split(",") if kv.strip()]
        out.append({k.strip(): v.strip() for k, v in pairs})
    return out


def apply_setting(setting, settings):
    """Sets the environment to `setting`: every knob that any of `settings` names and `setting` does not is
    unset."""
    for knob in {k for s in settings for k in s}:
        os.environ.pop(knob, None)
    os.environ.update(setting)


def setting_name(setting):
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "(none)"

