"""CPU tests of `python -m flash_ext.benchmark`: FLOPs, grid, verdicts, ratio, table, JSON, plot, dry run,
and the runner driven end to end on CPU (SDPA math / CPU flash, a deliberately wrong fake backend)."""
import io
import json
import math
import os

import pytest
import torch

from flash_ext import _bench_report as rep
from flash_ext import benchmark as bench
from flash_ext.benchmark import Record, Shape


def _args(*argv):
    return bench.build_parser().parse_args(list(argv))


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------
def _pairs_brute(sq, sk):
    return sum(min(max(i + sk - sq + 1, 0), sk) for i in range(sq))


def test_flops_non_causal():
    s = Shape(batch=2, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_kv=16, headdim=128, causal=False)
    assert rep.attention_flops(s, "fwd") == 4 * 2 * 16 * 1024 * 1024 * 128
    s2 = Shape(2, 1000, 3000, 16, 4, 64, False)
    assert rep.attention_flops(s2, "fwd") == 4 * 2 * 16 * 1000 * 3000 * 64


def test_flops_causal_square_is_exactly_half():
    # FlashAttention's published convention: causal = half of non-causal when sq == sk (the exact pair
    # count s(s+1)/2 would include the diagonal; we deliberately do not).
    for s in (1, 512, 8192):
        nc = Shape(4, s, s, 8, 8, 64, False)
        c = Shape(4, s, s, 8, 8, 64, True)
        assert rep.attention_flops(c, "fwd") * 2 == rep.attention_flops(nc, "fwd")
    c = Shape(1, 512, 512, 1, 1, 64, True)
    assert rep.attention_flops(c, "fwd") != 4 * 64 * rep.causal_pairs(512, 512)
    assert rep.causal_pairs(512, 512) == 512 * 513 // 2


@pytest.mark.parametrize("sq,sk", [(1, 1), (3, 5), (5, 3), (7, 7), (1, 9), (9, 1), (128, 1000), (1000, 128), (4, 0)])
def test_causal_pairs_bottom_right(sq, sk):
    assert rep.causal_pairs(sq, sk) == _pairs_brute(sq, sk)


def test_flops_causal_rectangular_uses_exact_pairs():
    s = Shape(1, 3, 5, 1, 1, 8, True)  # rows see 3, 4, 5 keys
    assert rep.attention_flops(s, "fwd") == 4 * 8 * (3 + 4 + 5)
    s = Shape(2, 5, 3, 4, 2, 8, True)  # rows see 0, 0, 1, 2, 3 keys
    assert rep.attention_flops(s, "fwd") == 4 * 2 * 4 * 8 * (1 + 2 + 3)


def test_flops_backward_is_2_5x_forward():
    for causal in (False, True):
        s = Shape(2, 2048, 2048, 16, 16, 128, causal)
        assert rep.attention_flops(s, "bwd") == 2.5 * rep.attention_flops(s, "fwd")
    with pytest.raises(ValueError):
        rep.attention_flops(s, "both")


def test_tflops():
    assert rep.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert rep.tflops(1e12, None) is None
    assert rep.tflops(1e12, 0.0) is None


# ------------------------------------------------------------------------------------------------
# Grid
# ------------------------------------------------------------------------------------------------
def test_default_grid():
    shapes = bench.build_grid(_args())
    assert len(shapes) == 36
    assert len(set(shapes)) == 36
    assert {s.headdim for s in shapes} == {64, 128, 256}
    assert {s.seqlen_q for s in shapes} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {s.causal for s in shapes} == {False, True}
    for s in shapes:
        assert s.batch * s.seqlen_q == 16384
        assert s.nheads * s.headdim == 2048
        assert s.seqlen_k == s.seqlen_q and s.nheads_kv == s.nheads


def test_quick_grid():
    shapes = bench.build_grid(_args("--quick"))
    assert len(shapes) == 4
    assert {(s.headdim, s.seqlen_q, s.causal) for s in shapes} == {(128, n, c) for n in (1024, 8192) for c in (False, True)}


