"""Command line: ``python -m graphamp demo``, ``python -m graphamp plot``."""

from __future__ import annotations

import argparse
import sys

from ..inspect.plot import plot_state_file
from . import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="graphamp",
        description="Graph-compiled automatic mixed precision for PyTorch (OneFlow-style).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = sub.add_parser("demo", help="train the OneFlow AMP example MLP through a Graph")
    demo.add_arguments(demo_parser)
    plot_parser = sub.add_parser(
        "plot",
        help="draw loss, loss scale and skipped steps (or, with "
        "--headroom, each low-precision op's headroom) from a saved "
        "graph state (g.state_dict()) as a PNG",
    )
    plot_parser.add_argument(
        "state",
        help="a file saved with torch.save(g.state_dict(), path) "
        "or a dict holding it under 'graph'",
    )
    plot_parser.add_argument("--out", default="training.png", help="PNG to write")
    plot_parser.add_argument(
        "--headroom",
        action="store_true",
        help="plot the headroom of each low-precision value and gradient "
        "against its dtype's largest number (needs a state saved with "
        "config.enable_overflow_tracing())",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.run(args)
        return 0
    if args.command == "plot":
        print(plot_state_file(args.state, args.out, headroom=args.headroom))
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
