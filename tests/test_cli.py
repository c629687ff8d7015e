"""The command line: --help, and the demo in a tiny CPU run."""

from __future__ import annotations

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
    assert (
        "summary" in out
        and "converted 5/7 ops to float16 with 2 casts (+4 low-precision parameter copies" in out
    )
    assert (tmp_path / "dump").is_dir()
