"""The measured figures of README.md and docs/*.md are their artifacts': `benchmarks/readme_table.py --check` passes,
and fails on a figure that differs from its artifact, a block that is missing or one that appears twice."""

import json
import re
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import readme_table  # noqa: E402


def test_every_results_block_of_the_readme_equals_its_artifact():
    assert readme_table.main(["--check"]) == 0


def test_the_check_fails_on_a_changed_figure_and_a_missing_block(tmp_path, monkeypatch):
    text = readme_table.README.read_text()
    body = readme_table.GENERATORS["budget"]()
    assert body in text
    shutil.copytree(readme_table.DOCS, tmp_path / "docs")
    changed = tmp_path / "README.md"
    changed.write_text(text.replace(body, body.replace("0.80", "0.78", 1)))  # 3ml base's FLOP ratio, misquoted
    monkeypatch.setattr(readme_table, "README", changed)
    monkeypatch.setattr(readme_table, "DOCS", tmp_path / "docs")
    assert readme_table.main(["--check"]) == 1
    assert readme_table.render(changed.read_text())[1] == ["budget"]
    changed.write_text(text.replace("<!-- results: budget -->", "<!-- budget -->"))
    assert readme_table.main(["--check"]) == 1
    changed.write_text(text.replace("<!-- results: budget -->", "<!-- results: budgets -->"))
    with pytest.raises(ValueError, match="README.md: unknown results block 'budgets'"):
        readme_table.main(["--check"])
    changed.write_text(text)
    assert readme_table.main(["--check"]) == 0
    study = (tmp_path / "docs" / "study.md").read_text()  # a figure of a docs page is checked the same way
    (tmp_path / "docs" / "study.md").write_text(study.replace("5.517 nats", "5.5 nats", 1))
    assert readme_table.main(["--check"]) == 1
    (tmp_path / "docs" / "study.md").write_text(study)
    (tmp_path / "docs" / "extra.md").write_text(f"<!-- results: budget -->\n{body}<!-- /results -->\n")
    assert readme_table.main(["--check"]) == 1  # one block in two places


def test_the_gpu_block_reads_a_collected_phase_before_the_first_runs_files(tmp_path, monkeypatch):
    """After `gpu_check.sh --collect`, a device directory holds PHASE/ folders: the block reads headline's throughput
    and kernels' kernels.json there, the first run's flat files only where no phase has come home."""
    device = tmp_path / "gpu" / "GPU"
    import throughput_blocks

    shutil.copytree(readme_table.RESULTS_DIR / "gpu" / "NVIDIA_H100_80GB_HBM3", device)
    monkeypatch.setattr(throughput_blocks, "RESULTS_DIR", tmp_path)
    first = throughput_blocks.gpu()
    result = readme_table.read_json(device / "throughput.json")
    result["results"][0]["tokens_per_s"] = 123456.0
    (device / "headline").mkdir(exist_ok=True)  # the real run's headline failed: no throughput there
    (device / "headline" / "throughput_headline.json").write_text(json.dumps(result))
    assert throughput_blocks.gpu() != first and "| 123K |" in throughput_blocks.gpu()


def test_gpu_kernels_are_sorted_by_the_work_their_names_say():
    """The GPU profile's table by kind (benchmarks/common.kernel_kind) on names a profile shows: an elementwise
    kernel's "{lambda(int)#1}" is pointwise work, not an optimizer's (LAMB)."""
    import common

    names = {
        "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64": "attention",
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits": "attention",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16>": "norm",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
        "float, float, float, MulFunctor<float> > >(at::TensorIteratorBase&)::{lambda(int)#1}>(int)": "pointwise",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "void (anonymous namespace)::indexing_backward_kernel<float, 4>(long const*)": "indexing",
        "_ce_rows_kernel": "cross-entropy",
        "_ce_grad_kernel": "cross-entropy",
        "_local_bwd_kernel": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void con": "attention",
        "_geglu_bwd_kernel": "pointwise",
        "_sum_parts_kernel": "reduction",
        "_segment_sums_kernel": "indexing",
        "_segment_carry_kernel": "indexing",
        "some_kernel_of_another_kind": "other",
    }
    assert {name: common.kernel_kind(name) for name in names} == names


