"""The kernels the loaded build holds, for the scripts that run each one (memcheck_*.py): read from
flash_ext.build_info(), the build's own list, in a stable order."""
import os

import torch

import flash_ext

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def compiled_kernels(direction, dtypes):
    """(head dim, torch dtype, causal) of every compiled `direction` ("fwd"/"bwd") kernel whose dtype is in
    `dtypes` ("fp16", "bf16", "e4m3"), by head dim, dtype (in the order given), non-causal first."""
    kernels = [k for k in flash_ext.build_info()["kernels"]
               if k["direction"] == direction and k["dtype"] in dtypes and not k.get("v_colmajor", False)]
    kernels.sort(key=lambda k: (k["headdim"], dtypes.index(k["dtype"]), k["causal"]))
    return [(k["headdim"], DTYPES[k["dtype"]], k["causal"]) for k in kernels]


def call_options(causal):
    """The masks and score options that run on a kernel of mask `causal`, as keyword arguments of
    flash_ext.forward / backward: the causal kernel also runs sliding windows (causal or not), and every
    kernel softcap."""
    if causal:
        return [dict(causal=True), dict(causal=True, window_size=(50, 0), softcap=10.0),
                dict(causal=False, window_size=(30, 20))]
    return [dict(causal=False), dict(causal=False, softcap=10.0)]


def launch_forms():
    """Each forward launch choice in turn: FLASH_EXT_PERSISTENT=0 (one CTA per tile), =1 (persistent), =2 (the
    mid-length tiles, persistent, where a configuration has them: d128 non-causal; elsewhere as 1), then unset
    (each kernel's own choice, e.g. one CTA per tile on the persistent form's tiles for one wave).
    Yields the setting's label; the variable is unset afterwards."""
    try:
        for value in ("0", "1", "2", None):
            if value is None:
                os.environ.pop("FLASH_EXT_PERSISTENT", None)
            else:
                os.environ["FLASH_EXT_PERSISTENT"] = value
            yield value or "default"
    finally:
        os.environ.pop("FLASH_EXT_PERSISTENT", None)

