"""The `bcd` command.

One table of subcommands; each row names the module that implements it, imported only when the
subcommand runs, so that `bcd helper` and `bcd status` start fast and the helper never pulls in the
agent's dependencies. A subcommand module provides `add_arguments(parser)` and `run(args) -> int`
(the dispatcher, shared with `bcd helper`, is bcd_shared.subcommands).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bcd_shared.subcommands import dispatch
from bcd_shared.version import VERSION

# name -> (module, one-line help). One literal table.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("bcd_agent.bench", "measure speed and memory targets; prints one JSON object"),
    "node": ("bcd_agent.node", "run the node agent: journal, dispatch, converge, session"),
    "join": ("bcd_agent.join", "join a control plane: node key, certificate, trust bundle, identity.json"),
    "devplane": ("bcd_agent.devplane.cli", "the development control plane: serve, apply, command, release"),
    "doctor": ("bcd_agent.doctor", "check this host's bcd setup: each check ok / warn / fail with its fix"),
    "plan": ("bcd_agent.plan", "dry run: the steps each section would take for a spec, applying nothing"),
    "status": ("bcd_agent.status", "generations, section states, conditions and the holder of each GPU"),
    "journal": ("bcd_agent.journalcli", "inspect the journal: meta, spec, commands, unacked results, events"),
    "sim": ("bcd_agent.sim", "devplane + helper + agent on a simulated host: apply a spec, show it converge"),
    "release": ("bcd_agent.sections.daemon.release", "self-update releases: version, build, confirm"),
}


def _helper_main(argv: Sequence[str]) -> int:
    # `bcd helper ...` is the root helper's own CLI; it lives in bcd-helper, which installs alone.
    # The Debian packages give it its own venv and program: /usr/bin/bcd-helper, not `bcd helper`.
    try:
        from bcd_helper.cli import main as helper_main
    except ImportError:
        from bcd_shared.subcommands import EX_USAGE

        print(
            "bcd: `bcd helper` needs bcd-helper in this Python environment; on a host installed from "
            "the packages, run `bcd-helper " + " ".join(argv[:2]) + (" ...`" if argv else "`"),
            file=sys.stderr,
        )
        return EX_USAGE
    return helper_main(list(argv))


def _image_main(argv: Sequence[str]) -> int:
    # `bcd image ...` has its own parser: issue 10 gives it exit 2 for usage errors, not the table's 64.
    from bcd_agent.imagecli import main as image_main

    return image_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] in (["node"], ["sim"]) and argv is None:
        from bcd_agent.earlystop import EarlyStop

        # A SIGTERM or SIGINT during start-up (imports, seeding) is remembered and honoured once the
        # command can: `bcd node` then ends with 0, `bcd sim` with its message and 128 + the signal.
        EarlyStop().install()
    if args_list and args_list[0] == "helper":
        return _helper_main(args_list[1:])
    if args_list and args_list[0] == "image":
        return _image_main(args_list[1:])
    return dispatch(
        args_list,
        SUBCOMMANDS,
        prog="bcd",
        description="bcd: node daemon for GPU and VM hosts",
        listed={
            "helper": "the root helper (bcd helper --help)",
            "image": "tenant images: `bcd image check FILE [--json]` (exit 0 accepted, 1 refused, 2 usage)",
        },
        version=f"bcd {VERSION}",
    )


if __name__ == "__main__":
    sys.exit(main())
