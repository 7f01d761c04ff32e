"""CPU tests of flash_ext.forward's argument checks: each bad input raises a clear, specific exception
before anything is launched. The tensor rules live in the C++ op (csrc/arg_checks.cpp), which runs them on
CPU tensors too: those tests need the built extension (no GPU); the Python-typed arguments are checked in
Python."""
import pytest
import torch

import flash_ext

needs_ext = pytest.mark.skipif(not flash_ext.extension_available(),
                               reason="the tensor rules are the C++ op's: flash_ext._C is not built")


def make(batch=1, seqlen=8, nheads=2, headdim=64, dtype=torch.float16):
    return torch.randn(batch, seqlen, nheads, headdim).to(dtype)


def qkv(**kwargs):
    return make(**kwargs), make(**kwargs), make(**kwargs)


def test_non_tensor_input():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got list"):
        flash_ext.forward(q.tolist(), k, v)
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor, got NoneType"):
        flash_ext.forward(q, k, None)


@needs_ext
@pytest.mark.parametrize("shape", [(8, 2, 64), (1, 1, 8, 2, 64)])
def test_wrong_rank(shape):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k must have 4 dims"):
        flash_ext.forward(q, torch.randn(shape).half(), v)


@needs_ext
@pytest.mark.parametrize("shape", [(8, 2, 64), (1, 1, 8, 2, 64)])
@pytest.mark.parametrize("op", ["fwd", "decode", "fwd_varlen"])
def test_wrong_rank_in_fake_as_in_op(shape, op):
    """Under torch.compile the ops' fakes run first: a q of the wrong rank gets the op's own message there too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = qkv()
    bad = torch.randn(shape).half()
    expected = r"q must have 4 dims \(batch, seqlen, nheads, headdim\), got \d dims with shape \("
    if op == "fwd":
        def call(q_):
            return torch.ops.flash_ext.fwd(q_, k, v, 0.125, False)
    elif op == "decode":
        def call(q_):
            return torch.ops.flash_ext.decode(q_, k, v, None, None, None, None, None, 0.125, False)
    else:
        if not flash_ext.ops.has_varlen_ops():
            pytest.skip("this build has no varlen ops")
        bad = torch.randn(shape[:-1] if len(shape) == 3 else shape).half()  # rank 2 or 5 where 3 is wanted
        cu = torch.tensor([0, 8], dtype=torch.int32)
        k, v = k[0], v[0]

        def call(q_):
            return torch.ops.flash_ext.fwd_varlen(q_, k, v, cu, cu, None, None, 8, 8, 0.125, False)
        expected = r"q must have 3 dims \(total_tokens, nheads, headdim\) for flash_ext.flash_attn_varlen_func, got"
    with pytest.raises(ValueError, match=expected):
        call(bad)  # the C++ op on CPU tensors
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=expected):
        call(bad)  # the fake


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float64])
def test_unsupported_dtype(dtype):
    q, k, v = qkv()
    bad = torch.ones(1, 8, 2, 64, dtype=dtype)
    with pytest.raises(TypeError, match=rf"q has dtype {dtype}; .*torch.float16, torch.bfloat16 and torch.float8_e4m3fn"):
        flash_ext.forward(bad, k, v)


@needs_ext
def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"share one dtype.*k torch.bfloat16"):
        flash_ext.forward(q, k.bfloat16(), v)


@needs_ext
def test_kv_shape_mismatch():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        flash_ext.forward(q, k, make(seqlen=9))


@needs_ext
def test_batch_mismatch():
    q = make(batch=2)
    with pytest.raises(ValueError, match=r"batch mismatch: q has batch 2, k and v have 1"):
        flash_ext.forward(q, make(), make())


@needs_ext
def test_headdim_mismatch():
    q = make(headdim=64)
    with pytest.raises(ValueError, match=r"head dim mismatch: q has 64, k and v have 128"):
        flash_ext.forward(q, make(headdim=128), make(headdim=128))


@needs_ext
@pytest.mark.parametrize("headdim", [60, 4, 264, 512])
def test_unsupported_headdim(headdim):
    q, k, v = qkv(headdim=headdim)
    with pytest.raises(ValueError, match=rf"head dim {headdim} is not supported: it must be a multiple of 8"):
        flash_ext.forward(q, k, v)


@needs_ext
@pytest.mark.parametrize("entry", ["forward", "attention", "backward", "flash_attn_func", "flash_attn_varlen_func",
                                   "flash_attn_with_kvcache", "sdpa"])
def test_zero_headdim_every_entry_point(entry):
    # The default softmax_scale, 1/sqrt(headdim), must not divide by zero before the op's shape check.
    q, k = torch.randn(2, 7, 4, 0, dtype=torch.bfloat16), torch.randn(2, 10, 2, 0, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 7, 14], dtype=torch.int32), torch.tensor([0, 10, 20], dtype=torch.int32)
    calls = {
        "forward": lambda: flash_ext.forward(q, k, k),
        "attention": lambda: flash_ext.attention(q, k, k),
        "backward": lambda: flash_ext.backward(q, q, k, k, q, torch.zeros(2, 4, 7)),
        "flash_attn_func": lambda: flash_ext.flash_attn_func(q, k, k),
        "flash_attn_varlen_func": lambda: flash_ext.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1),
                                                                           cu_q, cu_k, 7, 10),
        "flash_attn_with_kvcache": lambda: flash_ext.flash_attn_with_kvcache(q, k, k),
        "sdpa": lambda: flash_ext.sdpa(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), enable_gqa=True),
    }
    with pytest.raises(ValueError, match=r"head dim 0 is not supported: it must be a multiple of 8"):
        calls[entry]()


@needs_ext
def test_nheads_not_multiple_of_nheads_kv():
    q = make(nheads=3)
    with pytest.raises(ValueError, match=r"nheads \(3\) must be a multiple of nheads_kv \(2\)"):
        flash_ext.forward(q, make(nheads=2), make(nheads=2))


@needs_ext
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 8), (8, 0), (0, 0)])
def test_zero_length_seqlen_is_legal(seqlen_q, seqlen_k):
    """Empty problems pass every argument rule (the GPU returns empty outputs: test_entry_points_gpu.py); CPU
    tensors then fail only the device check."""
    q = make(seqlen=seqlen_q)
    with pytest.raises(ValueError, match=r"needs CUDA"):
        flash_ext.forward(q, make(seqlen=seqlen_k), make(seqlen=seqlen_k))


@needs_ext
def test_zero_heads():
    with pytest.raises(ValueError, match=r"head counts must be >= 1"):
        flash_ext.forward(make(nheads=0), make(nheads=0), make(nheads=0))


@needs_ext
@pytest.mark.parametrize("scale", [-0.125, 0.0, float("nan"), float("inf")])
def test_bad_softmax_scale_value(scale):
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite positive number"):
        flash_ext.forward(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.125", True, torch.tensor(0.125)])
def test_bad_softmax_scale_type(scale):
    with pytest.raises(TypeError, match=r"softmax_scale must be a float or None"):
        flash_ext.forward(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("causal", [1, "True", None])
def test_non_bool_causal(causal):
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        flash_ext.forward(*qkv(), causal=causal)


@needs_ext
def test_non_contiguous_last_dim():
    q, k, v = qkv()
    strided = make(headdim=128)[..., ::2]
    assert strided.shape == q.shape
    with pytest.raises(ValueError, match=r"v must be contiguous in its last \(headdim\) dim"):
        flash_ext.forward(q, k, strided)


@needs_ext
def test_stride_not_multiple_of_8_elements():
    q, k, v = qkv()
    sliced = make(headdim=68)[..., :64]  # heads stride 68 elements = 136 bytes
    with pytest.raises(ValueError, match=r"k stride 68 of dim 2 must be a positive multiple of 8 elements"):
        flash_ext.forward(q, sliced, v)


@needs_ext
def test_expanded_zero_stride():
    q, k, v = qkv(batch=2)
    expanded = make(batch=1).expand(q.shape[0], -1, -1, -1)  # batch stride 0
    assert expanded.stride(0) == 0
    with pytest.raises(ValueError, match=r"k stride 0 of dim 0 must be a positive multiple"):
        flash_ext.forward(q, expanded, v)


@needs_ext
def test_misaligned_data_pointer():
    q, k, v = qkv()
    flat = torch.randn(q.numel() + 1).half()
    shifted = flat[1:].view(q.shape)  # contiguous strides, but starts 2 bytes past an aligned address
    with pytest.raises(ValueError, match=r"q's data pointer is not 16-byte aligned"):
        flash_ext.forward(shifted, k, v)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_valid_cpu_tensors_need_cuda(dtype):
    # Also valid: GQA, a non-default scale, and a strided slice of a packed qkv tensor.
    packed = torch.randn(2, 16, 3, 4, 64).to(dtype)
    q, k, v = packed.unbind(2)
    with pytest.raises(ValueError, match=r"q is on cpu; flash_ext.forward needs CUDA tensors"):
        flash_ext.forward(q, k, v, softmax_scale=0.1, causal=True)
    with pytest.raises(ValueError, match=r"needs CUDA"):
        flash_ext.forward(make(nheads=4, dtype=dtype), make(nheads=1, dtype=dtype), make(nheads=1, dtype=dtype))


@pytest.mark.parametrize("headdim,expected", [(8, 64), (64, 64), (72, 96), (128, 128), (136, 192), (200, 256),
                                              (256, 256)])
def test_kernel_headdim(headdim, expected):
    assert flash_ext.kernel_headdim(headdim) == expected


@pytest.mark.parametrize("headdim", [0, -8, 60, 7.5, True])
def test_kernel_headdim_invalid(headdim):
    with pytest.raises(ValueError, match=r"head dim must be a positive multiple of 8"):
        flash_ext.kernel_headdim(headdim)


def test_kernel_headdim_too_large():
    with pytest.raises(ValueError, match=r"head dim 264 is larger than the largest supported \(256\)"):
        flash_ext.kernel_headdim(264)


# ------------------------------------------------------------------------------------------------
# backward's arguments (the same rules as forward's for q, k, v; its own for dout, out, lse, dlse, dq...)
# ------------------------------------------------------------------------------------------------
def bwd_args(**kwargs):
    q, k, v = qkv(**kwargs)
    b, s, h, _ = q.shape
    return dict(dout=make(**kwargs), q=q, k=k, v=v, out=make(**kwargs), lse=torch.zeros(b, h, s))


@needs_ext
def test_backward_dout_shape():
    a = bwd_args()
    a["dout"] = make(seqlen=7)
    with pytest.raises(ValueError, match=r"dout must have the shape of q \(1, 8, 2, 64\), got \(1, 7, 2, 64\)"):
        flash_ext.backward(**a)


@needs_ext
def test_backward_out_dtype():
    a = bwd_args()
    a["out"] = a["out"].bfloat16()
    with pytest.raises(TypeError, match=r"out must have the dtype of q \(torch.float16\), got torch.bfloat16"):
        flash_ext.backward(**a)


@needs_ext
@pytest.mark.parametrize("lse_shape", [(1, 2, 7), (2, 8), (1, 8, 2)])
def test_backward_lse_from_another_call(lse_shape):
    a = bwd_args()
    a["lse"] = torch.zeros(lse_shape)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads, seqlen_q\) = \(1, 2, 8\)"):
        flash_ext.backward(**a)


@needs_ext
def test_backward_lse_dtype_and_dlse():
    a = bwd_args()
    a["lse"] = a["lse"].half()
    with pytest.raises(TypeError, match=r"lse must be torch.float32"):
        flash_ext.backward(**a)
    a = bwd_args()
    with pytest.raises(ValueError, match=r"dlse must have shape"):
        flash_ext.backward(**a, dlse=torch.zeros(1, 2, 9))


@needs_ext
def test_backward_preallocated_output_shape():
    a = bwd_args()
    with pytest.raises(ValueError, match=r"dv must have the shape of v"):
        flash_ext.backward(**a, dv=make(headdim=128))


@needs_ext
def test_backward_valid_cpu_tensors_need_cuda():
    with pytest.raises(ValueError, match=r"q is on cpu; flash_ext.backward needs CUDA tensors"):
        flash_ext.backward(**bwd_args(), causal=True)


@pytest.mark.parametrize("name,value", [("deterministic", 1), ("causal", "yes")])
def test_backward_python_argument_types(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a bool"):
        flash_ext.backward(**bwd_args(), **{name: value})


def test_backward_non_tensor_lse():
    a = bwd_args()
    a["lse"] = [0.0]
    with pytest.raises(TypeError, match=r"lse must be a torch.Tensor, got list"):
        flash_ext.backward(**a)


@pytest.mark.parametrize("name,value", [("attention_chunk", 64), ("sm_margin", 8), ("num_splits", 2)])
def test_flash_attn_func_unsupported_arguments(name, value):
    with pytest.raises(NotImplementedError, match=rf"{name}=.* is not supported by flash_ext yet"):
        flash_ext.flash_attn_func(*qkv(), **{name: value})


def test_flash_attn_qkvpacked_func_argument_errors():
    with pytest.raises(NotImplementedError, match=r"flash_attn_qkvpacked_func: attention_chunk=64 is not supported"):
        flash_ext.flash_attn_qkvpacked_func(torch.randn(1, 8, 3, 2, 64).half(), attention_chunk=64)
    with pytest.raises(TypeError, match=r"qkv must be a torch.Tensor, got list"):
        flash_ext.flash_attn_qkvpacked_func([0.0])
    with pytest.raises(ValueError, match=r"a 5-D qkv must be \(batch, seqlen, 3, nheads, headdim\)"):
        flash_ext.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 2, 64).half())
    with pytest.raises(ValueError, match=r"num_heads_q is only for a 4-D qkv"):
        flash_ext.flash_attn_qkvpacked_func(torch.randn(1, 8, 3, 2, 64).half(), num_heads_q=2)
    with pytest.raises(ValueError, match=r"needs num_heads_q"):
        flash_ext.flash_attn_qkvpacked_func(torch.randn(1, 8, 6, 64).half())
    with pytest.raises(ValueError, match=r"not num_heads_q=3 plus twice a positive number of KV heads"):
        flash_ext.flash_attn_qkvpacked_func(torch.randn(1, 8, 6, 64).half(), num_heads_q=3)
    with pytest.raises(ValueError, match=r"must be 5-D .* or 4-D"):
        flash_ext.flash_attn_qkvpacked_func(torch.randn(8, 6, 64).half())


def test_flash_attn_qkvpacked_func_unpacks_views():
    from flash_ext.fa3_compat import _unpack_qkv

    packed = torch.randn(2, 8, 3, 4, 64)
    q, k, v = _unpack_qkv(packed, None)
    assert q.shape == (2, 8, 4, 64) and torch.equal(k, packed[:, :, 1]) and q.data_ptr() == packed.data_ptr()
    gqa = torch.randn(2, 8, 8 + 2 * 2, 64)
    q, k, v = _unpack_qkv(gqa, 8)
    assert (q.shape[2], k.shape[2], v.shape[2]) == (8, 2, 2) and torch.equal(v, gqa[:, :, 10:])


def _sdpa_inputs(heads=2, heads_kv=2, seq=8):
    return (torch.randn(1, heads, seq, 64).half(), torch.randn(1, heads_kv, seq, 64).half(),
            torch.randn(1, heads_kv, seq, 64).half())


def test_sdpa_argument_errors():
    q, k, v = _sdpa_inputs()
    with pytest.raises(NotImplementedError, match=r"sdpa: attn_mask is not supported"):
        flash_ext.sdpa(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match=r"sdpa: dropout_p=0.1 is not supported"):
        flash_ext.sdpa(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match=r"is_causal must be a bool"):
        flash_ext.sdpa(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match=r"sdpa: key must be a torch.Tensor"):
        flash_ext.sdpa(q, None, v)
    with pytest.raises(ValueError, match=r"sdpa: query must be 4-D \(batch, heads, seq, dim\)"):
        flash_ext.sdpa(q[0], k, v)
    q, k, v = _sdpa_inputs(heads=4, heads_kv=2)
    with pytest.raises(ValueError, match=r"pass enable_gqa=True"):
        flash_ext.sdpa(q, k, v)
    with pytest.raises(ValueError, match=r"key and value must have the same number of heads"):
        flash_ext.sdpa(q, k, v[:, :1], enable_gqa=True)


# ------------------------------------------------------------------------------------------------
# window_size and softcap: Python checks their types (before any op call); the op checks their values.
# ------------------------------------------------------------------------------------------------

BAD_WINDOW_TYPES = [(5, TypeError), ((1,), ValueError), ((1, 2, 3), ValueError), ((1.5, 0), TypeError),
                    ((True, 0), TypeError), ((0, None), TypeError), ("64,0", TypeError), (None, TypeError)]
BAD_SOFTCAP_TYPES = ["x", True, None, torch.tensor(5.0), (5.0,)]


def _entry_points():
    """Every public entry point that takes window_size and softcap, as f(**kwargs) on valid CPU tensors."""
    q, k, v = qkv()
    a = bwd_args()
    return {
        "forward": lambda **kw: flash_ext.forward(q, k, v, **kw),
        "forward_fp8": lambda **kw: flash_ext.forward(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)), **kw),
        "attention": lambda **kw: flash_ext.attention(q, k, v, **kw),
        "attention_grad": lambda **kw: flash_ext.attention(q.requires_grad_(), k, v, **kw),
        "backward": lambda **kw: flash_ext.backward(**a, **kw),
        "backward_out": lambda **kw: flash_ext.backward(**a, dq=torch.empty_like(a["q"]), **kw),
        "flash_attn_func": lambda **kw: flash_ext.flash_attn_func(q, k, v, **kw),
        "flash_attn_qkvpacked_func": lambda **kw: flash_ext.flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), **kw),
    }


@pytest.fixture
def no_op_calls(monkeypatch):
    """Fails the test if anything reaches the ops: the type checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("an op was called before the Python type checks")

    monkeypatch.setattr(flash_ext.interface, "_require_extension", refuse)


