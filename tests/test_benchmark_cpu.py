"""CPU tests of `python -m flash_ext.benchmark` (the package flash_ext/bench/): FLOPs, grid, verdicts, ratio,
table, JSON, plot, dry run, flash_ext's support decision from a fake build_info, and the runner driven end to
end on CPU (SDPA math / CPU flash, a deliberately wrong fake backend, a fake flash_ext forward/backward)."""
import collections
import copy
import dataclasses
import io
import json
import math
import os
import statistics

import pytest
import torch

import flash_ext
from flash_ext import reference
from flash_ext.bench import backends, check, cli, env, jsonfile, plot, progress, records, report, runner, shapes, timing
from flash_ext.bench.records import Record
from flash_ext.bench.shapes import Shape


def _args(*argv):
    return cli.build_parser().parse_args(list(argv))


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------
def _pairs_brute(sq, sk):
    return sum(min(max(i + sk - sq + 1, 0), sk) for i in range(sq))


def test_flops_non_causal():
    s = Shape(batch=2, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_kv=16, headdim=128, causal=False)
    assert shapes.attention_flops(s, "fwd") == 4 * 2 * 16 * 1024 * 1024 * 128
    s2 = Shape(2, 1000, 3000, 16, 4, 64, False)
    assert shapes.attention_flops(s2, "fwd") == 4 * 2 * 16 * 1000 * 3000 * 64


def test_flops_causal_square_is_exactly_half():
    # FlashAttention's published convention: causal = half of non-causal when sq == sk (the exact pair
    # count s(s+1)/2 would include the diagonal; we deliberately do not).
    for s in (1, 512, 8192):
        nc = Shape(4, s, s, 8, 8, 64, False)
        c = Shape(4, s, s, 8, 8, 64, True)
        assert shapes.attention_flops(c, "fwd") * 2 == shapes.attention_flops(nc, "fwd")
    c = Shape(1, 512, 512, 1, 1, 64, True)
    assert shapes.attention_flops(c, "fwd") != 4 * 64 * shapes.causal_pairs(512, 512)
    assert shapes.causal_pairs(512, 512) == 512 * 513 // 2


@pytest.mark.parametrize("sq,sk", [(1, 1), (3, 5), (5, 3), (7, 7), (1, 9), (9, 1), (128, 1000), (1000, 128), (4, 0)])
def test_causal_pairs_bottom_right(sq, sk):
    assert shapes.causal_pairs(sq, sk) == _pairs_brute(sq, sk)


def test_flops_causal_rectangular_uses_exact_pairs():
    s = Shape(1, 3, 5, 1, 1, 8, True)  # rows see 3, 4, 5 keys
    assert shapes.attention_flops(s, "fwd") == 4 * 8 * (3 + 4 + 5)
    s = Shape(2, 5, 3, 4, 2, 8, True)  # rows see 0, 0, 1, 2, 3 keys
    assert shapes.attention_flops(s, "fwd") == 4 * 2 * 4 * 8 * (1 + 2 + 3)


def test_flops_backward_is_2_5x_forward():
    for causal in (False, True):
        s = Shape(2, 2048, 2048, 16, 16, 128, causal)
        assert shapes.attention_flops(s, "bwd") == 2.5 * shapes.attention_flops(s, "fwd")
    with pytest.raises(ValueError):
        shapes.attention_flops(s, "both")


def test_tflops():
    assert shapes.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert shapes.tflops(1e12, None) is None
    assert shapes.tflops(1e12, 0.0) is None


# ------------------------------------------------------------------------------------------------
# Grid
# ------------------------------------------------------------------------------------------------
def test_default_grid():
    grid = cli.build_grid(_args())
    assert len(grid) == 36
    assert len(set(grid)) == 36
    assert {s.headdim for s in grid} == {64, 128, 256}
    assert {s.seqlen_q for s in grid} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {s.causal for s in grid} == {False, True}
    for s in grid:
        assert s.batch * s.seqlen_q == 16384
        assert s.nheads * s.headdim == 2048
        assert s.seqlen_k == s.seqlen_q and s.nheads_kv == s.nheads


def test_quick_grid():
    grid = cli.build_grid(_args("--quick"))
    assert len(grid) == 4
    assert {(s.headdim, s.seqlen_q, s.causal) for s in grid} == {(128, n, c) for n in (1024, 8192) for c in (False, True)}


def test_custom_grids():
    grid = cli.build_grid(_args("--headdims", "64,128", "--seqlens", "512,8k", "--causal", "no"))
    assert [(s.headdim, s.seqlen_q, s.batch, s.nheads, s.causal) for s in grid] == [
        (64, 512, 32, 32, False),
        (64, 8192, 2, 32, False),
        (128, 512, 32, 16, False),
        (128, 8192, 2, 16, False),
    ]
    (s,) = cli.build_grid(
        _args("--batch", "3", "--seqlen-q", "1k", "--seqlen-k", "4096", "--nheads", "8", "--nheads-kv", "2",
              "--headdim", "64", "--causal", "yes")
    )
    assert s == Shape(3, 1024, 4096, 8, 2, 64, True)
    with pytest.raises(ValueError):
        cli.build_grid(_args("--nheads", "6", "--nheads-kv", "4"))
    assert cli.parse_int_list("512, 1k,16K") == [512, 1024, 16384]


def test_modes_and_backends():
    assert cli.resolve_modes("both") == ["fwd", "bwd"]
    # FP8 is forward-only: "auto" times the forward alone, an explicit backward is an error.
    assert cli.resolve_modes("auto", "fp8") == ["fwd"]
    assert cli.resolve_modes("fwd", "fp8") == ["fwd"]
    for mode in ("bwd", "both"):
        with pytest.raises(ValueError, match="FP8 is forward-only"):
            cli.resolve_modes(mode, "fp8")
    assert cli.resolve_modes("auto") == (["fwd", "bwd"] if backends.flash_ext_has_backward() else ["fwd"])
    keys = cli.select_backends(_args("--flex"))
    assert keys[0] == "flash_ext" and "flex" in keys and "sdpa_math" in keys
    assert cli.select_backends(_args("--backends", "sdpa_math,flash_ext")) == ["flash_ext", "sdpa_math"]
    with pytest.raises(SystemExit):
        _args("--backends", "nope")


def test_sdpa_math_size_limit():
    cfg = runner.RunConfig(math_max_gb=2.0)
    math_be = backends.SDPAMath(cfg)
    small = Shape(32, 512, 512, 32, 32, 64, False)  # 1 GiB of scores
    big = Shape(1, 16384, 16384, 16, 16, 128, False)  # 16 GiB
    assert math_be.refuse(small, "fwd") is None
    status, reason = math_be.refuse(big, "fwd")
    assert status == records.SKIPPED and "GiB" in reason
    assert backends.SDPAFlash(runner.RunConfig(dtype="fp8")).refuse(small, "fwd")[0] == records.SKIPPED


# ------------------------------------------------------------------------------------------------
# Verdict and ratio
# ------------------------------------------------------------------------------------------------
def test_verdict_marks_large_errors_wrong():
    tol = check.tolerance("bf16", math_err=4e-3, ref_absmax=0.5)
    assert tol == pytest.approx(2 * 4e-3 + 1e-3)
    assert check.verdict(5e-3, tol)[0]
    ok, why = check.verdict(0.2, tol)
    assert not ok and "tolerance" in why
    assert not check.verdict(float("nan"), tol)[0]
    assert not check.verdict(float("inf"), tol)[0]
    assert check.tolerance("bf16", None) == pytest.approx(2e-2)
    assert check.tolerance("bf16", float("nan")) == pytest.approx(2e-2)
    assert check.tolerance("fp16", 1e-4, ref_absmax=4.0) == pytest.approx(2e-4 + 4e-3)


def _rec(shape, backend, status=records.OK, tf=None, mode="fwd", reason=""):
    return Record(shape=shape, mode=mode, backend=backend, status=status, tflops=tf, reason=reason,
                  ms=(1.0 if tf else None), checked=True)


S1 = Shape(2, 8192, 8192, 16, 16, 128, False)
S2 = Shape(2, 8192, 8192, 16, 16, 128, True)


