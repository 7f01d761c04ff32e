"""The command line of `python -m flash_ext.benchmark`: options, the grid of shapes, and main."""
import argparse
import datetime
import math
import os
import sys
import time

import torch

from .backends import BACKENDS, fa3_importable, flash_ext_has_backward, make_backends, padded_length
from .check import REF_HEADS, REF_MAX_ELEMS
from .decode import FLUSHES as DECODE_FLUSHES
from .env import collect_env, nvidia_smi
from .jsonfile import write_json
from .plot import write_plot
from .progress import Progress
from .records import backend_name, order_backends
from .report import MODE_TITLES, format_metric_table, format_table, modes_in
from .runner import DTYPES, RunConfig, run_benchmark
from .shapes import (NO_WINDOW, VARLEN_MAX, VARLEN_MIN, VARLEN_SEQS, VARLEN_TOKENS, Shape, attention_flops,
                     dense_equivalent, dense_label, varlen_seqlens, varlen_shape)
from .timing import cpu_timer, cuda_peak_mib, make_do_bench_timer

DEFAULT_HEADDIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_HEADDIMS = (128,)
QUICK_SEQLENS = (1024, 8192)
DEFAULT_TOKENS = 16384  # batch * seqlen
DEFAULT_HIDDEN = 2048  # nheads * headdim
# flex compiles once per shape: opt-in; the bf16 yardstick only for fp8 runs; the comparison columns only with
# --window / --softcap; the dense yardstick (the same work as the varlen batch) and SDPA on nested tensors only with --varlen.
DEFAULT_BACKENDS = tuple(k for k in BACKENDS
                         if k not in ("flex", "flash_ext_bf16", "flash_ext_no_window", "flash_ext_no_softcap",
                                      "flash_ext_dense", "sdpa_nested"))


def parse_int_list(text):
    """'512,1k,8192' -> [512, 1024, 8192]; a 'k' suffix means x1024."""
    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            n = int(item[:-1]) * 1024 if item.endswith("k") else int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an integer (a 'k' suffix means x1024)") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} must be positive")
        out.append(n)
    if not out:
        raise argparse.ArgumentTypeError(f"empty list {text!r}")
    return out


def _positive_int(text):
    (n,) = parse_int_list(text)
    return n


def parse_window(text):
    """'256,0' -> (256, 0): --window's LEFT,RIGHT, each -1 (unbounded) or >= 0."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        left, right = (int(p) for p in parts)
    except ValueError:  # not two items, or not integers
        raise argparse.ArgumentTypeError(
            f"{text!r} is not LEFT,RIGHT: two integers, each -1 (unbounded) or >= 0, e.g. 256,0") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"{text!r}: each bound must be -1 (unbounded) or >= 0")
    return left, right


def parse_softcap(text):
    """--softcap's C: a finite number >= 0 (0 = off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the softcap must be a finite number >= 0 (0 = off)")
    return value


