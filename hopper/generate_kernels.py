#!/usr/bin/env python3
"""Writes one .cu file per entry of flash_ext/kernel_table.py into hopper/instantiations/ (one
instantiation per translation unit keeps each compile to minutes and lets setup.py's switches pick a subset).

    python hopper/generate_kernels.py          # rewrite the files
    python hopper/generate_kernels.py --check  # fail if the committed files are stale (CI)
"""
import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "hopper" / "instantiations"


def load_kernel_table():
    # By path: flash_ext/__init__ imports torch, which a build environment may not have yet.
    spec = importlib.util.spec_from_file_location("kernel_table", ROOT / "flash_ext" / "kernel_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_files():
    return {entry.file_name: entry.source() for entry in load_kernel_table().all_kernels()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify instead of writing")
    args = parser.parse_args()
    files = kernel_files()
    if args.check:
        existing = {p.name for p in OUT_DIR.glob("*.cu")}
        stale = [n for n, text in files.items() if not (OUT_DIR / n).exists() or (OUT_DIR / n).read_text() != text]
        extra = sorted(existing - set(files))
        if stale or extra:
            print(f"stale: {stale}, unexpected: {extra}; run python hopper/generate_kernels.py", file=sys.stderr)
            return 1
        return 0
    OUT_DIR.mkdir(exist_ok=True)
    for old in OUT_DIR.glob("*.cu"):
        if old.name not in files:
            old.unlink()
    for name, text in files.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {len(files)} files to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
