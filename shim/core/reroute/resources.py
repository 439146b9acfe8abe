"""What a container asks for and a host has room for: CPU cores and memory bytes."""

from __future__ import annotations

from dataclasses import dataclass

from shim.core.quantity import format_bytes

# Cores arrive as floats that went through subtraction (4.0 - 3.7 is
# 0.2999999999999998), so an exact fit would be refused without some slack. A
# nanocore is far below the millicore that Kubernetes can express.
CPU_SLACK = 1e-9


@dataclass(frozen=True)
class Resources:
    cpu_cores: float
    memory_bytes: int

    def minus(self, other: Resources) -> Resources:
        """The plain difference, negative where ``other`` is larger: callers clamp where that matters."""
        return Resources(self.cpu_cores - other.cpu_cores, self.memory_bytes - other.memory_bytes)

    def fits_in(self, room: Resources) -> bool:
        return self.cpu_cores <= room.cpu_cores + CPU_SLACK and self.memory_bytes <= room.memory_bytes

    def __str__(self) -> str:
        return f"{cores_text(self.cpu_cores)} CPU, {format_bytes(self.memory_bytes)}"


ZERO = Resources(0.0, 0)


def cores_text(cpu: float) -> str:
    return f"{round(cpu, 3):g}"
