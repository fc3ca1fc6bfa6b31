"""The development control plane (docs/devplane.md): gateway half of the session, JoinService, worker key,
approvers, secret broker, state in a directory, an admin socket. `DevPlane` is the trio service."""

from bcd_agent.devplane.plane import DevPlane

__all__ = ["DevPlane"]
