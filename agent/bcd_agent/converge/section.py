"""The contract between the converge runner and the sections: `Section`, `Observation`, `PassContext`.

A section is any object with

    name: str                                   # one of SECTION_ORDER
    def is_empty(desired) -> bool               # desired: the section's payload from DesiredSpec, or None
    def converge(desired, observation, ctx) -> SectionOutcome            # run in a worker thread
    async def converge(desired, observation, ctx) -> SectionOutcome      # awaited in the runner's task

`converge` is called in EVERY pass, empty section included (an emptied section must remove what it
made), with the pass's single observation. It plans (pure) and applies the steps, and returns one
SectionOutcome; or it raises: TerminalError -> FAILED, RetryableError / HelperRefused -> PROGRESSING,
anything else -> PROGRESSING with reason "InternalError" (logged with its traceback). A synchronous
`converge` runs in a worker thread so that a long step (a driver install) never stalls the session;
an asynchronous one is awaited under the runner's section timeout. See docs/converge.md.

The observation is read ONCE at the start of a pass, before any section acts, and shared by all
sections: a section sees what another section changed only in the next pass (a section that
changed the host says so with `SectionOutcome.changed`, and the runner runs that next pass at once).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import trio
from attrs import field, frozen
from bcd_shared.errors import RetryableError, StepError

from bcd_agent.converge.types import DesiredSpec, SectionOutcome


@frozen
class PartFailed:
    """An observation part whose reader raised: `Observation.get` raises the error again."""

    error: StepError


def _freeze(value: Mapping[str, object]) -> Mapping[str, object]:
    return MappingProxyType(dict(value))


@frozen(eq=False)
class Observation:
    """What one pass read of the host, by part name ("inventory", "cdi-holds", "units", ...).

    Parts are read by the observer the node composes (see `PartsObserver`); which parts a section
    reads is that section's documented contract. A part whose reader failed holds a `PartFailed`,
    so only the sections that need it go PROGRESSING.
    """

    parts: Mapping[str, object] = field(factory=dict, converter=_freeze)
    taken_monotonic: float = 0.0
    # Set when the observer itself failed: every `get` raises it.
    failure: StepError | None = None

    def get(self, name: str) -> object:
        """The part, or raise: RetryableError when it is missing, its reader's error when it failed."""
        if self.failure is not None:
            raise self.failure
        try:
            value = self.parts[name]
        except KeyError:
            raise RetryableError(
                "ObservationMissing", f"the observation has no part {name!r} (observer not configured for it)"
            ) from None
        if isinstance(value, PartFailed):
            raise value.error
        return value

    def has(self, name: str) -> bool:
        return self.failure is None and name in self.parts and not isinstance(self.parts[name], PartFailed)


@frozen
class PassContext:
    """Facts about the pass a section runs in. Dependencies (System, helper client, journal) are
    given to a section when it is built, not here."""

    spec: DesiredSpec
    pass_number: int
    reasons: frozenset[str]
    now_monotonic: float

    @property
    def generation(self) -> int:
        return self.spec.generation


class Section(Protocol):
    """A section converger (see the module docstring)."""

    @property
    def name(self) -> str: ...

    def is_empty(self, desired: object | None) -> bool: ...

    def converge(
        self, desired: object | None, observation: Observation, ctx: PassContext
    ) -> SectionOutcome | Awaitable[SectionOutcome]: ...


# The node's observer: called once at the start of each pass.
Observer = Callable[[], Awaitable[Observation]]
# A reader of one observation part (synchronous: it reads files and runs tools through a System).
PartReader = Callable[[], object]


class PartsObserver:
    """An Observer built from named part readers, run in order in one worker thread per pass.

    A reader that raises a StepError records it as `PartFailed`; any other exception is wrapped in a
    RetryableError naming the part, so one broken reader never stops the pass.
    """

    def __init__(
        self,
        readers: Mapping[str, PartReader],
        clock: Callable[[], float],
        *,
        in_thread: bool = True,
    ) -> None:
        self._readers = dict(readers)
        self._clock = clock
        self._in_thread = in_thread

    def read_all(self) -> dict[str, object]:
        parts: dict[str, object] = {}
        for name, reader in self._readers.items():
            try:
                parts[name] = reader()
            except StepError as e:
                parts[name] = PartFailed(e)
            except Exception as e:
                parts[name] = PartFailed(
                    RetryableError("ObservationFailed", f"reading {name!r} failed: {type(e).__name__}: {e}")
                )
        return parts

    async def __call__(self) -> Observation:
        taken = self._clock()
        parts = await trio.to_thread.run_sync(self.read_all) if self._in_thread else self.read_all()
        return Observation(parts=parts, taken_monotonic=taken)
