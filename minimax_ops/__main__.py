"""python -m minimax_ops {demo,bench} ...

    demo   the tiny model compiled with the fused-decode pass vs the eager reference (CPU or CUDA)
    bench  one real-size decode layer, fused vs unfused (CUDA); arguments go to minimax_ops.bench
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m minimax_ops", description="MiniMax-M3 fused decode ops")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench}")
    from . import demo
    demo.add_arguments(sub.add_parser("demo", help="compiled + fused tiny model vs the eager reference"))
    # bench parses its own arguments (its --help included), so hand it everything after "bench".
    sub.add_parser("bench", help="benchmark one real-size decode layer on CUDA (see its --help)", add_help=False)
    if argv[:1] == ["bench"]:
        try:
            from . import bench
        except ModuleNotFoundError as e:
            if e.name != "minimax_ops.bench":
                raise
            print("bench: minimax_ops/bench.py does not exist in this checkout, so there is no benchmark to run")
            return 2
        return int(bench.main(argv[1:]) or 0)
    args = parser.parse_args(argv)
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
