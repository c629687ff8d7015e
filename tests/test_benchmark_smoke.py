"""The benchmark's CPU smoke mode (tiny models, few steps, aot_eager) runs end to end."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench  # noqa: E402
import pytest  # noqa: E402


@pytest.mark.slow
def test_benchmark_smoke_mode(tmp_path):
    rows = bench.main(["--smoke", "--workload", "mlp", "gpt2", "--out", str(tmp_path)])
    variants = {(r["workload"], r["variant"]) for r in rows}
    assert len(variants) == 2 * len(bench.VARIANTS)
    for r in rows:
        assert r["ms_per_step"] > 0 and r["loss_finite"], r
    graphamp_rows = [r for r in rows if r["variant"].startswith("graphamp")]
    assert all("ratio_vs_best_peer" in r and "precision" in r for r in graphamp_rows)
    lines = open(tmp_path / "bench_smoke.jsonl").read().splitlines()
    assert len(lines) == len(rows) and json.loads(lines[0])["meta"]["torch"]
    table = open(tmp_path / "bench_smoke.md").read()
    assert "| graphamp_fp16 |" in table and "## gpt-tiny" in table


@pytest.mark.slow
def test_benchmark_smoke_llama_workload(tmp_path):
    """The Llama-style workload (transformers' LlamaForCausalLM from a config) at smoke
    size trains under graphamp and its peer in one run, with tokens/s reported."""
    rows = bench.main(
        [
            "--smoke",
            "--workload",
            "llama1b",
            "--variant",
            "graphamp_bf16",
            "eager_bf16",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["variant"] for r in rows] == ["graphamp_bf16", "eager_bf16"]
    assert all(
        r["workload"] == "llama-tiny" and r["loss_finite"] and r["tokens_per_s"] > 0 for r in rows
    ), rows
    assert rows[0]["ratio_vs_best_peer"] > 0


def test_benchmark_measures_overflow_tracing_against_the_untraced_step(tmp_path):
    rows = bench.main(
        [
            "--smoke",
            "--workload",
            "mlp",
            "--variant",
            "graphamp_fp16",
            "graphamp_fp16_traced",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r["variant"] for r in rows] == ["graphamp_fp16", "graphamp_fp16_traced"]
    traced = rows[1]
    assert traced["loss_finite"]
    assert traced["tracing_cost"] == traced["ms_per_step"] / rows[0]["ms_per_step"]
    assert "overflow tracing costs" in open(tmp_path / "bench_smoke.md").read()


@pytest.mark.slow
def test_forensics_cost_script_runs_on_the_cpu(tmp_path):
    import forensics_cost

    rows = forensics_cost.main(
        [
            "--workload",
            "gpt",
            "--backend",
            "aot_eager",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    (row,) = rows
    assert row["ms_off"] > 0 and row["ms_on"] > 0
    assert row["step_nodes_on"] - row["step_nodes_off"] >= row["forensics_nodes"] > 0
    table = open(tmp_path / "forensics_cost_cpu.md").read()
    assert (
        "| gpt | aot_eager |" in table and "Command: `python benchmarks/forensics_cost.py" in table
    )


@pytest.mark.slow
def test_kernel_count_counts_the_launches_inside_an_outlined_steps_subgraphs():
    """kernel_count.py's CUDA target on the smoke GPT (2 blocks): the default variant is the
    step CUDA builds (inlined), and the outlined step's launches include those of each call of
    a block's subgraph, so both count the same GEMMs. It runs in its own process: it answers
    torch's CUDA queries as an H100 would."""
    import subprocess

    script = os.path.join(ROOT, "benchmarks", "kernel_count.py")
    rows = {}
    for variant in ("graphamp_bf16", "graphamp_bf16_outline"):
        done = subprocess.run(
            [sys.executable, script, "--smoke", "--workload", "gpt2", "--target", "cuda"]
            + ["--variant", variant],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        rows[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    inlined, outlined = rows["graphamp_bf16"], rows["graphamp_bf16_outline"]
    assert inlined["outlined_calls"] == 0 and outlined["outlined_calls"] == 4  # 2 forward, 2 back
    assert outlined["launches"]["extern"] == inlined["launches"]["extern"] > 0
    assert outlined["launches"]["triton"] >= inlined["launches"]["triton"] > 0


@pytest.mark.slow
def test_conv_layout_script_runs_on_the_cpu(tmp_path):
    """conv_layout.py's smoke mode (a tiny convolution net, aot_eager): three programs, a row
    with their ratios and losses, and its table."""
    import conv_layout

    (row,) = conv_layout.main(["--smoke", "--out", str(tmp_path)])
    assert set(row["ms"]) == set(conv_layout.PROGRAMS) and all(v > 0 for v in row["ms"].values())
    assert row["default/channels-last"] > 0 and row["default/compile"] > 0
    # the same batch from the same weights: every program's first loss is finite and the same
    # model's (aot_eager keeps the traced ops, so the two graphamp programs agree bitwise)
    first = {p: v[0] for p, v in row["loss_first_last"].items()}
    assert first["default"] == first["channels-last"], first
    table = open(tmp_path / "conv_layout_smoke.md").read()
    assert "| smoke |" in table and "Command: `python benchmarks/conv_layout.py" in table


@pytest.mark.slow
def test_outline_cost_runs_each_program_in_a_process_of_its_own(tmp_path):
    """outline_cost.py's smoke mode: the three programs built and timed in child processes of
    their own, driven in lockstep (every round's steps come back, with their page faults)."""
    import outline_cost

    (row,) = outline_cost.main(["--smoke", "--workload", "gpt", "--out", str(tmp_path)])
    assert set(row["ms"]) == set(outline_cost.PROGRAMS) and all(v > 0 for v in row["ms"].values())
    assert row["rounds"] == 2 and row["outlined/inlined"] > 0
    assert row["best_peer"] in outline_cost.PEERS and row[f"outlined/{outline_cost.BY_HAND}"] > 0
    assert set(row["minor_faults_per_step"]) == set(outline_cost.PROGRAMS)
    table = open(tmp_path / "outline_cost_smoke.md").read()
    assert "each program in a process of its own" in table


def test_paired_steps_pairs_each_variant_with_the_first_in_every_round(tmp_path):
    """paired_steps.py's smoke mode: the variants built in this process, timed in turns, each
    ratio taken against the first variant's block of the same round."""
    import paired_steps

    (row,) = paired_steps.main(
        ["--smoke", "--variants", "inlined", "outlined", "default", "--out", str(tmp_path)]
    )
    assert list(row["ms"]) == ["0:inlined", "1:outlined", "2:default"]
    assert row["ratio_to_first"]["0:inlined"] == 1.0 and row["rounds"] == 2
    assert all(v > 0 for v in row["ms"].values())
    low, high = row["rounds_ratio_range"]["1:outlined"]
    assert 0 < low <= row["ratio_to_first"]["1:outlined"] <= high
    table = open(tmp_path / "paired_steps_smoke.md").read()
    assert "| gpt | outlined |" in table and "Command: `python benchmarks/paired_steps.py" in table
