"""What scripts/setup.sh and scripts/check_wheel.sh print last: where entmax_fast is imported
from, the torch and triton installed beside it and, with --backends, what each backend runs on.

    python scripts/installed.py PREFIX [--backends]
"""
import argparse
import importlib.metadata as metadata

import entmax_fast


def installed_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="the first word of the line (the calling script's name)")
    parser.add_argument("--backends", action="store_true", help="also a line per backend")
    args = parser.parse_args(argv)
    print(f"{args.prefix}: entmax_fast from {entmax_fast.__file__}; torch {installed_version('torch')}, "
          f"triton {installed_version('triton')}")
    if args.backends:
        for name, info in entmax_fast.backend_info()["backends"].items():
            print(f"entmax_fast backend {name}: CPU tensors: {info['cpu']}; CUDA tensors: {info['cuda']}")


if __name__ == "__main__":
    main()
