"""Runs README.md's decoding examples as written (the block from "# Decoding from a KV cache" to the FP8 call) and
checks both outputs against the float64 reference (the FP8 one on the dequantized values): the README's code
stays true."""
import re

import torch

import flash_ext
from flash_ext import fp8
from flash_ext.reference import attention_kvcache_ref

text = open("README.md").read()
block = re.search(r"(# Decoding from a KV cache.*?# out2 bf16)", text, re.S).group(1)
k_before = v_before = None
env = {"torch": torch, "flash_ext": flash_ext}
code = block.replace("out1 = flash_ext", "k_before, v_before = k_cache.clone(), v_cache.clone()\nout1 = flash_ext", 1)
code = code.replace("out2 = flash_ext", "k8_before, v8_before = k8_cache.clone(), v8_cache.clone()\nout2 = flash_ext", 1)
exec(code, env)
ref, _, _, _ = attention_kvcache_ref(env["q1"], env["k_before"], env["v_before"], env["k1"], env["v1"],
                                     env["cache_seqlens"], causal=True)
err = (env["out1"].double() - ref).abs().max().item()
print(f"README decoding example: out1 {tuple(env['out1'].shape)}, max error vs float64 reference {err:.2e}")
assert err < 2e-2, err


def deq(x8, descale):
    return fp8.dequantize(x8, descale, 4)


scale = env["kv_descale"]
new_k, new_v = (deq(fp8.quantize_with(env[name], scale), scale) for name in ("k2", "v2"))
ref2, _, _, _ = attention_kvcache_ref(deq(env["q8"], env["q_descale"]), deq(env["k8_before"], scale),
                                      deq(env["v8_before"], scale), new_k, new_v, env["cache_seqlens"] + 1, causal=True)
err2 = (env["out2"].double() - ref2).abs().max().item()
print(f"README FP8 decoding example: out2 {tuple(env['out2'].shape)} {env['out2'].dtype}, max error vs float64 "
      f"reference on the dequantized values {err2:.2e}")
assert env["out2"].dtype == torch.bfloat16 and err2 < 2e-2, err2
