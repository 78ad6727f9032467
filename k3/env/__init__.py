"""k3.env: agent environments — sandboxes, the harness, autonomous-execution tasks and their verifiers (SPEC §9).

Nothing below k3.env imports it; see docs/env.md.
"""

from .base import ExecResult, SandboxBase, Snapshot
from .limits import Limits
from .sandbox import Sandbox

__all__ = ["ExecResult", "Limits", "Sandbox", "SandboxBase", "Snapshot"]