@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("window,exc", [pytest.param(w, e, id=repr(w)) for w, e in BAD_WINDOW_TYPES])
def test_window_size_type(entry, window, exc, no_op_calls):
    with pytest.raises(exc, match=r"window_size must be a tuple \(left, right\) of two ints"):
        _entry_points()[entry](window_size=window)


@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("softcap", BAD_SOFTCAP_TYPES, ids=repr)
def test_softcap_type(entry, softcap, no_op_calls):
    with pytest.raises(TypeError, match=r"softcap must be a float \(0 = off\)"):
        _entry_points()[entry](softcap=softcap)


def test_window_size_and_softcap_conversion():
    from flash_ext.interface import NO_WINDOW, _softcap, _window_size

    assert _window_size([3, -1]) == (3, -1) and _window_size((0, 0)) == (0, 0)
    assert _softcap(30) == 30.0 and isinstance(_softcap(30), float) and _softcap(0.5) == 0.5
    # Values are not Python's to judge: they reach the op, which raises for them.
    assert _window_size((-7, 100)) == (-7, 100) and _softcap(-1.0) == -1.0
    assert _window_size(NO_WINDOW) is NO_WINDOW and _window_size([-1, -1]) == NO_WINDOW


# (kwargs, the argument the op's ValueError names)
BAD_VALUES = [
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(0, -3)), "window_size"),
    (dict(window_size=(-1, 5), causal=True), "window_size"),
    (dict(window_size=(16, 1), causal=True), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
]


