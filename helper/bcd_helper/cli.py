"""`bcd helper` (also installed as `bcd-helper`): the root helper's command line."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bcd_shared.subcommands import dispatch
from bcd_shared.version import VERSION

# name -> (module, help). Each module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("bcd_helper.serve", "serve the node on the helper's Unix socket (as root)"),
    "audit": ("bcd_helper.audit", "show or verify the hash-chained audit log"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    return dispatch(
        args_list,
        SUBCOMMANDS,
        prog="bcd helper",
        description="bcd's root helper",
        version=f"bcd-helper {VERSION}",
    )


if __name__ == "__main__":
    sys.exit(main())