def test_best_sdpa_ignores_wrong_and_skipped():
    row = {
        "flash_ext": _rec(S1, "flash_ext", tf=600.0),
        "fa3": _rec(S1, "fa3", tf=700.0),  # not an SDPA backend
        "sdpa_cudnn": _rec(S1, "sdpa_cudnn", status=records.WRONG, tf=900.0),
        "sdpa_flash": _rec(S1, "sdpa_flash", tf=300.0),
        "sdpa_efficient": _rec(S1, "sdpa_efficient", status=records.SKIPPED, reason="refused"),
        "sdpa_math": _rec(S1, "sdpa_math", tf=20.0),
    }
    assert report.best_sdpa(row) == ("sdpa_flash", 300.0)
    assert report.ratio_to(row) == pytest.approx(2.0)
    assert report.ratio_to(row, against="fa3") == pytest.approx(600 / 700)
    row["sdpa_cudnn"] = _rec(S1, "sdpa_cudnn", tf=500.0)
    assert report.best_sdpa(row) == ("sdpa_cudnn", 500.0)
    assert report.ratio_to(row) == pytest.approx(1.2)
    row["flash_ext"] = _rec(S1, "flash_ext", status=records.SKIPPED, reason="not built")
    assert report.ratio_to(row) is None
    assert report.best_sdpa({"sdpa_flash": _rec(S1, "sdpa_flash", status=records.OOM)}) == (None, None)


# ------------------------------------------------------------------------------------------------
# Table, JSON, plot
# ------------------------------------------------------------------------------------------------
def _synthetic_records():
    recs = []
    for shape, base in ((S1, 300.0), (S2, 280.0)):
        recs += [
            _rec(shape, "flash_ext", tf=base * 1.5),
            _rec(shape, "fa3", tf=base * 1.9),
            _rec(shape, "sdpa_cudnn", tf=base * 1.3),
            _rec(shape, "sdpa_flash", tf=base),
            _rec(shape, "sdpa_efficient", status=records.WRONG, reason="max abs error 0.3 > tolerance 0.01"),
            _rec(shape, "sdpa_math", status=records.SKIPPED, reason="too large: 16 GiB > 2 GiB"),
            _rec(shape, "flash_ext", status=records.NA, reason="no backward yet", mode="bwd"),
            _rec(shape, "sdpa_cudnn", tf=base * 1.1, mode="bwd"),
            _rec(shape, "sdpa_flash", status=records.OOM, reason="CUDA out of memory", mode="bwd"),
        ]
    for r in recs:
        r.flops = shapes.attention_flops(r.shape, r.mode)
        if r.status == records.OK:
            r.peak_mib = 123.0
            r.max_err = 1e-3
            r.tol = 9e-3
    recs[4].max_err = float("nan")
    return recs


