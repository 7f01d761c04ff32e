#!/usr/bin/env python3
"""Writes hopper/gmma_extended.h: the warpgroup MMA (wgmma) operations, and their CuTe traits, for the tile
widths N our kernels use beyond CuTe's base set (8, 16, 32, 64, 96, 128, 192, 256).

CuTe has every other width behind CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, but those headers (about 7 MB of
templates: every width, dtype and sparse form) more than doubled each kernel's front-end compile time
(docs/perf-notes.md section 27). This file holds only the widths listed here; gmma_select.h picks them, and
fails to compile for a width that is in neither set.

    python hopper/generate_gmma.py          # rewrite the header
    python hopper/generate_gmma.py --check  # fail if the committed header is stale (CI)
"""
import argparse
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "gmma_extended.h"

# The widths outside CuTe's base set that the kernels' tiles need (tile_size.h): 16-bit forward d128 kBlockN
# 176, d192 112, d256 80; backward tiles of 80 and head-split halves of 40 and 48; FP8 forward kBlockN 160 and
# 224. A new tile width goes here (gmma_select.h's static_assert names this file).
WIDTHS_16BIT = (40, 48, 80, 112, 176)
WIDTHS_FP8 = (160, 224)

# (name in C++, PTX type, CuTe value type, k per instruction)
TYPES = {
    "Bf16": ("bf16", "cutlass::bfloat16_t", 16),
    "F16": ("f16", "cutlass::half_t", 16),
    "E4m3": ("e4m3", "cutlass::float_e4m3_t", 32),
}


def operand_list(first, count, per_line=8):
    names = [f"%{first + i}" for i in range(count)]
    lines = [", ".join(names[i:i + per_line]) for i in range(0, count, per_line)]
    return '"{' + (',"\n        "').join(lines) + '}"'


def op_struct(type_name, n, rs):
    ptx_type, value_type, k = TYPES[type_name]
    fp8 = type_name == "E4m3"
    regs = n // 2  # f32 accumulators per thread of a 64 x n tile
    name = f"{'Rs' if rs else 'Ss'}_64x{n}x{k}_F32{type_name}"
    # Operand numbering: the accumulators, then A (4 registers or a descriptor), B's descriptor, scale_D.
    a_count = 4 if rs else 1
    scale_d = regs + a_count + 1
    immediates = ["scaleA", "scaleB"] + ([] if fp8 else ([] if rs else ["tnspA"]) + ["tnspB"])
    imm_refs = ", ".join(f"%{scale_d + 1 + i}" for i in range(len(immediates)))
    if fp8:
        template = "template <GMMA::ScaleIn scaleA = GMMA::ScaleIn::One, GMMA::ScaleIn scaleB = GMMA::ScaleIn::One>"
    else:
        template = ("template <GMMA::Major tnspA, GMMA::Major tnspB, GMMA::ScaleIn scaleA = GMMA::ScaleIn::One,\n"
                    "          GMMA::ScaleIn scaleB = GMMA::ScaleIn::One>")
    d_params = ",\n                  ".join(", ".join(f"float& d{i:03d}" for i in range(j, min(j + 6, regs)))
                                           for j in range(0, regs, 6))
    d_operands = ",\n          ".join(", ".join(f'"+f"(d{i:03d})' for i in range(j, min(j + 6, regs)))
                                      for j in range(0, regs, 6))
    a_params = "uint32_t const& a0, uint32_t const& a1, uint32_t const& a2, uint32_t const& a3" if rs else "uint64_t const& desc_a"
    a_inputs = '"r"(a0), "r"(a1), "r"(a2), "r"(a3)' if rs else '"l"(desc_a)'
    a_asm = operand_list(regs, 4) if rs else f'"%{regs}"'
    imm_inputs = ", ".join(f'"n"(int32_t({x}))' for x in immediates)
    checks = []
    if rs and not fp8:
        checks.append('  static_assert(tnspA == GMMA::Major::K, "a register A operand is K-major");')
    return f"""{template}
struct {name} {{
  using DRegisters = void;
  using ARegisters = {"uint32_t[4]" if rs else "uint64_t[1]"};
  using BRegisters = uint64_t[1];
  using CRegisters = float[{regs}];
{chr(10).join(checks)}
  CUTE_HOST_DEVICE static void fma({a_params}, uint64_t const& desc_b,
                  {d_params},
                  GMMA::ScaleOut const scale_D = GMMA::ScaleOut::One) {{
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{scale_d}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx_type}.{ptx_type} "
        {operand_list(0, regs)}
        ", " {a_asm} ", %{regs + a_count}, p, {imm_refs};\\n}}\\n"
        : {d_operands}
        : {a_inputs}, "l"(desc_b), "r"(int32_t(scale_D)), {imm_inputs});
#else
    CUTE_INVALID_CONTROL_PATH("{name} needs sm_90a");
#endif
  }}
}};
"""


