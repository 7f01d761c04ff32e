"""Runs every decode kernel (flash_attn_with_kvcache) on small inputs, for compute-sanitizer memcheck: head dims
64..256 and one between, fp16, bf16 and FP8 (e4m3, with descales), contiguous / paged / cache_batch_idx caches, appends, splits, masks,
and out-of-range lengths and pages with the value checks off (the kernel must clamp them).

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/memcheck_decode.py
"""
import torch

import flash_ext


def main():
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        for headdim in (64, 96, 128, 256):
            if not flash_ext.has_kernel("decode", headdim, dtype, False):
                print(f"d{headdim} {dtype}: no kernel in this build")
                continue
            b, hkv, cap = 3, 2, 96
            randn = lambda *s: torch.randn(*s, device="cuda").to(dtype)  # noqa: E731
            q, kc, vc = randn(b, 3, 8, headdim), randn(b, cap, hkv, headdim), randn(b, cap, hkv, headdim)
            kn, vn = randn(b, 3, hkv, headdim), randn(b, 3, hkv, headdim)
            descales = {}
            if dtype == torch.float8_e4m3fn:
                descales = {name: torch.rand(b, hkv, device="cuda") + 0.5 for name in ("q_descale", "k_descale", "v_descale")}
            lens = torch.tensor([93, 0, 40], dtype=torch.int32, device="cuda")
            for splits in (1, 3, 0):
                flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, lens, causal=True, num_splits=splits, **descales)
                flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, lens, window_size=(5, 1), softcap=5.0,
                                                  num_splits=splits, **descales)
            pages = randn(8, 16, hkv, headdim)
            table = torch.tensor([[7, 6, 5, 4, 3, 2], [1, 0, 0, 0, 0, 0], [2, 4, 6, 0, 0, 0]], dtype=torch.int32,
                                 device="cuda")
            flash_ext.flash_attn_with_kvcache(q, pages, pages.clone(), kn, vn, lens, page_table=table, causal=True,
                                              **descales)
            flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, lens, cache_batch_idx=torch.tensor(
                [2, 0, 1], dtype=torch.int32, device="cuda"), **descales)
            bad_lens = torch.tensor([-7, 1 << 30, 95], dtype=torch.int32, device="cuda")
            bad_table = torch.tensor([[1 << 30, -1, 5, 4, 3, 2]] * 3, dtype=torch.int32, device="cuda")
            flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, bad_lens, check_values=False, **descales)
            flash_ext.flash_attn_with_kvcache(q, pages, pages.clone(), kn, vn, bad_lens, page_table=bad_table,
                                              check_values=False, **descales)
            flash_ext.flash_attn_with_kvcache(q, kc, vc, kn, vn, lens, check_values=False, cache_batch_idx=torch.tensor(
                [-3, 1 << 20, 1], dtype=torch.int32, device="cuda"), **descales)
            torch.cuda.synchronize()
            print(f"d{headdim} {dtype}: ran")


if __name__ == "__main__":
    main()