def test_the_gpus_idle_time_is_charged_to_what_it_waited_for():
    """gpu_idle: each stretch with no kernel running, between the first kernel and the last, charged to the host ops
    that launched the kernel after it (by its linked correlation id), overlapping kernels (two streams) one busy
    stretch, ms per call; a CPU profile (no kernels) has none."""
    from types import SimpleNamespace

    import common
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.zeros(8).add_(1)
    assert common.gpu_idle(list(prof.events()), repeats=1) == {}

    def op(name, id, parent=None):
        return SimpleNamespace(name=name, id=id, cpu_parent=parent, device_type=DeviceType.CPU,
                               linked_correlation_id=0)

    def kernel(start, end, launched_by):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=DeviceType.CUDA,
                               linked_correlation_id=launched_by)

    step = op("Optimizer.step", 1)
    adam, mm, fill = op("aten::_fused_adamw_", 2, step), op("aten::mm", 3), op("aten::fill_", 4)
    launch = SimpleNamespace(name="cudaLaunchKernel", id=2, cpu_parent=None, device_type=DeviceType.CPU,
                             linked_correlation_id=9)  # the runtime's call: its own id may be an op's
    events = [step, adam, mm, fill, launch, kernel(0, 100, 3), kernel(20, 60, 4), kernel(150, 160, 2),
              kernel(400, 500, 3), kernel(700, 710, 77)]
    assert common.gpu_idle(events, repeats=2) == {
        "aten::_fused_adamw_ < Optimizer.step": 0.025, "aten::mm": 0.12, "(no host op linked)": 0.1}


def test_the_hosts_time_is_told_by_each_ops_own_time():
    """host_self_time: each host event's own time (without its children's) summed by name, ms per call, the `top`
    largest, and their sum over every name; the GPU's kernels are not host time. A real CPU profile's events carry
    what it reads."""
    from types import SimpleNamespace

    import common
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8).mm(torch.ones(8, 8))
    assert "aten::mm" in common.host_self_time(list(prof.events()), repeats=1, top=50)

    def event(name, own_us, total_us, device=DeviceType.CPU):
        return SimpleNamespace(name=name, self_cpu_time_total=own_us, cpu_time_total=total_us, device_type=device)

    events = [event("_ProjectBackward", 300, 900), event("aten::mm", 400, 500), event("aten::mm", 200, 200),
              event("cudaLaunchKernel", 100, 100), event("nvjet_kernel", 700, 700, DeviceType.CUDA)]
    assert common.host_self_time(events, repeats=2, top=2) == {"aten::mm": 0.3, "_ProjectBackward": 0.15,
                                                              "(all host ops)": 0.5}


def test_the_host_overheads_python_calls_are_the_steps_not_the_countings():
    """host_overhead.PythonCalls: each Python call the step makes, not an emulated kernel's insides (muted); torch ops
    called from Python add none (outside StepCounter's dispatch mode, whose own Python would)."""
    from host_overhead import PythonCalls

    def leaf():
        return 1

    def empty_kernel(counter):
        with counter.kernel("triton k"):
            pass

    def busy_kernel(counter):
        with counter.kernel("triton k"):
            leaf(), leaf()

    def two_calls(counter):
        leaf(), leaf()

    def torch_ops(counter):
        torch.ones(4).add_(1).sum()

    def nothing(counter):
        pass

    def calls(part) -> int:
        with PythonCalls() as counter:
            part(counter)
        return counter.calls

    base = calls(nothing)
    assert base >= 1 and calls(two_calls) == base + 2 and calls(torch_ops) == base
    assert calls(busy_kernel) == calls(empty_kernel)