def traits(type_name, n, rs):
    _, value_type, k = TYPES[type_name]
    fp8 = type_name == "E4m3"
    name = f"{'Rs' if rs else 'Ss'}_64x{n}x{k}_F32{type_name}"
    if fp8:
        params, args = "GMMA::ScaleIn scaleA, GMMA::ScaleIn scaleB", "scaleA, scaleB"
        frg_a, frg_b = "GMMA::smem_desc<GMMA::Major::K>", "GMMA::smem_desc<GMMA::Major::K>"
    else:
        params = "GMMA::Major tnspA, GMMA::Major tnspB, GMMA::ScaleIn scaleA, GMMA::ScaleIn scaleB"
        args = "tnspA, tnspB, scaleA, scaleB"
        frg_a, frg_b = "GMMA::smem_desc<tnspA>", "GMMA::smem_desc<tnspB>"
    a_layout = f"GMMA::ALayout_64x{k}" if rs else f"GMMA::ABLayout<64, {k}>"
    frg_a_line = "" if rs else f"  using FrgTypeA = {frg_a};\n"
    return f"""template <{params}>
struct MMA_Traits<flash::gmma_extended::{name}<{args}>> {{
  using ValTypeD = float;
  using ValTypeA = {value_type};
  using ValTypeB = {value_type};
  using ValTypeC = float;
{frg_a_line}  using FrgTypeB = {frg_b};
  using Shape_MNK = Shape<_64, Int<{n}>, Int<{k}>>;
  using ThrID = Layout<_128>;
  using ALayout = {a_layout};
  using BLayout = GMMA::ABLayout<{n}, {k}>;
  using CLayout = GMMA::CLayout_64xN<{n}>;
  GMMA::ScaleOut accumulate_ = GMMA::ScaleOut::One;
}};
"""


def shapes():
    for type_name in ("Bf16", "F16"):
        for n in WIDTHS_16BIT:
            yield type_name, n
    for n in WIDTHS_FP8:
        yield "E4m3", n


def header():
    ops = "\n".join(op_struct(t, n, rs) for t, n in shapes() for rs in (False, True))
    all_traits = "\n".join(traits(t, n, rs) for t, n in shapes() for rs in (False, True))
    element = {"Bf16": "cutlass::bfloat16_t", "F16": "cutlass::half_t", "E4m3": "cutlass::float_e4m3_t"}
    table = []
    for t, n in shapes():
        k = TYPES[t][2]
        if t == "E4m3":
            table.append(f"template <GMMA::Major A, GMMA::Major B>\nstruct Extended<{element[t]}, {n}, A, B> {{\n"
                         f"  static_assert(A == GMMA::Major::K && B == GMMA::Major::K, \"FP8 GMMA operands are K-major\");\n"
                         f"  static constexpr bool kDefined = true;\n"
                         f"  using Ss = Ss_64x{n}x{k}_F32{t}<>;\n  using Rs = Rs_64x{n}x{k}_F32{t}<>;\n}};")
        else:
            table.append(f"template <GMMA::Major A, GMMA::Major B>\nstruct Extended<{element[t]}, {n}, A, B> {{\n"
                         f"  static constexpr bool kDefined = true;\n  using Ss = Ss_64x{n}x{k}_F32{t}<A, B>;\n  using Rs = Rs_64x{n}x{k}_F32{t}<A, B>;\n}};")
    table_text = "\n".join(table)
    return f"""// Generated by hopper/generate_gmma.py; do not edit.
// wgmma operations and CuTe traits for the tile widths beyond CuTe's base set that the kernels use (f32
// accumulators; the generator's docstring says why these are not CuTe's extended-shape headers).
#pragma once

#include <cstdint>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

namespace flash::gmma_extended {{
namespace GMMA = cute::SM90::GMMA;

{ops}
// The operations of one (element type, width): Ss (A and B in shared memory), Rs (A in registers).
template <class Element, int N, GMMA::Major A, GMMA::Major B>
struct Extended {{
  static constexpr bool kDefined = false;
}};
{table_text}
}}  // namespace flash::gmma_extended

namespace cute {{
namespace GMMA = SM90::GMMA;

{all_traits}
}}  // namespace cute
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify instead of writing")
    args = parser.parse_args()
    text = header()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale; run python hopper/generate_gmma.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
