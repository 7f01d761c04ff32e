"""The environment recorded with the results: GPU, clocks, driver, versions, flash_ext build, git commit."""
import importlib.metadata
import pathlib
import platform
import subprocess

import torch

import flash_ext

from .backends import fa3_importable

ENV_KEYS = (
    "gpu_name",
    "gpu_capability",
    "sm_count",
    "gpu_memory_gib",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "sm_clock_after_run_mhz",
    "driver_version",
    "cuda_version",
    "torch_version",
    "cudnn_version",
    "triton_version",
    "python_version",
    "flash_ext_version",
    "flash_ext_extension",
    "flash_ext_build_info",
    "flash_attn_interface",
    "git_commit",
    "git_dirty",
    "hostname",
)
_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_cmd(cmd, cwd=None):
    """stdout of a command, or None when it is missing or fails."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def nvidia_smi(index=0):
    """{name, driver_version, sm_clock_mhz, sm_clock_max_mhz} of GPU `index`, or {} without nvidia-smi."""
    text = _run_cmd(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits"]
    )
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    if not lines:
        return {}
    parts = [p.strip() for p in lines[min(index, len(lines) - 1)].split(",")]
    if len(parts) < 4:
        return {}

    def num(x):
        try:
            return int(float(x))
        except ValueError:  # "[N/A]"
            return None

    return {"name": parts[0], "driver_version": parts[1], "sm_clock_mhz": num(parts[2]), "sm_clock_max_mhz": num(parts[3])}


def collect_env(device=None):
    """Every ENV_KEYS entry (None when unknown); the GPU fields need a CUDA `device`."""
    env = dict.fromkeys(ENV_KEYS)
    env["torch_version"] = torch.__version__
    env["cuda_version"] = torch.version.cuda
    env["cudnn_version"] = torch.backends.cudnn.version()
    env["python_version"] = platform.python_version()
    env["hostname"] = platform.node()
    try:
        env["triton_version"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    env["flash_ext_version"] = flash_ext.__version__
    env["flash_ext_extension"] = flash_ext.extension_available()
    if env["flash_ext_extension"]:
        env["flash_ext_build_info"] = flash_ext.build_info()
    env["flash_attn_interface"] = fa3_importable()
    env["git_commit"] = _run_cmd(["git", "rev-parse", "HEAD"], cwd=_REPO_ROOT)
    status = _run_cmd(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO_ROOT)
    env["git_dirty"] = None if status is None or env["git_commit"] is None else bool(status)
    index = 0
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        env["gpu_name"] = props.name
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["sm_count"] = props.multi_processor_count
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    smi = nvidia_smi(index)
    if smi:
        env["gpu_name"] = env["gpu_name"] or smi["name"]
        env["driver_version"] = smi["driver_version"]
        env["sm_clock_mhz"] = smi["sm_clock_mhz"]
        env["sm_clock_max_mhz"] = smi["sm_clock_max_mhz"]
    return env