def test_each_kernel_is_told_with_the_host_ops_that_launched_it():
    """kernel_launchers reads a real profile's host events (names and enclosing ops as torch.profiler links them; a
    CPU profile has no kernels, so each event here is given the kernels a CUDA one would hold): the launching op
    first, then the ops around it, `depth` in all, counted per chain."""
    from types import SimpleNamespace

    import common
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.zeros(8).add_(1)
    events = {event.name: event for event in prof.events()}
    assert events["aten::zero_"].cpu_parent.name == "aten::zeros" and events["aten::add_"].kernels == []
    memset, add = SimpleNamespace(name="Memset (Device)"), SimpleNamespace(name="vectorized_elementwise_kernel")
    launched = [SimpleNamespace(name=e.name, cpu_parent=e.cpu_parent, kernels=kernels)
                for e, kernels in ((events["aten::zero_"], [memset]), (events["aten::add_"], [add, memset]))]
    assert common.kernel_launchers(launched * 2) == {
        "Memset (Device)": {"aten::zero_ < aten::zeros": 2, "aten::add_": 2},
        "vectorized_elementwise_kernel": {"aten::add_": 2}}
    assert common.kernel_launchers(launched, depth=1)["Memset (Device)"] == {"aten::zero_": 1, "aten::add_": 1}


def test_a_steady_step_is_timed_back_to_back_and_drained_once_a_run(monkeypatch):
    """steady_time: `calls` calls back to back, the device drained once at the end of each of `windows` runs (and
    once after the warm-up), the time of a run over its calls, the median over runs; on a fake clock each call takes
    its number in seconds."""
    import common

    clock, drained, order = [0.0], [], []

    def call():
        order.append("call")
        clock[0] += len(order)

    def synchronize():
        order.append("drain")
        drained.append(len(order))

    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    seconds = common.steady_time(call, warmup=1, windows=3, calls=2)
    assert order == ["call", "drain"] + ["call", "call", "drain"] * 3
    # the runs' calls are entries 3-4, 6-7, 9-10 of `order` (counted when each is made): their means
    assert seconds == statistics.median([(3 + 4) / 2, (6 + 7) / 2, (9 + 10) / 2])


def test_the_scale_table_reads_gaps_and_spreads_as_it_says():
    """study_blocks' gaps: first arm less second, ± the sum of half ranges; one seed says so; fine-tunes that did not
    train give both medians and no difference."""
    import study_blocks

    def arm(loss, spread, median, ft_spread, failed=()):
        return {"final_eval_loss": loss, "final_eval_loss_spread": spread, "finetune": [
            {"task": "sst2", "median": median, "spread": ft_spread, "runs": 4, "did_not_train": list(failed)}]}

    objectives = {"3ml": arm(4.5, 0.2, 0.80, 0.04), "mlm:mask_rate=0.3": arm(4.0, 0.1, 0.85, 0.02)}
    assert study_blocks._gap(objectives, "3ml", "mlm:mask_rate=0.3") == "+0.500 ± 0.150"
    assert study_blocks._finetune_gaps(objectives, "3ml", "mlm:mask_rate=0.3") == "sst2 -0.050 ± 0.030"
    assert study_blocks._gap(objectives, "3ml", "mlm") == "no such arm"
    one = {"3ml": arm(4.5, None, 0.8, None, ["seed 0: one class"]), "mlm": arm(4.25, None, 0.9, None)}
    assert study_blocks._gap(one, "3ml", "mlm") == "+0.250 (one seed)"
    assert study_blocks._finetune_gaps(one, "3ml", "mlm") == "sst2 0.800 vs 0.900 (did not train: 3ml 1 of 4)"


MEASURED = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?x\b|\d+\.\d+ ?(?:ms|nats|s)\b|\d+(?:\.\d+)?[KM]? tokens/s|MFU \d\.\d+"
                      r"|\d+\.\d+%|busy \d\.\d+)")


def test_no_measured_figure_sits_in_the_prose_outside_a_block():
    """README and docs/ state fastmae's measurements only inside results blocks (regenerated and checked from their
    artifacts): a ratio, a time, a loss in nats, a tokens/s, an MFU or a busy share in the prose around them is one
    the check cannot keep true (a target an issue set is not a measurement: its line says `target`)."""
    found = []
    for path in readme_table.documents():
        prose = readme_table.BLOCK.sub("", path.read_text())
        for number, line in enumerate(prose.splitlines(), 1):
            if line.startswith(("    ", "|")) or "target" in line:
                continue
            found += [f"{path.name}: {match.group(0)!r} in {line.strip()[:80]!r}" for match in MEASURED.finditer(line)]
    assert not found, found