def test_custom_grids():
    shapes = bench.build_grid(_args("--headdims", "64,128", "--seqlens", "512,8k", "--causal", "no"))
    assert [(s.headdim, s.seqlen_q, s.batch, s.nheads, s.causal) for s in shapes] == [
        (64, 512, 32, 32, False),
        (64, 8192, 2, 32, False),
        (128, 512, 32, 16, False),
        (128, 8192, 2, 16, False),
    ]
    (s,) = bench.build_grid(
        _args("--batch", "3", "--seqlen-q", "1k", "--seqlen-k", "4096", "--nheads", "8", "--nheads-kv", "2",
              "--headdim", "64", "--causal", "yes")
    )
    assert s == Shape(3, 1024, 4096, 8, 2, 64, True)
    with pytest.raises(ValueError):
        bench.build_grid(_args("--nheads", "6", "--nheads-kv", "4"))
    assert bench.parse_int_list("512, 1k,16K") == [512, 1024, 16384]


def test_modes_and_backends():
    assert bench.resolve_modes("both") == ["fwd", "bwd"]
    assert bench.resolve_modes("auto") == (["fwd", "bwd"] if bench.flash_ext_has_backward() else ["fwd"])
    keys = bench.select_backends(_args("--flex"))
    assert keys[0] == "flash_ext" and "flex" in keys and "sdpa_math" in keys
    assert bench.select_backends(_args("--backends", "sdpa_math,flash_ext")) == ["flash_ext", "sdpa_math"]
    with pytest.raises(SystemExit):
        _args("--backends", "nope")


def test_sdpa_math_size_limit():
    cfg = bench.RunConfig(math_max_gb=2.0)
    math_be = bench.SDPAMath(cfg)
    small = Shape(32, 512, 512, 32, 32, 64, False)  # 1 GiB of scores
    big = Shape(1, 16384, 16384, 16, 16, 128, False)  # 16 GiB
    assert math_be.refuse(small, "fwd") is None
    status, reason = math_be.refuse(big, "fwd")
    assert status == rep.SKIPPED and "GiB" in reason
    assert bench.SDPAFlash(bench.RunConfig(dtype="fp8")).refuse(small, "fwd")[0] == rep.SKIPPED


# ------------------------------------------------------------------------------------------------
# Verdict and ratio
# ------------------------------------------------------------------------------------------------
def test_verdict_marks_large_errors_wrong():
    tol = rep.tolerance("bf16", math_err=4e-3, ref_absmax=0.5)
    assert tol == pytest.approx(2 * 4e-3 + 1e-3)
    assert rep.verdict(5e-3, tol)[0]
    ok, why = rep.verdict(0.2, tol)
    assert not ok and "tolerance" in why
    assert not rep.verdict(float("nan"), tol)[0]
    assert not rep.verdict(float("inf"), tol)[0]
    assert rep.tolerance("bf16", None) == pytest.approx(2e-2)
    assert rep.tolerance("bf16", float("nan")) == pytest.approx(2e-2)
    assert rep.tolerance("fp16", 1e-4, ref_absmax=4.0) == pytest.approx(2e-4 + 4e-3)


def _rec(shape, backend, status=rep.OK, tf=None, mode="fwd", reason=""):
    return Record(shape=shape, mode=mode, backend=backend, status=status, tflops=tf, reason=reason,
                  ms=(1.0 if tf else None), checked=True)


S1 = Shape(2, 8192, 8192, 16, 16, 128, False)
S2 = Shape(2, 8192, 8192, 16, 16, 128, True)