def test_table_rendering():
    recs = _synthetic_records()
    text = report.format_table(recs, "fwd", title="== forward ==")
    for key in ("flash_ext", "fa3", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math"):
        assert records.backend_name(key) in text
    assert "ext/SDPA" in text and "best SDPA" in text and "ext/FA3" in text
    assert "1.15x" in text  # 1.5 / 1.3 (cuDNN is the best SDPA)
    assert "WRONG[" in text and "skip[" in text
    assert "too large: 16 GiB > 2 GiB" in text and "max abs error 0.3" in text
    assert S1.label() in text and S2.label() in text
    assert "geomean" in text
    btext = report.format_table(recs, "bwd")
    assert "n/a[" in btext and "no backward yet" in btext and "OOM[" in btext
    mem = report.format_metric_table(recs, "fwd", "peak_mib")
    assert "123" in mem and "WRONG" in mem


def test_json_round_trip(tmp_path):
    recs = _synthetic_records()
    environment = env.collect_env(None)  # CPU: GPU fields are None but present
    cfg = cli.config_dict(_args("--quick"), cli.build_grid(_args("--quick")), ["fwd"], ["flash_ext"])
    path = jsonfile.write_json(str(tmp_path / "b.json"), environment, cfg, recs, created="now", command=["x"])
    with open(path) as f:
        doc = json.load(f)
    for key in ("gpu_name", "sm_clock_mhz", "sm_clock_max_mhz", "driver_version", "cuda_version",
                "torch_version", "cudnn_version", "git_commit", "triton_version", "flash_ext_extension"):
        assert key in doc["env"]
    assert doc["env"]["torch_version"] == torch.__version__
    assert doc["schema"] == jsonfile.SCHEMA and doc["config"]["quick"] is True and doc["config"]["num_shapes"] == 4
    assert len(doc["results"]) == len(recs)
    first = doc["results"][0]
    for key in ("backend", "mode", "status", "reason", "ms", "tflops", "max_err", "peak_mib", "batch",
                "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim", "causal"):
        assert key in first
    assert doc["summary"]["fwd"]["rows"][0]["best_sdpa"] == "sdpa_cudnn"
    _, back = jsonfile.load_json(path)
    assert len(back) == len(recs)
    for a, b in zip(recs, back):
        assert (a.shape, a.mode, a.backend, a.status, a.reason, a.tflops) == (b.shape, b.mode, b.backend, b.status, b.reason, b.tflops)
    assert math.isnan(back[4].max_err)


def test_plot_written(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the plot is optional")
    recs = _synthetic_records()
    # a second head dim, so that the panel grid is 2 x 2
    for r in list(recs):
        s = r.shape
        recs.append(dataclass_replace(r, shape=Shape(s.batch * 2, s.seqlen_q // 2, s.seqlen_k // 2, 32, 32, 64, s.causal)))
    path = plot.write_plot(str(tmp_path / "p.png"), recs, "fwd", gpu_name="Test GPU", dtype="bf16")
    assert path and os.path.getsize(path) > 5000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert plot.write_plot(str(tmp_path / "b.png"), recs, "bwd") is not None


def dataclass_replace(rec, **kw):
    return dataclasses.replace(rec, **kw)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def test_dry_run(capsys):
    assert cli.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "36 shape(s)" in out and "d256 16k C b1 h8" in out
    assert cli.main(["--quick", "--dry-run", "--mode", "both"]) == 0
    out = capsys.readouterr().out
    assert "4 shape(s)" in out and "GFLOP bwd" in out
    with pytest.raises(SystemExit):
        cli.main(["--dry-run", "--nheads", "6", "--nheads-kv", "4"])


# ------------------------------------------------------------------------------------------------
# The runner end to end on CPU
# ------------------------------------------------------------------------------------------------
class _WrongBackend(backends.Backend):
    """Returns 2*q: must be caught by the reference check and never timed."""

    key = "fake_wrong"

    def call(self, q, k, v, shape, scale, state):
        return q * 2.0 + (k.sum() + v.sum()) * 0.0  # k, v in the graph so that autograd.grad works


def test_runner_on_cpu(tmp_path):
    cfg = runner.RunConfig(dtype="bf16")
    bes = backends.make_backends(["flash_ext", "sdpa_flash", "sdpa_math"], cfg) + [_WrongBackend(cfg)]
    grid = [Shape(1, 64, 64, 2, 2, 32, True), Shape(1, 48, 80, 4, 2, 32, True)]
    stream = io.StringIO()
    prog = progress.Progress(len(grid) * 2 * len(bes), len(grid), stream=stream)
    recs, fatal = runner.run_benchmark(grid, ["fwd", "bwd"], bes, cfg, torch.device("cpu"), timing.cpu_timer,
                                       progress=prog)
    assert fatal is None
    assert len(recs) == len(grid) * 2 * len(bes)
    by = {(r.shape, r.mode, r.backend): r for r in recs}
    for s in grid:
        for mode in ("fwd", "bwd"):
            math_rec = by[(s, mode, "sdpa_math")]
            assert math_rec.status == records.OK, math_rec.reason
            assert math_rec.checked and math_rec.max_err <= math_rec.tol and math_rec.ms > 0
            assert by[(s, mode, "fake_wrong")].status == records.WRONG
            assert by[(s, mode, "fake_wrong")].ms is None
        ext = by[(s, "fwd", "flash_ext")]
        if not backends.flash_ext_has_backward():
            assert by[(s, "bwd", "flash_ext")].status in (records.NA, records.SKIPPED)
        if not torch.cuda.is_available():
            assert ext.status == records.SKIPPED and ext.reason
    assert "[1/2]" in stream.getvalue() and "[2/2]" in stream.getvalue()
    args = _args("--no-plot", "--out", str(tmp_path))
    text, paths = cli.write_outputs(str(tmp_path), "bench", env.collect_env(None), {"test": True}, recs, args,
                                    [b.key for b in bes], ["test"])
    assert "SDPA math" in text and "fake_wrong" in text and "WRONG[" in text
    assert sorted(os.path.basename(p) for p in paths) == ["bench.json", "bench.txt"]


def test_main_on_cpu_writes_outputs(tmp_path, capsys):
    out = tmp_path / "o"
    rc = cli.main(["--device", "cpu", "--headdim", "32", "--seqlen-q", "64", "--batch", "1", "--nheads", "2",
                   "--backends", "flash_ext,sdpa_math", "--mode", "both", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "SDPA math" in text and "ext/SDPA" in text
    names = sorted(os.listdir(out))
    assert "bench.json" in names and "bench.txt" in names
    _, recs = jsonfile.load_json(str(out / "bench.json"))
    assert {(r.mode, r.backend) for r in recs} == {(m, b) for m in ("fwd", "bwd") for b in ("flash_ext", "sdpa_math")}
    assert all(r.status == records.OK for r in recs if r.backend == "sdpa_math")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert "bench_fwd.png" in names and "bench_bwd.png" in names


def test_backward_reference_is_attention_autograd(monkeypatch):
    # fp16, bwd only: the gradient reference (float64) and its error baseline (fp16) both come from
    # flash_ext.reference.attention_autograd; SDPA math passes against them, a wrong result does not.
    upcasts = []

    def spy(*a, **kw):
        upcasts.append(kw["upcast"])
        return reference.attention_autograd(*a, **kw)

    monkeypatch.setattr(check, "attention_autograd", spy)
    cfg = runner.RunConfig(dtype="fp16")
    bes = backends.make_backends(["sdpa_math"], cfg) + [_WrongBackend(cfg)]
    grid = [Shape(1, 48, 80, 2, 1, 32, True), Shape(1, 64, 64, 8, 2, 32, False)]
    recs, fatal = runner.run_benchmark(grid, ["bwd"], bes, cfg, torch.device("cpu"), timing.cpu_timer)
    assert fatal is None
    assert upcasts == [True, False] * len(grid)
    by = {(r.shape, r.backend): r for r in recs}
    for s in grid:
        math_rec = by[(s, "sdpa_math")]
        assert math_rec.status == records.OK and math_rec.checked and math_rec.max_err <= math_rec.tol, math_rec.reason
        assert by[(s, "fake_wrong")].status == records.WRONG
    # Groups of 2 = the 2 checked query heads: all of kv head 0's readers are in the slice, so dk/dv are
    # checked; groups of 4 are not, so only dq is.
    assert set(by[(grid[0], "sdpa_math")].err_detail) == {"dq", "dk", "dv"}
    assert set(by[(grid[1], "sdpa_math")].err_detail) == {"dq"}


# ------------------------------------------------------------------------------------------------
# flash_ext's support decision from build_info(), and its backward call (all faked on CPU)
# ------------------------------------------------------------------------------------------------
_FAKE_BUILD = {
    "kernels": [{"direction": "fwd", "headdim": 128, "dtype": dt, "causal": c}
                for dt in ("fp16", "bf16") for c in (False, True)]
    + [{"direction": "bwd", "headdim": 128, "dtype": "bf16", "causal": False}],
    "headdims": [128],
    "dtypes": ["fp16", "bf16"],
    "causal": [False, True],
    "backward": True,
    "cutlass": "4.2.0",
    "cuda": "13.0",
}


@pytest.fixture
def fake_build(monkeypatch):
    info = copy.deepcopy(_FAKE_BUILD)
    monkeypatch.setattr(flash_ext, "extension_available", lambda: True)
    monkeypatch.setattr(flash_ext, "build_info", lambda: info)
    return info


def test_flash_ext_support_from_build_info(fake_build):
    be = backends.FlashExtBackend(runner.RunConfig(dtype="bf16"))
    assert be.unavailable is None
    d128 = Shape(2, 1024, 1024, 16, 16, 128, False)
    assert be.refuse(d128, "fwd") is None and be.refuse(d128, "bwd") is None
    assert be.refuse(dataclasses.replace(d128, headdim=120, causal=True), "fwd") is None  # runs on the d128 kernel
    status, reason = be.refuse(dataclasses.replace(d128, causal=True), "bwd")
    assert status == records.SKIPPED and "bwd" in reason and "d128" in reason and "causal" in reason
    assert be.refuse(dataclasses.replace(d128, headdim=64), "fwd")[0] == records.SKIPPED
    assert be.refuse(dataclasses.replace(d128, headdim=264), "fwd")[0] == records.SKIPPED  # no kernel size
    status, reason = backends.FlashExtBackend(runner.RunConfig(dtype="fp8")).refuse(d128, "fwd")
    assert status == records.SKIPPED and "fp8" in reason
    assert backends.flash_ext_has_backward() and cli.resolve_modes("auto") == ["fwd", "bwd"]

    fake_build["backward"] = False
    fake_build["kernels"] = [k for k in fake_build["kernels"] if k["direction"] == "fwd"]
    status, reason = backends.FlashExtBackend(runner.RunConfig(dtype="bf16")).refuse(d128, "bwd")
    assert status == records.NA and "backward" in reason
    assert not backends.flash_ext_has_backward() and cli.resolve_modes("auto") == ["fwd"]


def test_flash_ext_not_built(monkeypatch):
    def no_build_info():
        raise AssertionError("build_info() must not be called when the extension did not load")

    monkeypatch.setattr(flash_ext, "extension_available", lambda: False)
    monkeypatch.setattr(flash_ext, "build_info", no_build_info)
    assert not backends.flash_ext_has_backward() and cli.resolve_modes("auto") == ["fwd"]
    cfg = runner.RunConfig()
    be = backends.FlashExtBackend(cfg)
    assert be.unavailable == "flash_ext extension not built (or it failed to load)"
    (rec,), _ = runner.run_benchmark([Shape(1, 64, 64, 2, 2, 32, False)], ["fwd"], [be], cfg, torch.device("cpu"),
                                     timing.cpu_timer)
    assert rec.status == records.SKIPPED and rec.reason == be.unavailable
    assert "skip[1]" in report.format_table([rec], "fwd") and be.unavailable in report.format_table([rec], "fwd")
    assert env.collect_env(None)["flash_ext_build_info"] is None


def test_deterministic_option():
    assert _args().deterministic is False
    args = _args("--deterministic", "--quick", "--mode", "both")
    assert args.deterministic is True
    cfg = cli.config_dict(args, cli.build_grid(args), ["fwd", "bwd"], ["flash_ext"])
    assert cfg["deterministic"] is True
    assert "deterministic" in cli.table_title("bwd", {}, args)
    assert "deterministic" not in cli.table_title("fwd", {}, args)
    assert "deterministic" not in cli.table_title("bwd", {}, _args())
    assert "flash_ext deterministic" in cli.format_dry_run(cli.build_grid(args), ["fwd", "bwd"], ["flash_ext"], args)


def test_heat_option(monkeypatch):
    """A row's backends are heated before they are timed (default 500 ms; perf-notes section 47: the timing order
    moved ratios by 2-7% without it); the titles say so; 0 turns it off; a negative value is refused."""
    assert _args().heat_ms == 500.0
    args = _args("--heat-ms", "0", "--quick")
    assert args.heat_ms == 0.0 and cli.config_dict(args, cli.build_grid(args), ["fwd"], ["flash_ext"])["heat_ms"] == 0.0
    assert "after 500 ms of heat" in cli.table_title("fwd", {}, _args())
    assert "500 ms of heat" in cli.format_dry_run(cli.build_grid(_args()), ["fwd"], ["flash_ext"], _args())
    with pytest.raises(SystemExit):
        cli.main(["--dry-run", "--heat-ms", "-1"])
    # heat(fns, 0, ...) calls nothing; heat(fns, ms, ...) runs the fns in turn, each at least once, until ms have
    # passed; a fn that raises gets its exception and runs no more (synchronize stubbed: no GPU here).
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []
    timing.heat([lambda: calls.append("a")], 0, [None])
    assert calls == []

    def boom():
        calls.append("x")
        raise RuntimeError("boom")

    results = [None, None]
    timing.heat([lambda: calls.append("a"), boom], 1, results)
    assert calls[:2] == ["a", "x"] and calls.count("x") == 1 and calls.count("a") >= 1
    assert results[0] is None and isinstance(results[1], RuntimeError)


def test_balanced_orders():
    """Every backend of a row is timed first, and right after each other backend, equally often."""
    for n in range(1, 8):
        orders = timing.balanced_orders(n)
        assert len(orders) == (2 * n if n % 2 and n > 1 else n)
        assert all(sorted(order) == list(range(n)) for order in orders)
        firsts = collections.Counter(order[0] for order in orders)
        pairs = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
        assert set(firsts.values()) == {len(orders) // n}
        if n > 1:
            assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1


def test_interleaved_timer(monkeypatch):
    """The do_bench timer times a row's fns in interleaved rounds of balanced orders, splits warmup and rep over
    the rounds, reports the median of each fn's rounds, and reports a failing fn's exception without stopping
    the others; --rounds overrides the count."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    seen = []  # (fn name, warmup, rep)
    times = {"a": iter([1.0, 9.0, 2.0, 3.0]), "b": iter([5.0, 4.0, 6.0, 100.0])}

    def fake_do_bench(fn, warmup, rep, return_mode):
        assert return_mode == "median"
        name = fn()
        seen.append((name, warmup, rep))
        if name == "c":
            raise torch.OutOfMemoryError("c ran out")
        return next(times[name])

    monkeypatch.setattr(timing, "do_bench", fake_do_bench)
    timer = timing.make_do_bench_timer(20, 100, heat_ms=0)
    assert timer([]) == []
    ms = timer([lambda: "a", lambda: "b"])
    assert [n for n, _, _ in seen] == ["a", "b", "b", "a"]  # orders [0, 1], [1, 0]
    assert {(w, r) for _, w, r in seen} == {(10, 50)}
    assert ms == [statistics.median([1.0, 9.0]), statistics.median([5.0, 4.0])]
    seen.clear()
    timer = timing.make_do_bench_timer(20, 100, heat_ms=0, rounds=4)
    times["a"], times["b"] = iter([1.0, 9.0, 2.0, 3.0]), iter([5.0, 4.0, 6.0, 100.0])
    ms = timer([lambda: "a", lambda: "b", lambda: "c"])
    assert isinstance(ms[2], torch.OutOfMemoryError) and [n for n, _, _ in seen].count("c") == 1
    assert ms[:2] == [2.5, 5.5] and len(seen) == 9 and {(w, r) for _, w, r in seen} == {(5, 25)}
    assert _args().rounds == 0 and _args("--rounds", "3").rounds == 3
    assert "balanced interleaved rounds" in cli.table_title("fwd", {}, _args())
    with pytest.raises(SystemExit):
        cli.main(["--dry-run", "--rounds", "-1"])


def test_runner_reports_a_timing_failure():
    """A backend that passes its check but fails while timed gets ERROR with the reason; the others keep their
    times."""
    cfg = runner.RunConfig(dtype="bf16")
    bes = backends.make_backends(["sdpa_math", "sdpa_flash"], cfg) + [_WrongBackend(cfg)]
    timed = []

    def timer(fns):
        timed.append(len(fns))
        return [RuntimeError("timing broke") if i == 0 else 1.0 for i in range(len(fns))]

    recs, fatal = runner.run_benchmark([Shape(1, 64, 64, 2, 2, 32, False)], ["fwd"], bes, cfg, torch.device("cpu"),
                                       timer)
    by = {r.backend: r for r in recs}
    assert fatal is None and len(timed) == 1  # one timer call per row, the WRONG backend not in it
    assert by["sdpa_math"].status == records.ERROR and "timing broke" in by["sdpa_math"].reason
    assert by["sdpa_math"].ms is None and by["fake_wrong"].status == records.WRONG
    flash = by["sdpa_flash"]
    assert timed[0] == (2 if flash.status == records.OK else 1)
    assert flash.status != records.OK or (flash.ms == 1.0 and flash.tflops > 0)


def test_gqa_option():
    grid = cli.build_grid(_args("--gqa", "4"))  # nheads 32, 16, 8 for d64, d128, d256
    assert {(s.headdim, s.nheads, s.nheads_kv) for s in grid} == {(64, 32, 8), (128, 16, 4), (256, 8, 2)}
    with pytest.raises(ValueError):
        cli.build_grid(_args("--gqa", "3"))
    with pytest.raises(SystemExit):
        _args("--gqa", "2", "--nheads-kv", "4")


def test_flash_ext_backward_call_on_cpu(fake_build, monkeypatch):
    # flash_ext's bwd: forward once outside the timed region, then backward(dout, q, k, v, out, lse, ...)
    # with the --deterministic setting; its gradients are checked like every backend's.
    calls = []

    def fake_forward(q, k, v, softmax_scale=None, causal=False):
        calls.append("forward")
        out, lse = reference.attention_ref(q, k, v, softmax_scale, causal)
        return out.to(q.dtype), lse.float()

    def fake_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False,
                      dq=None, dk=None, dv=None, dlse=None):
        calls.append(("backward", deterministic))
        assert out.dtype == q.dtype and lse.dtype == torch.float32
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        o, _ = reference.attention_autograd(*leaves, softmax_scale=softmax_scale, causal=causal)
        return tuple(g.to(q.dtype) for g in torch.autograd.grad(o, leaves, dout.double()))

    monkeypatch.setattr(flash_ext, "forward", fake_forward)
    monkeypatch.setattr(flash_ext, "backward", fake_backward, raising=False)
    cfg = runner.RunConfig(dtype="bf16", deterministic=True)
    bes = backends.make_backends(["flash_ext", "sdpa_math"], cfg)
    shape = Shape(1, 64, 64, 2, 2, 128, False)  # a kernel of the fake build in both directions
    recs, fatal = runner.run_benchmark([shape], ["fwd", "bwd"], bes, cfg, torch.device("cpu"), timing.cpu_timer)
    assert fatal is None
    by = {(r.mode, r.backend): r for r in recs}
    for mode in ("fwd", "bwd"):
        rec = by[(mode, "flash_ext")]
        assert rec.status == records.OK and rec.checked and rec.max_err <= rec.tol, rec.reason
        assert by[(mode, "sdpa_math")].diff_vs_flash_ext is not None
    assert set(by[("bwd", "flash_ext")].err_detail) == {"dq", "dk", "dv"}
    backward_calls = [c for c in calls if c != "forward"]
    assert backward_calls and set(backward_calls) == {("backward", True)}


def test_fp8_v_colmajor_option(fake_build, monkeypatch):
    """--fp8-v-colmajor: flash_ext's FP8 forward gets V column-major (made outside the timed call) where the
    build has a kernel for it, row-major elsewhere; the titles say so, only for --dtype fp8."""
    args = _args("--dtype", "fp8", "--fp8-v-colmajor", "--quick")
    assert "flash_ext FP8 V column-major" in cli.table_title("fwd", {}, args)
    assert "column-major" not in cli.table_title("fwd", {}, _args("--fp8-v-colmajor", "--quick"))
    fake_build["kernels"].append({"direction": "fwd", "headdim": 256, "dtype": "e4m3", "causal": False, "v_colmajor": True})
    seen = []
    monkeypatch.setattr(flash_ext, "forward", lambda q, k, v, **kw: seen.append(v.stride(1)) or (q, None))
    backend = backends.FlashExtBackend(runner.RunConfig(dtype="fp8", fp8_v_colmajor=True))
    for d in (256, 128):
        q = torch.zeros(1, 32, 2, d).to(torch.float8_e4m3fn)
        fn, _ = backend.make_fwd(q, q, q, Shape(1, 32, 32, 2, 2, d, False), 0.1)
        fn()
    assert seen == [1, 2 * 128]  # d256: column-major (sequence stride 1); d128: as given (nheads * headdim)


def test_fp8_run_has_the_bf16_yardstick(fake_build):
    """--dtype fp8: flash_ext runs the e4m3 kernels (forward only) and flash_ext_bf16 our bf16 forward on the
    same inputs; the table shows their ratio."""
    fake_build["kernels"].append({"direction": "fwd", "headdim": 128, "dtype": "e4m3", "causal": False})
    fake_build["dtypes"].append("e4m3")
    d128 = Shape(2, 1024, 1024, 16, 16, 128, False)
    fp8_cfg = runner.RunConfig(dtype="fp8")
    assert backends.FlashExtBackend(fp8_cfg).refuse(d128, "fwd") is None
    assert backends.FlashExtBackend(fp8_cfg).refuse(d128, "bwd")[0] == records.NA
    status, reason = backends.FlashExtBackend(fp8_cfg).refuse(dataclasses.replace(d128, causal=True), "fwd")
    assert status == records.SKIPPED and "e4m3" in reason
    yardstick = backends.FlashExtBf16Backend(fp8_cfg)
    assert yardstick.refuse(d128, "fwd") is None and yardstick.refuse(d128, "bwd")[0] == records.NA
    assert backends.FlashExtBf16Backend(runner.RunConfig(dtype="bf16")).refuse(d128, "fwd")[0] == records.SKIPPED
    recs = [_rec(S1, "flash_ext", tf=900.0), _rec(S1, "flash_ext_bf16", tf=600.0),
            _rec(S1, "sdpa_cudnn", status=records.SKIPPED, reason="SDPA has no fp8 attention")]
    for r in recs:
        r.flops = shapes.attention_flops(r.shape, r.mode)
    text = report.format_table(recs, "fwd")
    assert "flash_ext bf16" in text and "fp8/bf16" in text and "1.50x" in text


# ------------------------------------------------------------------------------------------------
# --window / --softcap: visible pairs, FLOPs, options, backends, the comparison columns
# ------------------------------------------------------------------------------------------------
def _visible_brute(sq, sk, causal, window):
    left, right = window
    right = 0 if causal else right
    count = 0
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            count += (right < 0 or j <= diag + right) and (left < 0 or j >= diag - left)
    return count


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 9), (9, 1), (5, 3), (3, 5), (7, 7), (16, 40), (40, 16), (33, 33)])
def test_visible_pairs_brute_force(sq, sk):
    for left in (-1, 0, 1, 2, 5, 8, 15, 39, 100):
        for right in (-1, 0, 1, 3, 8, 39, 100):
            for causal in (False, True):
                if causal and right > 0:
                    continue
                assert shapes.visible_pairs(sq, sk, causal, (left, right)) == _visible_brute(sq, sk, causal, (left, right)), \
                    (sq, sk, causal, left, right)
    assert shapes.visible_pairs(sq, sk) == sq * sk
    assert shapes.visible_pairs(sq, sk, True) == shapes.causal_pairs(sq, sk) == _pairs_brute(sq, sk)


def test_visible_pairs_large_and_invalid():
    # A 256-key causal window on 8k: every row sees min(i + 1, 257) keys.
    assert shapes.visible_pairs(8192, 8192, True, (256, 0)) == sum(min(i + 1, 257) for i in range(8192))
    assert shapes.visible_pairs(8192, 8192, False, (100, 100)) == sum(
        min(i + 100, 8191) - max(i - 100, 0) + 1 for i in range(8192))
    assert shapes.visible_pairs(4, 0, True, (3, 0)) == 0
    with pytest.raises(ValueError):
        shapes.visible_pairs(8, 8, True, (3, 2))
    with pytest.raises(ValueError):
        shapes.visible_pairs(8, 8, False, (-2, 0))


def test_flops_with_window_and_softcap():
    for causal, window in ((True, (256, 0)), (False, (64, 64)), (True, (-1, 0)), (False, (-1, 100)), (True, (5000, 0))):
        s = Shape(2, 1000, 1200, 16, 4, 128, causal, *window)
        assert shapes.attention_flops(s, "fwd") == 4 * 2 * 16 * 128 * _visible_brute(1000, 1200, causal, window)
        assert shapes.attention_flops(s, "bwd") == 2.5 * shapes.attention_flops(s, "fwd")
    # No window: the convention as before (causal sq == sk exactly half); the softcap changes no FLOP count.
    for causal in (False, True):
        plain = Shape(4, 2048, 2048, 8, 8, 64, causal)
        assert shapes.attention_flops(Shape(4, 2048, 2048, 8, 8, 64, causal, -1, -1, 30.0), "fwd") == \
            shapes.attention_flops(plain, "fwd") == (4 if not causal else 2) * 4 * 8 * 2048 * 2048 * 64


def test_shape_window_fields_labels_and_old_json():
    s = Shape(2, 1024, 1024, 16, 16, 128, True, 256, 0, 30.0)
    assert s.window == (256, 0) and s.has_window()
    assert s.label() == "d128 1k C b2 h16 w256,0 cap30"
    assert s.window_softcap_kwargs() == {"window_size": (256, 0), "softcap": 30.0}
    plain = Shape(2, 1024, 1024, 16, 16, 128, True)
    assert plain.label() == "d128 1k C b2 h16" and plain.window_softcap_kwargs() == {} and not plain.has_window()
    assert Shape(1, 8, 8, 1, 1, 64, False, softcap=5.0).window_softcap_kwargs() == {"softcap": 5.0}
    assert Shape.from_dict(s.to_dict()) == s
    old = {k: v for k, v in plain.to_dict().items() if k not in ("window_left", "window_right", "softcap")}
    assert Shape.from_dict(old) == plain  # a results file written before the window existed


def test_window_and_softcap_options():
    args = _args()
    assert args.window is None and args.softcap == 0.0
    args = _args("--window", "256,0", "--softcap", "30")
    assert args.window == (256, 0) and args.softcap == 30.0
    assert _args("--window=-1,100").window == (-1, 100)
    assert _args("--window", " 7 , -1 ").window == (7, -1)
    for bad in (["--window", "3"], ["--window", "1,2,3"], ["--window", "a,b"], ["--window", "1.5,0"],
                ["--window=-2,0"], ["--window", "0,-5"], ["--window", ""], ["--softcap", "-1"], ["--softcap", "nan"],
                ["--softcap", "inf"], ["--softcap", "x"]):
        with pytest.raises(SystemExit):
            _args(*bad)
    # Causal shapes need a right bound of -1 or 0: an argparse error, not a crash.
    with pytest.raises(ValueError, match=r"right bound > 0 needs --causal no"):
        cli.build_grid(_args("--window", "64,64"))
    with pytest.raises(SystemExit):
        cli.main(["--dry-run", "--window", "64,64", "--causal", "both"])


def test_window_grid_and_backends():
    grid = cli.build_grid(_args("--quick", "--window", "256,0", "--softcap", "30"))
    assert len(grid) == 4 and all(s.window == (256, 0) and s.softcap == 30.0 for s in grid)
    grid = cli.build_grid(_args("--quick", "--window", "64,64", "--causal", "no"))
    assert {(s.window, s.causal, s.softcap) for s in grid} == {((64, 64), False, 0.0)}
    assert cli.build_grid(_args("--quick", "--window=-1,-1")) == cli.build_grid(_args("--quick"))
    keys = cli.select_backends(_args("--window", "256,0"))
    assert keys[:2] == ["flash_ext", "flash_ext_no_window"] and "flash_ext_no_softcap" not in keys
    keys = cli.select_backends(_args("--softcap", "5"))
    assert keys[:2] == ["flash_ext", "flash_ext_no_softcap"] and "flash_ext_no_window" not in keys
    keys = cli.select_backends(_args("--window", "8,0", "--softcap", "5"))
    assert keys[:3] == ["flash_ext", "flash_ext_no_window", "flash_ext_no_softcap"]
    assert "flash_ext_no_window" not in cli.select_backends(_args())
    assert cli.select_backends(_args("--window", "8,0", "--backends", "flash_ext,sdpa_flash")) == ["flash_ext", "sdpa_flash"]
    assert records.backend_name("flash_ext_no_window") == "flash_ext (no window)"
    assert records.backend_name("flash_ext_no_softcap") == "flash_ext (no softcap)"


def test_dry_run_shows_window_and_softcap(capsys):
    assert cli.main(["--dry-run", "--quick", "--causal", "yes", "--window", "256,0", "--softcap", "30", "--mode", "both"]) == 0
    out = capsys.readouterr().out
    assert "window (256, 0), softcap 30" in out
    assert "flash_ext (no window)" in out and "flash_ext (no softcap)" in out
    assert "d128 8k C b2 h16 w256,0 cap30" in out and "visible (query, key) pairs" in out
    gflop = 4 * 2 * 16 * 128 * shapes.visible_pairs(8192, 8192, True, (256, 0)) / 1e9
    assert f"{gflop:.1f}" in out
    assert cli.main(["--dry-run", "--quick"]) == 0
    assert "window" not in capsys.readouterr().out


def test_window_softcap_refusals(fake_build):
    windowed = Shape(2, 1024, 1024, 16, 16, 128, False, 64, 64)
    capped = Shape(2, 1024, 1024, 16, 16, 128, True, softcap=30.0)
    plain = Shape(2, 1024, 1024, 16, 16, 128, False)
    cfg = runner.RunConfig(dtype="bf16")
    for key in tuple(k for k in records.SDPA_KEYS if k != "sdpa_nested") + ("flex",):  # nested: --varlen only
        be = backends.BACKENDS[key](cfg)
        status, reason = be.refuse(windowed, "fwd")
        assert status == records.SKIPPED and "window" in reason
        status, reason = be.refuse(capped, "fwd")
        assert status == records.SKIPPED and "softcap" in reason
        assert be.refuse(plain, "fwd") is None
    ext = backends.FlashExtBackend(cfg)
    # The fake build has d128 bf16 forward kernels both ways but only the non-causal backward: a window runs
    # on the causal kernel, so its backward is skipped, with the reason.
    assert ext.refuse(windowed, "fwd") is None and ext.refuse(plain, "bwd") is None
    status, reason = ext.refuse(windowed, "bwd")
    assert status == records.SKIPPED and "sliding windows" in reason
    no_window = backends.FlashExtNoWindowBackend(cfg)
    assert no_window.problem(windowed) == plain and no_window.refuse(windowed, "bwd") is None
    assert no_window.refuse(plain, "fwd")[0] == records.SKIPPED
    no_softcap = backends.FlashExtNoSoftcapBackend(cfg)
    assert no_softcap.problem(capped) == dataclasses.replace(capped, softcap=0.0)
    assert no_softcap.refuse(plain, "fwd")[0] == records.SKIPPED
    assert backends.FlashExtBackend(cfg).problem(windowed) == windowed


def test_window_softcap_run_on_cpu(fake_build, monkeypatch, tmp_path):
    """The runner with --window and --softcap: flash_ext (faked by the float64 reference) runs the band and the
    softcap and is checked against the reference of both; the comparison columns run without one of them, with
    their own FLOPs and reference; SDPA is skipped with the reason; the table shows the time ratios."""
    seen = []

    def fake_forward(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        seen.append((tuple(window_size), softcap))
        out, lse = reference.attention_ref(q, k, v, softmax_scale, causal, window_size=window_size, softcap=softcap)
        return out.to(q.dtype), lse.float()

    def fake_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False,
                      dq=None, dk=None, dv=None, dlse=None, window_size=(-1, -1), softcap=0.0):
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        o, _ = reference.attention_autograd(*leaves, softmax_scale=softmax_scale, causal=causal,
                                            window_size=window_size, softcap=softcap)
        return tuple(g.to(q.dtype) for g in torch.autograd.grad(o, leaves, dout.double()))

    monkeypatch.setattr(flash_ext, "forward", fake_forward)
    monkeypatch.setattr(flash_ext, "backward", fake_backward, raising=False)
    fake_build["kernels"].append({"direction": "bwd", "headdim": 128, "dtype": "bf16", "causal": True})
    args = _args("--window", "24,0", "--softcap", "5", "--causal", "yes")
    keys = cli.select_backends(args)[:3] + ["sdpa_math"]
    cfg = runner.RunConfig(dtype="bf16")
    bes = backends.make_backends(keys, cfg)
    shape = Shape(1, 96, 128, 2, 2, 128, True, 24, 0, 5.0)
    recs, fatal = runner.run_benchmark([shape], ["fwd", "bwd"], bes, cfg, torch.device("cpu"), timing.cpu_timer)
    assert fatal is None
    by = {(r.mode, r.backend): r for r in recs}
    for mode in ("fwd", "bwd"):
        for key in ("flash_ext", "flash_ext_no_window", "flash_ext_no_softcap"):
            rec = by[(mode, key)]
            assert rec.shape == shape  # one row of the table
            assert rec.status == records.OK and rec.checked and rec.max_err <= rec.tol, (key, rec.reason)
        assert by[(mode, "flash_ext")].flops == shapes.attention_flops(shape, mode)
        assert by[(mode, "flash_ext_no_window")].flops == shapes.attention_flops(
            dataclasses.replace(shape, window_left=-1, window_right=-1), mode)
        assert by[(mode, "flash_ext_no_window")].flops > by[(mode, "flash_ext")].flops
        assert by[(mode, "flash_ext_no_softcap")].flops == by[(mode, "flash_ext")].flops
        assert by[(mode, "flash_ext_no_window")].diff_vs_flash_ext is None  # another problem: no diff
        assert by[(mode, "sdpa_math")].status == records.SKIPPED and "window" in by[(mode, "sdpa_math")].reason
    assert {((24, 0), 5.0), ((-1, -1), 5.0), ((24, 0), 0.0)} <= set(seen)
    text = report.format_table(recs, "fwd", keys)
    assert "t/t(no window)" in text and "t/t(no softcap)" in text and "flash_ext (no window)" in text
    assert "visible (query, key) pairs" in text and "SDPA has no sliding window" in text
    assert "window (24, 0), softcap 5" in cli.table_title("fwd", {}, args)
    path = jsonfile.write_json(str(tmp_path / "w.json"), env.collect_env(None), cli.config_dict(args, [shape], ["fwd"], keys),
                               recs)
    doc, back = jsonfile.load_json(path)
    assert back[0].shape == shape and doc["config"]["window"] == [24, 0] and doc["config"]["softcap"] == 5.0
    row = doc["summary"]["fwd"]["rows"][0]
    assert row["flash_ext_time_over_no_window"] is not None and row["flash_ext_time_over_no_softcap"] is not None


def test_window_reference_catches_an_ignored_window(fake_build, monkeypatch):
    """A flash_ext that ignored the window would be WRONG (the check's reference applies it), not timed."""
    def forward_without_window(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        out, lse = reference.attention_ref(q, k, v, softmax_scale, causal, softcap=softcap)
        return out.to(q.dtype), lse.float()

    monkeypatch.setattr(flash_ext, "forward", forward_without_window)
    cfg = runner.RunConfig(dtype="bf16")
    shape = Shape(1, 128, 128, 2, 2, 128, True, 8, 0)
    (rec,), _ = runner.run_benchmark([shape], ["fwd"], backends.make_backends(["flash_ext"], cfg), cfg,
                                     torch.device("cpu"), timing.cpu_timer)
    assert rec.status == records.WRONG and rec.ms is None


# ------------------------------------------------------------------------------------------------
# --varlen: the length generator, the option, FLOPs, the backends' layouts, the runner with fakes
# ------------------------------------------------------------------------------------------------
def test_varlen_seqlens_default_batch():
    lengths = shapes.varlen_seqlens()
    assert len(lengths) == shapes.VARLEN_SEQS == 16 and sum(lengths) == shapes.VARLEN_TOKENS == 32768
    assert all(isinstance(n, int) and shapes.VARLEN_MIN <= n <= shapes.VARLEN_MAX for n in lengths)
    assert lengths == shapes.varlen_seqlens(), "a fixed seed: the same batch in every run"
    assert len(set(lengths)) > 8, "lengths that vary"
    assert shapes.varlen_seqlens(seed=1) != lengths


@pytest.mark.parametrize("seed", range(40))
def test_varlen_seqlens_exact_total_within_bounds(seed):
    for num, total, low, high in ((16, 32768, 128, 8192), (3, 1000, 10, 600), (7, 7 * 128, 128, 8192),
                                  (5, 5 * 8192, 128, 8192), (1, 300, 1, 1000), (16, 130000, 128, 8192)):
        lengths = shapes.varlen_seqlens(num, total, low, high, seed)
        assert len(lengths) == num and sum(lengths) == total and all(low <= n <= high for n in lengths)


def test_varlen_seqlens_impossible():
    for args in ((4, 100, 30, 50), (4, 300, 30, 50), (0, 0, 1, 2), (2, 10, 6, 5)):
        with pytest.raises(ValueError, match="cannot sum to"):
            shapes.varlen_seqlens(*args)


def test_varlen_option_grid():
    assert _args().varlen is False
    grid = cli.build_grid(_args("--varlen"))
    lengths = shapes.varlen_seqlens()
    assert [(s.headdim, s.causal) for s in grid] == [(d, c) for d in (64, 128, 256) for c in (False, True)]
    for s in grid:
        assert s.is_varlen() and s.seqlens == lengths and s.tokens == 32768 and s.batch == 16
        assert s.seqlen_q == s.seqlen_k == max(lengths) and s.nheads * s.headdim == 2048 and s.nheads_kv == s.nheads
    assert grid[3].label() == "d128 varlen 32k C b16 h16"
    quick = cli.build_grid(_args("--varlen", "--quick", "--causal", "yes", "--gqa", "4"))
    assert [(s.headdim, s.causal, s.nheads, s.nheads_kv) for s in quick] == [(128, True, 16, 4)]
    windowed = cli.build_grid(_args("--varlen", "--headdim", "64", "--window", "256,0", "--softcap", "30"))
    assert all(s.window == (256, 0) and s.softcap == 30.0 and s.is_varlen() for s in windowed)
    for bad in (["--seqlens", "1k"], ["--seqlen-q", "512"], ["--batch", "2"], ["--tokens", "8192"]):
        with pytest.raises(ValueError, match=rf"--varlen draws its own lengths .*drop {bad[0]}"):
            cli.build_grid(_args("--varlen", *bad))
        with pytest.raises(SystemExit):
            cli.main(["--dry-run", "--varlen", *bad])


def test_varlen_flops_and_dense_equivalent():
    lengths = (5, 1, 300, 17)
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (True, (8, 0)), (False, (3, 4))):
        s = shapes.varlen_shape(lengths, 8, 2, 64, causal, window)
        pairs = sum(_visible_brute(n, n, causal, window) for n in lengths)
        assert shapes.attention_flops(s, "fwd") == 4 * 8 * 64 * pairs
        assert shapes.attention_flops(s, "bwd") == 2.5 * shapes.attention_flops(s, "fwd")
    causal = shapes.varlen_shape(lengths, 8, 2, 64, True)
    assert shapes.attention_flops(causal, "fwd") == 4 * 8 * 64 * sum(n * (n + 1) // 2 for n in lengths)
    # The yardstick: the dense batch of the same work, sequences of L = round(sum(s^2) / sum(s)) (so that
    # L * tokens = sum(s^2): the same (query, key) pairs over the same tokens), batch round(tokens / L).
    big = cli.build_grid(_args("--varlen", "--headdim", "128", "--causal", "no"))[0]
    seqlens = shapes.varlen_seqlens()
    tokens, squares = sum(seqlens), sum(n * n for n in seqlens)
    assert big.seqlens == seqlens and tokens == 32768
    L = round(squares / tokens)
    batch = max(1, round(tokens / L))
    assert (L, batch) == (3107, 11)  # the default batch's yardstick (not 4 x 8192: ~2.6x the pairs per token)
    dense = shapes.dense_equivalent(big)
    assert dense == Shape(batch, L, L, 16, 16, 128, False) and shapes.dense_label(big) == "11 x 3107"
    assert abs(L * tokens - squares) <= tokens / 2  # L * tokens = sum(s^2) up to the rounding of L
    assert abs(dense.tokens - tokens) <= L / 2  # the same tokens up to the rounding of the batch
    # the same pairs (batch * L^2 = sum(s^2)) up to both roundings: |L (batch L - tokens) + (L tokens - sum s^2)|
    assert abs(dense.batch * L * L - squares) <= L * L / 2 + tokens / 2
    assert abs(dense.batch * L * L / squares - 1) < 0.05  # 106.2M pairs per head against 101.8M
    assert shapes.attention_flops(dense, "fwd") == 4 * 16 * 128 * batch * L * L
    assert abs(shapes.attention_flops(dense, "fwd") / shapes.attention_flops(big, "fwd") - 1) < 0.05
    for variant in (dict(causal=True), dict(causal=True, window=(256, 0), softcap=30.0)):
        s = shapes.varlen_shape(seqlens, 8, 2, 64, **variant)
        assert shapes.dense_equivalent(s) == Shape(batch, L, L, 8, 2, 64, True, *s.window, s.softcap)
    # small batches: (5, 1, 300, 17) -> L = round(90315 / 323) = 280, batch round(323 / 280) = 1
    assert shapes.dense_equivalent(causal) == Shape(1, 280, 280, 8, 2, 64, True)
    assert shapes.dense_equivalent(shapes.varlen_shape((40, 40, 40, 100), 2, 2, 8, False)) == Shape(3, 67, 67, 2, 2, 8,
                                                                                                     False)
    assert shapes.dense_equivalent(shapes.varlen_shape((64,) * 4, 2, 2, 8, False)) == Shape(4, 64, 64, 2, 2, 8, False)
    with pytest.raises(ValueError, match="varlen"):
        shapes.dense_equivalent(Shape(2, 64, 64, 2, 2, 8, False))
    assert not hasattr(shapes, "VARLEN_DENSE_SEQLEN")
    s = shapes.varlen_shape(lengths, 8, 2, 64, True)
    assert Shape.from_dict(json.loads(json.dumps(s.to_dict()))) == s  # seqlens back as a (hashable) tuple


def test_varlen_backends_and_dry_run(capsys):
    keys = cli.select_backends(_args("--varlen"))
    assert keys[:2] == ["flash_ext", "flash_ext_dense"] and "sdpa_nested" in keys and "sdpa_math" in keys
    assert "flash_ext_dense" not in cli.select_backends(_args()) and "sdpa_nested" not in cli.select_backends(_args())
    assert records.backend_name("flash_ext_dense") == "flash_ext (dense, same work)"
    assert records.backend_name("sdpa_nested") == "SDPA nested" and "sdpa_nested" in records.SDPA_KEYS
    assert cli.main(["--dry-run", "--varlen", "--mode", "both"]) == 0
    out = capsys.readouterr().out
    lengths = shapes.varlen_seqlens()
    assert "varlen batch: 16 sequences, 32768 tokens, lengths " + ", ".join(map(str, lengths)) in out
    assert "flash_ext (dense, same work): 11 x 3107" in out and "SDPA nested" in out and "4 x 8192" not in out
    assert "d256 varlen 32k C b16 h8" in out and "6 shape(s)" in out
    s = shapes.varlen_shape(lengths, 16, 16, 128, True)
    assert f"{shapes.attention_flops(s, 'bwd') / 1e9:.1f}" in out


def test_varlen_packed_layouts():
    s = shapes.varlen_shape((3, 1, 18), 2, 2, 8, True)
    packed = backends.Packed(s, torch.device("cpu"))
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 22] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 18 and packed.padded == backends.padded_length(s) == 32
    x = torch.randn(1, 22, 2, 8)
    padded = packed.pad(x)
    assert padded.shape == (3, 32, 2, 8)
    assert torch.equal(padded[1, 0], x[0, 3]) and torch.equal(padded[2, :18], x[0, 4:]) and (padded[0, 3:] == 0).all()
    assert torch.equal(packed.unpad(padded), x)
    nested = packed.nested(x[0])
    assert nested.is_nested and nested.shape[0] == 3 and torch.equal(nested.values(), x[0])
    for causal in (False, True):
        bias = packed.attn_bias(causal, torch.float32)
        assert bias.shape == (3, 1, 32, 32)
        for b, n in enumerate(s.seqlens):
            for i in range(32):
                for j in range(32):
                    visible = j < n and (not causal or j <= i)
                    assert bias[b, 0, i, j].item() == (0.0 if visible else -math.inf), (b, i, j)


def test_varlen_refusals(fake_build, monkeypatch):
    cfg = runner.RunConfig(dtype="bf16")
    varlen = shapes.varlen_shape((100, 28), 16, 16, 128, False)
    plain = Shape(2, 1024, 1024, 16, 16, 128, False)
    ext = backends.FlashExtBackend(cfg)
    monkeypatch.setattr(flash_ext.ops, "has_varlen_ops", lambda: False)
    status, reason = ext.refuse(varlen, "fwd")
    assert status == records.SKIPPED and "no varlen ops" in reason
    monkeypatch.setattr(flash_ext.ops, "has_varlen_ops", lambda: True)
    assert ext.refuse(varlen, "fwd") is None and ext.refuse(plain, "fwd") is None
    dense = backends.FlashExtDenseBackend(cfg)
    # L = round((100^2 + 28^2) / 128) = 84, batch round(128 / 84) = 2
    assert dense.problem(varlen) == Shape(2, 84, 84, 16, 16, 128, False) and dense.refuse(varlen, "fwd") is None
    assert dense.refuse(plain, "fwd")[0] == records.SKIPPED and dense.problem(plain) == plain
    nested = backends.SDPANested(cfg)
    assert nested.refuse(varlen, "fwd") is None and nested.refuse(plain, "fwd")[0] == records.SKIPPED
    assert "window" in nested.refuse(dataclasses.replace(varlen, window_left=8, window_right=0), "fwd")[1]
    assert backends.FlexBackend(cfg).refuse(varlen, "fwd")[0] == records.SKIPPED
    fp8 = runner.RunConfig(dtype="fp8")
    fake_build["dtypes"].append("e4m3")
    assert "FP8" in backends.FlashExtBackend(fp8).refuse(varlen, "fwd")[1]
    assert backends.FlashExtBf16Backend(fp8).refuse(varlen, "fwd")[0] == records.SKIPPED


def test_dense_yardstick_inputs():
    """The dense yardstick's inputs: the packed rows laid out as its batch, the first batch * L rows (a view)
    when there are enough, else the packed rows repeated."""
    x = torch.arange(220 * 2 * 3, dtype=torch.float32).view(1, 220, 2, 3)
    fewer = shapes.varlen_shape((40, 40, 40, 100), 2, 2, 3, False)  # 3 x 67 = 201 rows of 220
    problem = shapes.dense_equivalent(fewer)
    q, k, v, dout = runner.problem_inputs(problem, (x, x, x, None))
    assert q.shape == (3, 67, 2, 3) and dout is None and q.data_ptr() == x.data_ptr()
    assert torch.equal(q.reshape(1, 201, 2, 3), x[:, :201])
    y = torch.arange(192 * 2 * 3, dtype=torch.float32).view(1, 192, 2, 3)
    more = shapes.dense_equivalent(shapes.varlen_shape((38, 53, 44, 57), 2, 2, 3, False))  # 4 x 49 = 196 of 192
    q, _, _, _ = runner.problem_inputs(more, (y, y, y, None))
    assert q.shape == (4, 49, 2, 3) and q.is_contiguous()
    flat = q.reshape(196, 2, 3)
    assert torch.equal(flat[:192], y[0]) and torch.equal(flat[192:], y[0, :4])
    assert runner.problem_inputs(fewer, (x, x, x, None))[0] is x  # the varlen row itself: unchanged


def _fake_varlen_ops(monkeypatch, calls, ignore_boundaries=False):
    """flash_ext's varlen forward and backward, and its dense ones, as the float64 references (on CPU). With
    ignore_boundaries the varlen forward attends across the whole packed batch: a wrong kernel."""
    monkeypatch.setattr(flash_ext.ops, "has_varlen_ops", lambda: True)

    def varlen_forward(q, k, v, packed, scale, shape):
        calls.append(("varlen_forward", packed.max_seqlen))
        cu = packed.cu_seqlens
        if ignore_boundaries:
            cu = cu[[0, -1]]
        out, lse = reference.attention_varlen_ref(q, k, v, cu, cu, scale, shape.causal, shape.window, shape.softcap)
        return out.to(q.dtype), lse.float()

    def varlen_backward(dout, q, k, v, out, lse, packed, scale, shape, deterministic):
        calls.append(("varlen_backward", deterministic))
        assert lse.shape == (q.shape[1], q.shape[0])
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        o, _ = reference.attention_varlen_autograd(*leaves, packed.cu_seqlens, packed.cu_seqlens, scale, shape.causal,
                                                   True, shape.window, shape.softcap)
        return tuple(g.to(q.dtype) for g in torch.autograd.grad(o, leaves, dout.double()))

    def forward(q, k, v, softmax_scale=None, causal=False, **mask):
        calls.append(("forward", q.shape[:2]))
        out, lse = reference.attention_ref(q, k, v, softmax_scale, causal, **mask)
        return out.to(q.dtype), lse.float()

    def backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False, **mask):
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        o, _ = reference.attention_autograd(*leaves, softmax_scale=softmax_scale, causal=causal, **mask)
        return tuple(g.to(q.dtype) for g in torch.autograd.grad(o, leaves, dout.double()))

    monkeypatch.setattr(backends, "varlen_forward", varlen_forward)
    monkeypatch.setattr(backends, "varlen_backward", varlen_backward)
    monkeypatch.setattr(flash_ext, "forward", forward)
    monkeypatch.setattr(flash_ext, "backward", backward)


def test_varlen_run_on_cpu(fake_build, monkeypatch, tmp_path):
    """The runner on a --varlen row: flash_ext's varlen op (faked by the reference) on the packed rows, the dense
    yardstick on the same tokens as one dense batch, SDPA math on the padded batch and SDPA on nested tensors,
    each checked against the varlen reference and timed; the table shows varlen/dense."""
    calls = []
    _fake_varlen_ops(monkeypatch, calls)
    cfg = runner.RunConfig(dtype="bf16", deterministic=True)
    keys = ["flash_ext", "flash_ext_dense", "sdpa_math", "sdpa_nested"]
    bes = backends.make_backends(keys, cfg)
    lengths = shapes.varlen_seqlens(4, 192, 16, 96, seed=3)
    assert lengths == (38, 53, 44, 57)
    shape = shapes.varlen_shape(lengths, 2, 2, 128, False)
    recs, fatal = runner.run_benchmark([shape], ["fwd", "bwd"], bes, cfg, torch.device("cpu"), timing.cpu_timer)
    assert fatal is None
    by = {(r.mode, r.backend): r for r in recs}
    for mode in ("fwd", "bwd"):
        for key in keys:
            rec = by[(mode, key)]
            if key == "sdpa_nested" and rec.status == records.SKIPPED:
                continue  # nested tensors' SDPA without a kernel on this machine: skipped with the reason
            assert rec.status == records.OK and rec.checked and rec.max_err <= rec.tol, (mode, key, rec.reason)
            assert rec.shape == shape
        assert by[(mode, "flash_ext")].flops == shapes.attention_flops(shape, mode)
        assert by[(mode, "sdpa_math")].flops == by[(mode, "flash_ext")].flops  # the padding is not counted
        # lengths (38, 53, 44, 57): L = round(9438 / 192) = 49, batch round(192 / 49) = 4
        assert by[(mode, "flash_ext_dense")].flops == shapes.attention_flops(Shape(4, 49, 49, 2, 2, 128, False), mode)
        assert by[(mode, "sdpa_math")].diff_vs_flash_ext is not None
        assert by[(mode, "flash_ext_dense")].diff_vs_flash_ext is None  # another problem
    assert set(by[("bwd", "flash_ext")].err_detail) == {"dq", "dk", "dv"}
    assert ("varlen_forward", max(lengths)) in calls and ("varlen_backward", True) in calls
    assert ("forward", (4, 49)) in calls  # the dense yardstick of the same work: 4 x 49 (196 rows from 192, repeated)
    text = report.format_table(recs, "fwd", keys)
    assert "varlen/dense" in text and "flash_ext (dense, same work)" in text and "4 x 49" in text
    assert "geomean flash_ext varlen / flash_ext dense (same work)" in text
    assert "SDPA's padding not counted" in text
    args = _args("--varlen", "--no-plot")
    out_text, _ = cli.write_outputs(str(tmp_path), "v", env.collect_env(None), {}, recs, args, keys, ["x"])
    assert "varlen batch: 4 sequences, 192 tokens" in out_text
    doc, back = jsonfile.load_json(str(tmp_path / "v.json"))
    assert back[0].shape == shape and doc["summary"]["fwd"]["rows"][0]["flash_ext_over_dense"] is not None
    assert doc["summary"]["fwd"]["rows"][0]["dense_same_work"] == [4, 49]
    assert "flash_ext (dense, same work): 4 x 49" in out_text


def test_varlen_check_catches_attention_across_sequences(fake_build, monkeypatch):
    """A varlen kernel that attended across sequence boundaries is WRONG (never timed), causal or not."""
    _fake_varlen_ops(monkeypatch, [], ignore_boundaries=True)
    cfg = runner.RunConfig(dtype="bf16")
    for causal in (False, True):
        shape = shapes.varlen_shape((40, 88), 2, 2, 128, causal)
        (rec,), _ = runner.run_benchmark([shape], ["fwd"], backends.make_backends(["flash_ext"], cfg), cfg,
                                         torch.device("cpu"), timing.cpu_timer)
        assert rec.status == records.WRONG and rec.ms is None


def test_decode_dry_run_and_table(capsys):
    from flash_ext.bench import cli, decode

    assert cli.main(["--decode", "--dry-run", "--decode-batches", "2", "--decode-seqlens", "1k"]) == 0
    assert "decode: batches [2], cache lengths [1024], page sizes (64, 256)" in capsys.readouterr().out
    rows = [
        {"batch": 2, "cache_len": 1024, "backend": "flash_ext", "kv_bytes": 4e6, "graph_us": 10.0, "eager_us": 12.0,
         "host_us": 9.0},
        {"batch": 2, "cache_len": 1024, "backend": "SDPA cuDNN", "kv_bytes": 4e6, "graph_us": 12.0, "eager_us": 15.0,
         "host_us": 11.0},
        {"batch": 2, "cache_len": 1024, "backend": "SDPA efficient", "kv_bytes": 4e6, "error": "RuntimeError: no"},
    ]
    table = decode.format_table(rows, 4000.0, "title")
    line = next(l for l in table.splitlines() if l.startswith("b2"))
    assert "400" in line and "10%" in line  # 4 MB / 10 us = 400 GB/s, 10% of 4000
    assert "1.20x" in line and "1.25x" in line  # SDPA's 12 / 10 (graph) and 15 / 12 (eager)
    assert "n/a (RuntimeError: no)" in table


def test_decode_paged_cache():
    """The decode benchmark's paged cache holds every key of the contiguous one, in the page its table names, for
    16-bit and FP8 caches; a page size that does not divide the length is refused."""
    from flash_ext.bench import decode

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k = torch.randn(2, 256, 3, 8).to(dtype)
        v = torch.randn(2, 256, 3, 8).to(dtype)
        k_pages, v_pages, table = decode.paged_cache(k, v, 64)
        assert table.dtype == torch.int32 and tuple(table.shape) == (2, 4) and k_pages.dtype == dtype
        assert sorted(table.flatten().tolist()) == list(range(8))
        for b in range(2):
            for key in (0, 63, 64, 200, 255):
                page, row = table[b, key // 64].item(), key % 64
                assert torch.equal(k_pages[page, row].view(torch.uint8), k[b, key].view(torch.uint8))
                assert torch.equal(v_pages[page, row].view(torch.uint8), v[b, key].view(torch.uint8))
    with pytest.raises(ValueError, match="does not divide"):
        decode.paged_cache(k, v, 96)


def test_decode_flush_option():
    """--decode evicts L2 with clean lines by default (perf-notes section 48), dirty (do_bench's) on request;
    anything else is refused."""
    from flash_ext.bench import decode

    assert _args().decode_flush == "clean" and _args("--decode-flush", "dirty").decode_flush == "dirty"
    with pytest.raises(SystemExit):
        _args("--decode-flush", "warm")
    assert decode.FLUSHES == ("clean", "dirty") and set(decode.FLUSHES) < set(timing.L2_FLUSHES)
    for bad in (lambda: decode.run_decode([1], [512], 1, 32, 8, 128, torch.bfloat16, (64,), 1.0, 1.0, flush="warm"),
                lambda: timing.l2_flush("warm")):
        with pytest.raises(ValueError, match="flush must be one of"):
            bad()
    assert timing.l2_flush("none")() is None