def _backend_list(text):
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad}; known: {','.join(BACKENDS)}")
    return names


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m flash_ext.benchmark",
        description="Time flash_ext against SDPA (flash, cuDNN, memory-efficient, math), FlexAttention and "
        "FlashAttention-3 on one grid of shapes; print a table, write JSON and a PNG plot.",
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--mode", choices=("fwd", "bwd", "both", "auto"), default="auto",
                   help="forward, backward or both; auto (default) = both when flash_ext's build has a backward, "
                   "else fwd")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="input dtype (default bf16)")
    g.add_argument("--quick", action="store_true", help="small grid: d128 x {1k, 8k} x both masks (< 1 minute)")
    g.add_argument("--backends", type=_backend_list, default=None,
                   help=f"comma list from {','.join(BACKENDS)} (default: all but flex; fa3 only when importable)")
    g.add_argument("--flex", action="store_true", help="add FlexAttention (torch.compile; compiles once per shape)")
    g.add_argument("--deterministic", action="store_true",
                   help="flash_ext's backward in its deterministic mode (no effect on other backends or the forward)")
    g.add_argument("--fp8-v-colmajor", action="store_true",
                   help="with --dtype fp8: flash_ext reads V column-major (flash_ext.fp8.colmajor, made outside the "
                   "timed region) at the head dims that have kernels for it (d256)")
    s = p.add_argument_group("shapes (default grid: d {64,128,256} x s {512..16k} x both masks, b*s = 16k, h*d = 2048)")
    s.add_argument("--headdims", type=parse_int_list, default=None, help="comma list of head dims, e.g. 64,128")
    s.add_argument("--seqlens", type=parse_int_list, default=None, help="comma list of seqlens, e.g. 512,8k")
    s.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="masks to run (default both)")
    s.add_argument("--batch", type=_positive_int, default=None, help="batch (default: --tokens // seqlen_q)")
    s.add_argument("--seqlen-q", type=_positive_int, default=None, help="one query length (overrides --seqlens)")
    s.add_argument("--seqlen-k", type=_positive_int, default=None, help="key length (default: = seqlen_q)")
    s.add_argument("--nheads", type=_positive_int, default=None, help="query heads (default: --hidden // headdim)")
    kv = s.add_mutually_exclusive_group()
    kv.add_argument("--nheads-kv", type=_positive_int, default=None, help="key/value heads, GQA/MQA (default: nheads)")
    kv.add_argument("--gqa", type=_positive_int, default=None,
                    help="query heads per key/value head (nheads_kv = nheads // GQA, for every head dim)")
    s.add_argument("--headdim", type=_positive_int, default=None, help="one head dim (overrides --headdims)")
    s.add_argument("--tokens", type=_positive_int, default=DEFAULT_TOKENS, help="batch * seqlen (default 16384)")
    s.add_argument("--hidden", type=_positive_int, default=DEFAULT_HIDDEN, help="nheads * headdim (default 2048)")
    s.add_argument("--varlen", action="store_true",
                   help=f"instead of the seqlen axis, one packed batch of {VARLEN_SEQS} sequences whose lengths are drawn "
                   f"(fixed seed) from {VARLEN_MIN}..{VARLEN_MAX // 1024}k, {VARLEN_TOKENS // 1024}k tokens in all, at "
                   "each head dim and mask of the run: flash_ext's varlen kernels next to its dense kernels on the "
                   "dense batch that does the same work (sequences of L = round(sum(s^2) / sum(s)), batch "
                   f"round(tokens / L): {dense_label(varlen_shape(varlen_seqlens(), 1, 1, 1, False))} for these lengths; the same "
                   "(query, key) pairs and tokens; column 'flash_ext (dense, same work)', ratio 'varlen/dense'), SDPA "
                   "on the zero-padded batch with a mask, and SDPA on nested tensors")
    a = p.add_argument_group(
        "attention variant (flash_ext and FA3 run it; SDPA and Flex are skipped with the reason; flash_ext is also "
        "timed without it, as the column 'flash_ext (no window)' / 'flash_ext (no softcap)')")
    a.add_argument("--window", type=parse_window, default=None, metavar="LEFT,RIGHT",
                   help="sliding window: query i sees keys i + sk - sq - LEFT .. i + sk - sq + RIGHT (-1 = unbounded; "
                   "write --window=-1,100 when LEFT is -1). Causal shapes need RIGHT -1 or 0 (use --causal no "
                   "otherwise). TFLOP/s count the exact number of visible (query, key) pairs")
    a.add_argument("--softcap", type=parse_softcap, default=0.0, metavar="C",
                   help="logits c * tanh(scale * q.k / c) (Gemma 2); 0 (default) = off")
    dg = p.add_argument_group(
        "decoding (--decode: one step of flash_attn_with_kvcache over a full cache, contiguous and paged, beside SDPA; "
        "uses --nheads (default 32), --nheads-kv (8), --headdim (128), --seqlen-q (1), --dtype)")
    dg.add_argument("--decode", action="store_true", help="run the decoding benchmark instead of the attention grid")
    dg.add_argument("--decode-batches", type=parse_int_list, default=None, help="batches (default 1,8,64)")
    dg.add_argument("--decode-seqlens", type=parse_int_list, default=None,
                    help="cache lengths (default 512,4k,32k,128k; batch * length above 2M tokens is skipped)")
    dg.add_argument("--page-sizes", type=parse_int_list, default=None, help="paged caches' page sizes (default 64,256)")
    dg.add_argument("--decode-flush", choices=DECODE_FLUSHES, default="clean",
                    help="how L2 is evicted before each timed call: clean = by reading 256 MB (default), dirty = by "
                         "writing it (triton's do_bench; the call then also writes back those dirty lines, 8-9 us "
                         "of a 50 us step: docs/perf-notes.md section 48)")
    t = p.add_argument_group("timing and checks")
    t.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up time in ms (default 25)")
    t.add_argument("--repeat-ms", type=float, default=100.0, help="do_bench measuring time in ms (default 100)")
    t.add_argument("--heat-ms", type=float, default=500.0,
                   help="run a row's backends in turn, back to back, this long before timing them, so that they are "
                        "timed at the GPU's steady (power-limited) clock (default 500; 0 = off)")
    t.add_argument("--rounds", type=int, default=0,
                   help="time a row's backends in this many interleaved rounds, each with warmup and rep divided by "
                        "the rounds, in balanced orders (every backend first, and right after each other one, "
                        "equally often); a backend's time is the median over the rounds (default 0 = one round "
                        "per order: the backends' count when even, twice it when odd)")
    t.add_argument("--math-max-gb", type=float, default=2.0,
                   help="skip SDPA math when its b*h*sq*sk*4-byte score matrix exceeds this many GiB (default 2)")
    t.add_argument("--input-scale", type=float, default=1.0, help="inputs are randn * this (default 1.0)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench_out", help="output folder (default ./bench_out)")
    o.add_argument("--name", default="bench", help="file stem: NAME.json, NAME.txt, NAME_fwd.png (default bench)")
    o.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--dry-run", action="store_true", help="print the grid and backends, then exit (no GPU needed)")
    o.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of the harness itself (CPU wall-clock timings, meaningless as numbers)")
    return p


