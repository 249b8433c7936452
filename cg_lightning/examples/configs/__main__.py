"""``python -m cg_lightning.examples.configs [NAME]``: the path of a shipped configuration, or all of them."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from . import names, path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cg_lightning.examples.configs",
                                     description="Print the path of a configuration shipped with cg-lightning, for "
                                                 "python -m cg_lightning fit --config PATH.")
    parser.add_argument("name", nargs="?", help=f"one of {', '.join(names())}; without it, every name and its path")
    args = parser.parse_args(argv)
    if args.name is None:
        for name in names():
            print(f"{name}\t{path(name)}")
        return 0
    try:
        print(path(args.name))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
