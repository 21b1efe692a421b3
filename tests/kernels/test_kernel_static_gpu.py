"""Static GPU check, on CPU: every kernel configuration compiles for sm_80 and sm_90 without spills, within shared
memory and with registers that leave enough warps resident (what stands in for running on CUDA until a GPU is lent).

Compiling all 1,100 takes ~3 CPU-minutes with Triton's cache empty (a fresh machine), so the table is committed
(benchmarks/results/kernels_static.json, from `python -m fastmae.kernels.aot`): the suite checks that it is of these
kernel sources and this Triton, and compiles the configuration nearest the register limit again."""

import json
import re
import subprocess
from pathlib import Path

import warm_python
from fastmae.kernels import aot

TABLE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kernels_static.json"
MEASURED = ("registers", "local_bytes", "stack_bytes", "shared_bytes", "load_bytes", "instructions")


def test_every_configuration_compiles_without_spills(tmp_path):
    table = json.loads(TABLE.read_text())
    assert table["inputs_sha256"] == aot.inputs_sha256() and table["match"] is None, (
        f"the kernels' sources or Triton changed since {TABLE.name} was made: `{aot.REGENERATE}`")
    results = table["results"]
    expected = {(name, desc) for name, desc, *_ in aot.all_configs()}
    for arch in ("sm_80", "sm_90"):
        assert sorted((r["kernel"], r["config"]) for r in results if r["arch"] == arch) == sorted(expected)
    for r in results:
        assert 0 < r["registers"] <= 255, r
        assert r["resident_warps"] == aot.resident_warps(r["registers"], r["num_warps"]), r
        # no spills, within shared memory, and (but for attention's register tiles) enough warps resident to hide
        # memory latency: the fused LayerNorm backward at 8 was the largest kernel of a RoBERTa-base step on an H200
        assert not aot.failures(r), r
    # the configuration with the most registers, compiled here for both architectures: the table's numbers (each
    # compile costs ~1.5 s of a fresh machine's suite, Triton's cache empty)
    nearest = sorted(results, key=lambda r: -r["registers"])[:1]
    match = "|".join(f"^{re.escape(r['kernel'])} {re.escape(r['config'])}$" for r in nearest)
    out = tmp_path / "again.json"
    done = subprocess.run([*warm_python.COMMAND, "-m", "fastmae.kernels.aot", "--match", match, "--json", str(out)],
                          env=warm_python.environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    again = json.loads(out.read_text())["results"]
    committed = {(r["kernel"], r["config"], r["arch"]): [r[k] for k in MEASURED] for r in results}
    assert len(again) == 2 * len({(r["kernel"], r["config"]) for r in nearest}) >= 2
    for r in again:
        assert [r[k] for k in MEASURED] == committed[r["kernel"], r["config"], r["arch"]], r


def test_the_table_compiles_each_kernel_as_the_jit_specializes_it():
    """Each compile is told what Triton's JIT specializes at a launch (aligned pointers, widths divisible by 16), or
    its registers are another kernel's: RoBERTa-base's bias + GELU and post-LN norm in bf16 read 16 bytes a load, as
    the GPU runs them (compiled unspecialized, bias + GELU's forward read 2)."""
    def load_bytes(kernel: str, config: str) -> set[int]:
        return {r["load_bytes"] for r in json.loads(TABLE.read_text())["results"]
                if (r["kernel"], r["config"]) == (kernel, config)}

    assert load_bytes("activation._bias_gelu_fwd_kernel", "bf16 BLOCK_C=1024") == {16}
    assert load_bytes("norm._add_norm_fwd_kernel", "bf16 BLOCK_H=256 CHUNKS=3 xbias=1 bias=1 sum=0 dropout=1") == {16}
    assert load_bytes("cross_entropy._scale_kernel", "fp32 -> bf16") == {16}  # n_elements divisible by 16
    assert load_bytes("cross_entropy._ce_grad_kernel", "bf16 BLOCK_V=1024 bias=1") == {16}  # the logits' rows
    assert aot.widest_load_bytes("ld.global.L1::evict_last.v4.b32 {a, b, c, d}, [x];\nld.global.b16 y, [z];") == 16
    assert aot.widest_load_bytes("ld.global.v2.b32 {a, b}, [x];") == 8 and aot.widest_load_bytes("st.global.b16") == 0


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/              @!P0 LDG.E.64 R12, desc[UR6][R2.64] ;
        /*0030*/                   FFMA R4, R12, R13, 1 ;
        /*0040*/                   NOP ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
"""


def test_the_table_counts_what_a_thread_issues_per_element():
    """The row-wise kernels are bound by the instructions they issue: the table counts a thread's loop body (or whole
    kernel) over the elements it holds. RoBERTa-base's bias + GELU, as shipped, issues at most 32 an element forward
    and 41 backward (libdevice's erf, a coefficient selected per element: 43 and 56); its post-LN norm at 42 and 70
    (a row of 768 in one block of 1,024 lanes: 72 and 100)."""
    assert aot.issue_instructions(SASS) == 3  # the loop's LDG, FFMA, BRA: not its NOP, not the prologue
    assert aot.issue_instructions(SASS.replace("0x20 ;", "0x70 ;")) == 7  # no backward branch: all but the NOP
    assert aot.thread_elements({"BLOCK_R": 2, "BLOCK_C": 1024}, 8) == 8
    assert aot.thread_elements({"BLOCK_M": 64}, 4) is None and aot.thread_elements({"BLOCK_V": 4096}, 8) == 16
    assert aot.thread_elements({"BLOCK_R": 4, "BLOCK_V": 1024}, 8) == 16  # the cross-entropy's gradient tile
    per_element = {(r["kernel"], r["config"]): r["instructions_per_element"]
                   for r in json.loads(TABLE.read_text())["results"] if r["arch"] == "sm_90"}
    assert per_element["activation._bias_gelu_fwd_kernel", "bf16 BLOCK_C=1024"] <= 32
    assert per_element["activation._bias_gelu_bwd_kernel", "bf16 BLOCK_C=1024"] <= 41
    assert per_element["norm._add_norm_fwd_kernel", "bf16 BLOCK_H=256 CHUNKS=3 xbias=1 bias=1 sum=0 dropout=1"] <= 42
    assert per_element["norm._add_norm_bwd_kernel", "bf16 BLOCK_H=256 CHUNKS=3 dh=0 xbias=1 dropout=1 sum=0"] <= 70
