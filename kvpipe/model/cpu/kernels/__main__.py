"""`python -m kvpipe.model.cpu.kernels`: build the CPU kernels ahead of time (make setup does)."""

from __future__ import annotations

import sys

from kvpipe.model.cpu.kernels.loader import EXTRA_KERNELS, build, build_dir, build_extra


def main() -> int:
    try:
        build(verbose=False)
        for stem in EXTRA_KERNELS:
            build_extra(stem)
    except Exception as e:  # setup goes on: servers fall back to the torch path
        print(f"kvpipe: CPU kernels not built ({type(e).__name__}: {e}); the torch path will be used", file=sys.stderr)
        return 0
    print(f"kvpipe: CPU kernels built in {build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