def test_best_sdpa_ignores_wrong_and_skipped():
    row = {
        "flash_ext": _rec(S1, "flash_ext", tf=600.0),
        "fa3": _rec(S1, "fa3", tf=700.0),  # not an SDPA backend
        "sdpa_cudnn": _rec(S1, "sdpa_cudnn", status=rep.WRONG, tf=900.0),
        "sdpa_flash": _rec(S1, "sdpa_flash", tf=300.0),
        "sdpa_efficient": _rec(S1, "sdpa_efficient", status=rep.SKIPPED, reason="refused"),
        "sdpa_math": _rec(S1, "sdpa_math", tf=20.0),
    }
    assert rep.best_sdpa(row) == ("sdpa_flash", 300.0)
    assert rep.ratio_to(row) == pytest.approx(2.0)
    assert rep.ratio_to(row, against="fa3") == pytest.approx(600 / 700)
    row["sdpa_cudnn"] = _rec(S1, "sdpa_cudnn", tf=500.0)
    assert rep.best_sdpa(row) == ("sdpa_cudnn", 500.0)
    assert rep.ratio_to(row) == pytest.approx(1.2)
    row["flash_ext"] = _rec(S1, "flash_ext", status=rep.SKIPPED, reason="not built")
    assert rep.ratio_to(row) is None
    assert rep.best_sdpa({"sdpa_flash": _rec(S1, "sdpa_flash", status=rep.OOM)}) == (None, None)


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
            _rec(shape, "sdpa_efficient", status=rep.WRONG, reason="max abs error 0.3 > tolerance 0.01"),
            _rec(shape, "sdpa_math", status=rep.SKIPPED, reason="too large: 16 GiB > 2 GiB"),
            _rec(shape, "flash_ext", status=rep.NA, reason="no backward yet", mode="bwd"),
            _rec(shape, "sdpa_cudnn", tf=base * 1.1, mode="bwd"),
            _rec(shape, "sdpa_flash", status=rep.OOM, reason="CUDA out of memory", mode="bwd"),
        ]
    for r in recs:
        r.flops = rep.attention_flops(r.shape, r.mode)
        if r.status == rep.OK:
            r.peak_mib = 123.0
            r.max_err = 1e-3
            r.tol = 9e-3
    recs[4].max_err = float("nan")
    return recs


