"""Build flash_ext: one CUDA extension (flash_ext._C, abi3) for sm_90a.

Build switches (environment variables), so a developer can rebuild one kernel in minutes:

  FLASH_EXT_HEADDIMS   comma list of kernel head dims to compile, from 64,96,128,192,256 (default: all)
  FLASH_EXT_DTYPES     comma list from fp16,bf16,e4m3 (default: all; e4m3 = FP8, forward only)
  FLASH_EXT_CAUSAL     comma list from 0,1: non-causal and/or causal attention kernels (default: both)
  FLASH_EXT_BACKWARD   1/0: compile the backward kernels (default 1)
  FLASH_EXT_FORWARD    1/0: compile the forward kernels (default 1; 0 for backward-only variant builds)
  FLASH_EXT_DECODE     1/0: compile the decode kernels of flash_attn_with_kvcache (default 1; they take every
                       mask at run time, so FLASH_EXT_CAUSAL does not select them)
  FLASH_EXT_PTXAS_V    1: print ptxas resource usage (registers, spills, smem) for every kernel
  MAX_JOBS             parallel compile jobs (honoured by torch's ninja build)
  CUDA_HOME            CUDA toolkit (default: /usr/local/cuda, else the directory above `nvcc`)
"""
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _default_cuda_home():
    # torch guesses /usr/local from /usr/local/bin/nvcc, and the link then fails with -lcudart.
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = candidate
            return
    nvcc = shutil.which("nvcc")
    if nvcc:
        os.environ["CUDA_HOME"] = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


_default_cuda_home()

import torch  # noqa: E402  (after CUDA_HOME is set: cpp_extension reads it at import)
from torch.utils.cpp_extension import BuildExtension, CUDAExtension  # noqa: E402


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError as e:
        raise RuntimeError(
            "flash_ext needs the CUTLASS/CuTe headers from the `nvidia-cutlass` package: "
            "pip install nvidia-cutlass==4.2.0.0"
        ) from e
    inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.exists(os.path.join(inc, "cute", "tensor.hpp")):
        raise RuntimeError(f"nvidia-cutlass is installed but has no CuTe headers under {inc}")
    return inc


def _parse_list(name, allowed, default):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(default)
    values = [v.strip() for v in raw.split(",") if v.strip()]
    bad = [v for v in values if v not in [str(a) for a in allowed]]
    if bad:
        raise RuntimeError(f"{name}={raw!r}: unknown value(s) {bad}; allowed: {','.join(map(str, allowed))}")
    return values


def _kernel_table():
    """flash_ext/kernel_table.py, the one list of kernels, loaded by path (the package imports torch)."""
    spec = importlib.util.spec_from_file_location("kernel_table", ROOT / "flash_ext" / "kernel_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _selected_kernels():
    """The instantiation files (hopper/instantiations/*.cu) this build compiles, and the defines of the op's
    C++ files (host compiler only: nvcc would split the comma list)."""
    table = _kernel_table()
    hdims = [int(h) for h in _parse_list("FLASH_EXT_HEADDIMS", table.KERNEL_HEADDIMS, table.KERNEL_HEADDIMS)]
    # Per direction, the kernels that run the selected head dims (the backward runs d192 on its d256 kernel).
    kernel_hdims = {direction: {table.kernel_headdim(h, direction) for h in hdims} for direction in table.HEADDIMS_BY_DIRECTION}
    dtypes = _parse_list("FLASH_EXT_DTYPES", tuple(table.DTYPES), tuple(table.DTYPES))
    causal = [c == "1" for c in _parse_list("FLASH_EXT_CAUSAL", ("0", "1"), ("0", "1"))]
    directions = [direction for direction, switch in (("fwd", "FLASH_EXT_FORWARD"), ("bwd", "FLASH_EXT_BACKWARD"),
                                                      ("decode", "FLASH_EXT_DECODE"))
                  if _parse_list(switch, ("0", "1"), ("1",)) == ["1"]]
    sources = []
    for entry in table.all_kernels():
        path = ROOT / "hopper" / "instantiations" / entry.file_name
        if not path.exists():
            raise RuntimeError(f"{path} is missing; run python hopper/generate_kernels.py")
        if (entry.direction in directions and entry.headdim in kernel_hdims[entry.direction] and entry.dtype in dtypes
                and (entry.causal in causal or len(table.CAUSAL_BY_DIRECTION[entry.direction]) == 1)):
            sources.append(str(path.relative_to(ROOT)))
    defines = [f"-DFLASH_EXT_{direction.upper()}_HEADDIMS=" + ",".join(map(str, headdims))
               for direction, headdims in table.HEADDIMS_BY_DIRECTION.items()]
    return sources, defines


def _variant():
    """FLASH_EXT_VARIANT=name builds flash_ext._C_<name> with ops torch.ops.flash_ext_<name>, loadable beside
    the main build, with FLASH_EXT_VARIANT_DEFINES (e.g. "-DFLASH_EXT_TILE_M=128 -DFLASH_EXT_TILE_N=176"):
    for A/B measurements in one process (scripts/build_variant.sh). Unset for normal builds."""
    name = os.environ.get("FLASH_EXT_VARIANT", "").strip()
    if not name:
        return "_C", []
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise RuntimeError(f"FLASH_EXT_VARIANT={name!r}: use lowercase letters, digits and _")
    defines = [f"-DFLASH_EXT_OPS_NAMESPACE=flash_ext_{name}", f"-DFLASH_EXT_MODULE_NAME=_C_{name}"]
    defines += os.environ.get("FLASH_EXT_VARIANT_DEFINES", "").split()
    return f"_C_{name}", defines


def _extension():
    sources, op_defines = _selected_kernels()
    module, variant_defines = _variant()
    # py_limited_api=True makes torch define Py_LIMITED_API (3.10 stable ABI) for both compilers.
    # Hidden visibility: only PyInit is exported, so two builds loaded side by side (variants) never share
    # a symbol such as the kernel registry.
    common = ["-DNDEBUG"] + variant_defines
    nvcc = [
        "-O3",
        "-std=c++17",
        "-gencode=arch=compute_90a,code=sm_90a",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "--use_fast_math",
        "-lineinfo",
        "-DCUTLASS_ENABLE_GDC_FOR_SM90",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        # ptxas C7510 (serialized wgmma) means lost performance: make it impossible to miss.
        "-Xptxas=--warn-on-spills",
        "-Xcompiler=-fvisibility=hidden",
    ] + common
    if os.environ.get("FLASH_EXT_PTXAS_V", "0") == "1":
        nvcc.append("-Xptxas=-v")
    threads = os.environ.get("FLASH_EXT_NVCC_THREADS")
    if threads:
        nvcc.append(f"--threads={threads}")
    return CUDAExtension(
        name=f"flash_ext.{module}",
        sources=["csrc/flash_api.cpp", "csrc/arg_checks.cpp"] + sources,
        include_dirs=[str(ROOT / "hopper"), str(ROOT / "csrc"), _cutlass_include()],
        extra_compile_args={"cxx": ["-O3", "-std=c++17", "-fvisibility=hidden"] + common + op_defines, "nvcc": nvcc},
        py_limited_api=True,
    )


setup(
    name="flash_ext",
    version="0.1.0",
    packages=find_packages(include=["flash_ext", "flash_ext.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
    python_requires=">=3.10",
)
