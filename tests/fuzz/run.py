"""Run one fuzz target under atheris (libFuzzer): `python tests/fuzz/run.py TARGET [--seconds N]`.

New inputs go to a scratch corpus (the committed seeds in tests/fuzz/corpus/TARGET stay as they are);
a crash writes its input to --artifacts and exits non-zero. A run over 1 s on one input is a crash
(libFuzzer's -timeout=1). Prints the exec count libFuzzer reports.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--artifacts", default=os.path.join(tempfile.gettempdir(), "bcd-fuzz-artifacts"))
    parser.add_argument("--rss-limit-mb", type=int, default=1024)
    parser.add_argument("--replay", nargs="*", default=None, help="run these inputs once (instrumented)")
    args = parser.parse_args()
    import atheris

    with atheris.instrument_imports(include=["bcd_shared", "bcd_helper", "bcd_agent"]):
        from fuzz import targets

        t = targets.target(args.target)
        expected = t.expected
        with contextlib.suppress(*expected):
            t.run(b"")  # import every module the target reaches while instrumenting

    def one(data: bytes) -> None:
        with contextlib.suppress(*expected):
            t.run(data)

    scratch = tempfile.mkdtemp(prefix=f"bcd-fuzz-{args.target}-")
    os.makedirs(args.artifacts, exist_ok=True)
    corpora = [scratch, str(targets.CORPUS / args.target)]
    reference = ROOT.parent / "shared" / "reference" / "nvidia-smi"
    if args.target == "nvidia_smi" and reference.is_dir():
        corpora.append(str(reference))
    if args.replay is not None:
        corpora = args.replay
    argv = [
        sys.argv[0],
        *corpora,
        f"-max_total_time={args.seconds}",
        "-timeout=1",
        f"-rss_limit_mb={args.rss_limit_mb}",
        f"-artifact_prefix={args.artifacts}/{args.target}-",
        "-print_final_stats=1",
    ]
    atheris.Setup(argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
