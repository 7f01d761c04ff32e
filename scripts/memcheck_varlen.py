"""Runs every compiled 16-bit kernel through the variable-length ops (torch.ops.flash_ext.fwd_varlen,
bwd_varlen) on small mixed batches, with valid offsets and with invalid ones that the Python API would
reject (decreasing, past the tensors' ends, seqused longer than the sequence, a max_seqlen below the longest
sequence): the kernels must stay inside their memory for any values (hopper/varlen.h). The workload for
compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_varlen.py [--headdims 192]

(--headdims: only the kernels of those head dims; --cases, --calls: only those offset cases and calls; the
whole run takes many minutes under the sanitizer. --verbose prints each call before it runs and its time after,
so a run that does not finish shows which call it was in.)
"""
import argparse
import time

import torch

import flash_ext  # noqa: F401  (loads the ops)
from compiled_kernels import call_options, compiled_kernels


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


# (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k) over 300 query and 260 key rows.
CASES = {
    "valid": ([0, 1, 130, 130, 300], [0, 7, 7, 200, 260], None, None, 170, 193),
    "seqused": ([0, 1, 130, 130, 300], [0, 7, 7, 200, 260], [1, 100, 0, 170], [3, 0, 150, 60], 170, 193),
    "decreasing": ([0, 200, 100, 250, 300], [0, 150, 20, 260, 100], None, None, 300, 260),
    "past_the_end": ([0, 100, 400, 9000, 100000], [5, 300, 2 ** 30, 7, 2 ** 31 - 1], None, None, 300, 260),
    "negative": ([-50, -1, 40, -7, 300], [0, -100, 30, 260, -5], [-3, 500, 2, -1], [1000, -9, 0, 40], 300, 260),
    "seqused_too_long": ([0, 1, 130, 130, 300], [0, 7, 7, 200, 260], [50, 500, 9, 999], [400, 8, 300, 100], 170, 193),
    "max_too_small": ([0, 1, 130, 130, 300], [0, 7, 7, 200, 260], None, None, 64, 50),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdims", default="", help="comma list of kernel head dims (default: all compiled)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of offset cases")
    parser.add_argument("--calls", default="bwd,bwd_det",
                        help="backward calls after each forward: comma list of bwd, bwd_det (or none)")
    parser.add_argument("--verbose", action="store_true")
    cli = parser.parse_args()
    only = {int(x) for x in cli.headdims.split(",") if x}
    cases = {name: CASES[name] for name in cli.cases.split(",")}
    calls = set(cli.calls.split(","))

    def run(label, fn):
        if cli.verbose:
            print(f"  {label} ...", end="", flush=True)
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        if cli.verbose:
            print(f" {time.perf_counter() - start:.1f} s", flush=True)
        return result

    total_q, total_k, h, hkv = 300, 260, 4, 2
    for d, dtype, causal in compiled_kernels("fwd", ["bf16", "fp16"]):
        if only and d not in only:
            continue
        has_bwd = (d, dtype, causal) in set(compiled_kernels("bwd", ["bf16", "fp16"]))
        q, dout = (torch.randn(total_q, h, d, device="cuda", dtype=dtype) for _ in range(2))
        k, v = (torch.randn(total_k, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        for name, (cu_q, cu_k, used_q, used_k, max_q, max_k) in cases.items():
            args = (i32(cu_q), i32(cu_k), None if used_q is None else i32(used_q), None if used_k is None else i32(used_k),
                    max_q, max_k)
            for options in call_options(causal):
                window = options.get("window_size", (-1, -1))
                extra = (window[0], window[1], options.get("softcap", 0.0))
                mask = options["causal"]
                label = f"d{d} {dtype} {name} {options}"
                out, lse = run(f"{label} fwd", lambda: torch.ops.flash_ext.fwd_varlen(q, k, v, *args, d ** -0.5, mask, *extra))
                for deterministic in (False, True):
                    call = "bwd_det" if deterministic else "bwd"
                    if has_bwd and call in calls:
                        run(f"{label} {call}", lambda: torch.ops.flash_ext.bwd_varlen(
                            dout, q, k, v, out, lse, None, *args, d ** -0.5, mask, deterministic, *extra))
            torch.cuda.synchronize()
        print(f"d{d} {dtype} causal={causal}: ran {len(cases)} offset cases", flush=True)


if __name__ == "__main__":
    main()
