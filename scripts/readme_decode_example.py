"""Runs README.md's decoding example as written (the block from "# Decoding from a KV cache" to its call) and
checks its output against the float64 reference: the README's code stays true."""
import re

import torch

import flash_ext
from flash_ext.reference import attention_kvcache_ref

text = open("README.md").read()
block = re.search(r"(# Decoding from a KV cache.*?# out1 like q1)", text, re.S).group(1)
k_before = v_before = None
env = {"torch": torch, "flash_ext": flash_ext}
code = block.replace("out1 = flash_ext", "k_before, v_before = k_cache.clone(), v_cache.clone()\nout1 = flash_ext", 1)
exec(code, env)
ref, _, _, _ = attention_kvcache_ref(env["q1"], env["k_before"], env["v_before"], env["k1"], env["v1"],
                                     env["cache_seqlens"], causal=True)
err = (env["out1"].double() - ref).abs().max().item()
print(f"README decoding example: out1 {tuple(env['out1'].shape)}, max error vs float64 reference {err:.2e}")
assert err < 2e-2, err