@needs_ext
@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("kwargs,name", [pytest.param(kw, n, id=str(kw)) for kw, n in BAD_VALUES])
def test_window_and_softcap_values_checked_by_the_op(entry, kwargs, name):
    with pytest.raises(ValueError, match=name):
        _entry_points()[entry](**kwargs)


@needs_ext
@pytest.mark.parametrize("kwargs,name", [pytest.param(kw, n, id=str(kw)) for kw, n in BAD_VALUES])
def test_window_and_softcap_values_checked_through_torch_ops(kwargs, name):
    q, k, v = qkv()
    a = bwd_args()
    causal = kwargs.get("causal", False)
    left, right = kwargs.get("window_size", (-1, -1))
    mask = dict(window_left=left, window_right=right, softcap=kwargs.get("softcap", 0.0))
    with pytest.raises(ValueError, match=name):
        torch.ops.flash_ext.fwd(q, k, v, 0.125, causal, None, None, None, **mask)
    with pytest.raises(ValueError, match=name):
        torch.ops.flash_ext.bwd(a["dout"], q, k, v, a["out"], a["lse"], None, 0.125, causal, False, **mask)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    with pytest.raises(ValueError, match=name):
        torch.ops.flash_ext.bwd_out(a["dout"], q, k, v, a["out"], a["lse"], None, 0.125, causal, False, dq, dk, dv,
                                    **mask)


@needs_ext
@pytest.mark.parametrize("kwargs", [dict(window_size=(0, 0)), dict(window_size=(128, 0), causal=True),
                                    dict(window_size=(-1, 0), causal=True), dict(window_size=(5, 7)),
                                    dict(window_size=(-1, 100)), dict(softcap=30.0), dict(softcap=0),
                                    dict(window_size=[64, -1], causal=True, softcap=5)],
                         ids=str)
def test_valid_window_and_softcap_pass_the_op_checks(kwargs):
    """Legal values pass every check but the device one (CPU tensors)."""
    for entry in ("forward", "forward_fp8", "backward", "flash_attn_func"):
        with pytest.raises(ValueError, match=r"needs CUDA"):
            _entry_points()[entry](**kwargs)
