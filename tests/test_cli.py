"""The command line: --help, and the demo in a tiny CPU run."""

from __future__ import annotations

import re
import subprocess
import sys

from graphamp.cli import main


def test_help_lists_the_commands():
    out = subprocess.run(
        [sys.executable, "-m", "graphamp", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "demo" in out and "plot" in out


def test_demo_trains_and_summarises(tmp_path, capsys):
    assert (
        main(
            [
                "demo",
                "--steps",
                "30",
                "--backend",
                "aot_eager",
                "--device",
                "cpu",
                "--quiet",
                "--dump",
                str(tmp_path / "dump"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # the two runs side by side: graphamp's casts and host reads against eager AMP's
    assert "graphamp" in out and "eager autocast + GradScaler" in out
    assert "2 (+4 parameter copies)" in out and "host reads per step" in out
    # step 18 of 30 overflowed on purpose: both runs skipped it
    assert re.search(r"skipped steps\s+\[18\]\s+\[18\]", out), out
    assert "deny list" in out and "allow list" in out  # each op's precision and why
    assert (tmp_path / "dump").is_dir()


def test_the_demo_learns_and_agrees_with_eager_amp():
    """The summary run() returns: the loss falls, the two runs agree within fp16's bounds, the
    overflowed step is skipped by both, and graphamp's step reads nothing on the host."""
    import argparse

    from graphamp.cli import demo

    args = argparse.Namespace(
        steps=120, device="cpu", dtype="fp16", backend="aot_eager", dump="", seed=0, quiet=True
    )
    s = demo.run(args)
    assert s["loss_last"] < 0.5 * s["loss_first"]
    assert abs(s["loss_last"] - s["eager_loss_last"]) < 0.03 * s["eager_loss_last"] + 1e-3
    assert s["skipped_steps"] == s["eager_skipped_steps"] == [72] and s["final_scale"] == 1500
    assert s["host_reads_per_step"] == 0 and s["eager_host_reads_per_step"] >= 1
    assert s["casts"] < s["autocast_casts"]
