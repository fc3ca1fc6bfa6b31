"""Kernel arguments on the boot loader's command line, shared by cpu, iommu and hugepages.

With `update-grub`: a drop-in `/etc/default/grub.d/90-bcd-<owner>.cfg` that appends to
GRUB_CMDLINE_LINUX, then `update-grub`. With `grubby`: `--remove-args` of the arguments bcd set
before, then `--args` of the new ones. With neither the step fails, retryably (HST-CPU-14; Q-HST-HP-02
answered the same way for hugepages). update-grub wins when both exist. The arguments bcd last set
are recorded in /var/lib/bcd-hostconfig/bootargs/<owner> (or hugepages-1g-boot), so an unchanged
list plans nothing.
"""

from __future__ import annotations

from attrs import frozen

from bcd_shared.errors import RetryableError
from bcd_shared.system import System

from ._base import STATE_DIR, ApplyContext, WriteFile, _guarded, check, has_program, header, text_record


@frozen
class BootloaderView:
    update_grub: bool
    grubby: bool


def observe_bootloader(system: System) -> BootloaderView:
    return BootloaderView(has_program(system, "update-grub"), has_program(system, "grubby"))


def dropin_path(owner: str) -> str:
    return f"/etc/default/grub.d/90-bcd-{owner}.cfg"


def record_path(owner: str) -> str:
    return f"{STATE_DIR}/bootargs/{owner}"


def grub_dropin(unit: str, args: str) -> bytes:
    return (header(unit) + f'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX {args}"\n').encode()


@frozen
class SetBootArgs:
    """Replace the arguments `previous` with `args` ("" removes them) and record what was set."""

    unit: str
    dropin: str
    record: str
    previous: str
    args: str
    record_text: str  # what the record holds afterwards ("" removes it)
    bootloader: BootloaderView

    def describe(self) -> str:
        return f"set kernel arguments {self.args!r} for {self.unit} on the boot loader"

    def apply(self, system: System, actx: ApplyContext) -> None:
        if self.bootloader.update_grub:
            _guarded(actx, self.dropin)
            if self.args:
                system.write_atomic(self.dropin, grub_dropin(self.unit, self.args))
            else:
                system.remove(self.dropin)
            check(system.run(["update-grub"]), message="update-grub failed")
        elif self.bootloader.grubby:
            if self.previous:
                check(
                    system.run(["grubby", "--update-kernel=ALL", f"--remove-args={self.previous}"]),
                    message="grubby failed",
                )
            if self.args:
                check(
                    system.run(["grubby", "--update-kernel=ALL", f"--args={self.args}"]),
                    message="grubby failed",
                )
        else:
            raise RetryableError(
                "NoBootloader",
                f"{self.unit}: neither update-grub nor grubby is installed to set kernel arguments",
            )
        _guarded(actx, self.record)
        if self.record_text:
            WriteFile(self.record, text_record(self.unit, self.record_text), 0o644).apply(system, actx)
        else:
            system.remove(self.record)
