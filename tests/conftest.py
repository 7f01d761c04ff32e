"""Shared pytest setup: the `gpu` marker skips with a stated reason unless an sm_90 GPU and the built
extension are both present, so one command runs everything on the H200 and the CPU tests elsewhere."""
import pytest
import torch


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (GPU tests need an sm_90 GPU)"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"GPU {torch.cuda.get_device_name()} is sm_{cap[0]}{cap[1]}, not sm_90"
    import flash_ext

    if not flash_ext.extension_available():
        return f"flash_ext._C is not built or failed to load: {flash_ext.interface._ext_error}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