def build_grid(args):
    """The list of Shapes to run, in table order (head dim, then mask, then seqlen). Raises ValueError."""
    headdims = [args.headdim] if args.headdim else (args.headdims or (QUICK_HEADDIMS if args.quick else DEFAULT_HEADDIMS))
    seqlens = [args.seqlen_q] if args.seqlen_q else (args.seqlens or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS))
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    window = args.window or NO_WINDOW
    if window[1] > 0 and True in causals:
        raise ValueError(f"--window {window[0]},{window[1]}: causal attention is the band with right = 0, so a right "
                         "bound > 0 needs --causal no")
    varlen = args.varlen
    if varlen:
        given = [option for option, value in (("--seqlens", args.seqlens), ("--seqlen-q", args.seqlen_q),
                                              ("--seqlen-k", args.seqlen_k), ("--batch", args.batch))
                 if value is not None] + (["--tokens"] if args.tokens != DEFAULT_TOKENS else [])
        if given:
            raise ValueError(f"--varlen draws its own lengths ({VARLEN_SEQS} sequences, {VARLEN_TOKENS} tokens): drop "
                             f"{', '.join(given)}")
        seqlens = [varlen_seqlens()]  # one batch per head dim and mask
    shapes = []
    for d in dict.fromkeys(headdims):
        nheads = args.nheads or max(1, args.hidden // d)
        if args.gqa and nheads % args.gqa != 0:
            raise ValueError(f"--gqa {args.gqa} does not divide nheads ({nheads}) (head dim {d})")
        nheads_kv = nheads // args.gqa if args.gqa else args.nheads_kv or nheads
        if nheads % nheads_kv != 0:
            raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv}) (head dim {d})")
        for causal in causals:
            if varlen:
                shapes.append(varlen_shape(seqlens[0], nheads, nheads_kv, d, causal, window, args.softcap))
                continue
            for sq in dict.fromkeys(seqlens):
                batch = args.batch or max(1, args.tokens // sq)
                shapes.append(Shape(batch, sq, args.seqlen_k or sq, nheads, nheads_kv, d, causal,
                                    window_left=window[0], window_right=window[1], softcap=args.softcap))
    return shapes


def resolve_modes(mode, dtype="bf16"):
    """The passes to time. FP8 is forward-only: "auto" gives the forward alone, an explicit backward raises."""
    if dtype == "fp8":
        if mode in ("bwd", "both"):
            raise ValueError(f"--mode {mode}: FP8 is forward-only (flash_ext has no FP8 backward, SDPA no FP8 attention)")
        return ["fwd"]
    if mode == "auto":
        mode = "both" if flash_ext_has_backward() else "fwd"
    return {"fwd": ["fwd"], "bwd": ["bwd"], "both": ["fwd", "bwd"]}[mode]


def _has_window(args):
    return args.window is not None and tuple(args.window) != NO_WINDOW


def select_backends(args):
    """Backend keys to run, in table order. FA3 joins the default set only when it is importable; with
    --window / --softcap, flash_ext without them joins as the comparison column."""
    keys = list(args.backends or (k for k in DEFAULT_BACKENDS if k != "fa3" or fa3_importable()))
    if args.backends is None and args.dtype == "fp8":
        keys.insert(1, "flash_ext_bf16")
    if args.backends is None and _has_window(args):
        keys.insert(1, "flash_ext_no_window")
    if args.backends is None and args.softcap:
        keys.insert(1, "flash_ext_no_softcap")
    if args.backends is None and args.varlen:
        keys[1:1] = ["flash_ext_dense"]
        keys.append("sdpa_nested")
    if args.flex:
        keys.append("flex")
    return order_backends(keys)


def config_dict(args, shapes, modes, backend_keys):
    return {
        **vars(args),
        "modes": list(modes),
        "backends": list(backend_keys),
        "num_shapes": len(shapes),
        "shapes": [s.to_dict() for s in shapes],
        "timer": "triton.testing.do_bench(return_mode='median'), a row's backends interleaved in balanced orders, "
        "median over the rounds",
        "reference_slice": f"batch 0, first {REF_HEADS} query heads, all rows up to {REF_MAX_ELEMS} score "
        "elements (else the last rows)",
    }


def _flash_ext_options_note(args, modes):
    note = ", flash_ext deterministic" if args.deterministic and "bwd" in modes else ""
    return note + (", flash_ext FP8 V column-major" if args.fp8_v_colmajor and args.dtype == "fp8" else "")


def _variant_note(args):
    """', window (256, 0), softcap 30' for the options that are on, else ''."""
    note = f", window ({args.window[0]}, {args.window[1]})" if _has_window(args) else ""
    return note + (f", softcap {args.softcap:g}" if args.softcap else "")


def _rounds_note(args):
    return str(args.rounds) if args.rounds else "balanced"


def format_dry_run(shapes, modes, backend_keys, args):
    lines = [
        f"flash_ext benchmark (dry run): modes {'+'.join(modes)}, "
        f"dtype {args.dtype}{_flash_ext_options_note(args, modes)}{_variant_note(args)}, {len(shapes)} shape(s), "
        f"backends {', '.join(backend_name(k) for k in backend_keys)}",
        f"timing: {args.heat_ms:g} ms of heat, then do_bench warmup {args.warmup_ms:g} ms, rep {args.repeat_ms:g} ms, "
        f"split over {_rounds_note(args)} interleaved rounds, median; output folder {args.out}",
    ]
    if _variant_note(args):
        columns = [backend_name(k) for k in ("flash_ext_no_window", "flash_ext_no_softcap") if k in backend_keys]
        lines.append(
            f"attention variant: {_variant_note(args)[2:]}: run by flash_ext and FA3, SDPA and Flex skipped (they have "
            "no window / softcap)" + (f"; flash_ext is also timed without it ({', '.join(columns)})" if columns else "")
            + ("; GFLOP count only the visible (query, key) pairs" if _has_window(args) else ""))
    varlen = [s for s in shapes if s.is_varlen()]
    if varlen:
        lines.append(format_varlen_note(varlen[0]))
    width = max([24] + [len(s.label()) for s in shapes])
    lines += [
        f"{'#':>3}  {'shape':<{width}} {'batch':>5} {'seqlen_q':>8} {'seqlen_k':>8} {'nheads':>6} {'nheads_kv':>9} "
        f"{'headdim':>7} {'causal':>6} " + " ".join(f"{'GFLOP ' + m:>11}" for m in modes),
    ]
    for i, s in enumerate(shapes, 1):
        fl = " ".join(f"{attention_flops(s, m) / 1e9:>11.1f}" for m in modes)
        lines.append(
            f"{i:>3}  {s.label():<{width}} {s.batch:>5} {s.seqlen_q:>8} {s.seqlen_k:>8} {s.nheads:>6} {s.nheads_kv:>9} "
            f"{s.headdim:>7} {str(s.causal):>6} {fl}"
        )
    return "\n".join(lines)


def format_varlen_note(shape):
    """The --varlen batch and its yardsticks, for the dry run and under the tables."""
    dense = dense_equivalent(shape)
    return (f"varlen batch: {len(shape.seqlens)} sequences, {shape.tokens} tokens, lengths "
            f"{', '.join(map(str, shape.seqlens))}\n"
            f"  flash_ext (dense, same work): {dense.batch} x {dense.seqlen_q}, sequences of L = round(sum(s^2) / "
            f"sum(s)) = {dense.seqlen_q}, batch round(tokens / L) = {dense.batch}: the same (query, key) pairs and "
            "tokens, up to rounding (varlen/dense = the TFLOP/s ratio); "
            f"SDPA: the batch zero-padded to {len(shape.seqlens)} x {padded_length(shape)} with a mask; SDPA nested: "
            "nested tensors (layout=torch.jagged); GFLOP count each sequence's own (query, key) pairs (causal: "
            "s(s+1)/2), not the padding")


def table_title(mode, env, args):
    gpu = env.get("gpu_name") or "unknown GPU"
    clock = ""
    if env.get("sm_clock_after_run_mhz"):
        clock = f", SM clock {env['sm_clock_after_run_mhz']} MHz at the end (max {env.get('sm_clock_max_mhz')})"
    elif env.get("sm_clock_mhz"):
        clock = f", SM clock {env['sm_clock_mhz']} MHz at the start"
    return (
        f"== {MODE_TITLES[mode]} | {args.dtype}{_flash_ext_options_note(args, [mode])}{_variant_note(args)} | {gpu}{clock} | "
        "TFLOP/s, median of "
        f"do_bench (warmup {args.warmup_ms:g} ms, rep {args.repeat_ms:g} ms) over {_rounds_note(args)} interleaved "
        f"rounds after {args.heat_ms:g} ms of heat =="
    )


def write_outputs(out_dir, name, env, config, records, args, backend_keys, command):
    """Tables (returned and written to NAME.txt), NAME.json and NAME_<mode>.png; returns (text, paths)."""
    os.makedirs(out_dir, exist_ok=True)
    parts = []
    for mode in modes_in(records):
        parts.append(format_table(records, mode, backend_keys, title=table_title(mode, env, args)))
        parts.append(format_metric_table(records, mode, "peak_mib", backend_keys,
                                         title=f"-- {mode} peak memory above inputs, MiB --"))
    varlen = [r.shape for r in records if r.shape.is_varlen()]
    if varlen:
        parts.append(format_varlen_note(varlen[0]))
    text = "\n\n".join(parts)
    txt_path = os.path.join(out_dir, f"{name}.txt")
    with open(txt_path, "w") as f:
        f.write(text + "\n")
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    paths = [txt_path, write_json(os.path.join(out_dir, f"{name}.json"), env, config, records, created=created,
                                  command=command)]
    if not args.no_plot:
        for mode in modes_in(records):
            path = write_plot(os.path.join(out_dir, f"{name}_{mode}.png"), records, mode, gpu_name=env.get("gpu_name"),
                              dtype=args.dtype, backends=backend_keys)
            if path:
                paths.append(path)
    return text, paths


def run_decode_cli(args, parser):
    from . import decode

    if args.dtype not in ("bf16", "fp16"):
        parser.error("--decode runs bf16 or fp16")
    batches = args.decode_batches or decode.DEFAULT_BATCHES
    seqlens = args.decode_seqlens or decode.DEFAULT_CACHE_LENS
    page_sizes = args.page_sizes or decode.DEFAULT_PAGE_SIZES
    nheads, nheads_kv, headdim, seqlen_q = args.nheads or 32, args.nheads_kv or 8, args.headdim or 128, args.seqlen_q or 1
    if nheads % nheads_kv:
        parser.error(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if args.dry_run:
        print(f"decode: batches {batches}, cache lengths {seqlens}, page sizes {page_sizes}, q {seqlen_q} token(s), "
              f"h{nheads}/kv{nheads_kv} d{headdim} {args.dtype}")
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible; the benchmark needs one (use --dry-run to see the grid)", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    rows, copy_gbs = decode.run_decode(batches, seqlens, seqlen_q, nheads, nheads_kv, headdim, dtype, page_sizes,
                                       args.warmup_ms, args.repeat_ms,
                                       log=lambda line: print(line, file=sys.stderr, flush=True), flush=args.decode_flush)
    env = collect_env(torch.device("cuda", torch.cuda.current_device()))
    title = (f"== decode step | {args.dtype} | q {seqlen_q} token(s), h{nheads}/kv{nheads_kv}, d{headdim} | "
             f"{env.get('gpu_name')} | us, median (warmup {args.warmup_ms:g} ms, rep {args.repeat_ms:g} ms), L2 evicted "
             f"before each call with {args.decode_flush} lines left "
             f"({'256 MB read' if args.decode_flush == 'clean' else '256 MB written, do_bench'}) ==")
    text = decode.format_table(rows, copy_gbs, title)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.txt")
    with open(path, "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.decode:
        return run_decode_cli(args, parser)
    try:
        shapes = build_grid(args)
    except ValueError as e:
        parser.error(str(e))
    if args.warmup_ms <= 0 or args.repeat_ms <= 0:
        parser.error("--warmup-ms and --repeat-ms must be positive")
    if not args.heat_ms >= 0:
        parser.error("--heat-ms must be 0 or more")
    if args.rounds < 0:
        parser.error("--rounds must be 0 (one per balanced order) or more")
    try:
        modes = resolve_modes(args.mode, args.dtype)
    except ValueError as e:
        parser.error(str(e))
    backend_keys = select_backends(args)
    if args.dry_run:
        print(format_dry_run(shapes, modes, backend_keys, args))
        return 0
    if args.device == "cpu":
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("error: no CUDA GPU visible; the benchmark needs one (use --dry-run to see the grid)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = RunConfig(dtype=args.dtype, input_scale=args.input_scale, seed=args.seed, math_max_gb=args.math_max_gb,
                    deterministic=args.deterministic, fp8_v_colmajor=args.fp8_v_colmajor)
    backends = make_backends(backend_keys, cfg)
    env = collect_env(device)
    command = [sys.executable, "-m", "flash_ext.benchmark"] + list(sys.argv[1:] if argv is None else argv)
    config = config_dict(args, shapes, modes, backend_keys)
    print(
        f"flash_ext benchmark: {len(shapes)} shape(s) x {'+'.join(modes)} x {len(backends)} backend(s) "
        f"[{', '.join(backend_name(k) for k in backend_keys)}] on {env['gpu_name']}, {args.dtype}",
        file=sys.stderr,
    )
    for be in backends:
        if be.unavailable:
            print(f"  {backend_name(be.key)}: skipped everywhere: {be.unavailable}", file=sys.stderr)
    if device.type == "cuda":
        timer = make_do_bench_timer(args.warmup_ms, args.repeat_ms, args.heat_ms, args.rounds)
        peak_fn = lambda fn: cuda_peak_mib(fn, device)  # noqa: E731
    else:
        timer, peak_fn = cpu_timer, None
    progress = Progress(len(shapes) * len(modes) * len(backends), len(shapes), enabled=not args.no_progress)
    t0 = time.monotonic()
    records, fatal = [], None
    try:
        _, fatal = run_benchmark(shapes, modes, backends, cfg, device, timer, peak_fn=peak_fn, progress=progress,
                                 records=records)
    except KeyboardInterrupt:  # keep and write what was measured
        progress.close()
        fatal = "interrupted"
    config["elapsed_s"] = round(time.monotonic() - t0, 1)
    config["stopped_early"] = fatal
    if device.type == "cuda":  # the clock under load (the one read at the start is usually the idle clock)
        env["sm_clock_after_run_mhz"] = nvidia_smi(device.index).get("sm_clock_mhz")
    text, paths = write_outputs(args.out, args.name, env, config, records, args, backend_keys, command)
    print(text)
    print(f"\nwrote {', '.join(paths)} in {config['elapsed_s']:.0f} s", file=sys.stderr)
    if fatal:
        print(f"error: stopped early: {fatal}", file=sys.stderr)
        return 1
    return 0