def test_table_rendering():
    recs = _synthetic_records()
    text = rep.format_table(recs, "fwd", title="== forward ==")
    for key in ("flash_ext", "fa3", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math"):
        assert rep.backend_name(key) in text
    assert "ext/SDPA" in text and "best SDPA" in text and "ext/FA3" in text
    assert "1.15x" in text  # 1.5 / 1.3 (cuDNN is the best SDPA)
    assert "WRONG[" in text and "skip[" in text
    assert "too large: 16 GiB > 2 GiB" in text and "max abs error 0.3" in text
    assert S1.label() in text and S2.label() in text
    assert "geomean" in text
    btext = rep.format_table(recs, "bwd")
    assert "n/a[" in btext and "no backward yet" in btext and "OOM[" in btext
    mem = rep.format_metric_table(recs, "fwd", "peak_mib")
    assert "123" in mem and "WRONG" in mem


def test_json_round_trip(tmp_path):
    recs = _synthetic_records()
    env = bench.collect_env(None)  # CPU: GPU fields are None but present
    cfg = bench.config_dict(_args("--quick"), bench.build_grid(_args("--quick")), ["fwd"], ["flash_ext"])
    path = rep.write_json(str(tmp_path / "b.json"), env, cfg, recs, created="now", command=["x"])
    with open(path) as f:
        doc = json.load(f)
    for key in ("gpu_name", "sm_clock_mhz", "sm_clock_max_mhz", "driver_version", "cuda_version",
                "torch_version", "cudnn_version", "git_commit", "triton_version", "flash_ext_extension"):
        assert key in doc["env"]
    assert doc["env"]["torch_version"] == torch.__version__
    assert doc["schema"] == rep.SCHEMA and doc["config"]["quick"] is True and doc["config"]["num_shapes"] == 4
    assert len(doc["results"]) == len(recs)
    first = doc["results"][0]
    for key in ("backend", "mode", "status", "reason", "ms", "tflops", "max_err", "peak_mib", "batch",
                "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim", "causal"):
        assert key in first
    assert doc["summary"]["fwd"]["rows"][0]["best_sdpa"] == "sdpa_cudnn"
    _, back = rep.load_json(path)
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
    path = rep.write_plot(str(tmp_path / "p.png"), recs, "fwd", gpu_name="Test GPU", dtype="bf16")
    assert path and os.path.getsize(path) > 5000
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert rep.write_plot(str(tmp_path / "b.png"), recs, "bwd") is not None


def dataclass_replace(rec, **kw):
    import dataclasses

    return dataclasses.replace(rec, **kw)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def test_dry_run(capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "36 shape(s)" in out and "d256 16k C b1 h8" in out
    assert bench.main(["--quick", "--dry-run", "--mode", "both"]) == 0
    out = capsys.readouterr().out
    assert "4 shape(s)" in out and "GFLOP bwd" in out
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--nheads", "6", "--nheads-kv", "4"])


# ------------------------------------------------------------------------------------------------
# The runner end to end on CPU
# ------------------------------------------------------------------------------------------------
class _WrongBackend(bench.Backend):
    """Returns 2*q: must be caught by the reference check and never timed."""

    key = "fake_wrong"

    def call(self, q, k, v, shape, scale, state):
        return q * 2.0 + (k.sum() + v.sum()) * 0.0  # k, v in the graph so that autograd.grad works


def test_runner_on_cpu(tmp_path):
    pytest.importorskip("flash_ext.reference")
    cfg = bench.RunConfig(dtype="bf16")
    backends = bench.make_backends(["flash_ext", "sdpa_flash", "sdpa_math"], cfg) + [_WrongBackend(cfg)]
    shapes = [Shape(1, 64, 64, 2, 2, 32, True), Shape(1, 48, 80, 4, 2, 32, True)]
    stream = io.StringIO()
    progress = bench.Progress(len(shapes) * 2 * len(backends), len(shapes), stream=stream)
    recs, fatal = bench.run_benchmark(shapes, ["fwd", "bwd"], backends, cfg, torch.device("cpu"), bench.cpu_timer,
                                      progress=progress)
    assert fatal is None
    assert len(recs) == len(shapes) * 2 * len(backends)
    by = {(r.shape, r.mode, r.backend): r for r in recs}
    for s in shapes:
        for mode in ("fwd", "bwd"):
            math_rec = by[(s, mode, "sdpa_math")]
            assert math_rec.status == rep.OK, math_rec.reason
            assert math_rec.checked and math_rec.max_err <= math_rec.tol and math_rec.ms > 0
            assert by[(s, mode, "fake_wrong")].status == rep.WRONG
            assert by[(s, mode, "fake_wrong")].ms is None
        ext = by[(s, "fwd", "flash_ext")]
        if not bench.flash_ext_has_backward():
            assert by[(s, "bwd", "flash_ext")].status in (rep.NA, rep.SKIPPED)
        if not torch.cuda.is_available():
            assert ext.status == rep.SKIPPED and ext.reason
    assert "[1/2]" in stream.getvalue() and "[2/2]" in stream.getvalue()
    args = _args("--no-plot", "--out", str(tmp_path))
    text, paths = bench.write_outputs(str(tmp_path), "bench", bench.collect_env(None), {"test": True}, recs, args,
                                      [b.key for b in backends], ["test"])
    assert "SDPA math" in text and "fake_wrong" in text and "WRONG[" in text
    assert sorted(os.path.basename(p) for p in paths) == ["bench.json", "bench.txt"]


def test_main_on_cpu_writes_outputs(tmp_path, capsys):
    pytest.importorskip("flash_ext.reference")
    out = tmp_path / "o"
    rc = bench.main(["--device", "cpu", "--headdim", "32", "--seqlen-q", "64", "--batch", "1", "--nheads", "2",
                     "--backends", "flash_ext,sdpa_math", "--mode", "both", "--out", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "SDPA math" in text and "ext/SDPA" in text
    names = sorted(os.listdir(out))
    assert "bench.json" in names and "bench.txt" in names
    _, recs = rep.load_json(str(out / "bench.json"))
    assert {(r.mode, r.backend) for r in recs} == {(m, b) for m in ("fwd", "bwd") for b in ("flash_ext", "sdpa_math")}
    assert all(r.status == rep.OK for r in recs if r.backend == "sdpa_math")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert "bench_fwd.png" in names and "bench_bwd.png" in names
