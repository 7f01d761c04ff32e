"""Compares the GEMM loops of two builds' kernels in SASS, without device time.

For a refactor meant to leave the hot code alone (one copy of a step instead of two, say), this checks that
ptxas still emits the same loops: for every kernel function present in both objects, every loop (a backward
branch and its target) that holds a tensor-core instruction (HGMMA, QGMMA) is compared instruction by
instruction, with register numbers, predicates and immediates normalised away (ptxas renumbers freely). It
prints per function the loops' lengths and how many lines differ, and the difference in the whole function.

    python3 scripts/sass_diff.py /tmp/base_objs build/main/hopper/instantiations [--only flash_fwd]
(cuobjdump: the CUDA toolkit's, or triton's copy beside the venv, which also brings nvdisasm.)
"""
import argparse
import difflib
import glob
import os
import re
import shutil
import subprocess

INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def cuobjdump():
    tool = shutil.which("cuobjdump")
    if tool is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        found = glob.glob(os.path.join(root, ".venv/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump"))
        if not found:
            raise SystemExit("no cuobjdump (CUDA toolkit or triton's copy)")
        tool = found[0]
        os.environ["PATH"] = os.path.dirname(tool) + os.pathsep + os.environ["PATH"]
    return tool


def functions(obj, tool):
    """{mangled name: [(address, instruction text)]} of one object's SASS."""
    out = subprocess.run([tool, "-sass", obj], capture_output=True, text=True, check=True).stdout
    funcs, current = {}, None
    for line in out.splitlines():
        if "Function :" in line:
            current = funcs.setdefault(line.split("Function :")[1].strip(), [])
        elif current is not None and (m := INSTR.match(line)):
            current.append((int(m.group(1), 16), m.group(2)))
    return funcs


def normalise(text):
    text = re.sub(r"\bU?R[0-9]+\b", "R", text)
    text = re.sub(r"\bU?P[0-9]\b", "P", text)
    return re.sub(r"0x[0-9a-f]+|\b[0-9]+\b", "N", text)


def gemm_loops(code):
    """The innermost loops that hold a tensor-core instruction (the step loops; the tile loop around them is
    left out), as normalised instruction lists in address order."""
    index = {addr: i for i, (addr, _) in enumerate(code)}
    spans = []
    for i, (addr, text) in enumerate(code):
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            start = index[int(m.group(1), 16)]
            if any("GMMA" in t for _, t in code[start:i + 1]):
                spans.append((start, i))
    inner = [(a, b) for a, b in spans if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    return [[normalise(t) for _, t in code[a:b + 1]] for a, b in inner]


def differing(a, b):
    return sum(1 for line in difflib.unified_diff(a, b, n=0, lineterm="") if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old_dir")
    parser.add_argument("new_dir")
    parser.add_argument("--only", default="", help="object names must contain this")
    args = parser.parse_args()
    tool = cuobjdump()
    changed = 0
    for old_obj in sorted(glob.glob(os.path.join(args.old_dir, "*.o"))):
        name = os.path.basename(old_obj)
        new_obj = os.path.join(args.new_dir, name)
        if args.only not in name or not os.path.exists(new_obj):
            continue
        old_f, new_f = functions(old_obj, tool), functions(new_obj, tool)
        for fn in sorted(set(old_f) & set(new_f)):
            old_loops, new_loops = gemm_loops(old_f[fn]), gemm_loops(new_f[fn])
            if not old_loops and not new_loops:
                continue
            whole = differing([normalise(t) for _, t in old_f[fn]], [normalise(t) for _, t in new_f[fn]])
            loops = [f"{len(a)}/{len(b)}:{differing(a, b)}" for a, b in zip(old_loops, new_loops)]
            same = len(old_loops) == len(new_loops) and all(differing(a, b) == 0 for a, b in zip(old_loops, new_loops))
            changed += not same
            short = subprocess.run(["c++filt"], input=fn, capture_output=True, text=True).stdout.strip()
            short = re.sub(r"cutlass::|flash::", "", short)[:110]
            print(f"{'same' if same else 'DIFF'} loops {' '.join(loops) or '-'} (count {len(old_loops)}/{len(new_loops)}), "
                  f"function lines differing {whole}  {name}  {short}")
    print(f"{changed} function(s) with a GEMM loop that differs")


if __name__ == "__main__":
    main()
