"""How many training steps ``--profile`` and ``--profile-trace`` run after ``--steps``.

The one source for the runtime (``launch.main``, ``profile.profile_train``), ``meshc run --help``,
the error that refuses ``--profile`` with ``--save``, and the README.  Free of torch: ``meshc``
builds its help from it without importing torch.
"""

from __future__ import annotations

__all__ = [
    "PROFILE_STEPS",
    "PROFILE_STEPS_TEXT",
    "PROFILE_TIMED",
    "PROFILE_UNTIMED",
    "TRACE_STEPS",
    "TRACE_STEPS_TEXT",
]

# Not timed: the warm-up builds schedules and allocates gradients and optimizer states; the memory
# step and the kernel count run under instrumentation that slows them 2-3x.
PROFILE_UNTIMED = ("a warm-up", "a step measured for memory", "one counting kernels")
PROFILE_TIMED = 4
PROFILE_STEPS = len(PROFILE_UNTIMED) + PROFILE_TIMED
PROFILE_STEPS_TEXT = f"{PROFILE_STEPS} more steps ({', '.join(PROFILE_UNTIMED)}, not timed; then {PROFILE_TIMED} timed)"

TRACE_STEPS = 2
TRACE_STEPS_TEXT = f"{TRACE_STEPS} more steps (1 warm-up, then 1 under torch.profiler)"
